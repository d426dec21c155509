"""The agent's side of the federation: join, wait for a task, fetch, train, submit; reconnect."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from agent_service.probe import TaskProbe
from agent_service.secure import SecureSteps
from fedrl.data.normalize import ObsStats
from fedrl.data.partition import Shard
from fedrl.federation.privacy import agent_clip, task_clip
from fedrl.federation.round import LocalTrainer, RoundInterrupted, algo_config
from fedrl.federation.runconfig import RunConfig, parse_run_config
from fedrl.federation.secagg import SecAggError
from fedrl.ops.metrics import AgentMetrics
from fedrl.proto.v1 import federation_pb2, federation_pb2_grpc
from fedrl.wire.codec import (
    INLINE_MAX_BYTES,
    CodecError,
    assemble,
    check_manifest_matches,
    encode,
    specs_of,
)
from fedrl.wire.memory import BufferPool
from fedrl.wire.rpc import StopFlag, create_channel, nothing_listens, weights_calls
from fedrl.wire.security import TLSFiles
from fedrl.wire.serde import (
    chunk_frame,
    manifest_from_proto,
    manifest_to_proto,
    read_task,
    read_weight_stream,
    session_update,
    update_messages,
)

log = logging.getLogger("fedrl.agent")
SESSION_METHOD = "/fedrl.v1.Federation/Session"
# From this size a learner adopts the global model's decoded tensors instead of copying them (30 MB:
# ~2.6 ms of an agent's CPU a round). Below it a copy of one fused call is cheaper than a call per
# tensor to adopt them.
ADOPT_MIN_BYTES = 1 << 20
# RESOURCE_EXHAUSTED: the aggregator is full (streams, agents) for now; another caller may hold
# the slots for a while, and the README tells clients to retry later, as an agent does (backing off)
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
             grpc.StatusCode.RESOURCE_EXHAUSTED)


# Learners an agent keeps, one per run it takes part in (a run's STOP drops its own)
MAX_RUN_LEARNERS = 16


@dataclass
class RunLearner:
    """What an agent keeps for one run between its rounds."""
    trainer: LocalTrainer
    config: RunConfig
    base_reference: dict[str, torch.Tensor]  # the tensors a base version must match (views of the live ones)
    base_specs: tuple  # what a base version's manifest lists


@dataclass
class AgentConfig:
    target: str
    agent_id: str
    index: int
    env_id: str
    device: torch.device
    task_wait: float = 10.0
    backoff_initial: float = 0.2
    backoff_max: float = 10.0
    rpc_timeout: float = 120.0
    connect_timeout: float = 5.0  # a Join waits this long for the aggregator, then retries (stop() is seen)
    tls: TLSFiles | None = None
    token: str | None = None
    inline_max_bytes: int = INLINE_MAX_BYTES  # updates up to this size go as one message; larger ones stream
    # one Session stream for tasks and updates (the default), or a NextTask and a submit call each round
    session: bool = True
    progress_seconds: float = 10.0  # a Session agent's progress messages while it trains, at most this far apart
    probe_seconds: float = 1.0  # while training, ask this often whether the task still stands (0: never)
    # send the shard's observation moments at Join (pooled normalisation); False keeps them: a
    # secure run then sums them under secure aggregation (a MOMENTS task), a plain one fails saying so
    share_moments: bool = True
    # runs trained at once: 1 takes the tasks of the runs this agent is in one after another (in
    # turn); N > 1 trains up to N runs' rounds at once, each in its own lane (a thread, a channel)
    runs_at_once: int = 1


# While another lane trains, a lane asks for a task this often at least (its request names the
# runs the others train, which change when one finishes)
LANE_POLL_SECONDS = 1.0


class Lanes:
    """An agent's lanes when it trains several runs at once (``runs_at_once`` > 1): one learner per
    run, shared, and the run each lane trains now. Lanes ask for a task one at a time, each naming
    the runs the others train (``busy_runs``), so two lanes never train one run."""

    def __init__(self) -> None:
        self.learners: dict[str, RunLearner] = {}
        self.asking = threading.Lock()
        self.busy: dict[int, str] = {}
        self.peak = 0  # the most runs trained at once so far

    def others(self, lane: int) -> list[str]:
        return [r for k, r in list(self.busy.items()) if k != lane]


class Agent:
    """Runs until :meth:`stop`; survives aggregator restarts by rejoining with backoff."""

    def __init__(self, cfg: AgentConfig, shard: Shard, metrics: AgentMetrics | None = None,
                 lanes: Lanes | None = None, lane: int = 0, stop: StopFlag | None = None) -> None:
        """``lanes``, ``lane``, ``stop``: another lane's (see :class:`Lanes`); an agent with
        ``runs_at_once`` > 1 makes its other lanes itself, when it runs."""
        self.cfg, self.shard = cfg, shard
        self.metrics = metrics or AgentMetrics(cfg.agent_id, str(cfg.device))
        self.stats = ObsStats.of(shard.transitions.obs)
        self._stop = stop or StopFlag()  # stop() may be called from a signal handler
        self.lanes = lanes if lanes is not None else Lanes() if cfg.runs_at_once > 1 else None
        self.lane = lane
        self.secure = SecureSteps(cfg.agent_id, cfg.task_wait, cfg.rpc_timeout, self._stop)
        self._channel: grpc.Channel | None = None  # the one in use (closed by stop)
        self._session_call = None  # the Session stream in use, and since when it has been awaited
        self._progress_to = None  # (answers queue, run, round, last sent) while a Session's TRAIN task trains
        self._awaited_since: float | None = None
        # A learner per run this agent takes part in (it takes their tasks in turn): each keeps its
        # own model, optimisers and random streams from round to round, whatever the others do.
        self.learners: dict[str, RunLearner] = self.lanes.learners if self.lanes is not None else {}
        self.rounds_done = 0
        # The task whose update was sent and not yet confirmed (by the next task on the Session
        # stream, or a submit call's reply). If the connection breaks first, the next Join's
        # reply says whether the aggregator took it.
        self._unacked = None
        self._bad_streak = 0  # global models refused in a row
        # turned off when the aggregator has no Session stream; lanes ask with calls, naming the busy runs
        self.use_session = cfg.session and self.lanes is None
        self._train_seconds = 0.0  # of the last local round
        self._sat_out: tuple[str, int] | None = None  # the (run, round) whose task this agent refused
        self._skip_run = ""  # with a call per task: the run the next call names busy (its round sat out)
        # The buffer a fetched global is assembled in, written again each round (a fresh one is
        # zero-filled first). Reused only once the trainer no longer reads the last one.
        self._buffers = BufferPool(keep=1)
        self.stop_reason: str | None = None

    def stop(self, reason: str = "asked to stop") -> None:
        """Stop at once (safe in a signal handler: it sets flags, takes no lock, logs nothing)."""
        self.stop_reason = self.stop_reason or reason
        self._stop.set()

    def run(self) -> None:
        """Until :meth:`stop`: join, then wait, fetch, train and submit; rejoin after failures.
        With ``runs_at_once`` > 1, the other lanes run beside it, and stop with it."""
        threading.Thread(target=self._watch, name="agent-watch", daemon=True).start()
        siblings = []
        if self.lanes is not None and self.lane == 0:
            for i in range(1, self.cfg.runs_at_once):
                sib = Agent(self.cfg, self.shard, self.metrics, self.lanes, i, self._stop)
                siblings.append(threading.Thread(target=sib.run, name=f"agent-lane-{i}", daemon=True))
                siblings[-1].start()
        try:
            self._run()
        finally:
            self._stop.set()  # a lane that gives up ends the others
            for t in siblings:
                t.join(timeout=self.cfg.rpc_timeout)

    def _run(self) -> None:
        delay = self.cfg.backoff_initial
        while not self._stop.is_set():
            channel = self._channel = create_channel(self.cfg.target, self.cfg.tls, self.cfg.token)
            try:
                if not self._stop.is_set():  # stop() may have come while the channel was made
                    delay = self._session(channel, delay)
            except Exception as e:
                if not self._stop.is_set():
                    raise
                # a call cancelled by _close_channel_on_stop, a local round cut short
                log.info("stopping (%s): %s", self.stop_reason, e.details() if isinstance(e, grpc.RpcError) else e)
                return
            finally:
                channel.close()
        log.info("stopping (%s)", self.stop_reason)

    def _watch(self) -> None:
        """Cancels a Session stream that has kept the agent waiting for a task longer than a
        NextTask call may take (a hung aggregator, a silently dead connection): the agent then
        reconnects. Once stopped, closes the channel in use: that cancels a call in flight (a
        wait for a task, a transfer) at once. :meth:`stop` itself runs in a signal handler,
        which must not take the locks closing a channel takes."""
        limit = self.cfg.task_wait + self.cfg.rpc_timeout
        while not self._stop.wait(1.0):
            call, since = self._session_call, self._awaited_since
            if call is not None and since is not None and time.monotonic() - since > limit:
                log.warning("no task for %.0fs on the session stream; reconnecting", limit)
                call.cancel()
        channel = self._channel
        if channel is not None:
            channel.close()

    def _session(self, channel: grpc.Channel, delay: float) -> float:
        """Join and work on one channel until it fails; returns the next reconnection delay.

        The delay grows (doubling, to ``backoff_max``, each wait jittered) until a round goes
        through: a Join alone does not reset it, since a Join that succeeds between refusals for
        capacity (the streams after it refused) would otherwise bring the agent back every 0.2 s."""
        rounds_before = self.rounds_done
        try:
            stub = federation_pb2_grpc.FederationStub(channel)
            self._weights_calls = weights_calls(channel)  # FetchGlobal / SubmitUpdate, weights as bytes
            self._join(stub)
            self._loop(channel, stub)
        except CodecError as e:
            # The global model failed verification on the way here (damaged in transit, a bad
            # store): nothing was trained or sent. Ask again after a pause, on a new channel.
            # The pause grows while no round succeeds (a successful submission resets it).
            wait = min(self.cfg.backoff_initial * 2 ** self._bad_streak, self.cfg.backoff_max)
            self._bad_streak += 1
            log.error("global model refused (%s: %s); asking again in %.1fs", e.reason, e, wait)
            self.metrics.bad_downloads.inc()
            self._stop.wait(wait * (0.5 + random.random()))
        except grpc.RpcError as e:
            code = e.code()
            if self._stop.is_set():
                raise
            if self.rounds_done > rounds_before:  # this connection did work: start the backoff over
                delay = self.cfg.backoff_initial
            if code not in RETRYABLE and code != grpc.StatusCode.NOT_FOUND:
                log.error("giving up: %s %s", code.name, e.details())
                raise
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and nothing_listens(self.cfg.target):
                log.warning("no aggregator at %s (connection refused); retrying in %.1fs", self.cfg.target, delay)
            else:
                log.warning("aggregator at %s unavailable (%s: %s); retrying in %.1fs", self.cfg.target,
                            code.name, e.details(), delay)
            self.metrics.reconnects.inc()
            self._stop.wait(delay * (0.5 + random.random()))
            delay = min(delay * 2, self.cfg.backoff_max)
        return delay

    def _join(self, stub) -> None:
        tr = self.shard.transitions
        req = federation_pb2.JoinRequest(
            agent_id=self.cfg.agent_id, agent_index=self.cfg.index, num_samples=len(tr),
            obs_dim=tr.obs.shape[1], act_dim=tr.actions.shape[1], env_id=self.cfg.env_id,
            device=str(self.cfg.device))
        if self.cfg.share_moments:
            req.obs_moments.CopyFrom(federation_pb2.ObsMoments(
                count=self.stats.count, sum=self.stats.total.tolist(), sum_sq=self.stats.total_sq.tolist()))
        reply = stub.Join(req, timeout=self.cfg.connect_timeout, wait_for_ready=True)
        log.info("joined as %s (run %s)", self.cfg.agent_id, reply.run_id or "none yet")
        sent, self._unacked = self._unacked, None
        if sent is not None:
            last = dict(reply.last_accepted)  # of every run it takes part in (an aggregator before v1.4: one)
            if reply.run_id and reply.run_id not in last:
                last[reply.run_id] = reply.last_accepted_round
            if last.get(sent.run_id, 0) >= sent.round:
                log.info("round %d: the update sent before the connection broke was taken", sent.round)
                self._submitted(sent)
            else:
                log.warning("round %d: the update sent before the connection broke was not taken", sent.round)

    def _loop(self, channel: grpc.Channel, stub) -> None:
        while not self._stop.is_set():
            try:
                if self.use_session:
                    self._session_stream(channel, stub)
                    self._stop.wait(self.cfg.backoff_initial)  # ended by the aggregator: it is stopping
                else:
                    self._calls(stub)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED and self.use_session and not self._stop.is_set():
                    log.warning("the aggregator has no Session stream; using a call per task instead")
                    self.use_session = False
                elif e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
                    self._unacked = None  # the update in flight, if any, was answered: refused
                    # an update for a round that closed without it, a run stopped under the task
                    log.warning("%s; asking for the next task", e.details())
                    self._stop.wait(self.cfg.backoff_initial)  # never a tight loop of refusals
                else:
                    raise

    def _calls(self, stub) -> None:
        """Tasks from NextTask (or an inline update's reply), one call per task."""
        task = None  # the next task, when the last submission's reply brought it
        # a lane's submission brings no task: its next request names the runs the other lanes train
        next_wait = 0.0 if self.lanes is not None else self.cfg.task_wait
        while not self._stop.is_set():
            if task is None:
                task = self._next_task(stub)
            current, task = task, None
            try:
                if current.kind == federation_pb2.Task.MOMENTS:
                    self._moments(stub, current)
                elif current.kind == federation_pb2.Task.TRAIN:
                    update = self._train(stub, current)
                    if update is not None:
                        self._unacked = current
                        reply = stub.SubmitUpdateInline(
                            federation_pb2.InlineUpdate(header=update[0], payload=update[1].payload,
                                                        next_task_wait_seconds=next_wait),
                            timeout=self.cfg.rpc_timeout + self.cfg.task_wait)
                        self._submitted(current)
                        task = reply.next_task if reply.HasField("next_task") else None  # one call a round
                else:
                    self._other(current)
            finally:
                if self.lanes is not None:
                    self.lanes.busy.pop(self.lane, None)

    def _next_task(self, stub):
        """A NextTask call's task. A lane asks while no other lane does, naming the runs the
        others train, and holds the run of a TRAIN or MOMENTS task it gets until it is done."""
        req = federation_pb2.TaskRequest(agent_id=self.cfg.agent_id, wait_seconds=self.cfg.task_wait)
        skip, self._skip_run = self._skip_run, ""
        if self.lanes is None:
            if skip:
                req.busy_runs.append(skip)
            return stub.NextTask(req, timeout=self.cfg.task_wait + 30)
        with self.lanes.asking:
            busy = self.lanes.others(self.lane) + ([skip] if skip else [])
            req.busy_runs.extend(busy)
            if busy:  # the busy runs change when a lane finishes: ask again soon
                req.wait_seconds = min(self.cfg.task_wait, LANE_POLL_SECONDS)
            t = stub.NextTask(req, timeout=self.cfg.task_wait + 30)
            if t.kind in (federation_pb2.Task.TRAIN, federation_pb2.Task.MOMENTS):
                self.lanes.busy[self.lane] = t.run_id
                self.lanes.peak = max(self.lanes.peak, len(self.lanes.busy))
            return t

    def _session_stream(self, channel: grpc.Channel, stub) -> None:
        """Tasks and updates on one Session stream until it ends; an update is taken when the
        next task comes. Messages go up serialised here (an update with one copy of its payload)."""
        answers: queue.SimpleQueue = queue.SimpleQueue()

        def messages():
            yield federation_pb2.SessionMessage(hello=federation_pb2.TaskRequest(
                agent_id=self.cfg.agent_id, wait_seconds=self.cfg.task_wait)).SerializeToString()
            while (m := answers.get()) is not None:
                yield m

        # Tasks come as bytes: a TRAIN task's weights are read in place (read_task), not copied
        # out of a parsed message.
        session = channel.stream_stream(SESSION_METHOD, request_serializer=None, response_deserializer=None)
        call = self._session_call = session(messages())
        sent = None  # the task whose update went inline and is not yet acknowledged
        try:
            self._awaited_since = time.monotonic()
            for data in call:
                self._awaited_since = None
                task, weights = read_task(data)
                if sent is not None:
                    self._submitted(sent)
                    sent = None
                if task.kind == federation_pb2.Task.TRAIN:
                    self._progress_to = (answers, task.run_id, task.round, time.monotonic())
                    try:
                        update = self._train(stub, task, weights)
                    finally:
                        self._progress_to = None
                    if update is None:
                        answers.put(federation_pb2.SessionMessage(
                            done=federation_pb2.TaskDone(round=task.round)).SerializeToString())
                    else:
                        answers.put(session_update(*update))
                        sent = self._unacked = task
                elif task.kind == federation_pb2.Task.MOMENTS:
                    self._moments(stub, task)
                    answers.put(federation_pb2.SessionMessage(
                        done=federation_pb2.TaskDone(round=task.round)).SerializeToString())
                else:
                    self._other(task)
                self._awaited_since = time.monotonic()
        finally:
            self._session_call = self._awaited_since = None
            answers.put(None)
            call.cancel()

    def _progress(self, done: int, total: int) -> None:
        """While a Session's TRAIN task trains: its local steps, every ``progress_seconds``
        (the aggregator ends a stream that stays silent longer than its idle limit)."""
        to = self._progress_to
        if to is None:
            return
        answers, run_id, round_, last = to
        now = time.monotonic()
        if now - last >= self.cfg.progress_seconds:
            answers.put(federation_pb2.SessionMessage(progress=federation_pb2.TaskProgress(
                round=round_, steps_done=done, steps_total=total, run_id=run_id)).SerializeToString())
            self._progress_to = (answers, run_id, round_, now)

    def _other(self, task) -> None:
        if task.kind == federation_pb2.Task.STOP:
            log.info("run %s is over", task.run_id)
            self.learners.pop(task.run_id, None)

    def _submitted(self, task) -> None:
        self._unacked = None
        self.rounds_done += 1
        self._bad_streak = 0
        self.metrics.rounds.inc()
        log.info("round %d: submitted after %d steps in %.1fs", task.round, task.local_steps, self._train_seconds)

    def _learner_for(self, task) -> RunLearner:
        """The learner of ``task``'s run, made at its first task (the oldest one goes past
        MAX_RUN_LEARNERS: a run whose STOP never came)."""
        lr = self.learners.get(task.run_id)
        if lr is None:
            rc = parse_run_config(task.run_config_json)
            hp = algo_config(rc.algo, rc.drpo, rc.bc)
            trainer = LocalTrainer(
                self.cfg.index, hp, self.shard.transitions, np.asarray(task.obs_mean, np.float32),
                np.asarray(task.obs_std, np.float32), rc.seed, self.cfg.device,
                federate_critic=rc.federate == "policy+critic", local_normalizer=rc.obs_norm == "local",
                update_clip=agent_clip(rc))
            # names, dtypes and shapes a base version must have (views of the live tensors)
            reference = trainer.learner.shared_state(trainer.federate_critic)
            lr = RunLearner(trainer, rc, reference, specs_of(reference))
            while len(self.learners) >= MAX_RUN_LEARNERS:
                self.learners.pop(next(iter(self.learners)))
            self.learners[task.run_id] = lr
        return lr

    def _secure_aggregation(self, stub, task, rc, res) -> None:
        self.secure.update(stub, task, rc, res)
        self._submitted(task)

    def _sit_out(self, task, why: str) -> None:
        """Take no part in ``task``'s round, saying ``why`` once (see :meth:`_sitting_out`)."""
        if why:
            log.error("round %d: no part in %s", task.round, why)
        self._sat_out = (task.run_id, task.round)

    def _sitting_out(self, task) -> bool:
        """Whether ``task`` is of a round this agent refused; it is never trained or run again (a
        refused secure step cannot be taken again). On a Session the agent answers it with done,
        and the aggregator offers it no more. With a call per task, the next call names its run
        busy (the other runs' tasks come meanwhile), and the call after asks for it again until
        the round closes. From an aggregator that offers it again at once it is taken no faster
        than a long poll."""
        if self._sat_out != (task.run_id, task.round):
            return False
        if self.use_session:
            self._stop.wait(self.cfg.task_wait)
        else:
            self._skip_run = task.run_id
        return True

    def _moments(self, stub, task) -> None:
        if not self._sitting_out(task) and not self.secure.moments(stub, task, self.stats):
            self._sit_out(task, "")  # secure.moments said why

    def _train(self, stub, task, weights: bytes | memoryview | None = None):
        """Train on ``task``. A small update is returned as (header, its Encoded payload) for the
        caller to send in one message; a large one is streamed here with SubmitUpdate (None returned).
        ``weights``: the task's inline weights where they were read from its bytes (read_task)."""
        if self._sitting_out(task):
            return None
        try:
            lr = self._learner_for(task)
        except ValueError as e:  # a run config this agent cannot read: a newer aggregator's settings
            self._sit_out(task, f"run {task.run_id}: its config cannot be used here: {e} (an agent older than "
                                "the aggregator?)")
            return None
        trainer, rc = lr.trainer, lr.config
        try:  # adaptive clipping under the masks: this agent clips its update itself, to the round's norm
            clip = task_clip(rc, task.dp_clip, task.round)
        except ValueError as e:  # trains nothing and takes no part; the round goes on without it
            self._sit_out(task, f"the secure aggregation: {e}")
            return None
        if clip is not None:
            trainer.update_clip = clip
        stream = None
        if task.HasField("base_manifest"):  # small model: the base version came with the task
            manifest = manifest_from_proto(task.base_manifest)
            chunks = [task.base_payload if weights is None else weights]
            if (manifest.run_id, manifest.base_version) != (task.run_id, task.base_version):
                raise CodecError("bad_manifest", "the task's inline weights are not its base version")
        else:
            stream = self._weights_calls[0](federation_pb2.FetchRequest(run_id=task.run_id, version=task.base_version),
                                            timeout=self.cfg.rpc_timeout)
        try:
            if stream is not None:  # its chunks are assembled (copied, hashed) as they arrive
                manifest, chunks = read_weight_stream(stream)
            if manifest.tensors != lr.base_specs:  # else the same list (the usual case: one comparison)
                check_manifest_matches(manifest, lr.base_reference)  # before a buffer is sized from it
            state = assemble(manifest, chunks, self._buffers)
        except CodecError:
            if stream is not None:
                stream.cancel()  # a refused stream is not read to its end
            raise
        # the trained tensors themselves, not copies: they are encoded (copied) before the next round.
        # A large model's learner takes the decoded tensors as its own (their buffer is this
        # agent's, and the pool hands out another next round while the learner still holds it).
        probe = TaskProbe(stub, self.cfg.agent_id, task, self._stop, self.cfg.probe_seconds)
        try:
            res = trainer.train_round(state, task.local_steps, stop=probe.stop_now, copy=False,
                                      progress=self._progress, adopt=manifest.total_bytes >= ADOPT_MIN_BYTES)
        except RoundInterrupted as e:
            if self._stop.is_set() or probe.reason is None:
                raise
            log.info("round %d abandoned (%s): %s", task.round, probe.reason, e)
            self.learners.pop(task.run_id, None)
            return None
        finally:
            probe.close()
        self.metrics.trained(task.local_steps, res.seconds, res.metrics)
        self._train_seconds = res.seconds
        if rc.secagg_threshold:  # the update goes masked, never in the clear
            try:
                self._secure_aggregation(stub, task, rc, res)
            except SecAggError as e:  # this agent's own check, or a step it must refuse
                self._sit_out(task, f"the secure aggregation: {e}")
            return None
        # An update too large for one message is streamed as chunk messages: they are built as it
        # is encoded, each chunk hashed in its message (one pass over the model, not two).
        streamed = sum(t.nbytes for t in res.state.values()) > self.cfg.inline_max_bytes
        enc = encode(res.state, task.run_id, task.round, task.base_version, res.num_samples,
                     frame=chunk_frame if streamed else None)
        header = federation_pb2.UpdateHeader(agent_id=self.cfg.agent_id, weights=manifest_to_proto(enc.manifest),
                                             metrics=res.metrics, train_seconds=res.seconds)
        if enc.manifest.total_bytes <= self.cfg.inline_max_bytes:
            return header, enc  # its pieces are copied once, into the message that carries them

        try:
            self._unacked = task
            self._weights_calls[1](update_messages(header, enc), timeout=self.cfg.rpc_timeout)
            self._submitted(task)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
                raise
            self._unacked = None
            log.warning("round %d: update not taken (%s)", task.round, e.details())
        return None
