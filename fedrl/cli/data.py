"""``fedrl data ...``: dataset tools (info, make, the behaviour policies)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from fedrl.common import argtypes
from fedrl.data.errors import DatasetError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="dataset tools")
    dsub = p.add_subparsers(dest="data_cmd", required=True)
    info = dsub.add_parser("info", help="episodes, transitions (the file's rows, and those a learner trains on), "
                                        "returns, normalised score and provenance of a dataset")
    info.add_argument("dataset", help="D4RL HDF5 file, Minari directory or dataset name")
    info.set_defaults(func=_cmd_data_info)

    from fedrl.behavior.config import SACConfig
    from fedrl.data import QUALITIES

    mk = dsub.add_parser("make", help="make a D4RL-format dataset from behaviour policies",
                         description="Roll the shipped behaviour policies (or --behavior-dir) out in "
                                     "MuJoCo and write a D4RL-format HDF5 file with provenance metadata. "
                                     "Default size: D4RL's (1M transitions; medium-replay: its buffer).")
    mk.add_argument("--env", required=True, help="Hopper-v5, HalfCheetah-v5, Walker2d-v5 or Ant-v5")
    mk.add_argument("--quality", required=True, choices=QUALITIES)
    size = mk.add_mutually_exclusive_group()
    size.add_argument("--episodes", type=argtypes.integer, default=None, help="whole episodes to record")
    size.add_argument("--transitions", type=argtypes.integer, default=None, help="rows to record")
    mk.add_argument("--seed", type=argtypes.integer, default=0)
    mk.add_argument("--out", required=True, help="output .hdf5 file (written atomically)")
    mk.add_argument("--behavior-dir", default=None,
                    help="a behaviour set written by ship-behavior (default: the shipped one)")
    mk.set_defaults(func=_cmd_data_make)

    sh = dsub.add_parser("ship-behavior", help="choose medium/expert/replay checkpoints from a "
                                               "train-behavior run and write a behaviour set")
    sh.add_argument("run", help="the --out folder of train-behavior")
    sh.add_argument("--dest", required=True, help="e.g. fedrl/behavior/checkpoints/hopper")
    sh.add_argument("--replay-checkpoints", type=argtypes.integer, default=5)
    sh.add_argument("--episodes", type=argtypes.integer, default=10, help="episodes per candidate measurement")
    sh.set_defaults(func=_cmd_ship_behavior)

    c = SACConfig()
    tb = dsub.add_parser("train-behavior", formatter_class=argtypes.DefaultsHelp,
                         help="train an online SAC behaviour policy, checkpointing as it goes",
                         description="Online SAC in gymnasium MuJoCo, as D4RL trained its behaviour "
                                     "policies. Rerun the same command to resume after an interruption.")
    tb.add_argument("--env", required=True, help="Hopper-v5, HalfCheetah-v5, Walker2d-v5 or Ant-v5")
    tb.add_argument("--out", required=True, help="run folder (checkpoints/, progress.jsonl, state/)")
    tb.add_argument("--steps", type=argtypes.integer, default=c.total_steps,
                    help="total environment steps (the shipped sets ran with 1000000, stopped earlier)")
    tb.add_argument("--start-steps", type=argtypes.integer, default=c.start_steps)
    tb.add_argument("--eval-every", type=argtypes.integer, default=c.eval_every)
    tb.add_argument("--eval-episodes", type=argtypes.integer, default=c.eval_episodes)
    tb.add_argument("--batch-size", type=argtypes.integer, default=c.batch_size)
    tb.add_argument("--hidden", type=argtypes.integer, nargs="+", default=list(c.hidden))
    tb.add_argument("--seed", type=argtypes.integer, default=c.seed)
    tb.add_argument("--device", default="auto")
    tb.add_argument("--threads", type=argtypes.at_least(0), default=0,
                    help="torch CPU threads (0: torch's default, one per core). Use 1 beside other "
                         "busy processes: two threads on two shared cores ran ~10x slower here")
    tb.add_argument("--keep", default=None, metavar="DIR",
                    help="also keep a compact resume state in DIR at every evaluation (actions, rewards, "
                         "networks, optimiser moments, random streams: small enough to commit); when --out "
                         "holds no state, the same command resumes from DIR, rebuilding the replay buffer")
    tb.add_argument("--stop-return", default=None, metavar="R|expert",
                    help="stop at the first evaluation whose stochastic return reaches R ('expert': the "
                         "env's expert bar, the least return ship-behavior accepts for an expert)")
    tb.set_defaults(func=_cmd_train_behavior)


def _cmd_data_info(a: argparse.Namespace) -> int:
    from fedrl.data.d4rl import to_transitions
    from fedrl.data.registry import infer_env, load
    from fedrl.envs.scores import normalized_score

    raw = load(a.dataset, progress=lambda m: print(m, file=sys.stderr))
    rets = raw.episode_returns()
    out = {"source": raw.source, "transitions": len(raw),
           # d4rl's qlearning_dataset drops rows flagged timeouts (no next observation to learn from)
           # and the last row; that is what a learner trains on
           "training_transitions": len(to_transitions(raw)),
           "episodes": int(len(rets)), "obs_dim": raw.obs_dim, "act_dim": raw.act_dim,
           "return_mean": float(rets.mean()), "return_min": float(rets.min()),
           "return_max": float(rets.max()), "metadata": raw.metadata}
    try:
        env = infer_env(raw, a.dataset)
        out["env_id"] = env.gym_id
        out["score_mean"] = normalized_score(env.key, float(rets.mean()))
    except DatasetError:
        pass
    print(json.dumps(out, indent=2, default=str))
    return 0


def _cmd_data_make(a: argparse.Namespace) -> int:
    from fedrl.data.d4rl import load_d4rl
    from fedrl.data.make import make_dataset

    t0 = time.perf_counter()
    path = make_dataset(a.env, a.quality, a.seed, a.out, transitions=a.transitions,
                        episodes=a.episodes, behavior_dir=a.behavior_dir)
    meta = load_d4rl(path).metadata
    print(json.dumps({"out": str(path), "seconds": round(time.perf_counter() - t0, 1),
                      **{k: meta[k] for k in ("env_id", "quality", "transitions", "episodes",
                                              "return_mean", "return_min", "return_max")}}))
    return 0


def _cmd_ship_behavior(a: argparse.Namespace) -> int:
    from fedrl.behavior.shipped import ship

    ship(a.run, a.dest, replay_checkpoints=a.replay_checkpoints, episodes=a.episodes)
    return 0


def _cmd_train_behavior(a: argparse.Namespace) -> int:
    from fedrl.behavior.sac import SACConfig, train

    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    stop = None
    if a.stop_return is not None:
        from fedrl.behavior.shipped import EXPERT_MIN
        from fedrl.envs import env_info

        if a.stop_return == "expert":
            key = env_info(a.env).key
            if key not in EXPERT_MIN:
                raise ValueError(f"--stop-return expert: no expert bar for {a.env}")
            stop = EXPERT_MIN[key]
        else:
            try:
                stop = float(a.stop_return)
            except ValueError:
                raise ValueError(f"--stop-return: a number or 'expert', got {a.stop_return!r}") from None
    cfg = SACConfig(total_steps=a.steps, start_steps=a.start_steps, eval_every=a.eval_every,
                    eval_episodes=a.eval_episodes, batch_size=a.batch_size, hidden=tuple(a.hidden),
                    seed=a.seed)
    recs = train(a.env, cfg, a.out, a.device, log=lambda m: print(m, flush=True), keep=a.keep, stop_return=stop)
    best = max(recs, key=lambda r: r["stochastic_return_mean"])
    print(json.dumps({"out": a.out, "steps": recs[-1]["step"], "best_step": best["step"],
                      "best_stochastic_return": round(best["stochastic_return_mean"], 1)}))
    return 0


# Made on first use from the shipped Hopper behaviour policies (fedrl/behavior/checkpoints/hopper).
