"""The tasks the aggregator gives agents: TRAIN (a round's, with its base version inline when
small), MOMENTS (round 0's secure aggregation), STOP (once per agent and run), or WAIT.

A part of :class:`aggregator_service.coordinator.Coordinator`: it reads the shared state and
the agent registry, and changes nothing but an agent's STOP given."""

from __future__ import annotations

import time
from typing import Any

from aggregator_service.agents import AgentRegistry
from aggregator_service.records import ACTIVE, Shared
from fedrl.wire.codec import INLINE_MAX_BYTES


class Tasks:
    def __init__(self, shared: Shared, registry: AgentRegistry, max_task_wait: float) -> None:
        self.s, self.registry, self.max_task_wait = shared, registry, max_task_wait

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
