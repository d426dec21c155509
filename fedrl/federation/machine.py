"""A federated run's rounds as one pure state machine, which the aggregator's service,
``fedrl simulate`` and the paper's cells all drive: the same events make the same versions on
every path, by construction.

The machine holds the run's open round, its global version and state (and, for the ``cql``
baseline, each agent's own), and the updates the open round has taken. It takes events and
returns what follows:

- :meth:`RoundMachine.begin`: the run starts (or resumes after its last version) -> the round
  to open, or the run is over; in a secure run with pooled normalisation, round 0 first
  (:class:`Gather`): the agents' observation moments summed by secure aggregation, which give
  :class:`Gathered`, from which the driver makes version 0 (:meth:`RoundMachine.found`);
- :meth:`RoundMachine.check` / :meth:`RoundMachine.take`: an agent's update for the open round
  -> accepted, or :class:`Refused` with the reason the services report;
- :meth:`RoundMachine.take_step` (or :meth:`RoundMachine.offer`, which then advances): an
  agent's message for a step of the open round's secure
  aggregation (:mod:`fedrl.federation.secure_steps`: keys, shares, masked vector, answer), checked
  by the same :meth:`RoundMachine.check`; :meth:`RoundMachine.advance` closes its steps as every
  agent's message is in, or at their deadlines with the threshold's, and its last step's sum
  gives the new version (or round 0's moments), or :class:`Failed`;
- :meth:`RoundMachine.close` (FedAvg or the configured rule, with each update clipped and the
  central noise added under differential privacy) or the secure sum's average -> the new
  version, not yet current;
- :meth:`RoundMachine.commit`: that version is kept (the driver wrote it where it must) -> it is
  current, and the next round opens, or the run finishes, or its privacy budget stops it.

No lock, no clock, no I/O: a driver brings the updates and messages from wherever they come
(RPCs, local trainers, a batch), keeps a version before committing it, and brings the time as
``now`` (any clock, the same throughout): a round's deadline is ``now`` at its opening plus the
plan's ``round_timeout``, and each secure step's the time its step before closed plus it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import numpy as np

from fedrl.federation.aggregate import Allocator, agent_weights, aggregate
from fedrl.federation.privacy import (
    PRIVACY_EPSILON,
    clip_update,
    count_noise,
    epsilon,
    fraction_from_shares,
    next_clip,
    noisy_average,
    noisy_unclipped_fraction,
    update_noise,
)
from fedrl.federation.secagg import SecAggError, SecAggParams
from fedrl.federation.secagg_sums import average_from_sum, extras_from_sum, moments_from_sum, moments_params
from fedrl.federation.secure_steps import Message, Refused, SecureSteps
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
    secagg_threshold: int = 0  # > 0: updates arrive only as a secure aggregation's sum, unmasked by this many
    dp_clip: float = 0.0
    dp_noise: float = 0.0
    dp_delta: float = 1e-5
    dp_epsilon_budget: float = 0.0
    dp_clip_quantile: float = 0.0  # adaptive clipping's target share (0: the norm stays dp_clip)
    dp_clip_lr: float = 0.2
    dp_count_noise: float = 0.0  # the clipped count's noise std (resolved: agents / 20 when unset)
    round_timeout: float = 0.0  # a round's deadline after it opens, and each secure step's (0: none)
    samples: tuple[int, ...] = ()  # each agent's public sample count: a secure sum's weights (default 1)
    context: str = ""  # the run's name, in each secure aggregation's context
    gather: int = 0  # > 0: round 0 sums the agents' observation moments (this many dimensions) securely

    @classmethod
    def of(cls, options: Any, agents: Sequence[Hashable], samples: Sequence[int] = (), context: str = "",
           obs_dim: int = 0) -> Plan:
        """The plan of a run with ``options`` (a :class:`fedrl.federation.options.FederationOptions`,
        or a run config, whose ``round_timeout`` and ``min_agents`` it takes: 0, or none, is every
        agent); ``obs_dim``: the agents' (a secure run with pooled normalisation gathers their
        moments in round 0)."""
        gather = obs_dim if options.secagg_threshold and options.obs_norm == "pooled" else 0
        quorum = getattr(options, "min_agents", 0) or len(agents)
        return cls(options.rounds, tuple(agents), quorum, options.aggregation, options.weighting,
                   options.trim_fraction, options.own_policies, options.secagg_threshold, options.dp_clip,
                   options.dp_noise, options.dp_delta, options.dp_epsilon_budget, options.dp_clip_quantile,
                   options.dp_clip_lr, count_noise(options), float(getattr(options, "round_timeout", 0.0)),
                   tuple(samples), context, gather)

    @property
    def secure(self) -> bool:
        return self.secagg_threshold > 0

    def __post_init__(self) -> None:
        if self.rounds < 0 or not self.agents or len(set(self.agents)) != len(self.agents):
            raise ValueError(f"a plan of {self.rounds} rounds for agents {list(self.agents)}: expected rounds >= 0 "
                             "and distinct agents")
        if not 0 <= self.quorum <= len(self.agents):
            raise ValueError(f"quorum {self.quorum} for {len(self.agents)} agents")
        if self.samples and len(self.samples) != len(self.agents):
            raise ValueError(f"{len(self.samples)} sample counts for {len(self.agents)} agents")
        if self.secagg_threshold == 1 or not 0 <= self.secagg_threshold <= len(self.agents) or (
                self.gather and not self.secure):
            raise ValueError(f"a secure aggregation threshold of {self.secagg_threshold} for {len(self.agents)} "
                             f"agents{' (round 0 gathers only under secure aggregation)' if self.gather else ''}")

    def secure_weights(self) -> dict[Hashable, float]:
        """Each agent's public weight in a secure sum: its sample count under ``samples``
        weighting, else 1 (normalised over the agents whose keys come, at the keys step)."""
        counts = list(self.samples) if self.samples else [1] * len(self.agents)
        return dict(zip(self.agents, agent_weights(self.weighting, counts)))

    def joined(self, agent: Hashable) -> int | None:
        """``agent``'s sample count as the plan has it (what it said when it joined), or None
        where the plan has no counts; its updates must count the same."""
        return self.samples[self.agents.index(agent)] if self.samples else None

    def moment_weights(self) -> dict[Hashable, float]:
        """Each agent's weight in round 0's pooled moments: its sample count whatever the
        weighting (the pool is of observations), else 1."""
        return dict(zip(self.agents, map(float, self.samples or [1] * len(self.agents))))


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
    """Round ``round`` is open; agents train from version ``version`` (until ``deadline``)."""

    round: int
    version: int
    deadline: float = float("inf")


@dataclass(frozen=True)
class Gather:
    """Round 0 is open: the agents' observation moments are summed by secure aggregation (until
    ``deadline``, the keys step's)."""

    deadline: float = float("inf")
    round: int = 0


@dataclass(frozen=True)
class Gathered:
    """Round 0's pooled observation moments (of ``agents``): version 0 is made from them."""

    mean: np.ndarray
    std: np.ndarray
    agents: tuple[Hashable, ...]


@dataclass(frozen=True)
class Failed:
    """The run cannot go on: ``message`` says why (a secure aggregation below its threshold, or a
    sum that does not check out). Nothing is made of the round."""

    message: str


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


class RoundMachine:
    """A run's rounds (module docstring). ``rounds_done``/``version``: where a resumed run
    stands (its last closed round and its version); ``agent_states``: own_policies' states;
    ``clip``: the clipping norm adaptive clipping had reached (default: the plan's first).
    ``global_state`` is None only for a plan that gathers round 0 (version 0 comes after it)."""

    def __init__(self, plan: Plan, global_state: State | None, version: int = 0, rounds_done: int = 0,
                 agent_states: Sequence[State] | None = None, clip: float | None = None) -> None:
        self.plan = plan
        self.clip = plan.dp_clip if clip is None else clip
        if plan.dp_clip and not self.clip > 0:
            raise ValueError(f"a clipping norm of {self.clip}")
        if global_state is None and not (plan.gather and rounds_done == 0):
            raise ValueError("a run's rounds need version 0's state, unless round 0 gathers the moments it is made from")
        self.global_state: State = global_state if global_state is not None else {}
        self.version = version
        self.round = rounds_done  # the open round, or the last one that closed
        self.agent_states = tuple(agent_states) if agent_states is not None else (self.global_state,) * len(plan.agents)
        self.phase = "ready"  # ready -> [gather -> gathered ->] open -> (open ...) -> finished | stopped | failed
        self.deadline = float("inf")  # the open round's (a secure step's is its own: secure.deadline)
        self.taken: dict[Hashable, Update] = {}
        self.secure: SecureSteps | None = None  # the open round's secure aggregation
        self.masked_seen: set[bytes] = set()  # digests of every masked vector the run took: a replay is refused
        self._founded = global_state is not None
        self._pending: Closed | None = None

    def begin(self, now: float = 0.0) -> Open | Gather | Finished | Stopped:
        if self.phase != "ready":
            raise RuntimeError(f"the run has begun (it is {self.phase})")
        if not self._founded:
            self.phase, self.round = "gather", 0
            self.deadline = self._deadline(now)
            params = moments_params(self.plan.secagg_threshold, f"{self.plan.context}/0".encode())
            self.secure = SecureSteps(params, self.plan.agents, self.plan.moment_weights(), 2 * self.plan.gather,
                                      self.plan.round_timeout or float("inf"), self.deadline, self.masked_seen)
            return Gather(self.deadline)
        return self._next(self.round + 1, now)

    def found(self, state: State, now: float = 0.0) -> Open | Finished | Stopped:
        """Version 0, made from round 0's :class:`Gathered` moments: round 1 opens."""
        if self.phase != "gathered":
            raise RuntimeError(f"version 0 comes after round 0's moments are gathered (the run is {self.phase})")
        self.global_state, self._founded = state, True
        self.agent_states = (state,) * len(self.plan.agents)
        return self._next(1, now)

    def check(self, agent: Hashable, round_: int, base_version: int | None = None, step: str | None = None,
              samples: int | None = None) -> bool:
        """Raise :class:`Refused` unless the open round would take ``agent``'s update of round
        ``round_`` trained from ``base_version`` and counting ``samples`` (in the order the
        services check), or with ``step``, its message for that secure aggregation step (False: a
        repeat of one taken, answered from what the step made). An update counts its agent's
        samples as the plan has them (what the agent said when it joined): one that said 0 failed
        a sample-weighted round, and 10^12 outweighed every other agent."""
        if agent not in self.plan.agents:
            raise Refused("not_selected", f"agent {agent!r} is not a participant of this run")
        if step is not None and not self.plan.secure:
            raise Refused("closed_round", "this run takes no secure aggregation")
        if self.phase == "gather" and step is None:
            raise Refused("closed_round", "the run is summing its agents' observation moments by secure "
                          "aggregation (round 0); no round takes updates yet")
        if self.phase not in ("open", "gather") or (step is not None and self.secure is None):
            raise Refused("closed_round", f"the run is {self.phase}; no round is open")
        if round_ < self.round:
            raise Refused("stale_round", f"round {round_} is closed (round {self.round} is open)")
        if round_ > self.round:
            raise Refused("future_round", f"round {round_} is in the future (round {self.round} is open)")
        if step is not None:
            return self.secure.check(agent, step)
        if base_version != self.version:
            raise Refused("wrong_base", f"update trained from version {base_version}, round {self.round} "
                          f"distributes version {self.version}")
        if self.plan.secure:
            raise Refused("secagg_only", "this run takes its updates by secure aggregation, never in the clear")
        if agent in self.taken:
            raise Refused("duplicate", f"agent {agent!r} already submitted for round {self.round}")
        if samples is not None and (joined := self.plan.joined(agent)) is not None:
            if samples != joined:
                raise Refused("wrong_samples", f"the update counts {samples} samples; agent {agent!r} joined "
                              f"with {joined}, and its updates weigh as that")
        return True

    def take(self, agent: Hashable, round_: int, base_version: int, update: Update) -> bool:
        """Take ``agent``'s update (or raise :class:`Refused`); True once every agent's is in."""
        self.check(agent, round_, base_version, samples=update.num_samples)
        self.taken[agent] = update
        self._pending = None
        return self.complete

    def took_part(self, agent: Hashable) -> bool:
        """Whether ``agent`` has sent the open round's update, or its secure aggregation's keys."""
        return agent in self.taken or (self.secure is not None and self.secure.has(agent, "keys"))

    def take_step(self, agent: Hashable, round_: int, step: str, msg: Message) -> None:
        """Take ``agent``'s message for ``step`` of the open round's secure aggregation (a repeat
        of one taken is ignored), or raise :class:`Refused`."""
        if self.check(agent, round_, step=step):
            self.secure.offer(agent, step, msg)

    def offer(self, agent: Hashable, round_: int, step: str, msg: Message,
              now: float = 0.0) -> Closed | Gathered | Failed | None:
        """:meth:`take_step`, then :meth:`advance` to ``now``."""
        self.take_step(agent, round_, step, msg)
        return self.advance(now)

    def advance(self, now: float = 0.0) -> Closed | Gathered | Failed | None:
        """Close the open round's secure steps that can close at ``now``. Once its last has, the
        sum: round 0's moments (:class:`Gathered`), or the round's new version (:class:`Closed`,
        as :meth:`close` gives: not yet current). :class:`Failed` when a step closed below the
        threshold or the sum does not check out. None while a step waits."""
        sec = self.secure
        if sec is None or self.phase not in ("open", "gather"):
            return None
        if self._pending is not None:  # the version is made; its driver has not kept it yet
            return self._pending
        name = "the observation moments (round 0)" if self.round == 0 else f"round {self.round}"
        try:
            while sec.advance(now):
                pass
        except SecAggError as e:  # a step closed below the threshold
            return self._fail(f"{name}: {e}")
        if not sec.done:
            return None
        try:
            total = sec.total()
            order = tuple(a for a in self.plan.agents if a in set(sec.survivors))
            if self.phase == "gather":
                mean, std = moments_from_sum(total, self.plan.gather)
                self.phase, self.secure = "gathered", None
                return Gathered(mean, std, order)
            new = average_from_sum(total, self.global_state)
            # adaptive clipping: the agents' noisy centred bits, summed with their models
            share = fraction_from_shares(float(extras_from_sum(total, 1)[0])) if self.plan.dp_clip_quantile else None
            return self.close_sum(new, order, unclipped_fraction=share)
        except (SecAggError, ValueError) as e:
            return self._fail(f"{name}: secure aggregation failed: {e}")

    def _fail(self, message: str) -> Failed:
        self.phase, self.secure = "failed", None
        return Failed(message)

    @property
    def complete(self) -> bool:
        return self.phase == "open" and len(self.taken) == len(self.plan.agents)

    def closable(self, now: float = float("-inf")) -> bool:
        """The open round may close: every update is in, or its deadline passed by ``now`` with
        the quorum's (a secure round closes by :meth:`advance`)."""
        return self.complete or (self.phase == "open" and now >= self.deadline and bool(self.taken)
                                 and len(self.taken) >= self.plan.quorum)

    def overdue(self, now: float) -> str:
        """What holds up an open round past its deadline without the quorum's updates ('' if none)."""
        if self.phase != "open" or self.secure is not None or now < self.deadline or len(self.taken) >= self.plan.quorum:
            return ""
        return (f"round {self.round} is past its deadline with {len(self.taken)} of the {self.plan.quorum} updates "
                "it needs; waiting for agents")

    def close(self, noise: torch.Generator | None = None, alloc: Allocator | None = None) -> Closed:
        """The open round's new version from the updates taken: clipped to the clipping norm (an
        agent that did not clip cannot void the guarantee), combined by the plan's rule, and with
        the central noise (drawn from ``noise``) under ``dp_noise``. Under adaptive clipping the
        noisy share of the updates within the norm gives the next round's norm (the metrics'
        ``dp_clip``, ``dp_unclipped_fraction`` and ``dp_clip_next``). Raises
        :class:`fedrl.federation.aggregate.AggregationError` (or ValueError) for updates that do
        not combine, or an average that is not finite; the round stays open. Closing again before
        another update is taken gives the same version (one noise draw per version)."""
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
        agents), and moves the norm. :meth:`advance` calls it with the sum it unmasked."""
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

    def commit(self, closed: Closed, now: float = 0.0) -> Open | Finished | Stopped:
        """``closed`` (the last close's) is kept: it becomes the current version, and what follows
        it is returned (a round opened at ``now``)."""
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
        return self._next(self.round + 1, now)

    def _spent(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.plan.dp_clip:  # what the run has spent once this round's version is out
            metrics[PRIVACY_EPSILON] = epsilon(self.plan.dp_noise, self.round, self.plan.dp_delta,
                                               self.plan.dp_count_noise)
        return metrics

    def _deadline(self, now: float) -> float:
        return now + self.plan.round_timeout if self.plan.round_timeout else float("inf")

    def _next(self, r: int, now: float) -> Open | Finished | Stopped:
        p = self.plan
        self.taken, self.secure = {}, None
        if r > p.rounds:
            self.phase = "finished"
            return Finished(self.round)
        if p.dp_epsilon_budget and (e := epsilon(p.dp_noise, r, p.dp_delta, p.dp_count_noise)) > p.dp_epsilon_budget:
            self.phase = "stopped"
            return Stopped(r, f"privacy budget: round {r} would spend epsilon {e:.3g} at delta {p.dp_delta:g}, "
                              f"over the budget of {p.dp_epsilon_budget:g}")
        self.phase, self.round = "open", r
        self.deadline = self._deadline(now)
        if p.secure:  # the model's values, and adaptive clipping's share of the count summed with them
            size = sum(t.numel() for t in self.global_state.values()) + (1 if p.dp_clip_quantile else 0)
            self.secure = SecureSteps(SecAggParams(threshold=p.secagg_threshold, context=f"{p.context}/{r}".encode()),
                                      p.agents, p.secure_weights(), size, p.round_timeout or float("inf"),
                                      self.deadline, self.masked_seen)
        return Open(r, self.version, self.deadline)


def resumed_clip(plan: Plan, last: Mapping[str, float] | None) -> float | None:
    """The clipping norm a resumed run goes on with: under adaptive clipping, the one its last
    closed round moved it to (``last``: that round's metrics, as :class:`Closed` gave them);
    otherwise, or before any round closed, None (the plan's first)."""
    if not plan.dp_clip_quantile or not last or "dp_clip_next" not in last:
        return None
    return float(last["dp_clip_next"])


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
