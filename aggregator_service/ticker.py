"""The aggregator's clock: a thread that, every tick, does what time does to each active run
(a join timeout, a round's deadline with its quorum, secure aggregation's step deadlines, a run
whose every agent sent NaN and left) and keeps or frees the runs' memory. Nothing it runs can end
it: an exception in a run's step fails that run, one in the memory's upkeep is logged, and the
clock goes on.

A part of :class:`aggregator_service.coordinator.Coordinator`: it uses the agent registry, the
journal, the rounds and the submissions (given at construction) and the shared state."""

from __future__ import annotations

import logging
import time

from aggregator_service.agents import AgentRegistry
from aggregator_service.journal import Journal
from aggregator_service.records import ACTIVE, AVERAGES_KEPT, Run, Shared, task_of
from aggregator_service.rounds import Rounds
from aggregator_service.submissions import Submissions
from fedrl.federation.privacy import warm_epsilon
from fedrl.wire.memory import release_free_memory

log = logging.getLogger("fedrl.aggregator")


class Ticker:
    def __init__(self, shared: Shared, registry: AgentRegistry, journal: Journal, rounds: Rounds,
                 submissions: Submissions) -> None:
        self.s, self.registry, self.journal, self.rounds, self.submissions = shared, registry, journal, rounds, submissions
        self.ticks = 0  # ticks done so far (how a test knows that time has acted, however loaded the machine)
        self._cold: set[str] = set()  # runs whose accountant values could not be computed ahead

    def tick_loop(self, tick: float) -> None:
        was_active = False
        while True:
            with self.s.cond:
                active = self.s.active()
            try:
                self._keep_memory(active, was_active)
            except Exception:  # noqa: BLE001 - memory kept or freed later; the clock goes on
                log.exception("the aggregator's clock: keeping or freeing the runs' memory raised")
            was_active = bool(active)
            with self.s.cond:
                if self.s.closed:
                    return
                self.s.cond.wait(tick)
                now = time.time()
                for run in self.s.runs.values():
                    if run.state not in ACTIVE and run.encoded:
                        with self.rounds.failing(run, "dropping an ended run's versions"):
                            run.versions_dropped()
                for run in self.s.active():
                    with self.rounds.failing(run, "the aggregator's clock"):  # the clock goes on for the others
                        self._tick(run, now)
                self.ticks += 1

    def _keep_memory(self, active: list[Run], was_active: bool) -> None:
        """Outside the lock, as either can take tens of ms after 30 MB rounds. While runs are
        active their memory is kept for their next rounds: a buffer per agent of each, and the
        heap (malloc arenas are few, see aggregator_service.__main__, so it does not climb). Once
        none is, both go back to the OS. And the accountant's values each private run's next
        close will ask for, computed here beforehand: a run whose values cannot be computed is
        left to its close, which fails it, naming why (under :meth:`Rounds.failing`)."""
        self.rounds.buffers.keep = sum(r.cfg.agents for r in active)
        self.rounds.averages.keep = AVERAGES_KEPT * len(active)
        for run in active:
            if run.cfg.dp_clip and run.run_id not in self._cold:
                try:
                    warm_epsilon(run.cfg, max(run.round, 1))
                except Exception:  # noqa: BLE001 - said once; the close meets it again and fails the run
                    self._cold.add(run.run_id)
                    log.exception("run %s: the accountant's values for its next close could not be computed",
                                  run.run_id)
        if was_active and not active:
            release_free_memory()

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
                            f"within {run.cfg.join_timeout:g}s{split}")
            self.s.cond.notify_all()
        elif run.state == "running" and run.non_finite:
            self.submissions.check_non_finite(run, now)
        m = run.machine
        if run.state != "running" or m is None:
            return
        if m.secure is not None:  # its steps have their own deadlines
            sec = m.secure
            with self.rounds.failing(run, f"round {run.round}'s secure aggregation"):
                self.rounds.secure_moved(run, sec, m.advance(now))
        elif msg := m.overdue(now):
            if run.says(msg):
                log.warning(msg)
        elif m.closable(now):
            self.rounds.close_round(run)
            self.s.cond.notify_all()
