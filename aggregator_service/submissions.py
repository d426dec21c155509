"""What agents send the aggregator for a round: updates (checked from their header on, then
taken by the round machine, which may close the round), updates refused as non-finite (which can
fail a run no agent can train), and secure aggregation's steps (values the machine checks and
takes; refusals become status codes).

A part of :class:`aggregator_service.coordinator.Coordinator`: it uses the agent registry, the
journal and the rounds (given at construction) and the shared state. Its methods whose names
start with an underscore run with the lock held."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

import grpc
import numpy as np
import torch

from aggregator_service.agents import AgentRegistry
from aggregator_service.journal import Journal
from aggregator_service.records import Run, Shared
from aggregator_service.rounds import Rounds
from fedrl.federation.machine import Refused, Update
from fedrl.federation.privacy import ADAPTIVE_RECORD, PRIVACY_EPSILON
from fedrl.federation.secure_steps import Message
from fedrl.ops.metrics import AggregatorMetrics
from fedrl.wire.codec import Flat, Manifest, check_manifest_matches
from fedrl.wire.rpc import ServiceError

# The status of an update or message the run does not take, by the machine's reason (others:
# FAILED_PRECONDITION)
REFUSED_STATUS = {"not_selected": grpc.StatusCode.PERMISSION_DENIED, "duplicate": grpc.StatusCode.ALREADY_EXISTS,
                  "secagg_bad": grpc.StatusCode.INVALID_ARGUMENT, "wrong_samples": grpc.StatusCode.INVALID_ARGUMENT}


# An update's metrics (its header's map, averaged into the round's ROUND_CLOSED event, which the
# journal keeps): a learner sends about 20 short names; more, or longer, would grow every round's
# event by up to the 8 MiB message.
MAX_UPDATE_METRICS = 64
METRIC_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")
# The metrics the round machine adds itself, differential privacy's record: an agent's of the same
# name would stand in the event (and in fedrl up's privacy record) wherever the machine adds none.
RESERVED_METRICS = frozenset({PRIVACY_EPSILON, *ADAPTIVE_RECORD})


def metrics_problem(metrics: Mapping[str, float]) -> str | None:
    """Why an update's metrics cannot be kept, or None."""
    if len(metrics) > MAX_UPDATE_METRICS:
        return f"{len(metrics)} metrics; an update carries at most {MAX_UPDATE_METRICS}"
    own = sorted(RESERVED_METRICS & set(metrics))
    if own:
        return f"metric {own[0]!r} is the aggregator's own (differential privacy's record)"
    bad = next((k for k in metrics if not METRIC_NAME.fullmatch(k)), None)
    if bad is not None:
        return (f"metric name {bad[:40]!r}{'...' if len(bad) > 40 else ''}: 1-64 characters of letters, "
                "digits and _ . : / -")
    return None


class Submissions:
    def __init__(self, shared: Shared, registry: AgentRegistry, journal: Journal, rounds: Rounds,
                 metrics: AggregatorMetrics, max_task_wait: float) -> None:
        self.s, self.registry, self.journal, self.rounds, self.metrics = shared, registry, journal, rounds, metrics
        self.max_task_wait = max_task_wait

    def check_header(self, agent_id: str, m: Manifest, metrics: Mapping[str, float] | None = None) -> None:
        """Refuse an update before its chunks are read (unknown agent, wrong run/round, duplicate,
        metrics past :func:`metrics_problem`'s bounds, tensors or a declared size the global model
        cannot have: a CodecError, which the servicer maps to its status like any other
        verification failure)."""
        if metrics is not None and (problem := metrics_problem(metrics)):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"agent {agent_id}'s update: {problem}", "bad_metrics")
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
        run = self._run(m.run_id, "update")
        if agent_id not in run.selected:
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                               f"agent {agent_id!r} is not a participant of run {run.run_id}", "not_selected")
        if run.state != "running":
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"run {run.run_id} is {run.state}; no round is open", "closed_round")
        try:
            run.machine.check(agent_id, m.round, m.base_version, samples=m.num_samples)
        except Refused as e:
            raise ServiceError(REFUSED_STATUS.get(e.reason, grpc.StatusCode.FAILED_PRECONDITION),
                               f"run {run.run_id}: {e}", e.reason) from None
        return run

    def _run(self, run_id: str, what: str) -> Run:
        """The run ``run_id`` names, among those held; refused (``wrong_run``) when there is none."""
        run = self.s.runs.get(run_id)
        if run is None:
            active = [r.run_id for r in self.s.active()]
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"{what} for run {run_id[:80]!r}, but the active runs are "
                               f"{', '.join(active) if active else 'none'}", "wrong_run")
        return run

    def update_refused(self, agent_id: str, run_id: str, reason: str, detail: str) -> None:
        """An update of ``agent_id`` for ``run_id`` was refused (``reason``: the codec's). Non-finite
        values from every selected agent in one round mean the settings cannot train: the run
        fails, saying so, instead of waiting for agents that give up on it (see
        :meth:`check_non_finite`)."""
        if reason != "non_finite":
            return
        with self.s.cond:
            run = self.s.runs.get(run_id)
            if run is None or run.state != "running" or agent_id not in run.selected:
                return
            run.non_finite_refused(agent_id, detail)
            self.check_non_finite(run, time.time())

    def check_non_finite(self, run: Run, now: float) -> None:
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
            rec.accepted[run.run_id] = (rec.accepted.get(run.run_id, (0, 0))[0] + 1, run.round)
            self.metrics.accepted.inc()
            r = run.round
            if run.machine.complete:
                self.rounds.close_round(run)
                self.s.cond.notify_all()  # only a closed round changes what waiters look for
            return r

    def secure_step(self, agent_id: str, run_id: str, round_: int, step: str, msg: Message,
                    wait: float) -> dict[str, Any] | None:
        """One secure aggregation step of ``agent_id`` (``msg``: its message for ``step``): what
        the step gives it once closed, or None (pending) after at most ``wait`` seconds."""
        end = time.monotonic() + max(0.0, min(wait, self.max_task_wait))
        with self.s.cond:
            self.registry.agent(agent_id)
            run = self._run(run_id, "secure aggregation")
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
            with self.rounds.failing(run, f"round {run.round}'s secure aggregation"):
                self.rounds.secure_moved(run, sec, run.machine.advance(time.time()))
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
