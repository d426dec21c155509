"""What secure aggregation costs a round: ``fedrl.federation.secagg.secure_fedavg`` (every agent's
keys, shares, masks and the aggregator's unmasking, all in this process, one thread) beside plain
FedAvg of the same states, at Hopper's model sizes (the policy; the policy and both critics).

    python -m benchmarks.secagg_cost [--agents 5,10] [--repeats 3]

Writes ``benchmarks/results/secagg-cost.json``: per case the median seconds of each over
``--repeats``, their ratio and the rounding bound the round met. Both are timed in one run, so the
ratio holds on a shared machine; the seconds are this machine's (2 cores, busy or not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from fedrl.algos import DRPOConfig
from fedrl.federation.aggregate import fedavg
from fedrl.federation.round import initial_global_state
from fedrl.federation.secagg import SecAggParams, secure_fedavg

OUT = Path(__file__).resolve().parent / "results" / "secagg-cost.json"
HOPPER = (11, 3)


def _states(n: int, federate_critic: bool) -> list[dict[str, torch.Tensor]]:
    g = initial_global_state(DRPOConfig(), *HOPPER, 0, np.zeros(HOPPER[0], np.float32), np.ones(HOPPER[0], np.float32),
                             federate_critic)
    gen = torch.Generator().manual_seed(0)
    return [{k: v + 0.01 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
             for k, v in g.items()} for _ in range(n)]


def measure(agents: list[int], repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for federate_critic in (False, True):
        for n in agents:
            states, w = _states(n, federate_critic), [1.0] * n
            plain, secure, bound = [], [], 0.0
            for _ in range(repeats):
                t = time.perf_counter()
                fedavg(states, w)
                plain.append(time.perf_counter() - t)
                t = time.perf_counter()
                _, rec = secure_fedavg(states, w, SecAggParams(threshold=max(2, n * 2 // 3), context=b"bench"))
                secure.append(time.perf_counter() - t)
                bound = rec["bound"]
            p, s = statistics.median(plain), statistics.median(secure)
            rows.append({"model": "policy+critic" if federate_critic else "policy", "agents": n,
                         "values": sum(v.numel() for v in states[0].values()), "fedavg_s": p, "secure_s": s,
                         "ratio": s / p, "bound": bound})
            print(f"{rows[-1]['model']:>13}  {n:>3} agents  {rows[-1]['values']:>9,} values  fedavg {p * 1e3:8.1f} ms  "
                  f"secure {s:7.2f} s  x{s / p:,.0f}  bound {bound:.1e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", default="5,10")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    rows = measure([int(x) for x in a.agents.split(",")], a.repeats)
    OUT.write_text(json.dumps({"command": "python -m benchmarks.secagg_cost", "threads": 1,
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
