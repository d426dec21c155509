"""``python -m evaluator_service`` (or ``fedrl-evaluator``): roll each global version out in MuJoCo."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from fedrl.common import argtypes
from fedrl.common.threads import THREADS_RULE, set_threads
from fedrl.ops.logs import add_log_args, setup_logging
from fedrl.ops.endpoint import add_metrics_args
from fedrl.wire.security import add_tls_arg


def _add_stream_args(p) -> None:
    from fedrl.wire.rpc import DEFAULT_MAX_WORKERS
    from fedrl.wire.streams import add_stream_args

    add_stream_args(p, f"its {DEFAULT_MAX_WORKERS} worker threads")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedrl-evaluator", formatter_class=argtypes.DefaultsHelp, description="Follows the aggregator's rounds, "
                                "evaluates every new global policy and reports returns and scores.")
    p.add_argument("--aggregator", default=None, metavar="HOST:PORT",
                   help="follow this aggregator (omit to serve on-demand evaluation only)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=argtypes.port, default=50052, help="0 picks a free port")
    p.add_argument("--port-file", default=None, help="write the bound port here once serving (default: nowhere)")
    p.add_argument("--seed", type=int, default=0, help="seed of the evaluation episodes")
    p.add_argument("--num-envs", type=argtypes.at_least(1), default=10, help="vectorised environments per rollout")
    # the default is evaluator_service.servicer.MAX_POLICY_BYTES in MiB (a test holds them equal)
    p.add_argument("--max-policy-mb", type=argtypes.at_least(1), default=64,
                   help="largest policy an on-demand Evaluate accepts, in MiB; a larger declared size is "
                        "refused (RESOURCE_EXHAUSTED) before anything is allocated (default %(default)s)")
    # the default is evaluator_service.servicer.MAX_INFLIGHT_BYTES in MiB
    p.add_argument("--max-inflight-mb", type=argtypes.at_least(1), default=256,
                   help="what all on-demand Evaluate streams together may be receiving at once, by their declared "
                        "sizes, in MiB; a stream past it is refused (RESOURCE_EXHAUSTED) at once (default %(default)s)")
    p.add_argument("--threads", type=argtypes.at_least(0), default=0, help=f"torch CPU threads; {THREADS_RULE}")
    add_log_args(p)
    p.add_argument("--health-port", type=argtypes.port, default=None,
                   help="also serve plaintext gRPC health checking (only) here, for probes")
    add_tls_arg(p)
    _add_stream_args(p)
    add_metrics_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    setup_logging(a.log_level, a.log_format)

    from evaluator_service.follower import Follower
    from evaluator_service.servicer import EvaluatorServicer
    from fedrl.ops.endpoint import start_side_endpoints
    from fedrl.ops.metrics import EvaluatorMetrics
    from fedrl.proto.v1 import evaluator_pb2_grpc
    from fedrl.wire.rpc import StopSignals, announce_port, create_server
    from fedrl.wire.streams import stream_limits
    from fedrl.wire.security import (
        Authenticator,
        AuthInterceptor,
        SecurityConfigError,
        tls_from_args,
    )

    threads, why = set_threads(a.threads)
    try:
        tls = tls_from_args(a.tls_dir)
        auth = Authenticator(os.environ.get("FEDRL_ADMIN_TOKEN"), os.environ.get("FEDRL_EVALUATOR_TOKEN"))
    except (OSError, SecurityConfigError) as e:
        print(f"fedrl-evaluator: error: {e}", file=sys.stderr)
        return 2
    stop = StopSignals()  # before any port is bound: a stop right after the announcement is a clean one
    metrics = EvaluatorMetrics()
    follower = (Follower(a.aggregator, a.seed, a.num_envs, metrics=metrics, tls=tls,
                         token=os.environ.get("FEDRL_EVALUATOR_TOKEN") or None) if a.aggregator else None)
    server = create_server([(evaluator_pb2_grpc.add_EvaluatorServicer_to_server,
                             EvaluatorServicer(follower, a.num_envs, metrics, a.max_policy_mb << 20,
                                               a.max_inflight_mb << 20), "fedrl.v1.Evaluator")],
                           a.host, a.port, interceptors=[metrics.grpc, AuthInterceptor(auth)], tls=tls,
                           **stream_limits(a))
    log = logging.getLogger("fedrl.evaluator")
    log.info("serving on %s:%d (torch threads: %d, %s)", a.host, server.port, threads, why)
    health = start_side_endpoints(a, metrics.registry, log, tls=tls)
    announce_port(a.port_file, server.port)
    if follower is not None:
        threading.Thread(target=follower.run, daemon=True, name="follower").start()
    why_stop = stop.wait()
    log.info("received %s; stopping (%s)", why_stop,
             f"following {a.aggregator}" if follower is not None else "on-demand evaluation only")
    if follower is not None:
        follower.stop()
    if health is not None:
        health.stop(0.5)
    server.stop(1.0)
    server.drain()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
