"""Secure aggregation (Bonawitz et al. 2017, "Practical Secure Aggregation for Privacy-Preserving
Machine Learning", the semi-honest protocol with dropouts): the aggregator learns the sum of the
agents' vectors and nothing else about any one of them.

The protocol only, with no I/O: every message is a value (bytes and dicts of bytes) that a caller
carries. The primitives are well-kept libraries': X25519 key agreement, HKDF-SHA256, ChaCha20 as
the mask generator and ChaCha20-Poly1305 for the shares come from ``cryptography``; Shamir's
secret sharing of 16-byte seeds (over GF(2^128)) from PyCryptodome.

One round, for the agents U that take part (n of them; threshold t):

1. **Keys.** Each agent makes two X25519 key pairs: one to encrypt shares to its peers, one whose
   agreement with each peer's gives their pairwise mask seed. The second's private key comes
   from a 16-byte seed so that it can be shared. The aggregator relays the public keys.
2. **Shares.** Each agent draws a self-mask seed b_u and splits both seeds into n Shamir shares,
   any t of which rebuild them. It encrypts each peer's two shares to that peer (the key from their
   agreement, the round and both ids authenticated). The aggregator relays the ciphertexts, which
   it cannot read. U2: the agents whose shares came.
3. **Masked input.** Each agent u of U2 sends y_u = x_u + PRG(b_u) + sum over peers v of U2 of
   +-PRG(s_uv) in Z_(2^64) (+ when u's id sorts before v's). U3: those whose y_u came.
4. **Unmasking.** The aggregator tells the agents of U3 who survived (U3) and who dropped
   (U2 - U3). Each answers once per round: for a survivor, its share of b_v; for a dropped agent,
   its share of its pairwise seed; never both for one agent (both would unmask that agent's
   input), and not at all when fewer than t survived. With t answers the aggregator rebuilds the
   survivors' self masks and the dropped agents' pairwise masks with the survivors, and
   subtracts them: what remains is the survivors' sum.

**A sender whose shares do not open.** An agent that cannot open a peer's sealed shares (a hostile
peer can seal right-length garbage) does not stop: it names that sender with its masked input
(``unopened``). A sender that fewer than t of the survivors can open is **excluded** (E): its
masked input, if it came, is left out of the sum, and each survivor u answers for it with the
pairwise seed s_uv itself, not a share. That is what the aggregator would rebuild for a dropped
agent from the shares, and it gives nothing of b_v: v's input stays masked. Excluding a sender
needs every survivor's answer (a survivor's pairwise mask with v can come only from it).


Vectors are fixed point in Z_(2^64): :func:`quantize` clips each value to [-clip, clip] and keeps
``frac_bits`` fractional bits. A sum of n of them is exact while n * clip * 2^frac_bits < 2^63;
its rounding error is at most n * 2^-(frac_bits + 1) per entry (:func:`rounding_bound`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

RING_BITS = 64
SEED_BYTES = 16
PAIR_SEED_BYTES = 32  # a pairwise mask's seed (HKDF-SHA256's output)
# The domain of every derived key: a key of one use is never one of another.
_PAIR_INFO, _SHARE_INFO, _SELF_INFO, _SK_INFO = (b"fedrl secagg v1 " + s for s in
                                                 (b"pairwise mask", b"share key", b"self mask", b"mask key"))


class SecAggError(Exception):
    """A step of the protocol that cannot go on; the message says why."""


@dataclass(frozen=True)
class SecAggParams:
    """One round's settings. ``context`` names the round (run id, round), bound into every key and
    ciphertext: nothing of one round serves in another."""

    threshold: int
    context: bytes
    frac_bits: int = 32
    clip: float = 2.0 ** 15

    def __post_init__(self) -> None:
        if self.threshold < 2:
            raise SecAggError(f"threshold {self.threshold}: at least 2 (one agent's sum is its input)")
        if not 0 <= self.frac_bits <= 48:
            raise SecAggError(f"frac_bits {self.frac_bits}: in [0, 48]")
        if not 0 < self.clip:
            raise SecAggError(f"clip {self.clip}: positive")

    def check_capacity(self, n: int) -> None:
        """Refuse ``n`` agents whose clipped sum could wrap around the ring."""
        if n * self.clip * 2.0 ** self.frac_bits >= 2.0 ** (RING_BITS - 1):
            raise SecAggError(f"{n} agents x clip {self.clip} x 2^{self.frac_bits} reaches 2^63: the sum "
                              "could wrap; lower clip or frac_bits")


# ---------------------------------------------------------------------------------------------
# fixed point
# ---------------------------------------------------------------------------------------------
def quantize(x: np.ndarray, params: SecAggParams) -> np.ndarray:
    """``x`` clipped to [-clip, clip], times 2^frac_bits, rounded, as uint64 (two's complement)."""
    v = np.clip(np.asarray(x, dtype=np.float64), -params.clip, params.clip)
    return np.rint(v * 2.0 ** params.frac_bits).astype(np.int64).view(np.uint64)


def dequantize(s: np.ndarray, params: SecAggParams) -> np.ndarray:
    """A ring element (a sum of quantized vectors) back to float64."""
    return np.asarray(s, dtype=np.uint64).view(np.int64).astype(np.float64) / 2.0 ** params.frac_bits


def rounding_bound(n: int, params: SecAggParams) -> float:
    """The most a dequantized sum of ``n`` vectors inside [-clip, clip] can differ from theirs."""
    return n * 2.0 ** -(params.frac_bits + 1)


# ---------------------------------------------------------------------------------------------
# primitives, all from cryptography / PyCryptodome
# ---------------------------------------------------------------------------------------------
def _hkdf(secret: bytes, info: bytes, context: bytes, length: int = 32) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=length, salt=hashlib.sha256(context).digest(),
                info=info).derive(secret)


def _x25519_from_seed(seed: bytes, context: bytes):
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    return X25519PrivateKey.from_private_bytes(_hkdf(seed, _SK_INFO, context))


def _public_bytes(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _agree(private, peer_public: bytes) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

    try:
        return private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as e:  # a malformed or low-order public key
        raise SecAggError(f"a public key cannot be used: {e}") from None


def prg(seed: bytes, size: int) -> np.ndarray:
    """``size`` uint64 values from a 32-byte seed: the ChaCha20 keystream, nonce zero (each seed
    is used for one mask only)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    enc = Cipher(algorithms.ChaCha20(seed, b"\0" * 16), mode=None).encryptor()
    return np.frombuffer(enc.update(b"\0" * (8 * size)), dtype=np.uint64)


def prg_at(seed: bytes, index: int) -> np.uint64:
    """``prg(seed, n)[index]`` for any n > index, without the values before it: the keystream
    from the 64-byte block that holds it (ChaCha20's counter is the nonce's first 4 bytes)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    block, offset = divmod(8 * index, 64)
    enc = Cipher(algorithms.ChaCha20(seed, block.to_bytes(4, "little") + b"\0" * 12), mode=None).encryptor()
    return np.frombuffer(enc.update(b"\0" * 64)[offset:offset + 8], dtype=np.uint64)[0]


def usable_key(public: bytes) -> bool:
    """Whether ``public`` is an X25519 public key an agreement can use: 32 bytes, and not a point
    of small order (whose agreement with any key is zero, so that a mask or share key made from
    it is known to everyone)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

    if len(public) != 32:
        return False
    try:
        X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:
        return False
    return True


def _seal(key: bytes, plain: bytes, aad: bytes) -> bytes:
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    nonce = os.urandom(12)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plain, aad)


def _open(key: bytes, sealed: bytes, aad: bytes) -> bytes:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    try:
        return ChaCha20Poly1305(key).decrypt(sealed[:12], sealed[12:], aad)
    except (InvalidTag, ValueError):
        raise SecAggError("a share's ciphertext does not authenticate (altered, or not for this agent "
                          "or round)") from None


def _split(secret: bytes, t: int, n: int) -> list[tuple[int, bytes]]:
    from Crypto.Protocol.SecretSharing import Shamir

    return Shamir.split(t, n, secret)


def _combine(shares: Iterable[tuple[int, bytes]]) -> bytes:
    from Crypto.Protocol.SecretSharing import Shamir

    return Shamir.combine(list(shares))


def _aad(params: SecAggParams, sender: str, receiver: str) -> bytes:
    return b"\0".join((params.context, sender.encode(), receiver.encode()))


# ---------------------------------------------------------------------------------------------
# the agent's side
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PublicKeys:
    """What an agent advertises: its key for shares, its key for pairwise masks."""

    share_key: bytes
    mask_key: bytes


class AgentSession:
    """One agent's part in one round."""

    def __init__(self, agent_id: str, params: SecAggParams, random: Callable[[int], bytes] = os.urandom) -> None:
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

        self.id, self.params = agent_id, params
        self._share_sk = X25519PrivateKey.generate()
        self._mask_seed = random(SEED_BYTES)
        self._mask_sk = _x25519_from_seed(self._mask_seed, params.context)
        self._self_seed = random(SEED_BYTES)
        self._roster: dict[str, PublicKeys] = {}
        self._index: dict[str, int] = {}
        self._held: dict[str, tuple[bytes, bytes]] = {}  # peer -> (its mask-seed share, its self-seed share)
        self._answered = False
        self._masked_for: frozenset[str] | None = None

    def advertise(self) -> PublicKeys:
        return PublicKeys(_public_bytes(self._share_sk), _public_bytes(self._mask_sk))

    def share_keys(self, roster: Mapping[str, PublicKeys]) -> dict[str, bytes]:
        """The encrypted shares of both seeds, one ciphertext per peer of ``roster`` (U1, which
        must hold this agent's own keys unchanged and at least ``threshold`` agents)."""
        if self._roster:
            raise SecAggError(f"agent {self.id}: shares were already made for this round")
        mine = roster.get(self.id)
        if mine != self.advertise():
            raise SecAggError(f"agent {self.id}: the roster does not hold this agent's own keys")
        if len(roster) < self.params.threshold:
            raise SecAggError(f"{len(roster)} agents advertised keys, fewer than the threshold "
                              f"{self.params.threshold}")
        if len({k.share_key for k in roster.values()} | {k.mask_key for k in roster.values()}) != 2 * len(roster):
            raise SecAggError("two agents of the roster advertise the same key")
        self.params.check_capacity(len(roster))
        ids = sorted(roster)
        self._roster = dict(roster)
        self._index = {a: i + 1 for i, a in enumerate(ids)}  # Shamir's points 1..n
        t, n = self.params.threshold, len(ids)
        mask_shares = dict(_split(self._mask_seed, t, n))
        self_shares = dict(_split(self._self_seed, t, n))
        out = {}
        for peer in ids:
            i = self._index[peer]
            plain = mask_shares[i] + self_shares[i]
            key = _hkdf(_agree(self._share_sk, roster[peer].share_key), _SHARE_INFO, self.params.context)
            out[peer] = _seal(key, plain, _aad(self.params, self.id, peer))
        return out

    def receive_shares(self, sealed: Mapping[str, bytes]) -> list[str]:
        """The ciphertexts addressed to this agent, by sender; each is opened and kept. A sender
        whose ciphertext does not open (altered, garbage, or not for this agent and round) is
        kept in :attr:`unopened`, not raised: one hostile sender must not stop the round. Returns
        the senders not opened by this call."""
        if not self._roster:
            raise SecAggError(f"agent {self.id}: shares came before the roster")
        bad = []
        for sender, blob in sealed.items():
            if sender not in self._roster:
                raise SecAggError(f"a share from {sender!r}, who is not in the round's roster")
            try:
                key = _hkdf(_agree(self._share_sk, self._roster[sender].share_key), _SHARE_INFO, self.params.context)
                plain = _open(key, blob, _aad(self.params, sender, self.id))
            except SecAggError:
                bad.append(sender)
                continue
            if len(plain) != 2 * SEED_BYTES:
                bad.append(sender)
                continue
            self._held[sender] = (plain[:SEED_BYTES], plain[SEED_BYTES:])
        return bad

    @property
    def unopened(self) -> list[str]:
        """The peers of the roster whose shares for this agent have not opened (or not come)."""
        return sorted(a for a in self._roster if a not in self._held and a != self.id)

    def masked_input(self, x: np.ndarray, shared: Iterable[str]) -> np.ndarray:
        """``x`` (uint64, already quantized) masked for the agents ``shared`` (U2: those whose
        shares were sent; it must include this agent)."""
        u2 = frozenset(shared)
        if self.id not in u2 or not u2 <= set(self._roster):
            raise SecAggError(f"agent {self.id}: the agents that shared must include it and be in the roster")
        if len(u2) < self.params.threshold:
            raise SecAggError(f"{len(u2)} agents shared, fewer than the threshold {self.params.threshold}")
        if self._masked_for is not None:
            raise SecAggError(f"agent {self.id}: already sent its masked input for this round")
        self._masked_for = u2
        x = np.asarray(x, dtype=np.uint64)
        y = x + prg(_hkdf(self._self_seed, _SELF_INFO, self.params.context), x.size)
        for peer in sorted(u2 - {self.id}):
            m = pairwise_mask(self._mask_sk, self._roster[peer].mask_key, self.id, peer, self.params, x.size)
            y = y + m
        return y

    def unmask(self, survivors: Iterable[str], dropped: Iterable[str], excluded: Iterable[str] = ()) -> Answer:
        """What the aggregator may have: for each survivor its self-seed share, for each dropped
        agent its mask-seed share (each only where this agent opened that sender's shares), and
        for each excluded agent (:attr:`ServerSession.excluded`) this agent's pairwise seed with
        it. Answered once per round, only to a request whose three sets are disjoint, together
        the agents that shared (U2), with at least ``threshold`` survivors including this agent."""
        u3, d, e = frozenset(survivors), frozenset(dropped), frozenset(excluded)
        if self._answered:
            raise SecAggError(f"agent {self.id}: it already answered an unmasking request this round; a "
                              "second could ask for the other share of an agent")
        if u3 & d:
            raise SecAggError(f"the request names {sorted(u3 & d)} as both survived and dropped: both shares "
                              "of one agent would unmask its input")
        if e & (u3 | d):
            raise SecAggError(f"the request names {sorted(e & (u3 | d))} as excluded and also as survived or "
                              "dropped")
        if self._masked_for is None or u3 | d | e != self._masked_for or self.id not in u3:
            raise SecAggError(f"agent {self.id}: the request's agents are not those it masked for")
        if len(u3) < self.params.threshold:
            raise SecAggError(f"{len(u3)} agents survived, fewer than the threshold {self.params.threshold}")
        self._answered = True
        point = self._index[self.id]
        # for a survivor only its self-seed share, for a dropped agent only its mask-seed share
        shares = {a: (point, self._held[a][1] if a in u3 else self._held[a][0]) for a in u3 | d if a in self._held}
        seeds = {v: _pair_seed(self._mask_sk, self._roster[v].mask_key, self.id, v, self.params) for v in sorted(e)}
        return Answer(shares, seeds)


@dataclass(frozen=True)
class Answer:
    """One agent's answer to the unmasking: ``shares`` by agent, as (its Shamir point, the
    share); ``pair_seeds``: its pairwise seed with each excluded agent."""

    shares: dict[str, tuple[int, bytes]]
    pair_seeds: dict[str, bytes] = field(default_factory=dict)


def pairwise_mask(private, peer_public: bytes, me: str, peer: str, params: SecAggParams, size: int) -> np.ndarray:
    """The mask ``me`` adds for ``peer``: +PRG(s) when ``me`` sorts first, -PRG(s) otherwise, where
    s is their X25519 agreement run through HKDF with both ids: the two masks cancel in a sum."""
    return _signed(prg(_pair_seed(private, peer_public, me, peer, params), size), me, peer)


def _signed(m, me: str, peer: str):
    """The pairwise mask ``m`` (a vector or one value) as ``me`` adds it for ``peer``: + when
    ``me`` sorts first, - otherwise, so that the two agents' masks cancel in a sum."""
    return m if me < peer else (np.uint64(0) - m)


def _pair_seed(private, peer_public: bytes, me: str, peer: str, params: SecAggParams) -> bytes:
    lo, hi = sorted((me, peer))
    return _hkdf(_agree(private, peer_public), _PAIR_INFO + b"\0" + lo.encode() + b"\0" + hi.encode(),
                 params.context)


# ---------------------------------------------------------------------------------------------
# the aggregator's side
# ---------------------------------------------------------------------------------------------
@dataclass
class ServerSession:
    """The aggregator's part in one round: it relays and finally unmasks, and sees only ciphertexts,
    masked inputs and the shares it is allowed."""

    params: SecAggParams
    roster: dict[str, PublicKeys] = field(default_factory=dict)
    sealed: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sender -> receiver -> blob
    masked: dict[str, np.ndarray] = field(default_factory=dict)
    unopened: dict[str, frozenset[str]] = field(default_factory=dict)  # by agent: whose shares it could not open

    def add_keys(self, agent_id: str, keys: PublicKeys) -> None:
        """Take ``agent_id``'s two public keys; refused unless each is a usable X25519 point that
        no agent (itself included) has advertised this round: a repeated or small-order key
        would make a mask or a share's key that others know, or fail every peer's step later."""
        if agent_id in self.roster:
            raise SecAggError(f"agent {agent_id} already advertised its keys this round")
        for name, k in (("share", keys.share_key), ("mask", keys.mask_key)):
            if not usable_key(k):
                raise SecAggError(f"{agent_id}'s {name} key is not a usable X25519 public key (32 bytes, not "
                                  "of small order)")
        taken = {k for pk in self.roster.values() for k in (pk.share_key, pk.mask_key)}
        if keys.share_key == keys.mask_key or {keys.share_key, keys.mask_key} & taken:
            raise SecAggError(f"{agent_id} advertises a key that this round has already seen")
        self.roster[agent_id] = keys

    def add_shares(self, agent_id: str, sealed: Mapping[str, bytes]) -> None:
        if agent_id not in self.roster:
            raise SecAggError(f"shares from {agent_id}, who advertised no keys")
        if set(sealed) != set(self.roster):
            raise SecAggError(f"shares from {agent_id} are not one per agent of the roster")
        self.sealed[agent_id] = dict(sealed)

    def shares_for(self, agent_id: str) -> dict[str, bytes]:
        """The ciphertexts addressed to ``agent_id``, by sender."""
        return {s: blobs[agent_id] for s, blobs in self.sealed.items()}

    @property
    def shared(self) -> list[str]:
        """U2: the agents whose shares came."""
        return sorted(self.sealed)

    def add_masked(self, agent_id: str, y: np.ndarray, unopened: Iterable[str] = ()) -> None:
        """Take ``agent_id``'s masked input, and the senders whose shares it could not open."""
        if agent_id not in self.sealed:
            raise SecAggError(f"a masked input from {agent_id}, whose shares did not come")
        if self.masked and next(iter(self.masked.values())).shape != np.shape(y):
            raise SecAggError(f"a masked input from {agent_id} of another size")
        unopened = set(unopened)
        if not unopened <= set(self.sealed) - {agent_id}:
            raise SecAggError(f"{agent_id} names shares it could not open from {sorted(unopened)}: only other "
                              "agents that shared can be named")
        self.masked[agent_id] = np.asarray(y, dtype=np.uint64)
        self.unopened[agent_id] = frozenset(unopened)

    def unmask_request(self) -> Unmask:
        """Who survived (U3, less the excluded), who dropped (U2 - U3, less the excluded) and who is
        excluded: the agents that shared whose shares fewer than ``threshold`` of the remaining
        survivors opened (themselves included), found by leaving such agents out until none is
        left. Once every masked input that will come has come."""
        t = self.params.threshold
        u3 = set(self.masked)
        if len(u3) < t:
            raise SecAggError(f"{len(u3)} masked inputs came, fewer than the threshold {t}: "
                              "the round cannot be unmasked")
        excluded: set[str] = set()
        while True:
            alive = u3 - excluded
            if len(alive) < t:
                raise SecAggError(f"{len(u3)} masked inputs came, but the shares of {sorted(excluded)} opened for "
                                  f"fewer than the threshold {t} of the survivors: {len(alive)} are left, the round "
                                  "cannot be unmasked")
            more = {v for v in self.shared if v not in excluded
                    and sum(v not in self.unopened.get(u, ()) for u in alive) < t}
            if not more:
                break
            excluded |= more
        survivors = sorted(u3 - excluded)
        return Unmask(survivors, [a for a in self.shared if a not in u3 and a not in excluded], sorted(excluded))

    def finish(self, answers: Mapping[str, Answer], check: Callable[[np.uint64], bool] | None = None) -> np.ndarray:
        """The survivors' sum from the agents' ``answers`` to :meth:`unmask_request` (at least
        ``threshold`` of them). With ``check`` (a test of the sum's last value, which the caller
        can predict: the survivors' summed weight), the sum must pass it. Where more than
        ``threshold`` answered and it does not, each answering agent's shares are left out in
        turn: the sum of the first set that passes is returned (:attr:`left_out` names whose
        were), so that one agent's shares off the polynomial cannot make a wrong sum. Only the
        last value is unmasked to test a set (:func:`prg_at`); the whole sum only once. With
        excluded agents, every survivor's pairwise seeds with them are needed."""
        u3, dropped, excluded = self.unmask_request()
        answers = {a: r for a, r in answers.items() if a in u3}
        if len(answers) < self.params.threshold:
            raise SecAggError(f"{len(answers)} agents answered the unmasking, fewer than the threshold "
                              f"{self.params.threshold}: the sum cannot be recovered")
        if excluded:
            silent = sorted(u for u in u3 if u not in answers or set(answers[u].pair_seeds) != set(excluded))
            if silent:
                raise SecAggError(f"{sorted(excluded)} are excluded (their shares did not open), and {silent} gave no "
                                  "pairwise seeds with them: the survivors' masks with them cannot be removed")
        pairs = {(u, v): bytes(answers[u].pair_seeds[v]) for u in u3 for v in excluded}
        if any(len(seed) != PAIR_SEED_BYTES for seed in pairs.values()):
            raise SecAggError(f"a pairwise seed is {PAIR_SEED_BYTES} bytes")
        size = next(iter(self.masked.values())).size
        self.left_out: list[str] = []
        if check is None:
            return self._unmasked(self._seeds(answers, u3, dropped), pairs, u3, size)
        names = sorted(answers)
        tries = [[]] + ([[a] for a in names] if len(answers) > self.params.threshold else [])
        for out in tries:
            try:
                seeds = self._seeds({a: r for a, r in answers.items() if a not in out}, u3, dropped)
            except (SecAggError, ValueError):  # shares that rebuild no key, or a malformed share
                continue
            if check(self._unmasked_at(seeds, pairs, u3, size - 1)):
                self.left_out = out
                return self._unmasked(seeds, pairs, u3, size)
        raise SecAggError(f"the unmasked sum does not check out with the answers of {len(answers)} agents"
                          + (", nor with any one agent's left out" if len(tries) > 1 else
                             f" (no answer to spare beyond the threshold {self.params.threshold})")
                          + ": an answer or a masked vector is wrong")

    def _seeds(self, answers: Mapping[str, Answer], u3: list[str],
               dropped: list[str]) -> tuple[dict[str, bytes], dict[str, object]]:
        """Each survivor's self-mask seed and each dropped agent's mask key, from ``answers``: each
        from the answers that hold a share of it, at least ``threshold`` of them."""
        def combine(a: str) -> bytes:
            held = [r.shares[a] for r in answers.values() if a in r.shares]
            if len(held) < self.params.threshold:
                raise SecAggError(f"{len(held)} answers hold a share of {a}'s seed, fewer than the threshold "
                                  f"{self.params.threshold}")
            return _combine(held)

        self_seeds = {u: _hkdf(combine(u), _SELF_INFO, self.params.context) for u in u3}
        keys = {}
        for v in dropped:
            sk = _x25519_from_seed(combine(v), self.params.context)
            if _public_bytes(sk) != self.roster[v].mask_key:
                raise SecAggError(f"the shares of {v}'s mask key rebuild another key: an answer is wrong")
            keys[v] = sk
        return self_seeds, keys

    def _unmasked(self, seeds, pairs: Mapping[tuple[str, str], bytes], u3: list[str], size: int) -> np.ndarray:
        self_seeds, keys = seeds
        total = np.zeros(size, dtype=np.uint64)
        for a in u3:
            total += self.masked[a]
        for a in u3:  # each survivor's self mask
            total -= prg(self_seeds[a], size)
        for v, sk in keys.items():  # each dropped agent's pairwise masks with the survivors
            for u in u3:
                # u added pairwise_mask(u, v); the same mask, computed from v's side, is its negative
                total += pairwise_mask(sk, self.roster[u].mask_key, v, u, self.params, size)
        for (u, v), seed in pairs.items():  # each survivor's pairwise mask with an excluded agent
            total -= _signed(prg(seed, size), u, v)
        return total

    def _unmasked_at(self, seeds, pairs: Mapping[tuple[str, str], bytes], u3: list[str], index: int) -> np.uint64:
        """:meth:`_unmasked`'s value at ``index`` alone."""
        self_seeds, keys = seeds
        with np.errstate(over="ignore"):
            x = np.uint64(0)
            for a in u3:
                x += self.masked[a][index] - prg_at(self_seeds[a], index)
            for v, sk in keys.items():
                for u in u3:
                    x += _signed(prg_at(_pair_seed(sk, self.roster[u].mask_key, v, u, self.params), index), v, u)
            for (u, v), seed in pairs.items():
                x -= _signed(prg_at(seed, index), u, v)
        return x


class Unmask(NamedTuple):
    """The aggregator's unmasking request: the survivors, the dropped, the excluded."""

    survivors: list[str]
    dropped: list[str]
    excluded: list[str]


# ---------------------------------------------------------------------------------------------
# the protocol's first two steps, every agent in this process
# ---------------------------------------------------------------------------------------------
def share_in_process(ids: Iterable[str], params: SecAggParams) -> tuple[dict[str, AgentSession], ServerSession]:
    """Steps 1 and 2 for agents ``ids``, all in this process: keys advertised, shares relayed and
    opened. Returns the agents' sessions and the aggregator's."""
    agents = {a: AgentSession(a, params) for a in ids}
    server = ServerSession(params)
    for a, s in agents.items():
        server.add_keys(a, s.advertise())
    for a, s in agents.items():
        server.add_shares(a, s.share_keys(server.roster))
    for a, s in agents.items():
        s.receive_shares(server.shares_for(a))
    return agents, server

