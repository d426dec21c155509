"""One secure aggregation at the aggregator, as the round machine holds it: the four steps of
:mod:`fedrl.federation.secagg` (keys, shares, masked vectors, answers), each closed when every
agent expected at it has sent its message, or at its deadline with at least the threshold.

Pure, like :mod:`fedrl.federation.machine`: no lock, no clock, no I/O, no message types. What an
agent sends comes in as a value (:class:`Keys`, :class:`Shares`, :class:`Masked`,
:class:`Answer`); a message a step does not take raises :class:`Refused` with the reason the
services map to a status; time comes in as ``now``. A step that closes with fewer than the
threshold raises :class:`fedrl.federation.secagg.SecAggError`: the sum cannot be unmasked.
What a driver should log (who was excluded, whose shares were left out) is in :attr:`notes`."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedrl.federation import secagg
from fedrl.federation.secagg import (
    PAIR_SEED_BYTES,
    SEED_BYTES,
    PublicKeys,
    SecAggError,
    SecAggParams,
    ServerSession,
    dequantize,
    rounding_bound,
)

STEPS = ("keys", "shares", "masked", "answer")
KEY_BYTES = 32
SEALED_BYTES = 12 + 2 * SEED_BYTES + 16  # nonce, both shares, tag


class Refused(Exception):
    """A message the run does not take; ``reason`` is the services' name for it."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Shares:
    """Step 2: an agent's sealed shares, by receiver."""

    sealed: Mapping[str, bytes]


@dataclass(frozen=True)
class Masked:
    """Step 3: an agent's masked vector (little-endian uint64s) and the senders whose shares it
    could not open; ``sent_metrics``: it also sent round metrics in the clear (they are dropped,
    unread)."""

    vector: bytes
    unopened: Sequence[str] = ()
    sent_metrics: bool = False


# Step 1 is an agent's two public keys, step 4 its answer to the unmasking, as the protocol's
# own agent side makes them
Keys, Answer = PublicKeys, secagg.Answer
Message = Keys | Shares | Masked | Answer
_KIND = dict(zip(STEPS, (Keys, Shares, Masked, Answer)))


class SecureSteps:
    """The aggregator's side of one secure aggregation (module docstring). ``agents``: who takes
    part; ``weights``: their public weights (1 each, or their sample counts); ``size``: the values
    each agent sums (the model, and the extra values it sums with it), the weight not counted;
    ``timeout``: each step's time after the one before closed; ``first_deadline``: the keys step's
    (it waits for training: the round's deadline); ``seen``: digests of the masked vectors the run
    has taken (shared by its rounds): a replay is refused."""

    def __init__(self, params: SecAggParams, agents: Sequence[Hashable], weights: Mapping[Hashable, float],
                 size: int, timeout: float, first_deadline: float, seen: set[bytes] | None = None) -> None:
        self.params, self.size, self.timeout = params, size, timeout
        self.seen = set() if seen is None else seen
        self.server = ServerSession(params)
        self.weights = dict(weights)
        self.step = 0  # the step open now (4: all done)
        self.expected: set[Hashable] = set(agents)  # who the open step waits for
        self.deadline = first_deadline
        self.alpha: dict[Hashable, float] = {}
        self.answers: dict[Hashable, Answer] = {}
        self.survivors: list[Hashable] = []
        self.dropped: list[Hashable] = []
        self.excluded: list[Hashable] = []  # senders whose shares too few survivors could open
        self.notes: list[str] = []  # what the driver should log; it empties the list
        self.sum: np.ndarray | None = None  # the survivors' dequantized sum, once made

    # -- what agents send -------------------------------------------------------------------
    def has(self, agent: Hashable, step: str) -> bool:
        """Whether ``step`` has taken ``agent``'s message."""
        return agent in (self.server.roster, self.server.sealed, self.server.masked, self.answers)[STEPS.index(step)]

    def check(self, agent: Hashable, step: str) -> bool:
        """Raise :class:`Refused` unless ``step`` takes ``agent``'s message now; False for a repeat
        of one taken (answered from what the step made, and not taken again)."""
        if step not in STEPS:
            raise Refused("secagg_bad", f"secure aggregation has no step {step!r} (its steps: {', '.join(STEPS)})")
        k = STEPS.index(step)
        if k > self.step:
            raise Refused("secagg_order", f"secure aggregation: {step} before {STEPS[self.step]} has closed")
        if self.has(agent, step):
            return False
        if k < self.step or agent not in self.expected:
            raise Refused("secagg_late", f"secure aggregation: the {step} step of this round closed without "
                          f"agent {agent}")
        return True

    def offer(self, agent: Hashable, step: str, msg: Message) -> None:
        """Take ``agent``'s message for ``step`` (a repeat of one taken is ignored), or raise
        :class:`Refused`."""
        if not self.check(agent, step):
            return
        if not isinstance(msg, _KIND[step]):
            raise Refused("secagg_bad", f"secure aggregation: the {step} step takes a {_KIND[step].__name__}, "
                          f"not a {type(msg).__name__}")
        try:
            getattr(self, f"_take_{step}")(agent, msg)
        except SecAggError as e:
            raise Refused("secagg_bad", f"secure aggregation: {e}") from None

    def _take_keys(self, agent: Hashable, msg: Keys) -> None:
        if len(msg.share_key) != KEY_BYTES or len(msg.mask_key) != KEY_BYTES:
            raise SecAggError(f"public keys are {KEY_BYTES} bytes each")
        self.server.add_keys(agent, PublicKeys(bytes(msg.share_key), bytes(msg.mask_key)))

    def _take_shares(self, agent: Hashable, msg: Shares) -> None:
        if any(len(b) != SEALED_BYTES for b in msg.sealed.values()):
            raise SecAggError(f"a sealed share is {SEALED_BYTES} bytes (nonce, two shares, tag)")
        self.server.add_shares(agent, {k: bytes(v) for k, v in msg.sealed.items()})

    def _take_masked(self, agent: Hashable, msg: Masked) -> None:
        if len(msg.vector) != 8 * (self.size + 1):
            raise SecAggError(f"a masked vector of {len(msg.vector)} bytes; this sum's is {8 * (self.size + 1)}")
        digest = hashlib.sha256(msg.vector).digest()
        if digest in self.seen:
            raise SecAggError(f"agent {agent} sent a masked vector this run has already taken (a replay): "
                              "a round's vector is masked for that round alone")
        self.server.add_masked(agent, np.frombuffer(bytes(msg.vector), dtype="<u8").astype(np.uint64),
                               list(msg.unopened))
        self.seen.add(digest)
        if msg.sent_metrics:  # an agent that still sends them: they are statistics of its data
            self.notes.append(f"agent {agent} sent its round metrics in the clear under secure aggregation; "
                              "they are dropped, unread (an agent of this version sends none)")

    def _take_answer(self, agent: Hashable, msg: Answer) -> None:
        names = (set(self.survivors) | set(self.dropped)) - self.server.unopened[agent]
        if set(msg.shares) != names:
            raise SecAggError("an answer must hold one share for each surviving or dropped agent whose shares "
                              "it opened, and only those")
        if any(len(share) != SEED_BYTES for _, share in msg.shares.values()):
            raise SecAggError(f"a share is {SEED_BYTES} bytes")
        point = sorted(self.alpha).index(agent) + 1  # Shamir's points: 1..n in the roster's order
        if any(p != point for p, _ in msg.shares.values()):
            raise SecAggError(f"{agent}'s shares are at its own point, {point}, of the roster")
        if set(msg.pair_seeds) != set(self.excluded):
            raise SecAggError("an answer must hold one pairwise seed for each excluded agent, and only those")
        if any(len(v) != PAIR_SEED_BYTES for v in msg.pair_seeds.values()):
            raise SecAggError(f"a pairwise seed is {PAIR_SEED_BYTES} bytes")
        self.answers[agent] = Answer({a: (int(p), bytes(s)) for a, (p, s) in msg.shares.items()},
                                     {a: bytes(v) for a, v in msg.pair_seeds.items()})

    # -- steps closing ----------------------------------------------------------------------
    def advance(self, now: float) -> bool:
        """Close the open step if every expected agent has sent, or at its deadline. Returns
        whether a step closed. Raises SecAggError when one closes below the threshold."""
        if self.step >= len(STEPS):
            return False
        step = STEPS[self.step]
        have = {a for a in self.expected if self.has(a, step)}
        if have != self.expected and now < self.deadline:
            return False
        t = self.params.threshold
        if len(have) < t:
            raise SecAggError(f"the {step} step closed with {len(have)} of the {len(self.expected)} "
                              f"agents it waited for, fewer than the threshold {t}: the sum cannot be unmasked")
        if step == "keys":
            total = sum(self.weights[a] for a in have)
            self.alpha = {a: self.weights[a] / total for a in sorted(have)}
        elif step == "shares":
            self.server.sealed = {a: s for a, s in self.server.sealed.items() if a in have}
        elif step == "masked":
            self.survivors, self.dropped, self.excluded = self.server.unmask_request()
            have = set(self.survivors)
            if self.excluded:
                self.notes.append(f"secure aggregation: the shares of {', '.join(map(str, self.excluded))} opened "
                                  "for fewer than the threshold of the survivors; they are left out of this "
                                  f"sum (by {', '.join(map(str, self.survivors))}'s pairwise seeds)")
        self.step += 1
        self.expected = set(have) if step != "answer" else set()
        self.deadline = now + self.timeout
        return True

    @property
    def done(self) -> bool:
        return self.step >= len(STEPS)

    def reply(self, agent: Hashable, step: str) -> dict[str, Any] | None:
        """What ``step`` gives ``agent`` once it has closed (None while it is open)."""
        k = STEPS.index(step)
        if self.step <= k:
            return None
        if step == "keys":
            return {"roster": {a: self.server.roster[a] for a in self.alpha}, "alpha": dict(self.alpha),
                    "threshold": self.params.threshold}
        if step == "shares":
            return {"sealed": self.server.shares_for(agent), "shared": self.server.shared}
        if step == "masked":
            return {"survivors": list(self.survivors), "dropped": list(self.dropped), "excluded": list(self.excluded)}
        return {"done": True}

    def total(self) -> np.ndarray:
        """The survivors' sum, dequantized (once every step has closed), checked: its last value,
        the summed weight, must be the survivors' public weights' total within the fixed point's
        rounding. Shares off the polynomial are left out where more than the threshold answered;
        a sum that does not check out raises SecAggError, and nothing is made of it."""
        want = sum(self.alpha[a] for a in self.survivors)
        bound = rounding_bound(len(self.survivors), self.params)

        def weight_fits(last: np.uint64) -> bool:
            return abs(float(dequantize(np.array([last]), self.params)[0]) - want) <= bound

        try:
            out = self.server.finish(self.answers, weight_fits)
        except SecAggError as e:
            raise SecAggError(f"the unmasking: {e}") from None
        if self.server.left_out:
            self.notes.append(f"secure aggregation: the unmasking shares of {', '.join(map(str, self.server.left_out))} "
                              "do not fit the others'; the sum was made without them")
        self.sum = dequantize(out, self.params)
        return self.sum
