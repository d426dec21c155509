"""The tasks the aggregator gives agents: TRAIN (a round's, with its base version inline when
small), MOMENTS (round 0's secure aggregation), STOP (once per agent and run), or WAIT; an agent
in several runs gets their tasks in turn.

A part of :class:`aggregator_service.coordinator.Coordinator`: it reads the shared state and
the agent registry, and changes nothing but an agent's STOP given."""

from __future__ import annotations

import time
from typing import Any

from aggregator_service.agents import AgentRegistry
from aggregator_service.records import ACTIVE, AgentRecord, Shared
from fedrl.wire.codec import INLINE_MAX_BYTES


class Tasks:
    def __init__(self, shared: Shared, registry: AgentRegistry, max_task_wait: float) -> None:
        self.s, self.registry, self.max_task_wait = shared, registry, max_task_wait

    def next_task(self, agent_id: str, wait: float, probe: bool = False, run_id: str = "",
                  busy: frozenset[str] = frozenset()) -> dict[str, Any]:
        """A task for the agent: TRAIN, MOMENTS, STOP, or WAIT after at most ``wait`` seconds.

        An agent in several runs takes their tasks in turn: of the runs whose round waits for
        it, the one whose round opened first (none of ``busy``: the runs it trains in other
        threads). A run's STOP is given once per agent, before any other task; a ``probe`` (a
        training agent asking whether its task of ``run_id`` stands) is told STOP without using
        it up, so the call after it gets STOP too."""
        end = time.monotonic() + max(0.0, min(wait, self.max_task_wait))
        with self.s.cond:
            while True:
                a = self.registry.agent(agent_id)
                task = self._task(a, probe, run_id, busy)
                if task is not None:
                    return task
                left = end - time.monotonic()
                if left <= 0 or self.s.closed:
                    return {"kind": "WAIT"}
                self.s.cond.wait(left)

    def declined(self, agent_id: str, run_id: str, round_: int) -> None:
        """``agent_id`` answered its task of ``run_id``'s round ``round_`` without taking part
        (a Session's done: it sits the round out): the round is not offered to it again, and the
        other runs' tasks come meanwhile."""
        with self.s.cond:
            a, run = self.registry.agents.get(agent_id), self.s.runs.get(run_id)
            if a is None or run is None or run.machine is None or run.round != round_ or run.machine.took_part(agent_id):
                return
            a.declined = {(r, k) for r, k in a.declined if r in self.s.runs and self.s.runs[r].round == k}
            a.declined.add((run_id, round_))
            self.s.cond.notify_all()

    def _task(self, a: AgentRecord, probe: bool, run_id: str, busy: frozenset[str]) -> dict[str, Any] | None:
        """The agent's task now, or None (it waits). Under the lock."""
        runs = [r for r in self.s.runs.values() if a.agent_id in r.selected and r.run_id not in busy
                and (not probe or not run_id or r.run_id == run_id)]
        for run in runs:
            if run.state not in ACTIVE and run.run_id not in a.stops_sent:
                if not probe:
                    a.stops_sent.add(run.run_id)
                return {"kind": "STOP", "run_id": run.run_id}
        waiting = [r for r in runs if r.state == "running" and r.machine is not None
                   and r.machine.phase in ("gather", "open") and not r.machine.took_part(a.agent_id)
                   and (r.run_id, r.round) not in a.declined]
        if not waiting:
            return None
        run = min(waiting, key=lambda r: r.round_opened)
        if run.machine.phase == "gather":  # round 0: the moments' secure aggregation
            return {"kind": "MOMENTS", "run_id": run.run_id, "round": 0,
                    "run_config_json": run.config_json, "deadline_unix": run.deadline}
        mean, std = run.norms[a.agent_id]
        task = {"kind": "TRAIN", "run_id": run.run_id, "round": run.round,
                "base_version": run.version, "local_steps": run.cfg.local_steps,
                "run_config_json": run.config_json, "obs_mean": mean, "obs_std": std,
                "deadline_unix": run.deadline, "dp_clip": run.machine.clip}
        enc = run.encoded[run.version]
        if enc.manifest.total_bytes <= INLINE_MAX_BYTES:
            task["base"] = enc  # sent inline: one RPC less per agent per round
        return task
