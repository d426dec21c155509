"""The ServerApp: FedAvg of every node in every round, no evaluation, through Flower's legacy
workflow; with ``secagg=1`` its fit is SecAggPlusWorkflow (``num-shares`` of ``nodes``, any
``reconstruction-threshold`` of them unmask). Each round's wall time, from the strategy's
``configure_fit`` (the round's start) to the end of its ``aggregate_fit``, is written to ``out``
(a ``.progress`` file marks each round's end)."""

import json
import time

import numpy as np
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import Grid, LegacyContext, ServerApp, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

app = ServerApp()


def initial(n_floats: int):
    rng = np.random.default_rng(0)
    half = n_floats // 2  # two tensors, like a weight and the rest (as the other Flower sides)
    return [rng.standard_normal(half).astype(np.float32), rng.standard_normal(n_floats - half).astype(np.float32)]


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    out, nodes, secagg = str(cfg["out"]), int(cfg["nodes"]), bool(int(cfg["secagg"]))
    marks: dict[int, list[float]] = {}

    class Timed(FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):
            marks[server_round] = [time.perf_counter()]
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):
            res = super().aggregate_fit(server_round, results, failures)
            marks[server_round].append(time.perf_counter())
            if failures or len(results) != nodes:
                raise RuntimeError(f"round {server_round}: {len(results)} results, {len(failures)} failures")
            with open(out + ".progress", "w") as f:
                f.write(str(server_round))
            return res

    while len(list(grid.get_node_ids())) < nodes:  # every SuperNode connected before round 1
        time.sleep(0.2)
    strategy = Timed(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=nodes, min_available_clients=nodes,
                     initial_parameters=ndarrays_to_parameters(initial(int(cfg["params"]))))
    legacy = LegacyContext(context=context, strategy=strategy,
                           config=ServerConfig(num_rounds=int(cfg["num-server-rounds"]),
                                               round_timeout=float(cfg["round-timeout"])))
    fit = (SecAggPlusWorkflow(num_shares=int(cfg["num-shares"]),
                              reconstruction_threshold=int(cfg["reconstruction-threshold"]),
                              timeout=float(cfg["round-timeout"])) if secagg else None)
    t0 = time.perf_counter()
    DefaultWorkflow(fit_workflow=fit)(grid, legacy)
    import flwr

    rounds = [marks[r][1] - marks[r][0] for r in sorted(marks) if len(marks[r]) == 2]
    with open(out, "w") as f:
        json.dump({"round_seconds": rounds, "wall_seconds": time.perf_counter() - t0, "flwr": flwr.__version__,
                   "path": "deployment engine, legacy workflow" + (" + SecAgg+" if secagg else "")}, f)
