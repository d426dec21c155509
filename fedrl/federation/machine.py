"""A federated run's rounds as one pure state machine, which the aggregator's service,
``fedrl simulate`` and the paper's cells all drive: the same events make the same versions on
every path, by construction.

The machine holds the run's open round, its global version and state (and, for the ``cql``
baseline, each agent's own), and the updates the open round has taken. It takes events and
returns what follows:

- :meth:`RoundMachine.begin`: the run starts (or resumes after its last version) -> the round
  to open, or the run is over;
- :meth:`RoundMachine.take`: an agent's update for the open round -> accepted, or
  :class:`Refused` with the reason the services report;
- :meth:`RoundMachine.close` (FedAvg or the configured rule, with each update clipped and the
  central noise added under differential privacy) or :meth:`RoundMachine.close_sum` (the
  average a secure aggregation summed) -> the new version, not yet current;
- :meth:`RoundMachine.commit`: that version is kept (the driver wrote it where it must) -> it is
  current, and the next round opens, or the run finishes, or its privacy budget stops it.

No lock, no clock, no I/O: a driver brings the updates from wherever they come (RPCs, local
trainers, a batch), keeps a version before committing it, and keeps its own time (a deadline
is a driver's reason to close with :meth:`RoundMachine.closable` ``past_deadline``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedrl.federation.aggregate import Allocator, agent_weights, aggregate
from fedrl.federation.privacy import (
    PRIVACY_EPSILON,
    clip_update,
    count_noise,
    epsilon,
    next_clip,
    noisy_average,
    noisy_unclipped_fraction,
    update_noise,
)
from fedrl.wire.codec import Flat

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Plan:
    """What a run's rounds are: how many, who takes part, when a round may close early, and how
    its updates combine."""

    rounds: int
    agents: tuple[Hashable, ...]
    quorum: int = 0  # updates a round needs to close at its deadline (0: every agent's)
    aggregation: str = "fedavg"
    weighting: str = "samples"
    trim_fraction: float = 0.1
    own_policies: bool = False  # the cql baseline: each agent keeps its own policy, nothing is averaged
    secure: bool = False  # updates arrive only as a secure aggregation's sum (close_sum)
    dp_clip: float = 0.0
    dp_noise: float = 0.0
    dp_delta: float = 1e-5
    dp_epsilon_budget: float = 0.0
    dp_clip_quantile: float = 0.0  # adaptive clipping's target share (0: the norm stays dp_clip)
    dp_clip_lr: float = 0.2
    dp_count_noise: float = 0.0  # the clipped count's noise std (resolved: agents / 20 when unset)

    @classmethod
    def of(cls, options: Any, agents: Sequence[Hashable], quorum: int = 0) -> Plan:
        """The plan of a run with ``options`` (a :class:`fedrl.federation.options.FederationOptions`)."""
        return cls(options.rounds, tuple(agents), quorum or len(agents), options.aggregation, options.weighting,
                   options.trim_fraction, options.own_policies, bool(options.secagg_threshold), options.dp_clip,
                   options.dp_noise, options.dp_delta, options.dp_epsilon_budget, options.dp_clip_quantile,
                   options.dp_clip_lr, count_noise(options))

    def __post_init__(self) -> None:
        if self.rounds < 0 or not self.agents or len(set(self.agents)) != len(self.agents):
            raise ValueError(f"a plan of {self.rounds} rounds for agents {list(self.agents)}: expected rounds >= 0 "
                             "and distinct agents")
        if not 0 <= self.quorum <= len(self.agents):
            raise ValueError(f"quorum {self.quorum} for {len(self.agents)} agents")


@dataclass(frozen=True)
class Update:
    """One agent's update of the open round."""

    state: State
    num_samples: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    flat: Flat | None = None  # the state as one flat tensor, where its decoder had one


@dataclass(frozen=True)
class Open:
    """Round ``round`` is open; agents train from version ``version``."""

    round: int
    version: int


@dataclass(frozen=True)
class Finished:
    """Every round closed."""

    rounds: int


@dataclass(frozen=True)
class Stopped:
    """The run stopped before round ``round``: it would exceed its privacy budget."""

    round: int
    message: str


@dataclass(frozen=True)
class Closed:
    """Round ``round``'s new version ``version``, made from the updates of ``agents`` (in the plan's
    order); ``metrics``: their metrics' means, and the privacy spent once it is out."""

    round: int
    version: int
    state: State
    agents: tuple[Hashable, ...]
    metrics: dict[str, float]
    agent_states: tuple[State, ...] | None = None  # own_policies: each agent's
    next_clip: float | None = None  # adaptive clipping: the norm the next round clips to


class Refused(Exception):
    """An update the open round does not take; ``reason`` is the services' name for it."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RoundMachine:
    """A run's rounds (module docstring). ``rounds_done``/``version``: where a resumed run
    stands (its last closed round and its version); ``agent_states``: own_policies' states;
    ``clip``: the clipping norm adaptive clipping had reached (default: the plan's first)."""

    def __init__(self, plan: Plan, global_state: State, version: int = 0, rounds_done: int = 0,
                 agent_states: Sequence[State] | None = None, clip: float | None = None) -> None:
        self.plan = plan
        self.clip = plan.dp_clip if clip is None else clip
        if plan.dp_clip and not self.clip > 0:
            raise ValueError(f"a clipping norm of {self.clip}")
        self.global_state = global_state
        self.version = version
        self.round = rounds_done  # the open round, or the last one that closed
        self.agent_states = tuple(agent_states) if agent_states is not None else (global_state,) * len(plan.agents)
        self.phase = "ready"  # ready -> open -> (open ...) -> finished | stopped
        self.taken: dict[Hashable, Update] = {}
        self._pending: Closed | None = None

    def begin(self) -> Open | Finished | Stopped:
        if self.phase != "ready":
            raise RuntimeError(f"the run has begun (it is {self.phase})")
        return self._next(self.round + 1)

    def check(self, agent: Hashable, round_: int, base_version: int) -> None:
        """Raise :class:`Refused` unless the open round would take ``agent``'s update of round
        ``round_`` trained from ``base_version`` (in the order the services check)."""
        if agent not in self.plan.agents:
            raise Refused("not_selected", f"agent {agent!r} is not a participant of this run")
        if self.phase != "open":
            raise Refused("closed_round", f"the run is {self.phase}; no round is open")
        if round_ < self.round:
            raise Refused("stale_round", f"round {round_} is closed (round {self.round} is open)")
        if round_ > self.round:
            raise Refused("future_round", f"round {round_} is in the future (round {self.round} is open)")
        if base_version != self.version:
            raise Refused("wrong_base", f"update trained from version {base_version}, round {self.round} "
                          f"distributes version {self.version}")
        if self.plan.secure:
            raise Refused("secagg_only", "this run takes its updates by secure aggregation, never in the clear")
        if agent in self.taken:
            raise Refused("duplicate", f"agent {agent!r} already submitted for round {self.round}")

    def take(self, agent: Hashable, round_: int, base_version: int, update: Update) -> bool:
        """Take ``agent``'s update (or raise :class:`Refused`); True once every agent's is in."""
        self.check(agent, round_, base_version)
        self.taken[agent] = update
        self._pending = None
        return self.complete

    @property
    def complete(self) -> bool:
        return self.phase == "open" and len(self.taken) == len(self.plan.agents)

    def closable(self, past_deadline: bool = False) -> bool:
        """The open round may close: every update is in, or its deadline passed with the quorum's."""
        return self.complete or (self.phase == "open" and past_deadline and bool(self.taken)
                                 and len(self.taken) >= self.plan.quorum)

    def close(self, noise: torch.Generator | None = None, alloc: Allocator | None = None) -> Closed:
        """The open round's new version from the updates taken: clipped to the clipping norm (an
        agent that did not clip cannot void the guarantee), combined by the plan's rule, and with
        the central noise (drawn from ``noise``) under ``dp_noise``. Under adaptive clipping the
        noisy share of the updates within the norm gives the next round's norm (the metrics'
        ``dp_clip``, ``dp_unclipped_fraction`` and ``dp_clip_next``). Raises
        :class:`fedrl.federation.aggregate.AggregationError` (or ValueError) for updates that do
        not combine, or an average that is not finite; the round stays open. Closing again before another update is taken gives
        the same version (one noise draw per version)."""
        if self._pending is not None:
            return self._pending
        if self.phase != "open" or not self.taken:
            raise RuntimeError(f"no update to close round {self.round} with ({self.phase})")
        p = self.plan
        order = tuple(a for a in p.agents if a in self.taken)
        ups = [self.taken[a] for a in order]
        metrics = mean_metrics([u.metrics for u in ups])
        if p.own_policies:
            own = dict(zip(order, (u.state for u in ups)))
            states = tuple(own.get(a, s) for a, s in zip(p.agents, self.agent_states))
            self._pending = Closed(self.round, self.version + 1, self.global_state, order, metrics, states)
            return self._pending
        w = agent_weights(p.weighting, [u.num_samples for u in ups])
        nxt = None
        if p.dp_clip:
            if p.dp_noise and noise is None:
                raise ValueError("differential privacy's noise needs a generator")
            done = [clip_update(u.state, self.global_state, self.clip) for u in ups]
            new = aggregate(p.aggregation, [c for c, _ in done], w, p.trim_fraction)
            if p.dp_clip_quantile:  # the count's noise is drawn first, then the updates'
                frac = noisy_unclipped_fraction([n for _, n in done], self.clip, p.dp_count_noise, noise)
                nxt = next_clip(self.clip, frac, p.dp_clip_quantile, p.dp_clip_lr)
                metrics |= {"dp_clip": self.clip, "dp_unclipped_fraction": frac, "dp_clip_next": nxt}
            if p.dp_noise:
                new = noisy_average(new, len(ups), self.clip, update_noise(p.dp_noise, p.dp_count_noise), noise)
        else:
            new = aggregate(p.aggregation, [u.state for u in ups], w, p.trim_fraction, [u.flat for u in ups], alloc)
        self._pending = Closed(self.round, self.version + 1, _finite(new, self.round), order, self._spent(metrics),
                               next_clip=nxt)
        return self._pending

    def close_sum(self, average: State, agents: Sequence[Hashable],
                  metrics: Sequence[Mapping[str, float]] = (), unclipped_fraction: float | None = None) -> Closed:
        """The open round's new version from a secure aggregation's ``average`` of the updates of
        ``agents`` (its survivors; its noise, if any, is the agents' own). Under adaptive clipping
        ``unclipped_fraction`` is the share within the norm the same sum gave (noised by the
        agents), and moves the norm."""
        if not self.plan.secure or self.phase != "open":
            raise RuntimeError(f"round {self.round} takes no secure sum ({self.phase}, secure {self.plan.secure})")
        unknown = [a for a in agents if a not in self.plan.agents]
        if unknown or not agents:
            raise ValueError(f"a secure sum of agents {list(agents)}: expected some of {list(self.plan.agents)}")
        order = tuple(a for a in self.plan.agents if a in set(agents))
        m, nxt = mean_metrics(metrics), None
        if self.plan.dp_clip_quantile:
            if unclipped_fraction is None:
                raise ValueError("adaptive clipping's secure sum needs the share of updates within the norm")
            nxt = next_clip(self.clip, unclipped_fraction, self.plan.dp_clip_quantile, self.plan.dp_clip_lr)
            m |= {"dp_clip": self.clip, "dp_unclipped_fraction": unclipped_fraction, "dp_clip_next": nxt}
        self._pending = Closed(self.round, self.version + 1, _finite(average, self.round), order, self._spent(m),
                               next_clip=nxt)
        return self._pending

    def commit(self, closed: Closed) -> Open | Finished | Stopped:
        """``closed`` (the last close's) is kept: it becomes the current version, and what follows
        it is returned."""
        if closed is not self._pending:
            raise RuntimeError(f"version {closed.version} of round {closed.round} is not the open round's close")
        self.version, self.global_state = closed.version, closed.state
        if closed.next_clip is not None:
            self.clip = closed.next_clip
        if closed.agent_states is not None:
            self.agent_states = closed.agent_states
        else:
            self.agent_states = (closed.state,) * len(self.plan.agents)
        self._pending = None
        return self._next(self.round + 1)

    def _spent(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.plan.dp_clip:  # what the run has spent once this round's version is out
            metrics[PRIVACY_EPSILON] = epsilon(self.plan.dp_noise, self.round, self.plan.dp_delta,
                                               self.plan.dp_count_noise)
        return metrics

    def _next(self, r: int) -> Open | Finished | Stopped:
        p = self.plan
        self.taken = {}
        if r > p.rounds:
            self.phase = "finished"
            return Finished(self.round)
        if p.dp_epsilon_budget and (e := epsilon(p.dp_noise, r, p.dp_delta, p.dp_count_noise)) > p.dp_epsilon_budget:
            self.phase = "stopped"
            return Stopped(r, f"privacy budget: round {r} would spend epsilon {e:.3g} at delta {p.dp_delta:g}, "
                              f"over the budget of {p.dp_epsilon_budget:g}")
        self.phase, self.round = "open", r
        return Open(r, self.version)


def _finite(state: State, round_: int) -> State:
    """``state``, refused (ValueError) where a floating tensor holds NaN or Inf: no version is made
    of it (an average of finite updates can still overflow, and noise can be past float32)."""
    for k, v in state.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise ValueError(f"round {round_}'s average holds NaN or Inf (in {k}): no version is made of it")
    return state


def mean_metrics(metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each metric's mean over the updates (a metric an update lacks counts as 0 there)."""
    out: dict[str, float] = {}
    for m in metrics:
        for k, x in m.items():
            out[k] = out.get(k, 0.0) + x / len(metrics)
    return out
