"""A run's rounds as the aggregator keeps them: the run's start begun, each round the machine
opens announced, a round closed (FedAvg by the machine, or its secure aggregation's sum) and its
version written before it is announced and committed, version 0 from round 0's gathered moments,
and a failing step failing its run alone.

A part of :class:`aggregator_service.coordinator.Coordinator`: it uses the agent registry, the
journal and the run's start (given at construction) and the shared state; the submissions, the
ticker and the lifecycle use it, never the reverse. Its methods whose names start with an
underscore run with the lock held, and so do ``close_round``, ``secure_moved`` and ``failing``."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from aggregator_service.agents import AgentRegistry
from aggregator_service.journal import Journal
from aggregator_service.records import ACTIVE, AVERAGE_POOL_MIN_BYTES, Run, Shared, encode_version
from aggregator_service.start import RunStart
from aggregator_service.store import Store
from fedrl.federation.aggregate import AggregationError
from fedrl.federation.machine import Closed, Failed, Finished, Gather, Gathered, Open, Stopped
from fedrl.federation.privacy import PRIVACY_EPSILON, noise_generator
from fedrl.federation.secure_steps import SecureSteps
from fedrl.ops.metrics import AggregatorMetrics
from fedrl.wire.memory import BufferPool

log = logging.getLogger("fedrl.aggregator")


class Rounds:
    def __init__(self, shared: Shared, registry: AgentRegistry, journal: Journal, start: RunStart, store: Store,
                 metrics: AggregatorMetrics) -> None:
        self.s, self.registry, self.journal, self.store, self.metrics = shared, registry, journal, store, metrics
        self.start = start
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

    def maybe_begin(self) -> None:
        """Each waiting run begins once enough agents of one task are connected (the start's
        job), oldest first; its round 1 opens here once version 0 is made."""
        for run in self.s.active():
            if run.state != "waiting_for_agents":
                continue
            with self.failing(run, "the run's start"):
                if self.start.maybe_begin(run) and run.state == "running":
                    self.follow(run, run.machine.begin(time.time()))

    @contextmanager
    def failing(self, run: Run, what: str) -> Iterator[None]:
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
            run.opened()
        elif isinstance(action, Finished):
            run.end("finished")
            self.journal.event(run, "RUN_FINISHED")
        elif isinstance(action, Stopped):
            run.end("stopped", action.message)
            self.journal.event(run, "RUN_STOPPED", message=run.message)
        else:
            self._opened(run)

    def _opened(self, run: Run) -> None:
        """The round the machine opened: its event."""
        run.opened()
        self.journal.event(run, "ROUND_OPENED", agents=list(run.selected))

    def close_round(self, run: Run) -> None:
        with self.failing(run, f"round {run.round}'s close"):
            try:
                closed = run.machine.close(self._dp_noise() if run.cfg.dp_noise else None, self._average_memory)
            except (AggregationError, ValueError) as e:
                self.journal.fail(run, f"aggregation failed in round {run.round}: {e}")
                return
            self._commit_round(run, closed)

    def secure_moved(self, run: Run, sec: SecureSteps, action: Closed | Gathered | Failed | None) -> None:
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
                run.closing_journaled(closing)
            self.store.save_version(run.run_id, v, enc.pieces(), enc.manifest.checksum)
        except OSError as e:
            msg = f"cannot persist version {v}; round {run.round} stays open: {e}"
            if run.says(msg):
                log.error(msg)
            return
        if run.machine.plan.secure:  # no update came in the clear: the agents' rounds count once summed
            for a in order:
                rec = self.registry.agents.get(a)
                if rec is not None:
                    rec.accepted[run.run_id] = (rec.accepted.get(run.run_id, (0, 0))[0] + 1, closed.round)
        then = run.machine.commit(closed, time.time())
        closing = run.closing
        run.written(v, enc)
        self.metrics.round_closed(run.run_id, seconds)
        self.journal.log_event(run, closing)
        run.events.append(closing)  # announced only now that the version is on disk
        if run.cfg.dp_clip:
            self.metrics.privacy_spent(run.run_id, closed.metrics[PRIVACY_EPSILON], run.machine.clip)
        self.follow(run, then)

    def _dp_noise(self):
        """The generator of differential privacy's noise, from the OS's secure source, made once."""
        if getattr(self, "_noise", None) is None:
            self._noise = noise_generator()
        return self._noise

