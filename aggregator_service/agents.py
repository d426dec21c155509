"""The agents an aggregator knows: Join (validated, bounded, forgotten when gone), progress,
liveness, and the evaluators that follow the runs.

A part of :class:`aggregator_service.coordinator.Coordinator`, below the rounds and the
lifecycle: it reads the shared state (:class:`aggregator_service.records.Shared`) and nothing of
theirs. Its methods whose names start with an underscore run with the lock held."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc
import numpy as np

from aggregator_service.records import (
    AGENT_ID,
    EVALUATOR_SEEN_SECONDS,
    RUN_ID,
    AgentRecord,
    Shared,
    check_moments,
    env_mismatch,
    task_of,
)
from fedrl.federation.runconfig import (
    JOIN_LIMITS,
    JOIN_TEXT_LIMITS,
)
from fedrl.wire.rpc import ServiceError

log = logging.getLogger("fedrl.aggregator")

class AgentRegistry:
    def __init__(self, shared: Shared, max_agents: int, agent_ttl: float, max_task_wait: float) -> None:
        self.s, self.max_agents, self.agent_ttl, self.max_task_wait = shared, max_agents, agent_ttl, max_task_wait
        self.agents: dict[str, AgentRecord] = {}
        self.evaluators = 0  # evaluators following the runs now (their watch streams)
        self.evaluator_seen = 0.0  # when an evaluator's watch last opened or closed
        # Called under the lock after each Join is recorded: the coordinator has the rounds see
        # whether a waiting run can begin (the registry knows nothing of rounds).
        self.on_join: Callable[[], None] = lambda: None

    def _check_task(self, rec: AgentRecord) -> None:
        """While runs are active, an agent that none of them can take is refused at Join, naming
        the first one's difference (see :meth:`_check_task_of`); one that any of them can take
        joins."""
        refusals = []
        for run in self.s.active():
            try:
                self._check_task_of(rec, run)
                return
            except ServiceError as e:
                refusals.append(e)
        if refusals:
            raise refusals[0]

    def _check_task_of(self, rec: AgentRecord, run) -> None:
        """Whether ``run`` could take the agent; no single agent decides the task for the others:

        - a run config that names ``env`` is the task: a Join that cannot be evaluated there is
          refused, whoever came first;
        - a running run's task is that of the agents it selected;
        - while a run without ``env`` waits, a Join is refused only when it differs from peers
          that agree among themselves (two or more): a lone first Join fixes nothing, and the run
          begins with the largest group that agrees (:meth:`_maybe_begin`)."""
        now = time.time()
        if run.cfg.env is not None:
            problem = env_mismatch(run.cfg.env, {rec.env_id} if rec.env_id else set(), rec.obs_dim, rec.act_dim)
            if problem:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"agent {rec.agent_id}: another task than run {run.run_id}'s: {problem}", "other_task")
        if run.state == "running":
            peers = [self.agents[a] for a in run.selected if a in self.agents and a != rec.agent_id]
        else:
            peers = [a for a in self.agents.values() if a.agent_id != rec.agent_id and self.connected(a, now)]
            if len({task_of(a) for a in peers}) != 1 or len(peers) < 2:
                return  # no agreeing majority yet: the run's start decides
        env = run.env_id or run.cfg.env or next((a.env_id for a in peers if a.env_id), "")
        dims = next(((a.obs_dim, a.act_dim) for a in peers), None)
        diff = []
        if env and rec.env_id and rec.env_id != env:
            diff.append(f"env {rec.env_id} (the run's: {env})")
        if dims is not None and (rec.obs_dim, rec.act_dim) != dims:
            diff.append(f"obs_dim {rec.obs_dim}, act_dim {rec.act_dim} (the run's: {dims[0]}, {dims[1]})")
        if diff:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"agent {rec.agent_id}: another task than run {run.run_id}'s: {'; '.join(diff)}",
                               "other_task")

    def join(self, rec: AgentRecord) -> str:
        if not AGENT_ID.fullmatch(rec.agent_id or ""):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"agent_id {rec.agent_id[:40]!r}: 1-128 characters of letters, digits and . _ - "
                               "(starting with a letter or digit)")
        if rec.obs_dim <= 0 or rec.act_dim <= 0 or rec.num_samples <= 0:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"agent {rec.agent_id}: obs_dim, act_dim and num_samples must be positive")
        for name, top in JOIN_TEXT_LIMITS.items():
            if len(v := getattr(rec, name)) > top:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"agent {rec.agent_id}: {name} of {len(v)} "
                                   f"characters (at most {top})")
        for name, top in JOIN_LIMITS.items():
            v = getattr(rec, name)
            if not 0 <= v <= top:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"agent {rec.agent_id}: {name} must be in "
                                   f"[0, {top}], got {v}")
        if rec.stats is not None and (len(rec.stats.total) != rec.obs_dim or len(rec.stats.total_sq) != rec.obs_dim
                                      or rec.stats.count <= 0):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"agent {rec.agent_id}: observation moments must have obs_dim={rec.obs_dim} "
                               "entries and a positive count")
        if rec.stats is not None:
            if rec.stats.count != rec.num_samples:  # else a few samples could weigh as a billion in the pool
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"agent {rec.agent_id}: observation moments "
                                   f"over {rec.stats.count} observations, but num_samples is {rec.num_samples}: "
                                   "the moments must be those of the agent's own samples")
            if rec.stats.count > JOIN_LIMITS["num_samples"]:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"agent {rec.agent_id}: observation count must "
                                   f"be at most {JOIN_LIMITS['num_samples']}, got {rec.stats.count}")
            check_moments(rec)
            with np.errstate(all="ignore"):
                derived = rec.stats.mean_std()
            if not all(np.isfinite(x).all() for x in (rec.stats.total, rec.stats.total_sq, *derived)):
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"agent {rec.agent_id}: observation moments (sums, sums of squares, and the mean "
                                   "and std they give) must be finite")
        with self.s.cond:
            old = self.agents.get(rec.agent_id)
            self._check_task(rec)
            mine = self.s.of_agent(rec.agent_id)
            if old is not None and any(r.state == "running" for r in mine):
                if (old.obs_dim, old.act_dim) != (rec.obs_dim, rec.act_dim):
                    raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                       f"agent {rec.agent_id} rejoined with different dimensions")
            for r in mine:  # its updates must count what its runs selected it with (RoundMachine.check)
                if r.state == "running" and r.machine is not None:
                    joined = r.machine.plan.joined(rec.agent_id)
                    if joined is not None and rec.num_samples != joined:
                        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                           f"agent {rec.agent_id} rejoined with {rec.num_samples} samples; run "
                                           f"{r.run_id} selected it with {joined}, which its updates must count")
            if old is not None:  # its counts and the STOPs it was given go on
                rec.accepted, rec.stops_sent = old.accepted, old.stops_sent
            else:  # first join since a restart: what the runs' stored closes say it gave
                rec.accepted = {r.run_id: r.accepted_before[rec.agent_id] for r in mine
                                if rec.agent_id in r.accepted_before}
            rec.last_seen = now = time.time()
            self._expire(now)
            if old is None and len(self.agents) >= self.max_agents:
                self._expire(now, make_room=True)
                if len(self.agents) >= self.max_agents:
                    raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       f"agent {rec.agent_id}: this aggregator holds {len(self.agents)} agents, "
                                       f"all connected or in the run (--max-agents {self.max_agents})",
                                       "too_many_agents")
            self.agents[rec.agent_id] = rec
            log.info("agent %s joined (index %d, %d samples)", rec.agent_id, rec.index, rec.num_samples,
                     extra={"event": {"kind": "AGENT_JOINED", "agent_id": rec.agent_id, "agent_index": rec.index,
                                      "num_samples": rec.num_samples}})
            self.on_join()
            self.s.cond.notify_all()
            mine = self.s.of_agent(rec.agent_id) or self.s.active()
            return mine[-1].run_id if mine else ""

    def _in_run(self, agent_id: str) -> bool:
        return bool(self.s.of_agent(agent_id))

    def _expire(self, now: float, make_room: bool = False) -> None:
        """Drop the records of agents gone: not seen for ``agent_ttl`` (or, with ``make_room``,
        not connected now), and not selected in an active run. Under the lock."""
        gone = [a for a in self.agents.values() if not self._in_run(a.agent_id)
                and (now - a.last_seen > self.agent_ttl or (make_room and not self.connected(a, now)))]
        for a in sorted(gone, key=lambda a: a.last_seen):
            del self.agents[a.agent_id]
            log.info("agent %s forgotten (last seen %.0fs ago)", a.agent_id, now - a.last_seen,
                     extra={"event": {"kind": "AGENT_FORGOTTEN", "agent_id": a.agent_id}})

    def forget_run(self, run_id: str) -> None:
        """``run_id`` is no longer held: the agents' records of it go (their counts, its STOP,
        its rounds sat out). Under the lock."""
        for a in self.agents.values():
            a.accepted.pop(run_id, None)
            a.stops_sent.discard(run_id)
            a.declined = {x for x in a.declined if x[0] != run_id}

    def last_accepted_round(self, agent_id: str, run_id: str) -> int:
        """The last round of ``run_id`` whose update from ``agent_id`` was accepted, 0 if none.
        A restarted aggregator knows those of the rounds whose close it stored (events)."""
        with self.s.cond:
            a = self.agents.get(agent_id)
            return a.accepted.get(run_id, (0, 0))[1] if a is not None else 0

    def accepted_rounds(self, agent_id: str) -> dict[str, int]:
        """Of every active run ``agent_id`` takes part in, the last round whose update from it
        was accepted (0: none)."""
        with self.s.cond:
            a = self.agents.get(agent_id)
            return {r.run_id: a.accepted.get(r.run_id, (0, 0))[1] if a is not None else 0
                    for r in self.s.of_agent(agent_id)}

    def agent(self, agent_id: str) -> AgentRecord:
        a = self.agents.get(agent_id)
        if a is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"unknown agent {agent_id[:80]!r}: call Join first",
                               "unknown_agent")
        a.last_seen = time.time()
        return a

    def progress(self, agent_id: str, round_: int, done: int, total: int, run_id: str = "") -> None:
        """An agent's local steps on a round of ``run_id`` it trains (a Session's progress
        message; no run: the newest it takes part in): keeps it connected while it trains, and
        shows in the status."""
        if not (0 <= done <= total <= 10**12):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"progress {done}/{total}: expected 0 <= steps_done <= steps_total", "bad_progress")
        if run_id and not RUN_ID.fullmatch(run_id):  # kept with the agent's record: no megabytes of it
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"progress for run {run_id[:40]!r}: not a run id", "bad_progress")
        with self.s.cond:
            a = self.agent(agent_id)
            if not run_id:
                mine = self.s.of_agent(agent_id)
                run_id = mine[-1].run_id if mine else ""
            a.progress = (run_id, round_, done, total)

    def connected(self, a: AgentRecord, now: float) -> bool:
        return now - a.last_seen < 2 * self.max_task_wait + 5

    @staticmethod
    def rounds_in(a: AgentRecord, run) -> int:
        """Rounds of ``run`` whose update from ``a`` was taken."""
        return a.accepted.get(run.run_id, (0, 0))[0] if run is not None else 0

    @staticmethod
    def progress_of(a: AgentRecord, run) -> dict[str, int]:
        pr_run, pr_round, done, total = a.progress
        if run is None or pr_run != run.run_id or pr_round != run.round or run.state != "running":
            return {"steps_done": 0, "steps_total": 0}
        return {"steps_done": done, "steps_total": total}

    def evaluator_attached(self, delta: int) -> None:
        """An evaluator's watch stream opened (+1) or closed (-1); either way it was just seen."""
        with self.s.cond:
            self.evaluators += delta
            self.evaluator_seen = time.time()
            self.s.cond.notify_all()

    def evaluators_following(self) -> int:
        """Evaluators following the runs: streams open now, or 1 for an evaluator seen within
        ``EVALUATOR_SEEN_SECONDS`` (one waiting for a run asks again at least that often)."""
        if self.evaluators > 0:
            return self.evaluators
        return int(time.time() - self.evaluator_seen < EVALUATOR_SEEN_SECONDS)

