"""``python -m aggregator_service`` (or ``fedrl-aggregator``): rounds, aggregation, the store."""

from __future__ import annotations

import argparse
import logging
import sys

from fedrl.common import argtypes
from fedrl.ops.logs import add_log_args, setup_logging
from fedrl.ops.endpoint import add_metrics_args
from fedrl.wire.security import add_tls_arg


def _add_stream_args(p) -> None:
    from fedrl.wire.streams import add_stream_args

    add_stream_args(p)

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedrl-aggregator", formatter_class=argtypes.DefaultsHelp, description="The federation's aggregator: "
                                "Federation (agents) and Control (operators) gRPC services.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a container)")
    p.add_argument("--port", type=argtypes.port, default=50051, help="0 picks a free port")
    p.add_argument("--port-file", default=None, help="write the bound port here once serving")
    p.add_argument("--state-dir", required=True, help="where every global version is kept")
    p.add_argument("--no-resume", dest="resume", action="store_false",
                   help="do not pick up unfinished runs from --state-dir (default: resume each from its "
                        "newest stored global version, as after a crash or a pod restart)")
    p.add_argument("--max-runs", type=argtypes.at_least(1), default=8,
                   help="runs active at once (waiting for agents or running); a StartRun past it is refused "
                        "with RESOURCE_EXHAUSTED. Each keeps two global versions in memory, and an agent in "
                        "several runs trains their rounds in turn (default %(default)s)")
    p.add_argument("--max-workers", type=argtypes.at_least(1), default=1024,
                   help="RPC threads, made as needed: each connected agent's Session stream holds one, as "
                        "do watchers and long polls (a warning is logged when agents come near it)")
    p.add_argument("--max-agents", type=argtypes.at_least(1), default=1024,
                   help="agent records kept; a Join past it first forgets agents gone (not connected, not in "
                        "an active run), else is refused with RESOURCE_EXHAUSTED; records unseen for an hour "
                        "are forgotten (default %(default)s)")
    p.add_argument("--task-wait", type=argtypes.positive_seconds, default=30.0, help="longest NextTask long poll, seconds")
    p.add_argument("--threads", type=argtypes.at_least(1), default=1,
                   help="torch CPU threads; its tensor work is small, and more threads only contend "
                        "with agents sharing the machine")
    add_log_args(p)
    p.add_argument("--health-port", type=argtypes.port, default=None,
                   help="also serve plaintext gRPC health checking (only) here, for probes when the "
                        "main port needs TLS or tokens (0: a free port)")
    add_tls_arg(p)
    _add_stream_args(p)
    p.add_argument("--agent-tokens-file", default=None,
                   help="AGENT_ID=TOKEN per line (default $FEDRL_AGENT_TOKENS, comma-separated); with "
                        "$FEDRL_ADMIN_TOKEN and $FEDRL_EVALUATOR_TOKEN. Any token set: every RPC but "
                        "health checking needs a valid one")
    add_metrics_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from fedrl.wire.memory import keep_heap_for_reuse

    keep_heap_for_reuse()  # before gRPC's and torch's threads allocate
    setup_logging(a.log_level, a.log_format)
    import torch

    torch.set_num_threads(max(1, a.threads))
    from aggregator_service.coordinator import Coordinator
    from aggregator_service.servicer import ControlServicer, FederationServicer
    from aggregator_service.store import Store
    from fedrl.ops.endpoint import start_side_endpoints
    from fedrl.ops.metrics import AggregatorMetrics
    from fedrl.proto.v1 import control_pb2_grpc, federation_pb2_grpc
    from fedrl.wire.rpc import StopSignals, announce_port, create_server
    from fedrl.wire.streams import stream_limits
    from fedrl.wire.security import (
        Authenticator,
        AuthInterceptor,
        SecurityConfigError,
        tls_from_args,
    )

    try:
        store = Store(a.state_dir)
        tls = tls_from_args(a.tls_dir)
        auth = Authenticator.from_env(a.agent_tokens_file)
    except (OSError, SecurityConfigError) as e:
        print(f"fedrl-aggregator: error: {e}", file=sys.stderr)
        return 2
    log = logging.getLogger("fedrl.aggregator")
    if auth.enabled and tls is None:
        log.warning("tokens without TLS travel in clear text; use --tls-dir outside a trusted network")
    stop = StopSignals()  # before any port is bound: a stop right after the announcement is a clean one
    metrics = AggregatorMetrics()
    coord = Coordinator(store, max_task_wait=a.task_wait, metrics=metrics, resume=a.resume, max_agents=a.max_agents,
                        max_runs=a.max_runs)
    server = create_server([
        (federation_pb2_grpc.add_FederationServicer_to_server, FederationServicer(coord, auth, a.max_workers),
         "fedrl.v1.Federation"),
        (control_pb2_grpc.add_ControlServicer_to_server, ControlServicer(coord, auth), "fedrl.v1.Control"),
    ], a.host, a.port, a.max_workers, interceptors=[metrics.grpc, AuthInterceptor(auth)], tls=tls,
        **stream_limits(a))
    log.info("serving on %s:%d (%s%s), state in %s", a.host, server.port,
             "mutual TLS" if tls and tls.ca else "TLS" if tls else "plaintext",
             ", tokens required" if auth.enabled else "", a.state_dir)
    health = start_side_endpoints(a, metrics.registry, log, tls=tls)
    announce_port(a.port_file, server.port)
    why = stop.wait()
    st = coord.status()
    run = (f"run {st['run_id']} {st['state']} at round {st['round']}, global version {st['global_version']}"
           if st.get("run_id") else "no run")
    log.info("received %s; stopping (%s; a restart on the same --state-dir continues a running run)", why, run)
    if health is not None:
        health.stop(0.5)
    server.stop(1.0)
    coord.close()  # wakes the handlers that wait on it
    server.drain()  # their last lines ("agent ... left") come before this process's
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
