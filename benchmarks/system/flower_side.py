"""Flower's side of ``benchmarks.system.peers``: runs in Flower's own virtual environment (flwr needs
protobuf < 7; this project pins 7), so it imports flwr and numpy only, never fedrl.

    python flower_side.py server --address 127.0.0.1:PORT --rounds R --params N --clients C --out FILE
    python flower_side.py client --address 127.0.0.1:PORT

Flower's legacy gRPC path (``start_server`` / ``start_client``): the server's strategy is FedAvg
with every client in every round and no evaluation; a client's ``fit`` returns the parameters it
received unchanged (no training, like the federation's zero local steps). The server records, per
round, the wall time from ``configure_fit`` (the round's start) to the end of ``aggregate_fit``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings


def initial(n_floats: int):
    import numpy as np

    rng = np.random.default_rng(0)
    half = n_floats // 2  # two tensors, like a weight and the rest
    return [rng.standard_normal(half).astype(np.float32), rng.standard_normal(n_floats - half).astype(np.float32)]


def server(a) -> int:
    import flwr as fl
    from flwr.common import ndarrays_to_parameters

    marks: dict[int, list[float]] = {}

    class Timed(fl.server.strategy.FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):
            marks[server_round] = [time.perf_counter()]
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):
            out = super().aggregate_fit(server_round, results, failures)
            marks[server_round].append(time.perf_counter())
            with open(a.out + ".progress", "w") as f:  # the orchestrator reads CPU after round 1
                f.write(str(server_round))
            if failures:
                raise RuntimeError(f"round {server_round}: {len(failures)} clients failed")
            return out

    strategy = Timed(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=a.clients,
                     min_available_clients=a.clients, min_evaluate_clients=0,
                     initial_parameters=ndarrays_to_parameters(initial(a.params)))
    t0 = time.perf_counter()
    fl.server.start_server(server_address=a.address, config=fl.server.ServerConfig(num_rounds=a.rounds),
                           strategy=strategy, grpc_max_message_length=1 << 30)
    rounds = [marks[r][1] - marks[r][0] for r in sorted(marks) if len(marks[r]) == 2]
    with open(a.out, "w") as f:
        json.dump({"round_seconds": rounds, "wall_seconds": time.perf_counter() - t0,
                   "flwr": fl.__version__, "path": "legacy gRPC (start_server/start_client)"}, f)
    return 0


def client(a) -> int:
    import flwr as fl

    class Echo(fl.client.NumPyClient):
        def get_parameters(self, config):
            return []

        def fit(self, parameters, config):
            return parameters, 1, {}

        def evaluate(self, parameters, config):
            return 0.0, 1, {}

    fl.client.start_client(server_address=a.address, client=Echo().to_client(),
                           grpc_max_message_length=1 << 30)
    return 0


def main() -> int:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("server", "client"))
    p.add_argument("--address", required=True)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--params", type=int, default=70_000, help="float32 parameters in the model")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--out", default="flower.json")
    a = p.parse_args()
    return server(a) if a.role == "server" else client(a)


if __name__ == "__main__":
    sys.exit(main())
