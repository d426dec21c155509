"""A run's rounds: tasks, global versions served, updates checked and taken, a round opened
and closed (FedAvg, or secure aggregation's sum; the version written before it is announced),
round 0's observation moments in a secure run, and the deadline tick.

A part of :class:`aggregator_service.coordinator.Coordinator`: it uses the agent registry and the
journal (given at construction) and the shared state; the lifecycle uses it, never the reverse.
Its methods whose names start with an underscore run with the lock held."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import grpc
import numpy as np
import torch

from aggregator_service.agents import AgentRegistry
from aggregator_service.journal import Journal
from aggregator_service.records import (
    ACTIVE,
    AVERAGE_POOL_MIN_BYTES,
    AVERAGES_KEPT,
    Run,
    Shared,
    encode_version,
    task_of,
)
from aggregator_service.start import RunStart
from aggregator_service.store import Store
from fedrl.federation.aggregate import AggregationError
from fedrl.federation.machine import Closed, Failed, Finished, Gather, Gathered, Open, Refused, Stopped, Update
from fedrl.federation.privacy import PRIVACY_EPSILON, noise_generator, warm_epsilon
from fedrl.federation.secure_steps import Message, SecureSteps
from fedrl.ops.metrics import AggregatorMetrics
from fedrl.wire.codec import (
    INLINE_MAX_BYTES,
    Flat,
    Manifest,
    check_manifest_matches,
)
from fedrl.wire.memory import BufferPool, release_free_memory
from fedrl.wire.rpc import ServiceError

log = logging.getLogger("fedrl.aggregator")

# The status of an update the round does not take, by the machine's reason (others: FAILED_PRECONDITION)
REFUSED_STATUS = {"not_selected": grpc.StatusCode.PERMISSION_DENIED, "duplicate": grpc.StatusCode.ALREADY_EXISTS,
                  "secagg_bad": grpc.StatusCode.INVALID_ARGUMENT}

class Rounds:
    def __init__(self, shared: Shared, registry: AgentRegistry, journal: Journal, start: RunStart, store: Store,
                 metrics: AggregatorMetrics, max_task_wait: float) -> None:
        self.s, self.registry, self.journal, self.store, self.metrics = shared, registry, journal, store, metrics
        self.start = start
        self.max_task_wait = max_task_wait
        # Where received updates are assembled: each agent's buffer is written again the next
        # round instead of being faulted in afresh. Kept only while a run is active (the ticker
        # sets how many), one per agent of the run.
        self.buffers = BufferPool()
        # Where each round's average is written: the buffer of a version no longer held (neither
        # current, nor the one before, which late agents may still fetch, nor cached for
        # FetchGlobal) serves the next, instead of 30 MB of fresh pages faulted in at the close,
        # where every agent waits. Kept only while a run is active (the ticker sets it).
        self.averages = BufferPool()
        self._noise = None  # differential privacy's generator, made on first use

    def next_task(self, agent_id: str, wait: float, probe: bool = False) -> dict[str, Any]:
        """A task for the agent: TRAIN, STOP, or WAIT after at most ``wait`` seconds. A run's STOP
        is given once per agent, to its task call; a ``probe`` (a training agent asking whether its
        task stands) is told STOP without using it up, so the call after it gets STOP too."""
        end = time.monotonic() + max(0.0, min(wait, self.max_task_wait))
        with self.s.cond:
            while True:
                a = self.registry.agent(agent_id)
                run = self.s.run
                if run is not None and agent_id in run.selected:
                    m = run.machine
                    if run.state != "running" or m is None or m.took_part(agent_id):
                        pass
                    elif m.phase == "gather":  # round 0: the moments' secure aggregation
                        return {"kind": "MOMENTS", "run_id": run.run_id, "round": 0,
                                "run_config_json": run.config_json, "deadline_unix": run.deadline}
                    elif m.phase == "open":
                        mean, std = run.norms[agent_id]
                        task = {"kind": "TRAIN", "run_id": run.run_id, "round": run.round,
                                "base_version": run.version, "local_steps": run.cfg.local_steps,
                                "run_config_json": run.config_json, "obs_mean": mean, "obs_std": std,
                                "deadline_unix": run.deadline, "dp_clip": run.machine.clip}
                        enc = run.encoded[run.version]
                        if enc.manifest.total_bytes <= INLINE_MAX_BYTES:
                            task["base"] = enc  # sent inline: one RPC less per agent per round
                        return task
                    if run.state not in ACTIVE and a.stop_sent_for != run.run_id:
                        if not probe:
                            a.stop_sent_for = run.run_id
                        return {"kind": "STOP", "run_id": run.run_id}
                left = end - time.monotonic()
                if left <= 0 or self.s.closed:
                    return {"kind": "WAIT"}
                self.s.cond.wait(left)

    def check_header(self, agent_id: str, m: Manifest) -> None:
        """Refuse an update before its chunks are read (unknown agent, wrong run/round, duplicate,
        tensors or a declared size the global model cannot have: a CodecError, which the servicer
        maps to its status like any other verification failure)."""
        with self.s.cond:
            self._check_tensors(self._check_submission(agent_id, m), m)

    @staticmethod
    def _check_tensors(run: Run, m: Manifest) -> None:
        """``m`` lists exactly the global model's tensors: compared as the specs of the global
        version's own manifest (one tuple comparison), and only when they differ tensor by
        tensor, to name the difference."""
        if m.tensors != run.encoded[run.version].manifest.tensors:
            check_manifest_matches(m, run.global_state)

    def _check_submission(self, agent_id: str, m: Manifest) -> Run:
        self.registry.agent(agent_id)
        run = self.s.run
        if run is None or run.run_id != m.run_id:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"update for run {m.run_id!r}, but the active run is "
                               f"{run.run_id if run else 'none'!r}", "wrong_run")
        if agent_id not in run.selected:
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                               f"agent {agent_id!r} is not a participant of run {run.run_id}", "not_selected")
        if run.state != "running":
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"run {run.run_id} is {run.state}; no round is open", "closed_round")
        try:
            run.machine.check(agent_id, m.round, m.base_version)
        except Refused as e:
            raise ServiceError(REFUSED_STATUS.get(e.reason, grpc.StatusCode.FAILED_PRECONDITION),
                               f"run {run.run_id}: {e}", e.reason) from None
        return run

    def update_refused(self, agent_id: str, reason: str, detail: str) -> None:
        """An update of ``agent_id`` was refused (``reason``: the codec's). Non-finite values from
        every selected agent in one round mean the settings cannot train: the run fails, saying so,
        instead of waiting for agents that give up on it (see :meth:`_check_non_finite`)."""
        if reason != "non_finite":
            return
        with self.s.cond:
            run = self.s.run
            if run is None or run.state != "running" or agent_id not in run.selected:
                return
            run.non_finite[agent_id] = (detail, time.time())
            self._check_non_finite(run, time.time())

    def _check_non_finite(self, run: Run, now: float) -> None:
        """Fails ``run`` once every selected agent's update of the round was refused as non-finite
        and no update was taken, and each of those agents has been silent since (not connected, not
        seen after its refusal): an agent that trains to NaN gives up. The silence is what makes the
        refusals the agents' own. Without tokens anyone can send an update under an agent's id; the
        agent, still alive, keeps calling, and its round goes on. Under the lock."""
        if not run.non_finite or run.submissions or not set(run.non_finite) >= set(run.selected):
            return
        for agent_id, (_, at) in run.non_finite.items():
            a = self.registry.agents.get(agent_id)
            if a is not None and (a.last_seen > at or self.registry.connected(a, now)):
                return
        detail = next(iter(run.non_finite.values()))[0]
        self.journal.fail(run, f"round {run.round}: every agent's update had NaN or Inf values ({detail}), and "
                        "every agent has gone; these settings cannot train")
        self.s.cond.notify_all()

    def submit(self, agent_id: str, m: Manifest, state: dict[str, torch.Tensor],
               metrics: Mapping[str, float], seconds: float, flat: Flat | None = None) -> int:
        """Accept a verified update (``state`` decoded from a payload checked against ``m``,
        and ``flat``, its decoder's flat tensor, where it had one); closes the round when it
        completes. Returns the round."""
        with self.s.cond:
            run = self._check_submission(agent_id, m)
            self._check_tensors(run, m)
            clean = {k: float(v) for k, v in metrics.items() if np.isfinite(v)}
            run.machine.take(agent_id, m.round, m.base_version, Update(state, m.num_samples, clean, seconds, flat))
            rec = self.registry.agents[agent_id]
            same_run = rec.last_accepted is not None and rec.last_accepted[0] == run.run_id
            rec.rounds_submitted = (rec.rounds_submitted if same_run else 0) + 1  # counted per run
            rec.last_accepted = (run.run_id, run.round)
            self.metrics.accepted.inc()
            r = run.round
            if run.machine.complete:
                self._close_round(run)
                self.s.cond.notify_all()  # only a closed round changes what waiters look for
            return r

    def maybe_begin(self) -> None:
        """A waiting run begins once enough agents of one task are connected (the start's job);
        its round 1 opens here once version 0 is made."""
        run = self.s.run
        if run is None:
            return
        with self._failing(run, "the run's start"):
            if self.start.maybe_begin() and run.state == "running":
                self.follow(run, run.machine.begin(time.time()))

    @contextmanager
    def _failing(self, run: Run, what: str) -> Iterator[None]:
        """Supervises a step of ``run`` that the lock holder takes (a close, a secure step, the
        start): any exception fails that run, naming ``what`` and the cause, and goes no further,
        so neither the ticker nor the agent whose message closed the step is hurt by it. Nothing
        is stored after it. Under the lock."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - whatever it is, this run cannot go on; the service can
            log.exception("run %s: %s raised", run.run_id, what)
            if run.state in ACTIVE:
                self.journal.fail(run, f"{what} failed: {type(e).__name__}: {e}")
            self.s.cond.notify_all()

    def _average_memory(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor for a round's average: in a buffer from :attr:`averages` from
        AVERAGE_POOL_MIN_BYTES up; below, malloc's (a small block comes from memory malloc
        already holds, and the pool's bookkeeping would cost more than it saves)."""
        nbytes = numel * dtype.itemsize
        if nbytes < AVERAGE_POOL_MIN_BYTES:
            return torch.empty(numel, dtype=dtype)
        return torch.frombuffer(self.averages.take(nbytes), dtype=dtype)

    def follow(self, run: Run, action: Open | Gather | Finished | Stopped) -> None:
        """Do what the rounds say comes next: open a round (or round 0), or end the run."""
        if isinstance(action, Gather):
            run.round_opened = time.time()
        elif isinstance(action, Finished):
            run.state, run.ended = "finished", time.time()
            self.journal.event(run, "RUN_FINISHED")
        elif isinstance(action, Stopped):
            run.state, run.ended, run.message = "stopped", time.time(), action.message
            self.journal.event(run, "RUN_STOPPED", message=run.message)
        else:
            self._opened(run)

    def _opened(self, run: Run) -> None:
        """The round the machine opened: its event."""
        run.non_finite = {}
        run.round_opened = time.time()
        self.journal.event(run, "ROUND_OPENED", agents=list(run.selected))

    def _close_round(self, run: Run) -> None:
        with self._failing(run, f"round {run.round}'s close"):
            try:
                closed = run.machine.close(self._dp_noise() if run.cfg.dp_noise else None, self._average_memory)
            except (AggregationError, ValueError) as e:
                self.journal.fail(run, f"aggregation failed in round {run.round}: {e}")
                return
            self._commit_round(run, closed)

    def _secure_moved(self, run: Run, sec: SecureSteps, action: Closed | Gathered | Failed | None) -> None:
        """What the machine's secure aggregation gave (``sec``'s notes logged): a failed run, version
        0 from round 0's moments, or the round's new version. Under the lock."""
        for note in sec.notes:
            log.warning("run %s: %s", run.run_id, note)
        sec.notes.clear()
        if isinstance(action, Failed):
            self.journal.fail(run, action.message)
        elif isinstance(action, Gathered):
            log.info("run %s: observation moments of %d agents pooled by secure aggregation", run.run_id,
                     len(action.agents))
            state = self.start.version_zero(run, action.mean, action.std, {})
            if state is not None:
                self.follow(run, run.machine.found(state, time.time()))
        elif isinstance(action, Closed):
            self._commit_round(run, action)
        self.s.cond.notify_all()

    def _commit_round(self, run: Run, closed: Closed) -> None:
        """Write the round's new version, journal it and announce it, then follow the rounds on;
        a version that cannot be written leaves the round open (its close is retried)."""
        v, order = closed.version, list(closed.agents)
        enc = encode_version(run, v, closed.state)
        seconds = time.time() - run.round_opened
        try:
            # Journal first, then the version: a restart that finds version v also finds whose
            # updates made it (a journal line whose version never got written is dropped then).
            # The line is fsynced (durable) so not even a power cut keeps the version without
            # it. A close retried after a failed write is journaled once.
            if run.closing is None or (run.closing["version"], run.closing["agents"]) != (v, order):
                closing = self.journal.new_event(run, "ROUND_CLOSED", version=v, agents=order,
                                                 metrics=closed.metrics, seconds=seconds)
                self.store.append_event(run.run_id, closing, durable=True)
                run.closing = closing
            self.store.save_version(run.run_id, v, enc.pieces(), enc.manifest.checksum)
        except OSError as e:
            msg = f"cannot persist version {v}; round {run.round} stays open: {e}"
            if run.message != msg:
                log.error(msg)
            run.message = msg
            return
        run.message = ""
        then = run.machine.commit(closed, time.time())
        run.encoded = {k: e for k, e in run.encoded.items() if k >= v - 1}
        run.encoded[v] = enc
        self.metrics.round_closed(seconds)
        self.journal.log_event(run, run.closing)
        run.events.append(run.closing)  # announced only now that the version is on disk
        run.closing = None
        if run.cfg.dp_clip:
            self.metrics.privacy_spent(closed.metrics[PRIVACY_EPSILON], run.machine.clip)
        self.follow(run, then)

    def secure_step(self, agent_id: str, run_id: str, round_: int, step: str, msg: Message,
                    wait: float) -> dict[str, Any] | None:
        """One secure aggregation step of ``agent_id`` (``msg``: its message for ``step``): what
        the step gives it once closed, or None (pending) after at most ``wait`` seconds."""
        end = time.monotonic() + max(0.0, min(wait, self.max_task_wait))
        with self.s.cond:
            self.registry.agent(agent_id)
            run = self.s.run
            if run is None or run.run_id != run_id:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"secure aggregation for run {run_id!r}, but the active run is "
                                   f"{run.run_id if run else 'none'!r}", "wrong_run")
            if run.machine is None or run.state != "running":
                reason = "not_selected" if agent_id not in run.selected else "closed_round"
                raise ServiceError(REFUSED_STATUS.get(reason, grpc.StatusCode.FAILED_PRECONDITION),
                                   f"run {run.run_id} is {run.state}; no round is open" if reason == "closed_round"
                                   else f"agent {agent_id!r} is not a participant of run {run.run_id}", reason)
            sec = run.machine.secure
            try:
                run.machine.take_step(agent_id, round_, step, msg)
            except Refused as e:
                raise ServiceError(REFUSED_STATUS.get(e.reason, grpc.StatusCode.FAILED_PRECONDITION),
                                   f"run {run.run_id}: {e}", e.reason) from None
            with self._failing(run, f"round {run.round}'s secure aggregation"):
                self._secure_moved(run, sec, run.machine.advance(time.time()))
            while True:
                if run.machine.secure is not sec:  # the round closed: every step of it has
                    return {"done": True} if step == "answer" else None
                out = sec.reply(agent_id, step)
                if out is not None:
                    return out
                left = end - time.monotonic()
                if left <= 0 or self.s.closed or run.state != "running":
                    return None
                self.s.cond.wait(left)

    def _dp_noise(self):
        """The generator of differential privacy's noise, from the OS's secure source, made once."""
        if getattr(self, "_noise", None) is None:
            self._noise = noise_generator()
        return self._noise

    def tick_loop(self, tick: float) -> None:
        was_active = False
        while True:
            run = self.s.run
            active = run is not None and run.state in ACTIVE
            # Outside the lock, as either can take tens of ms after 30 MB rounds. While a run is
            # active its memory is kept for its next rounds: a buffer per agent, and the heap
            # (malloc arenas are few, see aggregator_service.__main__, so it does not climb).
            # Once it ends, both go back to the OS.
            self.buffers.keep = run.cfg.agents if active else 0
            self.averages.keep = AVERAGES_KEPT if active else 0
            if active and run.cfg.dp_clip:  # the accountant's values the open round's close will ask for
                warm_epsilon(run.cfg, max(run.round, 1))
            if was_active and not active:
                release_free_memory()
            was_active = active
            with self.s.cond:
                if self.s.closed:
                    return
                self.s.cond.wait(tick)
                run = self.s.run
                if run is None:
                    continue
                with self._failing(run, "the aggregator's clock"):  # the clock goes on for the next run
                    self._tick(run, time.time())

    def _tick(self, run: Run, now: float) -> None:
        """What the clock does for ``run`` at ``now``: deadlines of joins, rounds and secure steps.
        Under the lock."""
        if run.state == "waiting_for_agents" and now - run.created > run.cfg.join_timeout:
            live = [a for a in self.registry.agents.values() if self.registry.connected(a, now)]
            tasks = {task_of(a) for a in live}
            split = (f" (they hold {len(tasks)} different tasks: "
                     + "; ".join(f"{e or 'no env'} {o}/{d}" for e, o, d in sorted(tasks)) + ")"
                     if len(tasks) > 1 else "")
            self.journal.fail(run, f"only {len(live)} of the {run.cfg.agents} agents the run needs were connected "
                            f"within {run.cfg.join_timeout:.0f}s{split}")
            self.s.cond.notify_all()
        elif run.state == "running" and run.non_finite:
            self._check_non_finite(run, now)
        m = run.machine
        if run.state != "running" or m is None:
            return
        if m.secure is not None:  # its steps have their own deadlines
            sec = m.secure
            with self._failing(run, f"round {run.round}'s secure aggregation"):
                self._secure_moved(run, sec, m.advance(now))
        elif msg := m.overdue(now):
            if run.message != msg:
                log.warning(msg)
                run.message = msg
        elif m.closable(now):
            self._close_round(run)
            self.s.cond.notify_all()

