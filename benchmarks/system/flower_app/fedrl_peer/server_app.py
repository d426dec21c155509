"""The ServerApp: FedAvg with every node in every round and no evaluation; the wall time of each
round, from ``configure_train`` (the round's start) to the end of ``aggregate_train``, is written
to the run config's ``out`` (the benchmark reads it; a ``.progress`` file marks each round's end)."""

import json
import time

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()


def initial(n_floats: int) -> ArrayRecord:
    rng = np.random.default_rng(0)
    half = n_floats // 2  # two tensors, like a weight and the rest (as the legacy side)
    return ArrayRecord([rng.standard_normal(half).astype(np.float32),
                        rng.standard_normal(n_floats - half).astype(np.float32)])


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    out, nodes = str(cfg["out"]), int(cfg["nodes"])
    marks: dict[int, list[float]] = {}

    class Timed(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            marks[server_round] = [time.perf_counter()]
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            res = super().aggregate_train(server_round, replies)
            marks[server_round].append(time.perf_counter())
            errors = [r for r in replies if r.has_error()]
            if errors or len(replies) != nodes:
                raise RuntimeError(f"round {server_round}: {len(replies)} replies, {len(errors)} errors")
            with open(out + ".progress", "w") as f:
                f.write(str(server_round))
            return res

    while len(list(grid.get_node_ids())) < nodes:  # every SuperNode connected before round 1
        time.sleep(0.2)
    t0 = time.perf_counter()
    Timed(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=nodes, min_available_nodes=nodes).start(
        grid=grid, initial_arrays=initial(int(cfg["params"])), num_rounds=int(cfg["num-server-rounds"]),
        timeout=float(cfg["round-timeout"]))  # a lost reply fails the round (aggregate_train raises)
    import flwr

    rounds = [marks[r][1] - marks[r][0] for r in sorted(marks) if len(marks[r]) == 2]
    with open(out, "w") as f:
        json.dump({"round_seconds": rounds, "wall_seconds": time.perf_counter() - t0, "flwr": flwr.__version__,
                   "path": "deployment engine (SuperLink + SuperNodes, flwr run)"}, f)
