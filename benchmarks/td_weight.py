"""Mean Q on the data over long training, for TD-term weights (1: eq. cql as written; 2: CORL).

    python -m benchmarks.td_weight [--steps 8000] [--weights 1,2] [--out FILE]

One agent, 5 trajectories of hopper-medium-v2 (seed 0), DRPO at the paper's sizes and defaults
except ``td_weight``; the policy it trains is its own global policy each 500-step round. Prints
and records mean Q on the data, the critics' TD loss (1/2 MSE, unweighted), the CQL penalty,
the temperature and the policy's NLL of the data actions every 500 steps. One thread; about
12 minutes per weight on this CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from fedrl.algos import DRPOConfig
from fedrl.federation.round import LocalTrainer, initial_global_state

from benchmarks.single_agent import one_shard

KEYS = ("q_data", "critic_td", "cql_penalty", "alpha", "reg_data")


def run(weight: float, steps: int, dataset: str, seed: int, every: int = 500) -> list[dict]:
    raw, data, mean, std = one_shard(dataset, 5, seed)
    cfg = dataclasses.replace(DRPOConfig(), td_weight=weight)
    trainer = LocalTrainer(0, cfg, data, mean, std, seed, torch.device("cpu"))
    state = initial_global_state(cfg, raw.obs_dim, raw.act_dim, seed, mean, std, False)
    rows = []
    for r in range(steps // every):
        res = trainer.train_round(state, every)
        state = res.state
        rows.append({"steps": (r + 1) * every, **{k: round(res.metrics[k], 3) for k in KEYS}})
        print(f"td_weight {weight:g} step {rows[-1]['steps']:6d}: " +
              " ".join(f"{k} {rows[-1][k]:8.3f}" for k in KEYS), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8000)
    p.add_argument("--weights", default="1,2")
    p.add_argument("--dataset", default="hopper-medium-v2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    res = {"dataset": a.dataset, "seed": a.seed, "trajectories": 5, "steps": a.steps,
           "runs": {w: run(float(w), a.steps, a.dataset, a.seed) for w in a.weights.split(",")}}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
