"""The aggregator, free of gRPC message types: a coordinator that owns the lock and holds its
parts, each with one job and each given what it uses, so that every dependency is one way:

    records (Run, AgentRecord, Shared) <- journal <- agents <- start <- rounds <- submissions <- ticker
                                                             tasks <- agents;  lifecycle <- rounds

It holds several runs at once (at most ``max_runs`` active), each with its own round machine,
config, versions and deadlines; an agent may take part in several, and takes their tasks in turn.
States of a run: ``waiting_for_agents`` -> ``running`` -> ``finished`` (or ``stopped`` /
``failed``). A round opens with the current global version; every selected agent fetches it,
trains and submits; the round closes when all selected agents have submitted, or at its
deadline if at least ``min_agents`` have. The new global version is written to the store
*before* it is announced; if it cannot be written the round stays open and the run reports why.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from aggregator_service.agents import AgentRegistry
from aggregator_service.journal import Journal
from aggregator_service.lifecycle import RunLifecycle
from aggregator_service.records import AGENT_TTL, MAX_AGENTS, MAX_RUNS, AgentRecord, Run, Shared
from aggregator_service.rounds import Rounds
from aggregator_service.start import RunStart
from aggregator_service.store import Store
from aggregator_service.submissions import Submissions
from aggregator_service.tasks import Tasks
from aggregator_service.ticker import Ticker
from aggregator_service.versions import Versions
from fedrl.ops.metrics import AggregatorMetrics
from fedrl.wire.codec import Flat, Manifest
from fedrl.wire.memory import BufferPool


class Coordinator:
    """Makes the parts and wires them; the servicers call the parts themselves (``registry``,
    ``tasks``, ``submissions``, ``versions``, ``lifecycle``). Its own few methods are the in-process
    calls scripts and tests use. Thread-safe: every public method takes the one lock; waiters use
    its condition."""

    def __init__(self, store: Store, max_task_wait: float = 30.0, tick: float = 0.1,
                 eval_grace: float = 120.0, metrics: AggregatorMetrics | None = None,
                 resume: bool = False, max_agents: int = MAX_AGENTS, agent_ttl: float = AGENT_TTL,
                 max_runs: int = MAX_RUNS) -> None:
        self.store, self.max_task_wait = store, max_task_wait
        self.metrics = metrics or AggregatorMetrics()
        self.shared = Shared()
        self.journal = Journal(store)
        self.registry = AgentRegistry(self.shared, max_agents, agent_ttl, max_task_wait)
        self.shared.on_forget = self._forget
        self.start = RunStart(self.shared, self.registry, self.journal, store)
        self.versions = Versions(self.shared, store)
        self.rounds = Rounds(self.shared, self.registry, self.journal, self.start, store, self.metrics)
        self.tasks = Tasks(self.shared, self.registry, max_task_wait)
        self.submissions = Submissions(self.shared, self.registry, self.journal, self.rounds, self.metrics,
                                       max_task_wait)
        self.ticker = Ticker(self.shared, self.registry, self.journal, self.rounds, self.submissions)
        self.lifecycle = RunLifecycle(self.shared, self.registry, self.journal, self.rounds, store, eval_grace,
                                      max_runs)
        self.registry.on_join = self.rounds.maybe_begin
        self.metrics.bind(self.lifecycle.gauges)
        if resume:
            with self.shared.cond:
                self.lifecycle.resume()
        self._ticker = threading.Thread(target=self.ticker.tick_loop, args=(tick,), daemon=True,
                                        name="aggregator-ticker")
        self._ticker.start()

    # -- the shared state, read by the servicers and the tests ----------------------------------
    @property
    def cond(self) -> threading.Condition:
        return self.shared.cond

    @property
    def run(self) -> Run | None:
        """The newest run held."""
        return self.shared.run

    @property
    def runs(self) -> dict[str, Run]:
        """Every run held, by id, oldest first."""
        return self.shared.runs

    @property
    def agents(self) -> dict[str, AgentRecord]:
        return self.registry.agents

    @property
    def evaluators(self) -> int:
        return self.registry.evaluators

    @property
    def max_agents(self) -> int:
        return self.registry.max_agents

    @max_agents.setter
    def max_agents(self, n: int) -> None:
        self.registry.max_agents = n

    @property
    def agent_ttl(self) -> float:
        return self.registry.agent_ttl

    @agent_ttl.setter
    def agent_ttl(self, seconds: float) -> None:
        self.registry.agent_ttl = seconds

    @property
    def buffers(self) -> BufferPool:
        return self.rounds.buffers

    @property
    def averages(self) -> BufferPool:
        return self.rounds.averages

    @property
    def closed(self) -> bool:
        return self.shared.closed

    def _forget(self, run_id: str) -> None:
        """A run is no longer held: its metric series and the agents' records of it go."""
        self.metrics.forget_run(run_id)
        self.registry.forget_run(run_id)

    def close(self) -> None:
        with self.shared.cond:
            self.shared.closed = True
            self.shared.cond.notify_all()
        self._ticker.join(timeout=2)

    # -- the in-process calls (scripts, tests) ---------------------------------------------------
    def join(self, rec: AgentRecord) -> str:
        return self.registry.join(rec)

    def submit(self, agent_id: str, m: Manifest, state: dict[str, torch.Tensor], metrics: Mapping[str, float],
               seconds: float, flat: Flat | None = None) -> int:
        return self.submissions.submit(agent_id, m, state, metrics, seconds, flat)

    def start_run(self, config_json: str) -> dict[str, Any]:
        return self.lifecycle.start_run(config_json)

    def stop_run(self, reason: str, run_id: str = "") -> dict[str, Any]:
        return self.lifecycle.stop_run(reason, run_id)

    def report_evaluation(self, report: dict[str, Any]) -> None:
        self.lifecycle.report_evaluation(report)

    def status(self, run_id: str = "") -> dict[str, Any]:
        return self.lifecycle.status(run_id)
