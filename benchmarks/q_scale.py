"""Does the actor's regularisation matter under each Q scale? One agent, same start, same data.

    python -m benchmarks.q_scale [--dataset PATH|NAME] [--steps 300] [--out FILE]

For q_scale raw / normalized, and CQL (lambdas 0) as the reference, train one DRPO learner at the
paper's sizes from the same initial weights on the same shard, then report mean Q on the data and
the policy's NLL of the data actions (what lambda1's term pulls down). If the NLL under DRPO
matches CQL's, the regulariser had no effect at that Q scale.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from fedrl.algos import DRPOConfig, cql_config
from fedrl.federation.round import LocalTrainer, initial_global_state

from benchmarks.single_agent import one_shard


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="hopper-random-v2")
    p.add_argument("--trajectories", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    raw, data, mean, std = one_shard(a.dataset, a.trajectories, a.seed)
    variants = {
        "cql (lambdas 0)": cql_config(),
        "drpo raw": DRPOConfig(q_scale="raw"),
        "drpo normalized": DRPOConfig(q_scale="normalized"),
    }
    rows = []
    for name, cfg in variants.items():
        g0 = initial_global_state(cfg, raw.obs_dim, raw.act_dim, a.seed, mean, std, False)
        tr = LocalTrainer(0, cfg, data, mean, std, a.seed, torch.device("cpu"))
        res = tr.train_round(g0, a.steps)
        buf = tr.buffer
        with torch.no_grad():
            nll = -tr.learner.policy.log_prob(buf.obs, buf.actions).mean().item()
            q = tr.learner.critic(buf.obs, buf.actions).mean().item()
        rows.append({"variant": name, "data_nll": nll, "mean_q": q,
                     "actor_q_term": res.metrics["actor_q_term"], "seconds": res.seconds,
                     "config": dataclasses.asdict(cfg)})
        print(f"{name:18s} NLL(data actions) {nll:8.3f}   mean Q(s,a_D) {q:8.2f}   "
              f"q term {res.metrics['actor_q_term']:8.3f}   [{res.seconds:.0f}s]")
    print(f"dataset {raw.source}, {len(data)} transitions, {a.steps} steps, paper sizes")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"dataset": raw.source, "transitions": len(data), "steps": a.steps,
                       "rows": rows}, f, indent=2, default=lambda o: list(o) if isinstance(o, tuple) else str(o))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
