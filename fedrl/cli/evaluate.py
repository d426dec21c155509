"""``fedrl evaluate``: roll a saved policy out in MuJoCo."""

from __future__ import annotations

import argparse
import json

from fedrl.common import argtypes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="roll a saved policy out in MuJoCo")
    p.add_argument("policy", nargs="+", help="a global_policy.safetensors written by a run (several: each "
                                             "in turn, all read before any is rolled out)")
    p.add_argument("--env", default=None, help="default: the env recorded in the file")
    p.add_argument("--episodes", type=argtypes.integer, default=10)
    p.add_argument("--seed", type=argtypes.integer, default=0)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (for scripts)")
    p.set_defaults(func=_cmd_evaluate)


def _cmd_evaluate(a: argparse.Namespace) -> int:
    from fedrl.algos.policy_io import load_policy
    from fedrl.envs.evaluation import evaluate

    loaded = []
    for path in a.policy:  # every file read first: a bad one is named before any rollout
        pol, meta = load_policy(path)
        env = a.env or meta.get("env_id")
        if not env:
            raise ValueError(f"{path}: no env recorded in the file; pass --env")
        loaded.append((path, pol, env))
    for path, pol, env in loaded:
        res = evaluate(pol, env, a.episodes, a.seed).as_dict()
        if a.json:
            print(json.dumps({"policy": path, **res}), flush=True)  # one line per policy
            continue
        print(f"{path} on {env}, {a.episodes} episode{'' if a.episodes == 1 else 's'} (seed {a.seed}), the deterministic policy tanh(mu(s)):\n"
              f"return {res['return_mean']:.1f} ± {res['return_std']:.1f}   D4RL score {res['score_mean']:.1f} "
              f"± {res['score_std']:.1f}")
        rets = res.get("returns") or []
        if rets:
            print(f"episodes: min {min(rets):.1f}, max {max(rets):.1f}"
                  + (f", mean length {sum(res['lengths']) / len(res['lengths']):.0f} steps" if res.get("lengths")
                     else ""), flush=True)
    return 0
