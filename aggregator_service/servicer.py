"""gRPC servicers of the aggregator: protobuf in and out, everything else in the coordinator."""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from aggregator_service.coordinator import Coordinator
from aggregator_service.records import AgentRecord
from fedrl.data.normalize import ObsStats
from fedrl.federation.secure_steps import Answer, Keys, Masked, Message, Shares
from fedrl.proto.v1 import (
    control_pb2,
    control_pb2_grpc,
    federation_pb2,
    federation_pb2_grpc,
)
from fedrl.wire.codec import Assembler, CodecError
from fedrl.wire.rpc import EVALUATOR_HEADER, ServiceError, codec_status, status_details
from fedrl.wire.security import AGENT, EVALUATOR, Authenticator
from fedrl.wire.serde import (
    evaluation_from_proto,
    event_to_proto,
    inline_update_in_session,
    length_delimited_field,
    manifest_from_proto,
    manifest_to_proto,
    read_raw_parts,
    status_to_proto,
    weight_part_bytes,
    with_leading_bytes_field,
)

log = logging.getLogger("fedrl.aggregator")
SESSION_MIN_WAIT = 1.0  # seconds: an idle session's WAIT heartbeats come no more often than this
SESSION = "/fedrl.v1.Federation/Session"
# Watch streams counted as evaluators following the runs when no token can say who is one (a
# finished run's watchers wait for its evaluations while one follows): an honest deployment has
# one or two evaluators.
MAX_UNVERIFIED_FOLLOWERS = 4
RESERVED_THREADS = 16  # RPC threads left for control calls, watchers and evaluators beside the agents' streams
MAX_BUSY_RUNS = 64  # runs a TaskRequest may name as busy (more than any aggregator holds at once)


def _abort(context: grpc.ServicerContext, e: Exception) -> None:
    if isinstance(e, ServiceError):
        context.abort(e.code, status_details(e.message))
    if isinstance(e, CodecError):
        context.abort(codec_status(e.reason), status_details(str(e)))
    raise e


def _parsed(kind, data, context):
    """``data`` parsed as a ``kind`` message of a Session; bytes that are not one end the call
    with INVALID_ARGUMENT, as any other RPC's do (fedrl.wire.rpc.ParseRequests)."""
    try:
        return kind.FromString(data)
    except DecodeError:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{SESSION}: the request is not a valid message")


def _session_message(data, context) -> federation_pb2.SessionMessage:
    return _parsed(federation_pb2.SessionMessage, data, context)


def session_answer(data: bytes, context) -> tuple[str | None, object, object]:
    """A Session message after the hello, received as bytes: its kind, then for an update its
    header (None where it has none) and payload, for another kind its message. An update as
    agents write it is read in place: its payload is a view of ``data``, copied once, into the
    buffer it is assembled in (fedrl.wire.serde.inline_update_in_session)."""
    inline = inline_update_in_session(data)
    if inline is not None:
        return "update", _parsed(federation_pb2.UpdateHeader, inline[0], context), inline[1]
    msg = _session_message(data, context)
    which = msg.WhichOneof("kind")
    if which == "update":
        u = msg.update
        return which, (u.header if u.HasField("header") else None), u.payload
    return which, (getattr(msg, which) if which else None), None


class FederationServicer(federation_pb2_grpc.FederationServicer):
    # Unary calls that may hold a worker while they wait for a task (a long poll; an inline update
    # asking for its next task): counted with the streams, per caller and in all
    # (fedrl.wire.streams.StreamGuard), so no caller can take every worker with them.
    LONG_POLLS = ("/fedrl.v1.Federation/NextTask", "/fedrl.v1.Federation/SubmitUpdateInline",
                  "/fedrl.v1.Federation/SecureAggregation")
    # These answer with bytes: a Task (alone, or as the next_task of a SubmitReply), which is the
    # same for every agent of a round, weights included, is serialised once per round instead of
    # once per agent (fedrl.wire.rpc.create_server sends such replies as they are).
    # FetchGlobal streams a version's parts, serialised once per version for all its fetchers.
    PRESERIALIZED = ("/fedrl.v1.Federation/NextTask", "/fedrl.v1.Federation/SubmitUpdateInline",
                     "/fedrl.v1.Federation/Session", "/fedrl.v1.Federation/FetchGlobal")
    # SubmitUpdate's chunk messages are read in place (fedrl.wire.serde.read_raw_parts), not parsed
    # into a message whose chunk is then copied out again.
    # A Session's messages are read as bytes too: an update's payload is then assembled from the
    # bytes received (fedrl.wire.serde.inline_update_in_session), not from a parsed message's
    # copy of it, copied out again; its other messages are parsed as they come.
    RAW_REQUESTS = ("/fedrl.v1.Federation/SubmitUpdate", SESSION)

    def __init__(self, coord: Coordinator, auth: Authenticator | None = None, max_workers: int | None = None) -> None:
        self.coord = coord
        self.auth = auth or Authenticator()
        # Every connected agent's Session holds one of the server's RPC threads for as long as it
        # is open: past max_workers, a new stream would wait for a thread that never comes free.
        self.max_workers = max_workers
        # Inline (small) updates are verified one at a time. Their work is many short torch ops,
        # each of which releases the GIL and takes it back: with ten handler threads verifying at
        # once, every hand-back is a contended GIL switch and the same work costs about twice the
        # CPU. Streamed updates are not held to it: they wait on the network between chunks, and
        # their long sha256 and finiteness passes run in parallel on several cores.
        self._inline_lock = threading.Lock()
        self._task_cache: tuple[tuple, bytes] | None = None  # the last task with weights, serialised
        # The serialised parts of the versions fetched last (at most two: the current one and
        # the one before, which a late agent may still fetch), each with its Encoded, whose
        # identity is the key. Built under the lock: ten agents fetching at once build it once.
        self._parts_cache: list[tuple[object, list[bytes]]] = []
        self._parts_lock = threading.Lock()

    def Join(self, request, context):
        self.auth.check_agent(context, request.agent_id)
        m = request.obs_moments
        stats = None
        if m.count > 0 or len(m.sum):
            stats = ObsStats(int(m.count), np.asarray(m.sum, np.float64), np.asarray(m.sum_sq, np.float64))
        rec = AgentRecord(request.agent_id, int(request.agent_index), int(request.num_samples),
                          int(request.obs_dim), int(request.act_dim), request.env_id, stats, request.device)
        try:
            run_id = self.coord.join(rec)
        except ServiceError as e:
            _abort(context, e)
        n = len(self.coord.agents)
        if self.max_workers is not None and n > self.max_workers - RESERVED_THREADS:
            log.warning("%d agents have joined; each Session stream holds one of the server's %d RPC threads "
                        "(%d kept for control calls and watchers): raise --max-workers", n, self.max_workers,
                        RESERVED_THREADS)
        return federation_pb2.JoinReply(agent_id=request.agent_id, run_id=run_id,
                                        last_accepted_round=self.coord.registry.last_accepted_round(request.agent_id, run_id),
                                        last_accepted=self.coord.registry.accepted_rounds(request.agent_id))

    def NextTask(self, request, context):
        self.auth.check_agent(context, request.agent_id)
        busy = frozenset(request.busy_runs[:MAX_BUSY_RUNS])
        if request.probe:  # a training agent asking whether its task still stands: at once, no weights
            return self._task(context, request.agent_id, 0.0, probe=True, run_id=request.run_id)[1]
        return self._task(context, request.agent_id, request.wait_seconds, busy=busy)[1]

    def _task(self, context, agent_id: str, wait: float, probe: bool = False, run_id: str = "",
              busy: frozenset[str] = frozenset()) -> tuple[str, bytes, str]:
        """The agent's next task: its kind, the Task serialised, and its run. A round's TRAIN tasks differ
        between agents only in their normalisers (none with pooled statistics): each distinct
        one is serialised once. A ``probe`` (of ``run_id``'s task) gets no base weights; no task
        of the ``busy`` runs is given."""
        try:
            t = self.coord.tasks.next_task(agent_id, wait, probe=probe, run_id=run_id, busy=busy)
        except ServiceError as e:
            _abort(context, e)
        base = t.pop("base", None)
        if probe:
            base = None
        kind = t["kind"]
        key = tuple(tuple(v) if isinstance(v, list) else v for v in t.values()) + (id(base),)
        cached = self._task_cache
        if cached is None or cached[0] != key:
            t["kind"] = federation_pb2.Task.Kind.Value(kind)
            if base is not None:
                t["base_manifest"] = manifest_to_proto(base.manifest)
            wire = federation_pb2.Task(**t).SerializeToString()
            if base is not None:  # the weights first: an agent reads them in place (serde.leading_bytes_field)
                wire = with_leading_bytes_field(federation_pb2.Task.BASE_PAYLOAD_FIELD_NUMBER, base.pieces(), wire)
            cached = (key, wire)
            if base is not None:  # a task with weights inline: worth keeping for the next agent
                self._task_cache = cached
        if base is not None:
            self.coord.metrics.bytes_sent.inc(base.manifest.total_bytes)
        return kind, cached[1], t.get("run_id", "")

    def SecureAggregation(self, request, context):
        """One step of a round's secure aggregation (fedrl/federation/secagg.py): the step's
        message is taken, and the reply waits (at most ``wait_seconds``) for the step to close."""
        self.auth.check_agent(context, request.agent_id)
        step = request.WhichOneof("step")
        if step is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a SecureAggregation message names one step "
                          "(keys, shares, masked or answer)")
        try:
            out = self.coord.submissions.secure_step(request.agent_id, request.run_id, int(request.round), step,
                                         secagg_value(step, getattr(request, step)), request.wait_seconds)
        except ServiceError as e:
            _abort(context, e)
        reply = federation_pb2.SecAggReply()
        if out is None:
            reply.pending = True
        elif step == "keys":
            for a, k in out["roster"].items():
                reply.roster.keys[a].share_key, reply.roster.keys[a].mask_key = k.share_key, k.mask_key
            reply.roster.alpha.update(out["alpha"])
            reply.roster.threshold = out["threshold"]
        elif step == "shares":
            reply.relay.sealed.update(out["sealed"])
            reply.relay.shared.extend(out["shared"])
        elif step == "masked":
            reply.unmask.survivors.extend(out["survivors"])
            reply.unmask.dropped.extend(out["dropped"])
            reply.unmask.excluded.extend(out["excluded"])
        else:
            reply.done = True
        return reply

    def FetchGlobal(self, request, context):
        who = self.auth.identify(context.invocation_metadata()) if self.auth.enabled else None
        try:  # an agent (by its token) fetches only its runs' versions; evaluators and admins any
            enc = self.coord.versions.global_weights(request.run_id, request.version,
                                                     agent=who[1] if who and who[0] == AGENT else None)
        except ServiceError as e:
            _abort(context, e)
        parts = self._serialised_parts(enc)
        yield parts[0]
        for k, part in enumerate(parts[1:]):
            self.coord.metrics.bytes_sent.inc(min(enc.chunk_bytes, enc.manifest.total_bytes - k * enc.chunk_bytes))
            yield part

    def _serialised_parts(self, enc) -> list[bytes]:
        with self._parts_lock:
            for cached, parts in self._parts_cache:
                if cached is enc:
                    return parts
            parts = weight_part_bytes(enc)
            self._parts_cache = [*self._parts_cache[-1:], (enc, parts)]
            return parts

    def SubmitUpdate(self, request_iterator, context):
        def parts():
            head, chunks = read_raw_parts(request_iterator, federation_pb2.UpdatePart)
            return head.header, chunks
        return self._submit(context, parts)

    def SubmitUpdateInline(self, request, context):
        reply = self._submit_inline(context, request.header if request.HasField("header") else None,
                                    request.payload).SerializeToString()
        if request.next_task_wait_seconds > 0:  # accepted: answer with the next task (one call a round)
            reply = length_delimited_field(federation_pb2.SubmitReply.NEXT_TASK_FIELD_NUMBER,
                                           self._task(context, request.header.agent_id,
                                                      request.next_task_wait_seconds)[1], prefix=reply)
        return reply

    def Session(self, request_iterator, context):
        """An agent's stream: its tasks (as NextTask answers them) out, its answers to TRAIN
        tasks in, each update checked as SubmitUpdateInline checks it; a refusal ends the stream
        with that call's status (see federation.proto)."""
        first = next(request_iterator, None)
        first = None if first is None else _session_message(first, context)
        if first is None or first.WhichOneof("kind") != "hello":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a session must start with its hello")
        # NaN compares false both ways: max(nan, 1.0) is nan, which waited 0 s, and the stream sent
        # WAIT heartbeats in a hot loop (13,000 in 2 s)
        asked = first.hello.wait_seconds
        agent_id, wait = first.hello.agent_id, SESSION_MIN_WAIT if math.isnan(asked) else max(asked, SESSION_MIN_WAIT)
        self.auth.check_agent(context, agent_id)
        log.info("agent %s connected (session from %s)", agent_id, context.peer(),
                 extra={"event": {"kind": "AGENT_CONNECTED", "agent_id": agent_id}})
        try:
            yield from self._session(request_iterator, context, agent_id, wait)
        finally:
            log.info("agent %s left (its session ended)", agent_id,
                     extra={"event": {"kind": "AGENT_LEFT", "agent_id": agent_id}})

    def _session(self, request_iterator, context, agent_id: str, wait: float):
        while context.is_active() and not self.coord.closed:
            kind, task, run_id = self._task(context, agent_id, wait)
            yield task
            if kind not in ("TRAIN", "MOMENTS"):
                continue
            while True:  # the answer to the task, after any progress
                data = next(request_iterator, None)
                if data is None:  # the agent closed its side of the stream
                    return
                which, header, payload = session_answer(data, context)
                if which != "progress":
                    break
                progress = header  # (for a progress message, the message itself)
                try:
                    self.coord.registry.progress(agent_id, progress.round, progress.steps_done, progress.steps_total,
                                        progress.run_id)
                except ServiceError as e:
                    _abort(context, e)
            if kind == "MOMENTS" and which != "done":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"a session answers a MOMENTS task with done, not {which or 'nothing'}")
            if which == "update":
                if header is not None and header.agent_id != agent_id:
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, f"the session of agent {agent_id[:80]!r} "
                                  f"carried an update of agent {header.agent_id[:80]!r}")
                self._submit_inline(context, header, payload)
            elif which == "done" and kind == "TRAIN":  # without its update here: streamed, or sat out
                self.coord.tasks.declined(agent_id, run_id, header.round)
            elif which != "done":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"a session answers a TRAIN task with its update or done, not {which or 'nothing'}")

    def _submit_inline(self, context, header, payload) -> federation_pb2.SubmitReply:
        """An update sent in one message: its header (None where the message had none) and payload."""
        def parts():
            if header is None:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "an inline update needs its header",
                                   "bad_stream")
            return header, (payload,)
        with self._inline_lock:
            return self._submit(context, parts)

    def _submit(self, context, parts):
        """Both submission paths: header checks before any byte is kept, then the same verification."""
        metrics = self.coord.metrics
        h = None
        try:
            h, chunks = parts()
            self.auth.check_agent(context, h.agent_id)
            manifest = manifest_from_proto(h.weights)
            self.coord.submissions.check_header(h.agent_id, manifest, h.metrics)
            asm = Assembler(manifest, self.coord.buffers)
            for c in chunks:
                metrics.bytes_received.inc(len(c))
                asm.add(c)
            state = asm.finish()
            r = self.coord.submit(h.agent_id, manifest, state, dict(h.metrics), h.train_seconds, asm.flat)
        except (ServiceError, CodecError) as e:
            log.warning("update refused: %s", e)
            metrics.reject(e.reason)
            if isinstance(e, CodecError) and h is not None:
                self.coord.submissions.update_refused(h.agent_id, h.weights.run_id, e.reason, str(e))
            _abort(context, e)
        return federation_pb2.SubmitReply(accepted=True, round=r, received_bytes=manifest.total_bytes)


class ControlServicer(control_pb2_grpc.ControlServicer):
    def __init__(self, coord: Coordinator, auth: Authenticator | None = None) -> None:
        """``auth``: the server's tokens, to tell an evaluator that follows the runs from a caller
        that only says it is one."""
        self.coord = coord
        self.auth = auth or Authenticator()

    def StartRun(self, request, context):
        try:
            return status_to_proto(self.coord.start_run(request.config_json))
        except ServiceError as e:
            _abort(context, e)

    def GetStatus(self, request, context):
        try:
            return status_to_proto(self.coord.status(request.run_id))
        except ServiceError as e:
            _abort(context, e)

    def StopRun(self, request, context):
        try:
            return status_to_proto(self.coord.stop_run(request.reason, request.run_id))
        except ServiceError as e:
            _abort(context, e)

    def WatchRounds(self, request, context):
        meta = context.invocation_metadata()
        follower = any(k == EVALUATOR_HEADER for k, _ in meta)
        if follower and self.auth.enabled:  # only the evaluator's own token makes a follower
            who = self.auth.identify(meta)
            follower = who is not None and who[0] == EVALUATOR
        elif follower and self.coord.evaluators >= MAX_UNVERIFIED_FOLLOWERS:
            follower = False  # without tokens anyone can send the header: only a few count
        if follower:  # counted while its stream is open (and seen, even when there is no run yet)
            self.coord.registry.evaluator_attached(+1)
        try:
            for e in self.coord.lifecycle.watch(request.after_version, context.is_active, run_id=request.run_id):
                yield event_to_proto(e)
        except ServiceError as e:
            _abort(context, e)
        finally:
            if follower:
                self.coord.registry.evaluator_attached(-1)

    def ListRuns(self, request, context):
        return control_pb2.RunList(runs=[control_pb2.RunSummary(
            run_id=r["run_id"], state=r["state"], algo=r["algo"], agents=r["agents"], rounds=r["rounds"],
            latest_version=r["latest_version"], started_unix=r["started_unix"],
            has_score=r["best_score"] is not None, best_score=r["best_score"] or 0.0,
            best_version=r["best_version"] if r["best_version"] is not None else -1, message=r["message"])
            for r in self.coord.lifecycle.list_runs(request.limit)])

    def ListVersions(self, request, context):
        try:
            run_id, versions = self.coord.lifecycle.list_versions(request.run_id)
        except ServiceError as e:
            _abort(context, e)
        return control_pb2.VersionList(run_id=run_id, versions=[control_pb2.VersionInfo(**v) for v in versions])

    def ReportEvaluation(self, request, context):
        try:
            self.coord.report_evaluation(evaluation_from_proto(request))
        except ServiceError as e:
            _abort(context, e)
        return control_pb2.ReportAck()


def secagg_value(step: str, msg: Any) -> Message:
    """A SecureAggregation step's protobuf message as the round machine's value
    (:mod:`fedrl.federation.secure_steps`); every check of it is the machine's."""
    if step == "keys":
        return Keys(bytes(msg.share_key), bytes(msg.mask_key))
    if step == "shares":
        return Shares({a: bytes(b) for a, b in msg.sealed.items()})
    if step == "masked":
        return Masked(bytes(msg.vector), tuple(msg.unopened), bool(msg.metrics))
    return Answer({a: (int(s.point), bytes(s.share)) for a, s in msg.shares.items()},
                  {a: bytes(v) for a, v in msg.pair_seeds.items()})
