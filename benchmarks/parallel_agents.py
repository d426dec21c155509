"""A run's agents one at a time vs in parallel threads (``fedrl simulate --parallel-agents``).

    python -m benchmarks.parallel_agents [--steps 150] [--agents 2]

Agents at the paper's sizes (DRPO, 5 trajectories of hopper-medium-v2 each), one torch thread in
the process; times ``--steps`` local steps of every agent one after another, then the same with
one thread per agent, and checks the two give the same weights. Prints both times and the ratio.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.single_agent import one_shard
from fedrl.algos import DRPOConfig
from fedrl.federation.round import LocalTrainer, initial_global_state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--agents", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    raw, data, mean, std = one_shard("hopper-medium-v2", 5, 0)
    cfg = DRPOConfig()
    g = initial_global_state(cfg, raw.obs_dim, raw.act_dim, 0, mean, std, False)

    def trainers():
        return [LocalTrainer(i, cfg, data, mean, std, 0, torch.device("cpu")) for i in range(a.agents)]

    seq, par = trainers(), trainers()
    for t in seq + par:  # warm-up
        t.train_round(g, 5)
    t0 = time.perf_counter()
    one = [t.train_round(g, a.steps).state for t in seq]
    t_seq = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.agents) as pool:
        many = list(pool.map(lambda t: t.train_round(g, a.steps).state, par))
    t_par = time.perf_counter() - t0
    same = all(torch.equal(x[k], y[k]) for x, y in zip(one, many) for k in x)
    print(f"{a.agents} agents x {a.steps} steps: one at a time {t_seq:.1f} s, in threads {t_par:.1f} s, "
          f"{t_seq / t_par:.2f}x; same weights: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
