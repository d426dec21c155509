"""Prometheus metrics: the gRPC server interceptor every service shares, and each service's own set.

Every metric object here owns its :class:`CollectorRegistry`, so several services in one
process (tests, notebooks) never share or double-register series. A service exposes its
registry over HTTP with :func:`fedrl.ops.endpoint.serve_metrics` on the port Kubernetes names ``metrics``.

Names follow the conventions stock dashboards expect: the gRPC ones are those of
go-grpc-prometheus (``grpc_server_started_total``, ``grpc_server_handled_total{grpc_code}``,
``grpc_server_handling_seconds``, ``grpc_server_msg_{received,sent}_total``, lower-case
``grpc_type``); the project's own all start with ``fedrl_<service>_``. Every label is bounded:
method names, status codes, refusal reasons, loss terms, agent ids (one per data holder) and
run ids (the runs an aggregator holds: its active ones and the last few that ended).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily


# No ``*_created`` series: Prometheus ignores them in the text format and they double the scrape.
disable_created_metrics()

PREFIX = "fedrl"

# Seconds; an RPC here ranges from a health check (sub-ms) to a long poll or a 30 MB stream.
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ROUND_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

# Why the aggregator refuses an update: the coordinator's refusal reasons and the codec's.
# Listed up front so every series exists (at 0) from the start and rate() works at once.
REJECT_REASONS = (
    "unknown_agent", "wrong_run", "not_selected", "closed_round", "stale_round", "future_round",
    "wrong_base", "duplicate", "tensor_mismatch", "bad_stream",
    "bad_manifest", "bad_encoding", "bad_dtype", "bad_payload", "non_finite", "truncated",
    "checksum_mismatch", "old_contract", "oversize", "bad_metrics", "wrong_samples",
    "other",
)

# The local-update metrics an agent exports as ``fedrl_agent_loss{term}``: learner key -> term.
LOSS_TERMS = {"critic_td": "critic", "cql_penalty": "cql_penalty", "actor_loss": "actor",
              "reg_data": "reg_data", "reg_global": "reg_global", "bc_loss": "bc"}


# --------------------------------------------------------------------------------------------
# gRPC server interceptor
# --------------------------------------------------------------------------------------------
_HANDLER_FACTORIES = {
    (False, False): ("unary", "unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("server_stream", "unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("client_stream", "stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("bidi_stream", "stream_stream", grpc.stream_stream_rpc_method_handler),
}


def _code_name(context: grpc.ServicerContext, default: grpc.StatusCode) -> str:
    code = context.code()
    if code is None:
        # A handler that returns after its client went away (it saw is_active() turn False)
        # ended the RPC as CANCELLED, whatever it returned.
        return default.name if context.is_active() else grpc.StatusCode.CANCELLED.name
    return code.name if isinstance(code, grpc.StatusCode) else str(code)


class GrpcServerMetrics(grpc.ServerInterceptor):
    """Counts and times every RPC a server handles, unary and streaming alike.

    ``handled`` is recorded once per RPC with the status it ended with: the code a handler
    set or aborted with, ``UNKNOWN`` for an exception, ``CANCELLED`` when the client went away
    in the middle of a response stream, ``OK`` otherwise.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.started = Counter("grpc_server_started_total", "RPCs started on the server.",
                               labels, registry=registry)
        self.handled = Counter("grpc_server_handled_total", "RPCs completed on the server, "
                               "regardless of success or failure.", [*labels, "grpc_code"], registry=registry)
        self.received = Counter("grpc_server_msg_received_total", "Stream messages received on the server.",
                                labels, registry=registry)
        self.sent = Counter("grpc_server_msg_sent_total", "Stream messages sent by the server.",
                            labels, registry=registry)
        self.seconds = Histogram("grpc_server_handling_seconds", "Response latency of RPCs handled "
                                 "by the server (until the last message is sent).", labels,
                                 buckets=RPC_BUCKETS, registry=registry)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        typ, attr, factory = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
        behavior = getattr(handler, attr)
        lv = (typ, service, method)
        started, handled, seconds = self.started.labels(*lv), self.handled, self.seconds.labels(*lv)
        received, sent = self.received.labels(*lv), self.sent.labels(*lv)

        def done(t0: float, code: str) -> None:
            handled.labels(*lv, code).inc()
            seconds.observe(time.perf_counter() - t0)

        def count_in(it: Iterable) -> Iterator:
            for m in it:
                received.inc()
                yield m

        def stream_out(result: Iterable, context, t0: float) -> Iterator:
            try:
                for m in result:
                    sent.inc()
                    yield m
            except GeneratorExit:
                done(t0, _code_name(context, grpc.StatusCode.CANCELLED))
                raise
            except BaseException:
                done(t0, _code_name(context, grpc.StatusCode.UNKNOWN))
                raise
            done(t0, _code_name(context, grpc.StatusCode.OK))

        def wrapped(request, context):
            t0 = time.perf_counter()
            started.inc()
            if handler.request_streaming:
                request = count_in(request)
            else:
                received.inc()
            try:
                result = behavior(request, context)
            except BaseException:
                done(t0, _code_name(context, grpc.StatusCode.UNKNOWN))
                raise
            if handler.response_streaming:
                return stream_out(result, context, t0)
            sent.inc()
            done(t0, _code_name(context, grpc.StatusCode.OK))
            return result

        return factory(wrapped, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)


# --------------------------------------------------------------------------------------------
# Per-service metrics
# --------------------------------------------------------------------------------------------
def _service_registry(registry: CollectorRegistry | None) -> CollectorRegistry:
    """``registry``, or a new one that also carries the process's own metrics
    (``process_resident_memory_bytes``, ``process_cpu_seconds_total``, open fds, ...: what the
    default registry of a Prometheus client exports, and what the dashboard's memory and CPU
    panels read). A registry passed in is the caller's: nothing is added to it."""
    if registry is not None:
        return registry
    r = CollectorRegistry()
    ProcessCollector(registry=r)
    return r


# Each run's state gauges: (name, help), a series per run held, labelled ``run``.
RUN_GAUGES = (
    ("agents_expected", "Agents the run asks for (0 once it is over)."),
    ("global_version", "The run's latest global version."),
    ("round", "The run's round open now (or last opened)."),
    ("run_active", "1 while the run waits for agents or runs rounds."),
    ("round_deadline", "Unix time at which the run's open round may close with a quorum (0: none open)."),
)


class _RunGauges:
    """The runs' state gauges, read at scrape time: a series per run the aggregator holds, so a
    run no longer held leaves no stale series behind."""

    def __init__(self, prefix: str, runs: Callable[[], Mapping[str, Mapping[str, float]]]) -> None:
        self.prefix, self.runs = prefix, runs

    def describe(self):
        return []  # collected at scrape time only (a registry asks describe() at registration)

    def collect(self):
        runs = self.runs()
        for key, text in RUN_GAUGES:
            name = f"{self.prefix}_{key}" + ("_timestamp_seconds" if key == "round_deadline" else "")
            g = GaugeMetricFamily(name, text, labels=["run"])
            for run_id, values in runs.items():
                g.add_metric([run_id], float(values.get(key, 0.0)))
            yield g


class AggregatorMetrics:
    """The aggregator's rounds, agents, updates and bytes (``fedrl_aggregator_*``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = _service_registry(registry)
        p = f"{PREFIX}_aggregator"
        self.grpc = GrpcServerMetrics(r)
        self.rounds_completed = Counter(f"{p}_rounds_completed_total", "Rounds closed with a new global "
                                        "version written to the state directory, by run.", ["run"], registry=r)
        self.round_duration = Histogram(f"{p}_round_duration_seconds", "Wall time from a round's opening "
                                        "to its close.", buckets=ROUND_BUCKETS, registry=r)
        self.accepted = Counter(f"{p}_updates_accepted_total", "Agent updates verified and taken into "
                                "a round.", registry=r)
        self.rejected = Counter(f"{p}_updates_rejected_total", "Agent updates refused, by reason.",
                                ["reason"], registry=r)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self.bytes_received = Counter(f"{p}_weights_received_bytes_total", "Weight payload bytes received "
                                      "in agent updates.", registry=r)
        self.bytes_sent = Counter(f"{p}_weights_sent_bytes_total", "Weight payload bytes sent to agents "
                                  "and evaluators.", registry=r)
        self.agents_connected = Gauge(f"{p}_agents_connected", "Agents heard from within the liveness "
                                      "window.", registry=r)
        self.runs_active = Gauge(f"{p}_runs_active", "Runs waiting for agents or running rounds now.", registry=r)
        self.last_round_closed = Gauge(f"{p}_last_round_closed_timestamp_seconds", "Unix time the last "
                                       "round of any run closed.", registry=r)
        self.privacy_epsilon = Gauge(f"{p}_privacy_epsilon", "Differential privacy spent by the run so far: "
                                     "epsilon at the run's dp_delta (+Inf with clipping and no noise); only "
                                     "runs with dp_clip.", ["run"], registry=r)
        self.privacy_clip = Gauge(f"{p}_privacy_clip_norm", "The norm the run's next round clips each update "
                                  "to (dp_clip; adaptive clipping moves it); only runs with dp_clip.", ["run"],
                                  registry=r)
        self._runs: Callable[[], Mapping[str, Mapping[str, float]]] = dict
        r.register(_RunGauges(p, lambda: self._runs()))

    def bind(self, snapshot: Callable[[], tuple[Mapping[str, float], Mapping[str, Mapping[str, float]]]]) -> None:
        """Read the gauges that describe state from ``snapshot()`` at scrape time: the
        aggregator's, and each run's (a series per run held, labelled ``run``)."""
        for key, gauge in (("agents_connected", self.agents_connected), ("runs_active", self.runs_active)):
            gauge.set_function(lambda key=key: float(snapshot()[0].get(key, 0.0)))
        self._runs = lambda: snapshot()[1]

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason if reason in REJECT_REASONS else "other").inc()

    def privacy_spent(self, run_id: str, epsilon: float, clip: float) -> None:
        self.privacy_epsilon.labels(run_id).set(epsilon)
        self.privacy_clip.labels(run_id).set(clip)

    def forget_run(self, run_id: str) -> None:
        """Drop a run's labelled series (it is no longer held)."""
        for g in (self.privacy_epsilon, self.privacy_clip, self.rounds_completed):
            try:
                g.remove(run_id)
            except KeyError:
                pass

    def round_closed(self, run_id: str, seconds: float) -> None:
        self.rounds_completed.labels(run_id).inc()
        self.round_duration.observe(seconds)
        self.last_round_closed.set(time.time())


class AgentMetrics:
    """One agent's local training (``fedrl_agent_*``), labelled with its agent id."""

    def __init__(self, agent_id: str, device: str = "", registry: CollectorRegistry | None = None) -> None:
        r = self.registry = _service_registry(registry)
        p = f"{PREFIX}_agent"
        self.agent_id = agent_id
        self.grpc = GrpcServerMetrics(r)  # the health-only server, when the agent runs one
        Gauge(f"{p}_info", "Constant 1; labels describe the agent.", ["agent", "device"],
              registry=r).labels(agent_id, device).set(1)
        self.local_steps = Counter(f"{p}_local_steps_total", "Local gradient steps taken.", ["agent"],
                                   registry=r).labels(agent_id)
        self.rounds = Counter(f"{p}_rounds_completed_total", "Rounds whose update the aggregator took.",
                              ["agent"], registry=r).labels(agent_id)
        self.update_seconds = Histogram(f"{p}_local_update_seconds", "Wall time of one round's local "
                                        "training.", ["agent"], buckets=ROUND_BUCKETS,
                                        registry=r).labels(agent_id)
        self.loss = Gauge(f"{p}_loss", "Mean of a loss term over the last round's local steps.",
                          ["agent", "term"], registry=r)
        self.reconnects = Counter(f"{p}_reconnects_total", "Times the agent lost the aggregator and "
                                  "retried.", ["agent"], registry=r).labels(agent_id)
        self.bad_downloads = Counter(f"{p}_downloads_rejected_total", "Global models received that failed "
                                     "verification (sha256, size, names, NaN) and were asked for again.",
                                     ["agent"], registry=r).labels(agent_id)

    def trained(self, steps: int, seconds: float, metrics: Mapping[str, float]) -> None:
        self.local_steps.inc(steps)
        self.update_seconds.observe(seconds)
        for key, term in LOSS_TERMS.items():
            if key in metrics:
                self.loss.labels(self.agent_id, term).set(metrics[key])


EVALUATED_RUNS_KEPT = 16  # runs whose latest evaluation the evaluator's gauges keep


class EvaluatorMetrics:
    """Rollouts of global versions (``fedrl_evaluator_*``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = _service_registry(registry)
        p = f"{PREFIX}_evaluator"
        self.grpc = GrpcServerMetrics(r)
        # a series per run (label ``run``), from the run's first evaluation on: none before, not a 0
        # that reads as a real return of 0; the runs evaluated last are kept (EVALUATED_RUNS_KEPT)
        self.ret = Gauge(f"{p}_return", "Mean raw return of the run's latest evaluated global version.", ["run"],
                         registry=r)
        self.ret_std = Gauge(f"{p}_return_std", "Standard deviation of that return over episodes.", ["run"],
                             registry=r)
        self.score = Gauge(f"{p}_normalized_score", "D4RL-normalised score of the run's latest evaluated global "
                           "version (0 random, 100 expert).", ["run"], registry=r)
        self.version = Gauge(f"{p}_evaluated_version", "Global version the return and score belong to.", ["run"],
                             registry=r)
        self._runs: list[str] = []
        self.episodes = Counter(f"{p}_episodes_total", "Evaluation episodes completed.", registry=r)
        self.env_steps = Counter(f"{p}_env_steps_total", "Environment steps of evaluation rollouts.", registry=r)
        self.steps_per_second = Gauge(f"{p}_rollout_steps_per_second", "Environment steps per second of "
                                      "the last rollout.", registry=r)
        self.evaluations = Counter(f"{p}_evaluations_total", "Rollouts completed, by origin.", ["origin"],
                                   registry=r)
        for origin in ("follower", "on_demand"):
            self.evaluations.labels(origin)
        self.failures = Counter(f"{p}_evaluation_failures_total", "Global versions that could not be "
                                "evaluated (bad model or config).", registry=r)

    def rollout(self, origin: str, episodes: int, env_steps: int, seconds: float) -> None:
        self.evaluations.labels(origin).inc()
        self.episodes.inc(episodes)
        self.env_steps.inc(env_steps)
        if seconds > 0:
            self.steps_per_second.set(env_steps / seconds)

    def latest(self, report: Mapping[str, float]) -> None:
        run = str(report["run_id"])
        if run not in self._runs:
            self._runs.append(run)
            for gone in self._runs[:-EVALUATED_RUNS_KEPT]:
                for g in (self.ret, self.ret_std, self.score, self.version):
                    g.remove(gone)
            self._runs = self._runs[-EVALUATED_RUNS_KEPT:]
        self.ret.labels(run).set(report["return_mean"])
        self.ret_std.labels(run).set(report["return_std"])
        self.score.labels(run).set(report["score_mean"])
        self.version.labels(run).set(report["version"])
