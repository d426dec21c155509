"""One round's secure aggregation at the aggregator: the four steps of
:mod:`fedrl.federation.secagg` (keys, shares, masked vectors, answers), each closed when every agent
expected at it has sent its message, or at its deadline with at least the threshold.

Used by the rounds under the coordinator's lock; no gRPC message types here. A step that closes
with fewer than the threshold raises :class:`SecAggError`: the round cannot be unmasked, and the
run fails saying so, with nothing stored."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any

import grpc
import numpy as np

from fedrl.federation.secagg import (
    PAIR_SEED_BYTES,
    SEED_BYTES,
    Answer,
    PublicKeys,
    SecAggError,
    SecAggParams,
    ServerSession,
    dequantize,
    rounding_bound,
)
from fedrl.wire.rpc import ServiceError

STEPS = ("keys", "shares", "masked", "answer")
KEY_BYTES = 32
SEALED_BYTES = 12 + 2 * SEED_BYTES + 16  # nonce, both shares, tag
log = logging.getLogger("fedrl.aggregator")


class SecureRound:
    """The aggregator's side of one round. ``selected``: the agents of the round; ``weights``:
    their public weights (1 each, or their sample counts); ``size``: the values of the model (and
    the extra values each agent sums with it: adaptive clipping's share of the count)."""

    def __init__(self, params: SecAggParams, selected: list[str], weights: Mapping[str, float], size: int,
                 timeout: float, first_deadline: float, seen: set[bytes] | None = None) -> None:
        self.params, self.size, self.timeout = params, size, timeout
        # digests of the masked vectors the run has taken (shared by its rounds): a replay is refused
        self.seen = set() if seen is None else seen
        self.server = ServerSession(params)
        self.weights = dict(weights)
        self.step = 0  # the step open now (4: all done)
        self.expected: set[str] = set(selected)  # who the open step waits for
        self.deadline = first_deadline  # the keys step waits for training: the round's deadline
        self.alpha: dict[str, float] = {}
        self.metrics: dict[str, tuple[dict[str, float], float]] = {}
        self.answers: dict[str, Answer] = {}
        self.survivors: list[str] = []
        self.dropped: list[str] = []
        self.excluded: list[str] = []  # senders whose shares too few survivors could open

    # -- what agents send -------------------------------------------------------------------
    def took_part(self, agent_id: str) -> bool:
        return agent_id in self.server.roster

    def offer(self, agent_id: str, step: str, msg: Any) -> None:
        """Take ``agent_id``'s message for ``step`` (a repeat of one taken is ignored)."""
        k = STEPS.index(step)
        if k > self.step:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"secure aggregation: {step} before {STEPS[self.step]} has closed", "secagg_order")
        if k < self.step or agent_id not in self.expected:
            if self._has(agent_id, k):
                return  # a repeat, answered from what the step made
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"secure aggregation: the {step} step of this round closed without agent "
                               f"{agent_id}", "secagg_late")
        if self._has(agent_id, k):
            return
        try:
            getattr(self, f"_take_{step}")(agent_id, msg)
        except SecAggError as e:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"secure aggregation: {e}", "secagg_bad") from None

    def _has(self, agent_id: str, k: int) -> bool:
        return agent_id in (self.server.roster, self.server.sealed, self.server.masked, self.answers)[k]

    def _take_keys(self, agent_id: str, msg) -> None:
        if len(msg.share_key) != KEY_BYTES or len(msg.mask_key) != KEY_BYTES:
            raise SecAggError(f"public keys are {KEY_BYTES} bytes each")
        self.server.add_keys(agent_id, PublicKeys(bytes(msg.share_key), bytes(msg.mask_key)))

    def _take_shares(self, agent_id: str, msg) -> None:
        if any(len(b) != SEALED_BYTES for b in msg.sealed.values()):
            raise SecAggError(f"a sealed share is {SEALED_BYTES} bytes (nonce, two shares, tag)")
        self.server.add_shares(agent_id, {k: bytes(v) for k, v in msg.sealed.items()})

    def _take_masked(self, agent_id: str, msg) -> None:
        if len(msg.vector) != 8 * (self.size + 1):
            raise SecAggError(f"a masked vector of {len(msg.vector)} bytes; this model's is {8 * (self.size + 1)}")
        digest = hashlib.sha256(msg.vector).digest()
        if digest in self.seen:
            raise SecAggError(f"agent {agent_id} sent a masked vector this run has already taken (a replay): "
                              "a round's vector is masked for that round alone")
        self.server.add_masked(agent_id, np.frombuffer(bytes(msg.vector), dtype="<u8").astype(np.uint64),
                               list(msg.unopened))
        self.seen.add(digest)
        if msg.metrics:  # an agent that still sends them: they are statistics of its data
            log.warning("agent %s sent its round metrics in the clear under secure aggregation; they are "
                        "dropped, unread (an agent of this version sends none)", agent_id)
        self.metrics[agent_id] = ({}, float(msg.train_seconds))

    def _take_answer(self, agent_id: str, msg) -> None:
        names = (set(self.survivors) | set(self.dropped)) - self.server.unopened[agent_id]
        if set(msg.shares) != names:
            raise SecAggError("an answer must hold one share for each surviving or dropped agent whose shares "
                              "it opened, and only those")
        if any(len(s.share) != SEED_BYTES for s in msg.shares.values()):
            raise SecAggError(f"a share is {SEED_BYTES} bytes")
        point = sorted(self.alpha).index(agent_id) + 1  # Shamir's points: 1..n in the roster's order
        if any(s.point != point for s in msg.shares.values()):
            raise SecAggError(f"{agent_id}'s shares are at its own point, {point}, of the roster")
        if set(msg.pair_seeds) != set(self.excluded):
            raise SecAggError("an answer must hold one pairwise seed for each excluded agent, and only those")
        if any(len(v) != PAIR_SEED_BYTES for v in msg.pair_seeds.values()):
            raise SecAggError(f"a pairwise seed is {PAIR_SEED_BYTES} bytes")
        self.answers[agent_id] = Answer({a: (int(s.point), bytes(s.share)) for a, s in msg.shares.items()},
                                        {a: bytes(v) for a, v in msg.pair_seeds.items()})

    # -- steps closing ----------------------------------------------------------------------
    def advance(self, now: float) -> bool:
        """Close the open step if every expected agent has sent, or at its deadline. Returns
        whether a step closed. Raises SecAggError when one closes below the threshold."""
        if self.step >= len(STEPS):
            return False
        have = {a for a in self.expected if self._has(a, self.step)}
        if have != self.expected and now < self.deadline:
            return False
        t = self.params.threshold
        if len(have) < t:
            raise SecAggError(f"the {STEPS[self.step]} step closed with {len(have)} of the {len(self.expected)} "
                              f"agents it waited for, fewer than the threshold {t}: the round cannot be unmasked")
        step = STEPS[self.step]
        if step == "keys":
            total = sum(self.weights[a] for a in have)
            self.alpha = {a: self.weights[a] / total for a in sorted(have)}
        elif step == "shares":
            self.server.sealed = {a: s for a, s in self.server.sealed.items() if a in have}
        elif step == "masked":
            self.survivors, self.dropped, self.excluded = self.server.unmask_request()
            have = set(self.survivors)
            if self.excluded:
                log.warning("secure aggregation: the shares of %s opened for fewer than the threshold of the "
                            "survivors; they are left out of this round's sum (by %s's pairwise seeds)",
                            ", ".join(self.excluded), ", ".join(self.survivors))
        self.step += 1
        self.expected = set(have) if step != "answer" else set()
        self.deadline = now + self.timeout
        return True

    @property
    def done(self) -> bool:
        return self.step >= len(STEPS)

    def reply(self, agent_id: str, step: str) -> dict[str, Any] | None:
        """What ``step`` gives ``agent_id`` once it has closed (None while it is open)."""
        k = STEPS.index(step)
        if self.step <= k:
            return None
        if step == "keys":
            return {"roster": {a: self.server.roster[a] for a in self.alpha}, "alpha": dict(self.alpha),
                    "threshold": self.params.threshold}
        if step == "shares":
            return {"sealed": self.server.shares_for(agent_id), "shared": self.server.shared}
        if step == "masked":
            return {"survivors": list(self.survivors), "dropped": list(self.dropped), "excluded": list(self.excluded)}
        return {"done": True}

    def total(self) -> np.ndarray:
        """The survivors' sum (once every step has closed), checked: its last value, the summed
        weight, must be the survivors' public weights' total within the fixed point's rounding.
        Shares off the polynomial are left out where more than the threshold answered; a sum
        that does not check out raises SecAggError, and nothing is made of it."""
        want = sum(self.alpha[a] for a in self.survivors)
        bound = rounding_bound(len(self.survivors), self.params)

        def weight_fits(last: np.uint64) -> bool:
            return abs(float(dequantize(np.array([last]), self.params)[0]) - want) <= bound

        try:
            out = self.server.finish(self.answers, weight_fits)
        except SecAggError as e:
            raise SecAggError(f"the unmasking: {e}") from None
        if self.server.left_out:
            log.warning("secure aggregation: the unmasking shares of %s do not fit the others'; the sum was "
                        "made without them", ", ".join(self.server.left_out))
        return out
