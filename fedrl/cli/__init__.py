"""The ``fedrl`` command line: ``up``, ``ctl``, ``simulate``, ``evaluate``, ``data ...``; with the
one-machine launcher (``launcher``).

Layer 8, the top of the core: may import every layer below it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from fedrl.algos import ALGOS, BCConfig, DRPOConfig
from fedrl.common import argtypes
from fedrl.data.errors import DatasetError
from fedrl.data.normalize import NORM_CHOICES
from fedrl.federation.choices import AGGREGATIONS, FEDERATE_CHOICES, WEIGHTINGS


def _simulate_parser(sub: argparse._SubParsersAction) -> None:
    from fedrl.common.device import DEVICE_CHOICES
    from fedrl.federation.simulate import DEFAULT_DATASET, ENGINES, SimConfig

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
    p.add_argument("--agents", type=int, default=d.agents)
    p.add_argument("--trajectories", type=int, default=d.trajectories, help="whole trajectories per agent")
    p.add_argument("--transitions", type=int, default=d.transitions,
                   help="with > 0, more whole trajectories per agent until it holds at least this many transitions")
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--local-steps", type=int, default=d.local_steps)
    p.add_argument("--eval-episodes", type=int, default=d.eval_episodes)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help=f"one of {', '.join(DEVICE_CHOICES)}[:N]")
    p.add_argument("--threads", type=argtypes.at_least(0), default=0,
                   help="torch CPU threads (0: torch's default). Results are bit-identical only for "
                        "equal thread counts: use 1 to reproduce a `fedrl up` run, whose agents use 1")
    p.add_argument("--obs-norm", choices=NORM_CHOICES, default=d.obs_norm)
    p.add_argument("--weighting", choices=WEIGHTINGS, default=d.weighting)
    p.add_argument("--federate", choices=FEDERATE_CHOICES, default=d.federate)
    p.add_argument("--aggregation", choices=AGGREGATIONS, default=d.aggregation)
    p.add_argument("--trim-fraction", type=float, default=d.trim_fraction)
    p.add_argument("--secagg-threshold", type=int, default=d.secagg_threshold,
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
                        "again continues a stopped run where it stopped, training no finished agent again")
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
    g.add_argument("--batch-size", type=int, default=hp.batch_size)
    g.add_argument("--hidden", type=int, nargs="+", default=list(hp.hidden))
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
    from fedrl.federation.simulate import parse_sim_config

    data = _settings_file(a.config)
    for kv in a.set:
        ((k, value),) = _set_pairs([kv]).items()
        head, dot, field = k.partition(".")
        if dot:  # drpo.alpha_lr=...
            if head not in ("drpo", "bc"):
                raise ValueError(f"--set {kv!r}: only drpo.FIELD and bc.FIELD have parts")
            data.setdefault(head, {})
            if not isinstance(data[head], dict):
                raise ValueError(f"--set {kv!r}: {head} is not an object in the settings")
            data[head][field] = value
        elif k in ("drpo", "bc") and isinstance(value, dict) and isinstance(data.get(k), dict):
            data[k] = {**data[k], **value}
        else:
            data[k] = value
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


def _evaluate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="roll a saved policy out in MuJoCo")
    p.add_argument("policy", help="a global_policy.safetensors written by a run")
    p.add_argument("--env", default=None, help="default: the env recorded in the file")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (for scripts)")
    p.set_defaults(func=_cmd_evaluate)


def _cmd_evaluate(a: argparse.Namespace) -> int:
    from fedrl.algos.policy_io import load_policy
    from fedrl.envs.evaluation import evaluate

    pol, meta = load_policy(a.policy)
    env = a.env or meta.get("env_id")
    if not env:
        raise ValueError(f"{a.policy}: no env recorded in the file; pass --env")
    res = evaluate(pol, env, a.episodes, a.seed).as_dict()
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"{a.policy} on {env}, {a.episodes} episodes (seed {a.seed}), the deterministic policy tanh(mu(s)):\n"
          f"return {res['return_mean']:.1f} ± {res['return_std']:.1f}   D4RL score {res['score_mean']:.1f} "
          f"± {res['score_std']:.1f}")
    rets = res.get("returns") or []
    if rets:
        print(f"episodes: min {min(rets):.1f}, max {max(rets):.1f}"
              + (f", mean length {sum(res['lengths']) / len(res['lengths']):.0f} steps" if res.get("lengths") else ""))
    return 0


def _data_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="dataset tools")
    dsub = p.add_subparsers(dest="data_cmd", required=True)
    info = dsub.add_parser("info", help="episodes, transitions (the file's rows, and those a learner trains on), "
                                        "returns, normalised score and provenance of a dataset")
    info.add_argument("dataset", help="D4RL HDF5 file, Minari directory or dataset name")
    info.set_defaults(func=_cmd_data_info)

    from fedrl.behavior.sac import SACConfig
    from fedrl.data.make import QUALITIES

    mk = dsub.add_parser("make", help="make a D4RL-format dataset from behaviour policies",
                         description="Roll the shipped behaviour policies (or --behavior-dir) out in "
                                     "MuJoCo and write a D4RL-format HDF5 file with provenance metadata. "
                                     "Default size: D4RL's (1M transitions; medium-replay: its buffer).")
    mk.add_argument("--env", required=True, help="Hopper-v5, HalfCheetah-v5, Walker2d-v5 or Ant-v5")
    mk.add_argument("--quality", required=True, choices=QUALITIES)
    size = mk.add_mutually_exclusive_group()
    size.add_argument("--episodes", type=int, default=None, help="whole episodes to record")
    size.add_argument("--transitions", type=int, default=None, help="rows to record")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--out", required=True, help="output .hdf5 file (written atomically)")
    mk.add_argument("--behavior-dir", default=None,
                    help="a behaviour set written by ship-behavior (default: the shipped one)")
    mk.set_defaults(func=_cmd_data_make)

    sh = dsub.add_parser("ship-behavior", help="choose medium/expert/replay checkpoints from a "
                                               "train-behavior run and write a behaviour set")
    sh.add_argument("run", help="the --out folder of train-behavior")
    sh.add_argument("--dest", required=True, help="e.g. fedrl/behavior/checkpoints/hopper")
    sh.add_argument("--replay-checkpoints", type=int, default=5)
    sh.add_argument("--episodes", type=int, default=10, help="episodes per candidate measurement")
    sh.set_defaults(func=_cmd_ship_behavior)

    c = SACConfig()
    tb = dsub.add_parser("train-behavior", formatter_class=argtypes.DefaultsHelp,
                         help="train an online SAC behaviour policy, checkpointing as it goes",
                         description="Online SAC in gymnasium MuJoCo, as D4RL trained its behaviour "
                                     "policies. Rerun the same command to resume after an interruption.")
    tb.add_argument("--env", required=True, help="Hopper-v5, HalfCheetah-v5, Walker2d-v5 or Ant-v5")
    tb.add_argument("--out", required=True, help="run folder (checkpoints/, progress.jsonl, state/)")
    tb.add_argument("--steps", type=int, default=c.total_steps,
                    help="total environment steps (the shipped sets ran with 1000000, stopped earlier)")
    tb.add_argument("--start-steps", type=int, default=c.start_steps)
    tb.add_argument("--eval-every", type=int, default=c.eval_every)
    tb.add_argument("--eval-episodes", type=int, default=c.eval_episodes)
    tb.add_argument("--batch-size", type=int, default=c.batch_size)
    tb.add_argument("--hidden", type=int, nargs="+", default=list(c.hidden))
    tb.add_argument("--seed", type=int, default=c.seed)
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
UP_DEFAULT_DATASET = "hopper-medium-v2"
# The first command a newcomer runs: short, yet long enough to learn. DRPO's critic needs about the
# paper's 1,000 local steps before its policy moves off the start (at 100 steps a round the returns
# stayed at 4-17); two agents, so each has a core of a 2-core laptop. Measured: README.
UP_DEFAULTS = {"agents": 2, "rounds": 3, "local_steps": 1000, "eval_episodes": 5}


def _up_parser(sub: argparse._SubParsersAction) -> None:
    from fedrl.federation.runconfig import SERVICE_ALGOS, RunConfig

    p = sub.add_parser("up", help="run the whole federation here: aggregator, agents, evaluator as processes",
                       description="Starts the aggregator, N agents and the evaluator as real processes on "
                                   "127.0.0.1, runs the federation, writes a run folder. The default needs "
                                   f"nothing from outside ({UP_DEFAULT_DATASET}, made on first use from the "
                                   "shipped behaviour policies) "
                                   "and takes a few minutes on 2 CPU cores.")
    p.add_argument("--config", default=None, help="run config JSON file (fields of RunConfig); flags override it")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="a run config field over --config, e.g. --set dp_clip=1 --set dp_noise=1.1 "
                        "--set 'drpo={\"lambda1\": 0.2}' (flags override it)")
    p.add_argument("--dataset", action="append", metavar="PATH|NAME[:AGENTS]",
                   help=f"the federation's data, dealt to agents in shards (default {UP_DEFAULT_DATASET})")
    p.add_argument("--algo", choices=SERVICE_ALGOS, default=None,
                   help=f"default {RunConfig().algo} (or the --config file's)")
    p.add_argument("--agents", type=int, default=None, help=f"default {UP_DEFAULTS['agents']}")
    p.add_argument("--trajectories", type=int, default=5, help="whole trajectories per agent")
    p.add_argument("--transitions", type=argtypes.at_least(0), default=0,
                   help="with > 0, more whole trajectories per agent until it holds at least this many transitions")
    p.add_argument("--rounds", type=int, default=None, help=f"default {UP_DEFAULTS['rounds']}")
    p.add_argument("--local-steps", type=int, default=None, help=f"default {UP_DEFAULTS['local_steps']}")
    p.add_argument("--eval-episodes", type=int, default=None, help=f"default {UP_DEFAULTS['eval_episodes']}")
    p.add_argument("--seed", type=int, default=None, help=f"default {RunConfig().seed} (or the --config file's)")
    p.add_argument("--aggregation", choices=AGGREGATIONS, default=None, help="default fedavg")
    p.add_argument("--device", default="auto", help="agents' device: auto, cpu, cuda[:N]")
    p.add_argument("--agent-threads", type=argtypes.at_least(0), default=1, help="torch threads per agent process")
    p.add_argument("--out", default=None, help="run folder (default runs/up-<time>)")
    p.add_argument("--prometheus", action="store_true",
                   help="also start a real Prometheus on 127.0.0.1 scraping every process, with the "
                        "deployment's alert rules (needs the prometheus binary, e.g. apt-get install prometheus)")
    p.add_argument("--prometheus-bin", default=None, help="the prometheus binary (default: from PATH)")
    p.add_argument("--secure", action="store_true",
                   help="mutual TLS (a throwaway CA in <out>/tls) and a bearer token per process, to try "
                        "the federation's identity checks")
    p.add_argument("--linger", type=argtypes.seconds, default=0.0, metavar="SECONDS",
                   help="keep every process (and Prometheus) up this long after the run, to look at "
                        "metrics and dashboards; Ctrl-C ends it early")
    p.set_defaults(func=_cmd_up)


def _settings_file(path: str | None) -> dict:
    """A JSON object of run settings read from ``path`` ({} without one); a ValueError that
    names the file when it is missing, unreadable, not JSON or not an object."""
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read the run settings ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of run settings, got {type(data).__name__}")
    return data


def _set_pairs(pairs: list[str]) -> dict:
    """``--set KEY=VALUE`` pairs: each VALUE as JSON, else as the string it is."""
    out = {}
    for kv in pairs:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise ValueError(f"--set {kv!r}: expected KEY=VALUE")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _cmd_up(a: argparse.Namespace) -> int:
    from fedrl.cli.launcher import UpConfig, up
    from fedrl.federation.runconfig import parse_run_config

    data = dict(UP_DEFAULTS)
    data_from_file = _settings_file(a.config)
    data_from_file.update(_set_pairs(a.set))
    data.update(data_from_file)
    for k in ("algo", "agents", "rounds", "local_steps", "eval_episodes", "seed", "aggregation"):
        if getattr(a, k) is not None:
            data[k] = getattr(a, k)
    datasets = tuple(a.dataset or [UP_DEFAULT_DATASET])
    counts = [d.rpartition(":")[2] for d in datasets]
    if a.agents is None and "agents" not in data_from_file and all(c.isdigit() for c in counts):
        data["agents"] = sum(int(c) for c in counts)  # e.g. expert.hdf5:4 medium.hdf5:1 -> 5 agents
    rc = parse_run_config(data)
    out = Path(a.out or f"runs/up-{time.strftime('%Y%m%d-%H%M%S')}")
    if a.prometheus:
        from fedrl.ops.local_prometheus import PrometheusError, find_prometheus
        try:
            find_prometheus(a.prometheus_bin)
        except PrometheusError as e:
            print(f"fedrl up: error: {e}", file=sys.stderr)
            return 2
    return up(UpConfig(rc, datasets, a.trajectories, out, a.device, a.agent_threads,
                       prometheus=a.prometheus, prometheus_bin=a.prometheus_bin, linger=a.linger,
                       secure=a.secure, transitions=a.transitions),
              log=lambda m: print(m, flush=True), progress=True)


# What ``fedrl ctl start`` without --config runs: every agent joined now, the paper's 1,000 local
# steps per round (a CQL-based learner scores visibly above zero after the first round on
# Hopper data), 10 rounds, each evaluated. Each can be changed with --set.
CTL_START_DEFAULTS = {"rounds": 10, "local_steps": 1000, "eval_episodes": 10}


DEFAULT_PORT = 50051  # the aggregator's --port default
CTL_CONNECT_TIMEOUT = 10.0  # fedrl ctl's wait for an aggregator that does not answer yet, by default


def _target(text: str) -> str:
    """``HOST[:PORT]`` (an IPv6 address in brackets): the aggregator's default port when none is given."""
    text = text.strip()
    if not text:
        raise argparse.ArgumentTypeError("empty target: give HOST[:PORT]")
    host, sep, port = text.rpartition(":")
    if text.startswith("[") and text.endswith("]") or not sep or (host.count(":") and not host.endswith("]")):
        return f"{text}:{DEFAULT_PORT}"  # no port: a bare name, [v6], or a bare v6 address
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: the port must be a number in 1-65535")
    return text


def _ctl_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ctl", help="control a running aggregator: start, status, watch, runs, versions, fetch, stop")
    p.add_argument("--target", type=_target, default=f"127.0.0.1:{DEFAULT_PORT}",
                   help=f"aggregator HOST[:PORT] (port {DEFAULT_PORT} when not given; default %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON (for scripts) instead of tables")
    p.add_argument("--connect-timeout", type=argtypes.positive_seconds, default=None,
                   help=f"seconds to wait for the aggregator to answer, also while nothing listens yet (e.g. "
                        f"while its pod starts). Default: {CTL_CONNECT_TIMEOUT:g} s, and a target where nothing "
                        f"listens (connection refused) is an error at once")
    from fedrl.wire.security import add_tls_arg
    add_tls_arg(p)
    p.epilog = 'The admin token, when the aggregator requires tokens, is read from $FEDRL_ADMIN_TOKEN.'
    csub = p.add_subparsers(dest="ctl_cmd", required=True)
    st = csub.add_parser("start", help="start a run", description=(
        "Without --config: the agents joined now, " + ", ".join(f"{k}={v}" for k, v in CTL_START_DEFAULTS.items())
        + ", the rest the run config's defaults (algo drpo); --set changes any of them."))
    st.add_argument("--config", default=None, help="run config JSON file (default: see above)")
    st.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override a field, e.g. --set rounds=10 --set 'drpo={\"lambda1\": 0.2}'")
    st.add_argument("--if-idle", action="store_true",
                    help="succeed without starting anything when a run is already active (idempotent jobs)")
    csub.add_parser("status", help="the run's state, round, agents and last evaluation")
    w = csub.add_parser("watch", help="print round events until the run ends, one line each")
    w.add_argument("--after-version", type=int, default=-1, help="skip events up to this version (default: all)")
    r = csub.add_parser("runs", help="the runs in the aggregator's state directory, newest first")
    r.add_argument("--limit", type=int, default=20, help="at most this many (default %(default)s)")
    v = csub.add_parser("versions", help="a run's stored versions: round, time, size, checksum, evaluated score")
    v.add_argument("--run", default="", help="run id (default: the newest run)")
    f = csub.add_parser("fetch", help="save a global version as a policy file (for fedrl evaluate)")
    f.add_argument("--run", default="", help="run id (see `fedrl ctl runs`; default: the current run)")
    f.add_argument("--version", type=argtypes.at_least(-1), default=-1, help="-1: the run's latest")
    f.add_argument("--out", required=True, help="the .safetensors file to write (an existing file is kept "
                                                "unless --force)")
    f.add_argument("--force", action="store_true", help="write over an existing --out file")
    sp = csub.add_parser("stop", help="stop the active run")
    sp.add_argument("--reason", default="stopped by operator", help="recorded with the run (default: %(default)s)")
    for each in csub.choices.values():  # --json before or after the command: `ctl --json watch`, `ctl watch --json`
        each.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                          help="print JSON (for scripts) instead of tables")
    p.set_defaults(func=_cmd_ctl)


def _cmd_ctl(a: argparse.Namespace) -> int:
    import os

    import grpc

    from fedrl.cli import show
    from fedrl.cli.client import ControlClient, dumps
    from fedrl.wire.security import SecurityConfigError, tls_from_args

    try:
        tls = tls_from_args(a.tls_dir)
    except SecurityConfigError as e:
        print(f"fedrl ctl: error: {e}", file=sys.stderr)
        return 2
    if a.ctl_cmd == "start":  # the settings are read before any connection: a bad file is named at once
        data = _settings_file(a.config) if a.config else dict(CTL_START_DEFAULTS)
        data.update(_set_pairs(a.set))
    from fedrl.wire.rpc import nothing_listens

    if a.connect_timeout is None and nothing_listens(a.target):
        print(f"fedrl ctl: error: nothing listens at {a.target} (connection refused): is the aggregator running? "
              "(--connect-timeout S waits for one that is starting)", file=sys.stderr)
        return 1
    try:
        with ControlClient(a.target, connect_timeout=a.connect_timeout or CTL_CONNECT_TIMEOUT, tls=tls,
                           token=os.environ.get("FEDRL_ADMIN_TOKEN") or None) as c:
            current = c.status() if a.ctl_cmd == "start" else None
            if current is not None and a.if_idle and current["state"] in ("waiting_for_agents", "running"):
                print(dumps(current) if a.json else f"a run is already active\n{show.status(current)}")
            elif a.ctl_cmd == "start":
                if not a.config and "agents" not in data:
                    n = sum(x["connected"] for x in current["agents"])
                    if n == 0:
                        print("fedrl ctl: error: no agent has joined the aggregator; start agents first, or say how "
                              "many to wait for with --set agents=N", file=sys.stderr)
                        return 1
                    data["agents"] = n
                st = c.start(data)
                print(dumps(st) if a.json else show.started(st, data))
            elif a.ctl_cmd == "status":
                st = c.status()
                print(dumps(st) if a.json else show.status(st))
            elif a.ctl_cmd == "watch":
                if a.json:
                    for e in c.watch(a.after_version):
                        print(json.dumps(e), flush=True)
                else:
                    show.follow(c, a.after_version)
            elif a.ctl_cmd == "runs":
                rs = c.runs(a.limit)
                print(dumps(rs) if a.json else show.runs(rs))
            elif a.ctl_cmd == "versions":
                vs = c.versions(a.run)
                print(dumps(vs) if a.json else show.versions(vs))
            elif a.ctl_cmd == "stop":
                st = c.stop(a.reason)
                print(dumps(st) if a.json else show.status(st))
            elif a.ctl_cmd == "fetch":
                if Path(a.out).exists() and not a.force:
                    print(f"fedrl ctl: error: {a.out} exists; pass --force to write over it", file=sys.stderr)
                    return 1
                try:
                    meta = c.save_policy(a.out, a.version, a.run)
                except (ValueError, OSError) as e:  # no run yet; the file cannot be written
                    print(f"fedrl ctl: error: {e}", file=sys.stderr)
                    return 1
                import hashlib

                digest = hashlib.sha256(Path(a.out).read_bytes()).hexdigest()
                out = {"path": a.out, **{k: meta[k] for k in ("run_id", "version", "env_id", "algo")}, "sha256": digest}
                print(dumps(out) if a.json else f"saved version {out['version']} of run {out['run_id']} "
                      f"({out['algo']}, {out['env_id']}) to {a.out}: its policy alone, sha256 {digest[:16]} "
                      "(the same bytes at every fetch; `ctl versions` lists the stored version's own)")
    except grpc.RpcError as e:
        print(f"fedrl ctl: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except ConnectionError as e:
        print(f"fedrl ctl: error: {e}", file=sys.stderr)
        return 1
    return 0


def _certs_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("certs", help="certificates for trying TLS / mutual TLS")
    csub = p.add_subparsers(dest="certs_cmd", required=True)
    d = csub.add_parser("dev-ca", help="a throwaway CA and one certificate per role: the aggregator's and "
                                       "the evaluator's (servers), the agents' and the admin's (clients) "
                                       "(development and tests only)")
    d.add_argument("--out", required=True,
                   help="directory to write (ca.crt, aggregator/, evaluator/, <client>/)")
    d.add_argument("--host", action="append", default=None,
                   help="extra name or IP the aggregator's certificate carries beside its service name "
                        "fedrl-aggregator (repeatable; default localhost and 127.0.0.1)")
    d.add_argument("--evaluator-host", action="append", default=None,
                   help="extra name or IP the evaluator's certificate carries beside fedrl-evaluator "
                        "(repeatable; default none: a certificate carries only its own role's names)")
    d.add_argument("--client", action="append", default=None,
                   help="client certificate to make, named by its identity: admin, or an agent id "
                        "(repeatable; default admin, agent-0, agent-1, agent-2)")
    d.add_argument("--days", type=int, default=30)
    p.set_defaults(func=_cmd_certs)


def _cmd_certs(a: argparse.Namespace) -> int:
    from fedrl.wire.devca import DEFAULT_HOSTS, make_dev_ca

    kw = {"days": a.days, "hosts": tuple(a.host or DEFAULT_HOSTS), "evaluator_hosts": tuple(a.evaluator_host or ())}
    if a.client:
        kw["clients"] = tuple(a.client)
    out = make_dev_ca(a.out, **kw)
    print(f"wrote a development CA to {out}: aggregator/ and evaluator/ for their --tls-dir, one "
          f"directory per client (agents, admin) for their --tls-dir and fedrl ctl's")
    return 0


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``only="ctl"``: just ``fedrl ctl``, whose commands talk to an
    aggregator and never need torch (building the other commands' options loads it: ~1.2 s)."""
    p = argparse.ArgumentParser(prog="fedrl", description="Federated offline RL (DRPO)")
    import fedrl

    p.add_argument("--version", action="version", version=f"fedrl {fedrl.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    argtypes.defaults_help(sub)  # every command's help shows the real defaults
    if only == "ctl":
        _ctl_parser(sub)
        return p
    _simulate_parser(sub)
    _evaluate_parser(sub)
    _data_parser(sub)
    _up_parser(sub)
    _ctl_parser(sub)
    _certs_parser(sub)
    return p


def _given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The options of ``parser`` that ``argv`` sets (not their defaults)."""
    saved = [(act, act.default) for act in parser._actions]
    try:
        for act, _ in saved:
            act.default = argparse.SUPPRESS
        ns, _ = parser.parse_known_args(argv)
    finally:
        for act, d in saved:
            act.default = d
    return set(vars(ns))


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest (sub)command parser ``args`` went through: ``fedrl ctl status`` -> its own."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name is None or name not in subs[0].choices:
            return parser
        parser = subs[0].choices[name]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only="ctl" if argv[:1] == ["ctl"] else None)
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand they were given to, with its usage (not fedrl's)
        _chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if argv[:1] == ["simulate"]:  # which flags were given (over --config): simulate's settings
        args.given = _given(_chosen_parser(parser, args), argv[1:])
    prog = _chosen_parser(parser, args).prog.split()
    prog = " ".join(prog[:2])  # "fedrl ctl", "fedrl data", "fedrl up": every error of a command the same way
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a reader that went away is found here, not in the interpreter's exit
        return rc
    except (DatasetError, ValueError, KeyError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedrl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (``fedrl data info x | head``): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 141

