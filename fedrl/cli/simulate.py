"""``fedrl simulate``: a federation in one process, its flags and its settings."""

from __future__ import annotations

import argparse
import json
import time

from fedrl.cli.settings import apply_sets, settings_file
from fedrl.algos import ALGOS, BCConfig, DRPOConfig
from fedrl.common import argtypes
from fedrl.data.normalize import NORM_CHOICES
from fedrl.federation.choices import AGGREGATIONS, FEDERATE_CHOICES, WEIGHTINGS


def add_parser(sub: argparse._SubParsersAction) -> None:
    from fedrl.common.argtypes import DEVICE_CHOICES
    from fedrl.federation.simconfig import DEFAULT_DATASET, ENGINES, SimConfig

    d, hp, bc = SimConfig(), DRPOConfig(), BCConfig()
    p = sub.add_parser("simulate", help="run a federation in one process (no network)",
                       formatter_class=argtypes.DefaultsHelp,
                       description="In-process federation with the same round logic as the services. "
                                   "Defaults are the paper's settings; the dataset default is made "
                                   "locally on first use.")
    p.add_argument("--algo", choices=ALGOS, default=d.algo)
    p.add_argument("--dataset", action="append", metavar="PATH|NAME[:AGENTS]",
                   help=f"D4RL HDF5 file, Minari directory or dataset name (repeat for a "
                        f"heterogeneous mix, e.g. expert.hdf5:4 medium.hdf5:1); default {DEFAULT_DATASET}")
    p.add_argument("--env", default=None, help="evaluation env (default: from the dataset)")
    p.add_argument("--agents", type=argtypes.integer, default=d.agents)
    p.add_argument("--trajectories", type=argtypes.integer, default=d.trajectories, help="whole trajectories per agent")
    p.add_argument("--transitions", type=argtypes.integer, default=d.transitions,
                   help="with > 0, more whole trajectories per agent until it holds at least this many transitions")
    p.add_argument("--rounds", type=argtypes.integer, default=d.rounds)
    p.add_argument("--local-steps", type=argtypes.integer, default=d.local_steps)
    p.add_argument("--eval-episodes", type=argtypes.integer, default=d.eval_episodes)
    p.add_argument("--eval-every", type=argtypes.integer, default=d.eval_every)
    p.add_argument("--seed", type=argtypes.integer, default=d.seed)
    p.add_argument("--device", default=d.device, help=f"one of {', '.join(DEVICE_CHOICES)}[:N]")
    p.add_argument("--threads", type=argtypes.at_least(0), default=0,
                   help="torch CPU threads (0: torch's default). Results are bit-identical only for "
                        "equal thread counts: use 1 to reproduce a `fedrl up` run, whose agents use 1")
    p.add_argument("--obs-norm", choices=NORM_CHOICES, default=d.obs_norm)
    p.add_argument("--weighting", choices=WEIGHTINGS, default=d.weighting)
    p.add_argument("--federate", choices=FEDERATE_CHOICES, default=d.federate)
    p.add_argument("--aggregation", choices=AGGREGATIONS, default=d.aggregation)
    p.add_argument("--trim-fraction", type=float, default=d.trim_fraction)
    p.add_argument("--secagg-threshold", type=argtypes.integer, default=d.secagg_threshold,
                   help="secure aggregation: with t >= 2 each round's average is taken under pairwise masks "
                        "and recovered while at least t agents answer (0: off; docs/guides/privacy.md)")
    p.add_argument("--out", default=None, help="run folder (default runs/<algo>-<time>)")
    p.add_argument("--parallel-agents", type=argtypes.at_least(1), default=1,
                   help="agents trained at once, one thread each (with --threads 1: the same numbers as one "
                        "at a time, on as many cores)")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="per-agent: one learner per agent (the services' path); batched: every agent as one "
                        "batched model (each its own data, draws and moments); auto: batched on a GPU, "
                        "per-agent on the CPU, where batching is slower (BENCHMARKS.md, batched throughput)")
    p.add_argument("--checkpoint", action="store_true",
                   help="write the whole state to OUT/checkpoint.safetensors after every round (and each "
                        "agent's, as it finishes its local round, to OUT/agents-in-round/); the same command "
                        "again continues a stopped run where it stopped, training no finished agent again, and "
                        "only on the data it started on (each shard's digest is in OUT/config.json)")
    p.add_argument("--config", default=None,
                   help="JSON file of run settings: SimConfig's fields, with 'drpo' and 'bc' objects of every "
                        "hyperparameter (docs/reference/config.md); the flags given override it")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="a setting of the same kind, over --config, e.g. --set drpo.alpha_lr=1e-4 --set "
                        "'drpo={\"cql_calibration\": \"none\"}' --set final_eval_episodes=50")
    g = p.add_argument_group("DRPO / CQL hyperparameters (defaults: the paper's table)")
    g.add_argument("--lambda1", type=float, default=hp.lambda1)
    g.add_argument("--lambda2", type=float, default=hp.lambda2)
    g.add_argument("--cql-weight", type=float, default=hp.cql_weight, help="beta")
    g.add_argument("--td-weight", type=float, default=hp.td_weight,
                   help="weight of each critic's 1/2 MSE TD term (1: the paper's equation; 2: the full MSE of CORL and d3rlpy)")
    g.add_argument("--q-scale", choices=("raw", "normalized"), default=hp.q_scale)
    g.add_argument("--actor-lr", type=float, default=hp.actor_lr)
    g.add_argument("--critic-lr", type=float, default=hp.critic_lr)
    g.add_argument("--batch-size", type=argtypes.integer, default=hp.batch_size)
    g.add_argument("--hidden", type=argtypes.integer, nargs="+", default=list(hp.hidden))
    g.add_argument("--gamma", type=float, default=hp.gamma)
    g2 = p.add_argument_group("BC hyperparameters")
    g2.add_argument("--bc-loss", choices=("nll", "mse"), default=bc.loss)
    g2.add_argument("--bc-lr", type=float, default=bc.lr)
    p.set_defaults(func=_cmd_simulate)


def _cmd_simulate(a: argparse.Namespace) -> int:
    from fedrl.federation.simulate import has_checkpoint, refuse_a_used_folder, run

    if a.threads:
        import torch
        torch.set_num_threads(a.threads)

    cfg = _sim_settings(a)
    out = a.out or f"runs/{cfg.algo}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not (a.checkpoint and has_checkpoint(out)):
        refuse_a_used_folder(out, ("config.json", "rounds.jsonl", "summary.json"))
    summary = run(cfg, out, checkpoint=a.checkpoint, parallel_agents=a.parallel_agents, progress=True,
                  engine=a.engine)
    if summary["final"]:
        f = summary["final"]
        print(json.dumps({"out": str(out), "final_return": round(f["return_mean"], 2),
                          "final_score": round(f["score_mean"], 2)}))
    return 0


# simulate's flags that are settings: flag dest -> (where, field); "both": DRPO's and BC's
_SIM_FLAGS = {"algo": ("", "algo"), "dataset": ("", "datasets"), "env": ("", "env"), "agents": ("", "agents"),
              "trajectories": ("", "trajectories"), "transitions": ("", "transitions"), "rounds": ("", "rounds"),
              "local_steps": ("", "local_steps"), "eval_episodes": ("", "eval_episodes"),
              "eval_every": ("", "eval_every"), "seed": ("", "seed"), "device": ("", "device"),
              "obs_norm": ("", "obs_norm"), "weighting": ("", "weighting"), "federate": ("", "federate"),
              "aggregation": ("", "aggregation"), "trim_fraction": ("", "trim_fraction"),
              "secagg_threshold": ("", "secagg_threshold"),
              "lambda1": ("drpo", "lambda1"), "lambda2": ("drpo", "lambda2"), "cql_weight": ("drpo", "cql_weight"),
              "td_weight": ("drpo", "td_weight"), "q_scale": ("drpo", "q_scale"), "actor_lr": ("drpo", "actor_lr"),
              "critic_lr": ("drpo", "critic_lr"), "gamma": ("drpo", "gamma"), "batch_size": ("both", "batch_size"),
              "hidden": ("both", "hidden"), "bc_loss": ("bc", "loss"), "bc_lr": ("bc", "lr")}


def _sim_settings(a: argparse.Namespace):
    """``fedrl simulate``'s settings from --config, then each --set, then the flags given (a flag
    not given leaves the file's value, or the default)."""
    from fedrl.federation.simconfig import parse_sim_config

    data = apply_sets(settings_file(a.config), a.set)
    given = getattr(a, "given", None)  # None (called without main): every flag counts
    for dest in _SIM_FLAGS if given is None else given:
        if dest not in _SIM_FLAGS or (dest == "dataset" and a.dataset is None):
            continue
        where, field = _SIM_FLAGS[dest]
        value = list(getattr(a, dest)) if dest in ("dataset", "hidden") else getattr(a, dest)
        for part in (("drpo", "bc") if where == "both" else (where,)):
            if part:
                data.setdefault(part, {})[field] = value
            else:
                data[field] = value
    return parse_sim_config(data)
