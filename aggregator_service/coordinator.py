"""The aggregator's round state machine, free of gRPC message types.

States of a run: ``waiting_for_agents`` -> ``running`` -> ``finished`` (or ``stopped`` /
``failed``). A round opens with the current global version; every selected agent fetches it,
trains and submits; the round closes when all selected agents have submitted, or at its
deadline if at least ``min_agents`` have. The new global version is written to the store
*before* it is announced; if it cannot be written the round stays open and the run reports why.
"""

from __future__ import annotations

import logging
import threading

from aggregator_service.agents import AgentRegistry
from aggregator_service.lifecycle import RunLifecycle
from aggregator_service.records import AGENT_TTL, MAX_AGENTS, AgentRecord, Run
from aggregator_service.rounds import Rounds
from aggregator_service.store import Store
from fedrl.ops.metrics import AggregatorMetrics
from fedrl.wire.memory import BufferPool

log = logging.getLogger("fedrl.aggregator")


class Coordinator(AgentRegistry, RunLifecycle, Rounds):
    """Thread-safe: every public method takes the one lock; waiters use its condition."""

    def __init__(self, store: Store, max_task_wait: float = 30.0, tick: float = 0.1,
                 eval_grace: float = 120.0, metrics: AggregatorMetrics | None = None,
                 resume: bool = False, max_agents: int = MAX_AGENTS, agent_ttl: float = AGENT_TTL) -> None:
        self.store, self.eval_grace = store, eval_grace
        self.evaluators = 0  # evaluators following the runs now (their watch streams)
        self.evaluator_seen = 0.0  # when an evaluator's watch last opened or closed
        self.max_agents, self.agent_ttl = max_agents, agent_ttl
        self._digests: dict[tuple[str, int, int], str] = {}  # stored versions' sha256, by file state
        self.metrics = metrics or AggregatorMetrics()
        self.metrics.bind(self.gauges)
        self.max_task_wait = max_task_wait
        self.cond = threading.Condition()
        self.agents: dict[str, AgentRecord] = {}
        self.run: Run | None = None
        self._closed = False
        # Where received updates are assembled: each agent's buffer is written again the next
        # round instead of being faulted in afresh. Kept only while a run is active (the ticker
        # sets how many), one per agent of the run.
        self.buffers = BufferPool()
        # Where each round's average is written: the buffer of a version no longer held (neither
        # current, nor the one before, which late agents may still fetch, nor cached for
        # FetchGlobal) serves the next, instead of 30 MB of fresh pages faulted in at the close,
        # where every agent waits. Kept only while a run is active (the ticker sets it).
        self.averages = BufferPool()
        if resume:
            self._resume()
        self._ticker = threading.Thread(target=self._tick_loop, args=(tick,), daemon=True,
                                        name="aggregator-ticker")
        self._ticker.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self.cond:
            self._closed = True
            self.cond.notify_all()
        self._ticker.join(timeout=2)

