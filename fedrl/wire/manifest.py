"""What travels beside the weights, without torch: the manifest, its tensor list, the checksum, the
size limits, and a payload ready to send (:class:`Encoded`). :mod:`fedrl.wire.codec` turns
tensors into these and back; a client that only talks to the services (``fedrl ctl``) loads this
and never torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import xxhash

CHUNK_BYTES = 1 << 20
ENCODING = "safetensors"
# The payload's checksum (wire contract v2): XXH3-128, 32 hex digits. It guards against damage in
# transit and in memory, not against a forger (TLS and tokens do that); sha256 cost a round ~3.5x
# the CPU here (benchmarks in docs/performance.md).
CHECKSUM = "xxh3-128"


def checksum(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)
# Message size limit set on every channel and server: a chunk plus headroom for the manifest.
MAX_MESSAGE_BYTES = 8 << 20
# Weights up to this size travel inside one message (a TRAIN task's base version, an inline update):
# half the message limit leaves room for the manifest and the rest of the message.
INLINE_MAX_BYTES = 4 << 20
MAX_PAYLOAD_BYTES = 2 << 30  # refuse manifests declaring more than 2 GiB
MAX_HEADER_ALLOWANCE = 1 << 20  # safetensors JSON header + metadata a payload may add to its tensors' bytes


class CodecError(ValueError):
    """Weights that cannot be accepted. ``reason`` is a stable, bounded label (metrics, tests)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TensorSpec(NamedTuple):
    """One tensor a manifest lists (a tuple: manifests of one layout compare and hash in C)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Manifest:
    run_id: str
    round: int
    base_version: int
    tensors: tuple[TensorSpec, ...]
    num_samples: int
    total_bytes: int
    checksum: str  # XXH3-128 of the payload, hex
    encoding: str = ENCODING

    def spec(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}


class Encoded:
    """A payload ready to send, and its manifest.

    :func:`encode` keeps the payload as the pieces it is made of (its header, then each tensor's
    bytes: views of the tensors, not copies), so a payload sent as chunks is copied once, into
    the chunk messages (:meth:`chunk_views`), instead of into a whole payload first and then again
    into each chunk (a 30 MB model's update: one 30 MB copy less per agent a round). ``payload``
    joins the pieces on first use (an inline message, a stored version) and keeps the result.
    The tensors must not change until the payload is sent or joined: the checksum, taken when it
    was encoded, would then refuse it on the other side."""

    __slots__ = ("_payload", "_pieces", "chunk_bytes", "frame", "framed", "manifest")

    def __init__(self, manifest: Manifest, payload: bytes | None = None, chunk_bytes: int = CHUNK_BYTES,
                 *, pieces: Sequence[bytes | memoryview] | None = None, frame: Callable[[int], bytes] | None = None,
                 framed: Sequence[bytes] | None = None) -> None:
        if (payload is None) == (pieces is None):
            raise TypeError("Encoded takes a payload or its pieces")
        self.manifest = manifest
        self.chunk_bytes = chunk_bytes
        # Where encode() was given a frame: each chunk already copied into a message, the
        # frame's bytes (as frame(len(chunk)) gave them) then the chunk's (see encode()).
        self.frame = frame
        self.framed = None if framed is None else tuple(framed)
        self._payload = payload
        self._pieces = None if pieces is None else tuple(memoryview(x).cast("B") for x in pieces)

    @property
    def payload(self) -> bytes:
        """The whole payload (joined from its pieces once, then kept)."""
        if self._payload is None:
            self._payload = b"".join(self._pieces or ())
            self._pieces = None  # the tensors are no longer needed
        return self._payload

    def pieces(self) -> tuple[memoryview, ...]:
        """The payload's bytes in order, as views (no copies): of the payload once it is joined,
        of the header and the tensors before (a stored version is written from these)."""
        return (memoryview(self._payload),) if self._pieces is None else self._pieces

    def chunk_views(self) -> Iterator[list[memoryview]]:
        """Each ``chunk_bytes`` span of the payload as the views that make it up (no copies)."""
        return _chunk_views(self.pieces(), self.chunk_bytes)

    def chunks(self) -> Iterator[bytes]:
        """The payload in ``chunk_bytes`` pieces."""
        for views in self.chunk_views():
            yield b"".join(views)


def _chunk_views(pieces: Sequence[memoryview], chunk_bytes: int) -> Iterator[list[memoryview]]:
    """Each ``chunk_bytes`` span of the bytes of ``pieces`` (in order) as the views that make it
    up (no copies); the last span what is left."""
    out: list[memoryview] = []
    room = chunk_bytes
    for mv in pieces:
        while len(mv):
            take = mv[:room]
            out.append(take)
            mv = mv[len(take):]
            room -= len(take)
            if room == 0:
                yield out
                out, room = [], chunk_bytes
    if out:
        yield out
