"""``fedrl up``: the whole federation on this machine, as processes."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fedrl.cli.settings import apply_sets, settings_file
from fedrl.common import argtypes
from fedrl.federation.choices import AGGREGATIONS


UP_DEFAULT_DATASET = "hopper-medium-v2"
# The first command a newcomer runs: short, yet long enough to learn. DRPO's critic needs about the
# paper's 1,000 local steps before its policy moves off the start (at 100 steps a round the returns
# stayed at 4-17); two agents, so each has a core of a 2-core laptop. Measured: README.
UP_DEFAULTS = {"agents": 2, "rounds": 3, "local_steps": 1000, "eval_episodes": 5}


def add_parser(sub: argparse._SubParsersAction) -> None:
    from fedrl.federation.runconfig import SERVICE_ALGOS, RunConfig

    p = sub.add_parser("up", help="run the whole federation here: aggregator, agents, evaluator as processes",
                       description="Starts the aggregator, N agents and the evaluator as real processes on "
                                   "127.0.0.1, runs the federation, writes a run folder. The default needs "
                                   f"nothing from outside ({UP_DEFAULT_DATASET}, made on first use from the "
                                   "shipped behaviour policies) "
                                   "and takes a few minutes on 2 CPU cores.")
    p.add_argument("--config", default=None, help="run config JSON file (fields of RunConfig); flags override it")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="a run config field over --config, e.g. --set drpo.lambda1=0.2 or --set "
                        "'drpo={\"lambda1\": 0.2}' (flags override it). Private updates: secure aggregation "
                        "--set secagg_threshold=T; differential privacy --set dp_clip=C --set dp_noise=SIGMA "
                        "[--set dp_epsilon_budget=E --set dp_delta=D], adaptive clipping --set "
                        "dp_clip_quantile=Q (docs/guides/privacy.md)")
    p.add_argument("--dataset", action="append", metavar="PATH|NAME[:AGENTS]",
                   help=f"the federation's data, dealt to agents in shards (default {UP_DEFAULT_DATASET})")
    p.add_argument("--algo", choices=SERVICE_ALGOS, default=None,
                   help=f"default {RunConfig().algo} (or the --config file's)")
    p.add_argument("--agents", type=argtypes.integer, default=None, help=f"default {UP_DEFAULTS['agents']}")
    p.add_argument("--trajectories", type=argtypes.integer, default=5, help="whole trajectories per agent")
    p.add_argument("--transitions", type=argtypes.at_least(0), default=0,
                   help="with > 0, more whole trajectories per agent until it holds at least this many transitions")
    p.add_argument("--rounds", type=argtypes.integer, default=None, help=f"default {UP_DEFAULTS['rounds']}")
    p.add_argument("--local-steps", type=argtypes.integer, default=None, help=f"default {UP_DEFAULTS['local_steps']}")
    p.add_argument("--eval-episodes", type=argtypes.integer, default=None, help=f"default {UP_DEFAULTS['eval_episodes']}")
    p.add_argument("--seed", type=argtypes.integer, default=None, help=f"default {RunConfig().seed} (or the --config file's)")
    p.add_argument("--aggregation", choices=AGGREGATIONS, default=None, help="default fedavg")
    p.add_argument("--device", default="auto", help="agents' device: auto, cpu, cuda[:N]")
    p.add_argument("--agent-threads", type=argtypes.at_least(0), default=1, help="torch threads per agent process")
    p.add_argument("--out", default=None, help="run folder (default runs/up-<time>)")
    p.add_argument("--prometheus", action="store_true",
                   help="also start a real Prometheus on 127.0.0.1 scraping every process, with the "
                        "deployment's alert rules (needs the prometheus binary, e.g. apt-get install prometheus)")
    p.add_argument("--prometheus-bin", default=None, help="the prometheus binary (default: from PATH)")
    p.add_argument("--tls", "--secure", dest="secure", action="store_true",
                   help="mutual TLS (a throwaway CA in <out>/tls) and a bearer token per process, to try "
                        "the federation's identity checks (--secure: the same; secure aggregation of the "
                        "updates is --set secagg_threshold=T)")
    p.add_argument("--linger", type=argtypes.seconds, default=0.0, metavar="SECONDS",
                   help="keep every process (and Prometheus) up this long after the run, to look at "
                        "metrics and dashboards; Ctrl-C ends it early")
    p.set_defaults(func=_cmd_up)




def _cmd_up(a: argparse.Namespace) -> int:
    from fedrl.cli.launcher import UpConfig, up
    from fedrl.federation.runconfig import parse_run_config

    data = dict(UP_DEFAULTS)
    data_from_file = apply_sets(settings_file(a.config), a.set)
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
