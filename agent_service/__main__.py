"""``python -m agent_service`` (or ``fedrl-agent``): one data holder's agent process."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys


from fedrl.common import argtypes
from fedrl.common.threads import THREADS_RULE, set_threads
from fedrl.ops.logs import add_log_args, setup_logging
from fedrl.ops.endpoint import add_metrics_args
from fedrl.wire.security import add_tls_arg


def index_arg(value: str) -> int:
    """An index, or ``ordinal``: the number a StatefulSet puts at the end of the pod's hostname."""
    if value != "ordinal":
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer or 'ordinal', got {value!r}") from None
    host = os.environ.get("HOSTNAME") or os.uname().nodename
    m = re.search(r"-(\d+)$", host)
    if m is None:
        raise argparse.ArgumentTypeError(f"'ordinal' needs a hostname ending in -N (a StatefulSet pod), got {host!r}")
    return int(m.group(1))


def agent_token(agent_id: str) -> str | None:
    """``$FEDRL_AGENT_TOKEN``, else this agent's entry in ``$FEDRL_AGENT_TOKENS`` (id=token,...)."""
    from fedrl.wire.security import parse_agent_tokens

    if os.environ.get("FEDRL_AGENT_TOKEN"):
        return os.environ["FEDRL_AGENT_TOKEN"]
    if os.environ.get("FEDRL_AGENT_TOKENS"):
        tokens = parse_agent_tokens(os.environ["FEDRL_AGENT_TOKENS"], "$FEDRL_AGENT_TOKENS")
        if agent_id not in tokens:
            raise ValueError(f"$FEDRL_AGENT_TOKENS has no token for agent {agent_id!r}")
        return tokens[agent_id]
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedrl-agent", formatter_class=argtypes.DefaultsHelp, description="A federated DRPO agent: trains on "
                                "its private shard, exchanges only policy weights with the aggregator.")
    p.add_argument("--aggregator", required=True, metavar="HOST:PORT")
    p.add_argument("--dataset", action="append", required=True, metavar="PATH|NAME[:AGENTS]",
                   help="the private data: a D4RL/Minari file or dataset name; with --shard, the "
                        "federation's shared file(s) this agent takes its seeded shard of")
    p.add_argument("--shard", type=index_arg, default=None,
                   help="this agent's shard index (0-based), or 'ordinal' (from a StatefulSet pod's hostname)")
    p.add_argument("--index", type=index_arg, default=None,
                   help="without --shard: the agent's index (its seed stream and order), or 'ordinal'")
    p.add_argument("--shards", type=argtypes.at_least(1), default=None, help="agents per dataset given without :N")
    p.add_argument("--trajectories", type=argtypes.at_least(1), default=5, help="whole trajectories per shard")
    p.add_argument("--transitions", type=argtypes.at_least(0), default=0,
                   help="with > 0, more whole trajectories per shard until it holds at least this many transitions")
    p.add_argument("--seed", type=int, default=0, help="seed of the shard partition (the run's seed)")
    p.add_argument("--agent-id", default=None, help="default: agent-<shard or index>")
    p.add_argument("--env", default=None, help="the task's env (default: the one the dataset records)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda[:N]")
    p.add_argument("--threads", type=argtypes.at_least(0), default=0, help=f"torch CPU threads; {THREADS_RULE}")
    p.add_argument("--host", default="127.0.0.1", help="address the health and metrics ports bind")
    p.add_argument("--health-port", type=argtypes.port, default=None,
                   help="serve gRPC health checking (only) on this port, for probes (0: a free port)")
    p.add_argument("--transport", choices=("session", "calls"), default="session",
                   help="session: one stream for tasks and updates; calls: a NextTask and a submit "
                        "call each round (what an aggregator without Session streams gets anyway)")
    p.add_argument("--progress-seconds", type=argtypes.positive_seconds, default=10.0,
                   help="on a Session, report local-step progress while training at most this far apart "
                        "(keeps the stream inside the aggregator's --stream-idle-seconds)")
    p.add_argument("--runs-at-once", type=argtypes.at_least(1), default=1,
                   help="an agent in several runs takes their tasks in turn (1, the default); N trains up to N "
                        "runs' rounds at once, each with its own learner, thread and channel (N times the memory "
                        "and cores of one)")
    p.add_argument("--private-moments", action="store_true",
                   help="send no observation moments at Join: a run with secagg_threshold sums them under "
                        "secure aggregation (round 0); a plain run with obs_norm=pooled fails, saying so")
    add_log_args(p)
    add_tls_arg(p)
    p.epilog = ("Its bearer token, when the aggregator requires tokens: $FEDRL_AGENT_TOKEN, or its own "
                "entry of $FEDRL_AGENT_TOKENS (AGENT_ID=TOKEN,...).")
    add_metrics_args(p)
    return p


# glibc malloc settings of an agent process (see fedrl.wire.memory.keep_heap_for_reuse): blocks
# up to 4 MiB from the heap (a message is 1 MiB), and up to 64 MiB of free heap kept for the
# next round (the aggregator keeps more: it takes ten updates a round).
AGENT_MMAP_THRESHOLD = 4 << 20
AGENT_TRIM_THRESHOLD = 64 << 20


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from fedrl.wire.memory import keep_heap_for_reuse

    # Before gRPC's threads allocate: a round's 1 MiB messages (the download's, the upload's)
    # then come from heap memory the last round freed, not from pages faulted in afresh.
    keep_heap_for_reuse(arenas=2, mmap_threshold=AGENT_MMAP_THRESHOLD, trim_threshold=AGENT_TRIM_THRESHOLD)
    setup_logging(a.log_level, a.log_format)
    from agent_service.client import Agent, AgentConfig
    from fedrl.common.device import resolve_device
    from fedrl.data.d4rl import to_transitions
    from fedrl.data.errors import DatasetError
    from fedrl.data.partition import Shard
    from fedrl.data.registry import infer_env, load
    from fedrl.federation.shards import load_shards
    from fedrl.wire.security import tls_from_args

    log = logging.getLogger("fedrl.agent")
    threads, why = set_threads(a.threads)
    log.info("torch threads: %d (%s)", threads, why)
    try:
        device = resolve_device(a.device)
        if a.shard is None:
            if len(a.dataset) != 1:
                raise ValueError("without --shard give exactly one --dataset (the agent's own file)")
            raw = load(a.dataset[0], progress=log.info)
            env = infer_env(raw, a.dataset[0], a.env)
            tr = to_transitions(raw)
            index = a.index or 0
            shard = Shard(index, raw.source, (), tr)
        else:
            shards, env = load_shards(a.dataset, a.shards or a.shard + 1, a.trajectories, a.seed, a.env, log.info,
                                      a.transitions)
            if not 0 <= a.shard < len(shards):
                raise ValueError(f"--shard {a.shard} is outside the {len(shards)} shards")
            shard, index = shards[a.shard], a.shard
        tls = tls_from_args(a.tls_dir)
    except (DatasetError, ValueError) as e:  # SecurityConfigError is a ValueError
        print(f"fedrl-agent: error: {e}", file=sys.stderr)
        return 2
    from fedrl.ops.endpoint import start_side_endpoints
    from fedrl.ops.metrics import AgentMetrics

    agent_id = a.agent_id or f"agent-{index}"
    metrics = AgentMetrics(agent_id, str(device))
    try:
        token = agent_token(agent_id)
    except ValueError as e:
        print(f"fedrl-agent: error: {e}", file=sys.stderr)
        return 2
    agent = Agent(AgentConfig(a.aggregator, agent_id, index, env.gym_id, device, tls=tls, token=token,
                              session=a.transport == "session", progress_seconds=a.progress_seconds,
                              share_moments=not a.private_moments, runs_at_once=a.runs_at_once),
                  shard, metrics)
    def on_signal(signum, _frame) -> None:
        # a handler must not take locks the interrupted code may hold (logging's): the agent logs
        # why it stops from its own thread once the flag is seen
        agent.stop(signal.Signals(signum).name)

    # before its ports are bound: a stop right after the announcement is a clean one
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    health = start_side_endpoints(a, metrics.registry, log, interceptors=[metrics.grpc], tls=tls)
    try:
        agent.run()
    except KeyboardInterrupt:
        pass
    finally:
        if health is not None:
            health.stop(0.5)
    log.info("stopped (%s)", agent.stop_reason or "the agent ended")
    return 0


if __name__ == "__main__":
    sys.exit(main())
