"""Weights on the wire: ``state_dict`` <-> a manifest plus ~1 MiB chunks of one safetensors file.

No pickle anywhere: the payload is a safetensors file (a JSON header and raw little-endian
tensor bytes). The decoder checks the declared size, the checksum (XXH3-128, since wire contract
v2; v1 carried a sha256: see docs/performance.md), that the payload's tensors are
exactly the manifest's (names, dtypes, shapes) and that every float is finite, before any tensor
is used. Protobuf types stop at the servicers: this module knows plain Python only. The file
format itself, written and parsed, is :mod:`fedrl.wire.tensorfile`'s.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import torch
import xxhash

from fedrl.wire.manifest import (  # noqa: F401 - the names the codec's users import from here
    CHECKSUM,
    CHUNK_BYTES,
    ENCODING,
    INLINE_MAX_BYTES,
    MAX_HEADER_ALLOWANCE,
    MAX_MESSAGE_BYTES,
    MAX_PAYLOAD_BYTES,
    CodecError,
    Encoded,
    Manifest,
    TensorSpec,
    _chunk_views,
    checksum,
)
from fedrl.wire.memory import BufferPool
from fedrl.wire import tensorfile as tf

def encode(state: Mapping[str, torch.Tensor], run_id: str = "", round: int = 0,
           base_version: int = 0, num_samples: int = 0,
           chunk_bytes: int = CHUNK_BYTES, metadata: Mapping[str, str] | None = None,
           frame: Callable[[int], bytes] | None = None) -> Encoded:
    """Serialise ``state`` (CPU tensors) as safetensors and describe it in a manifest (the
    payload kept as views of the tensors until it is sent or joined: see :class:`Encoded`).

    ``metadata`` is written into the file's header (covered by the checksum; decoders ignore it):
    the aggregator stores the very bytes it sends, with the version's provenance inside.

    ``frame``, for a payload that will be sent as chunk messages: ``frame(n)`` gives the bytes
    that open a message of a chunk of ``n`` bytes, and each chunk is copied into its message
    here (:attr:`Encoded.framed`) and hashed there, while it is in cache. Hashing the tensors
    and copying them into messages later read a large model twice from memory; this reads it
    once (a 30 MB update: ~1 ms less of an agent's CPU a round, measured in docs/performance.md)."""
    tensors = {k: v if _plain(v) else v.detach().to("cpu").contiguous() for k, v in state.items()}
    layout = tf.layout_of(tensors)
    pieces = [memoryview(x).cast("B") for x in tf.pieces(tensors, layout, metadata)]
    h = xxhash.xxh3_128()
    framed = None
    if frame is None:
        for x in pieces:  # the same digest as one pass over the joined payload
            h.update(x)
    else:
        framed = []
        for views in _chunk_views(pieces, chunk_bytes):
            key = frame(sum(map(len, views)))
            msg = b"".join((key, *views))
            h.update(memoryview(msg)[len(key):])  # the chunk, as it now lies in its message
            framed.append(msg)
    m = Manifest(run_id, int(round), int(base_version), _specs(layout), int(num_samples),
                 sum(map(len, pieces)), h.hexdigest())
    return Encoded(m, chunk_bytes=chunk_bytes, pieces=pieces, frame=frame, framed=framed)


@functools.lru_cache(maxsize=16)
def _specs(layout: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]) -> tuple[TensorSpec, ...]:
    """A manifest's tensor list (sorted by name) for a layout; cached like the header."""
    return tuple(TensorSpec(k, tf.dtype_name(dtype), shape) for k, dtype, shape in sorted(layout, key=lambda e: e[0]))


def _plain(t: torch.Tensor) -> bool:
    """Already what the writer reads: a contiguous CPU tensor outside autograd (attribute
    checks, cheaper than three no-op tensor calls per tensor each round)."""
    return t.device.type == "cpu" and not t.requires_grad and t.is_contiguous()


def encoded_from_payload(payload: bytes, run_id: str = "", round: int = 0, base_version: int = 0,
                         num_samples: int = 0, chunk_bytes: int = CHUNK_BYTES) -> Encoded:
    """An already written safetensors file (e.g. a stored global version) ready to send as is:
    its tensors are checked and listed in the manifest, nothing is re-serialised."""
    tensors = tf.parse_safetensors(payload)
    specs = tuple(TensorSpec(k, tf.dtype_name(v.dtype), tuple(v.shape)) for k, v in sorted(tensors.items()))
    m = Manifest(run_id, int(round), int(base_version), specs, int(num_samples), len(payload),
                 checksum(payload))
    return Encoded(m, bytes(payload), chunk_bytes)


class Assembler:
    """Receives chunks for a manifest into one buffer of the declared size; refuses anything
    past it. The buffer is allocated once (untouched pages cost no memory until chunks land in
    them), so a 30 MB update is not copied again each time it grows; a payload that comes whole
    (an inline message) is copied once, with no zero-filled buffer first.

    Each chunk is hashed as it lands (the bytes in the buffer, which are what gets used), so
    the checksum is done when the last chunk is: hashing runs while the sender is still sending,
    instead of as one pass over the whole payload after the stream ends."""

    def __init__(self, manifest: Manifest, pool: BufferPool | None = None, grow: bool = False) -> None:
        """``grow``: the buffer grows with the bytes received instead of being sized from the
        declaration first (a server that takes payloads from callers it does not trust: its
        memory then follows what was sent, not what was claimed)."""
        check_manifest(manifest)
        self.manifest = manifest
        self.pool = pool  # where the buffer comes from, if anywhere (reused round after round)
        self.grow = grow
        self.buf: bytearray | memoryview | None = None
        self.received = 0
        self._hash = xxhash.xxh3_128()
        self.flat: Flat | None = None  # set by finish() where the tensors are one span

    def add(self, chunk: bytes | memoryview) -> None:
        n, total = len(chunk), self.manifest.total_bytes
        if self.received + n > total:
            raise CodecError("oversize", f"chunks exceed the declared {total} bytes")
        if self.grow:
            if self.buf is None:
                self.buf = bytearray()
            self.buf += chunk
            self._hash.update(memoryview(self.buf)[self.received:self.received + n])
            self.received += n
            return
        if self.buf is None:
            if n == total and self.pool is None:
                self.buf, self.received = bytearray(chunk), n
                self._hash.update(self.buf)
                return
            self.buf = bytearray(total) if self.pool is None else self.pool.take(total)
        self.buf[self.received:self.received + n] = chunk
        self._hash.update(memoryview(self.buf)[self.received:self.received + n])
        self.received += n

    def finish(self) -> dict[str, torch.Tensor]:
        """The verified tensors (views of the buffer). Where they are one run of one dtype (a
        policy, a policy and its critics), :attr:`flat` is then that run as one tensor too."""
        if self.received != self.manifest.total_bytes:
            raise CodecError("truncated", f"received {self.received} of {self.manifest.total_bytes} declared bytes")
        out, self.flat = _decode(self.manifest, self.buf, self._hash.hexdigest())
        return out


_HEX = frozenset("0123456789abcdef")


def check_manifest(m: Manifest) -> None:
    """A manifest's own consistency, before any chunk is accepted."""
    if m.encoding != ENCODING:
        raise CodecError("bad_encoding", f"encoding {m.encoding!r} is not accepted (only {ENCODING!r})")
    if not 0 < m.total_bytes <= MAX_PAYLOAD_BYTES:
        raise CodecError("bad_manifest", f"declared size {m.total_bytes} is outside (0, {MAX_PAYLOAD_BYTES}]")
    if len(m.checksum) != 32 or not _HEX.issuperset(m.checksum):
        raise CodecError("bad_manifest", f"the {CHECKSUM} checksum must be 32 lower-case hex digits")
    if m.num_samples < 0:
        raise CodecError("bad_manifest", f"num_samples must be >= 0, got {m.num_samples}")
    # A receiver sizes its buffer from total_bytes: it must be what the listed tensors take plus
    # a header, whoever receives (the aggregator, an agent, the evaluator, which has no model
    # of its own to compare with). The tensors themselves are bounded by MAX_PAYLOAD_BYTES.
    data = _tensor_list_bytes(tuple(m.tensors))
    if not data + 8 < m.total_bytes <= data + 8 + MAX_HEADER_ALLOWANCE:
        raise CodecError("bad_manifest", f"declared size {m.total_bytes} bytes does not fit the listed tensors "
                                         f"({data} bytes of data plus a header of at most "
                                         f"{MAX_HEADER_ALLOWANCE} bytes)")


@functools.lru_cache(maxsize=64)
def _tensor_list_bytes(tensors: tuple[TensorSpec, ...]) -> int:
    """The data bytes a manifest's tensor list declares, once the list is found sound. Cached:
    every update of a run lists the same tensors (a refusal raises and is not cached)."""
    if not tensors:
        raise CodecError("bad_manifest", "manifest lists no tensors")
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise CodecError("bad_manifest", "manifest lists a tensor name twice")
    for t in tensors:
        if t.dtype not in tf.DTYPE_OF:
            raise CodecError("bad_dtype", f"tensor {t.name!r}: unknown dtype {t.dtype!r}")
        if any(d < 0 for d in t.shape):
            raise CodecError("bad_manifest", f"tensor {t.name!r}: negative dimension in {list(t.shape)}")
    return sum(math.prod(t.shape) * tf.DTYPE_OF[t.dtype].itemsize for t in tensors)


def _writable(payload: bytes | bytearray | memoryview) -> bool:
    """Memory the tensors can be views of as it is: a bytearray, or a writable view (a pooled buffer)."""
    return isinstance(payload, bytearray) or (isinstance(payload, memoryview) and not payload.readonly)


def decode(m: Manifest, payload: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Verify ``payload`` against ``m`` and return its tensors."""
    if len(payload) != m.total_bytes:
        raise CodecError("truncated", f"received {len(payload)} of {m.total_bytes} declared bytes")
    return _decode(m, payload if _writable(payload) else bytearray(payload), checksum(payload))[0]


def _decode(m: Manifest, buf: bytearray | memoryview, digest: str) -> tuple[dict[str, torch.Tensor], Flat | None]:
    """:func:`decode` of a writable buffer of the declared size whose checksum is known (computed
    from these very bytes: :class:`Assembler` hashes each chunk where it landed), and the
    tensors as one :class:`Flat` where they are one span."""
    if digest != m.checksum:
        raise CodecError("checksum_mismatch", f"payload {CHECKSUM} does not match the manifest")
    start, entries = tf.file_layout(buf)
    _check_entries(entries, tuple(m.tensors))
    plan = _one_span(entries)
    if plan is not None and start % plan.dtype.itemsize == 0:
        # The usual payload (a policy, a policy and its critics): one dtype, every tensor
        # non-empty and aligned. Checked as one flat tensor over the data area and cut into
        # the tensors in one call: a few torch calls instead of a few per tensor.
        flat = torch.frombuffer(buf, dtype=plan.dtype, count=plan.count, offset=start)
        if not tf.all_finite(flat):
            bad = tf.first_non_finite(buf, start, entries)
            raise CodecError("non_finite", f"tensor {bad!r} contains NaN or Inf")
        return plan.cut(flat), Flat(plan, flat)
    bad = tf.first_non_finite(buf, start, entries)
    if bad is not None:
        raise CodecError("non_finite", f"tensor {bad!r} contains NaN or Inf")
    return tf.views(buf, start, entries), None


class Span(NamedTuple):
    """A data area that is one run of tensors of one dtype (see :func:`_one_span`)."""

    dtype: torch.dtype
    count: int  # elements in all
    names: tuple[str, ...]  # in the order of their bytes
    sizes: tuple[int, ...]  # each tensor's elements
    shapes: tuple[tuple[int, ...], ...]

    def cut(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors of a flat tensor of this span (views of it), in the span's order."""
        return dict(zip(self.names, [t if len(shape) == 1 else t.view(shape) for t, shape in
                                     zip(torch.split_with_sizes(flat, self.sizes), self.shapes)]))


class Flat(NamedTuple):
    """A payload's tensors as one flat tensor over their bytes (one dtype, in the payload's
    order: ``span.names``), beside the dict of views :func:`decode` returns. Two payloads whose
    spans are equal hold the same tensors at the same positions, so their flat tensors can be
    combined element by element (FedAvg does)."""

    span: Span
    tensor: torch.Tensor


@functools.lru_cache(maxsize=64)
def _one_span(entries: tuple[tf.Entry, ...]) -> Span | None:
    """The entries (sorted, tiling the data area) as one span of a single dtype where every
    tensor is non-empty; None otherwise (mixed dtypes, an empty tensor: taken one by one)."""
    if not entries or len({e.dtype for e in entries}) != 1 or any(e.numel == 0 for e in entries):
        return None
    return Span(entries[0].dtype, sum(e.numel for e in entries), tuple(e.name for e in entries),
                 tuple(e.numel for e in entries), tuple(e.shape for e in entries))


@functools.lru_cache(maxsize=64)
def _check_entries(entries: tuple[tf.Entry, ...], tensors: tuple[TensorSpec, ...]) -> None:
    """A payload's tensors (its parsed header) are exactly the manifest's: names, dtypes,
    shapes. Cached: every update of a run pairs the same header with the same tensor list."""
    spec = {t.name: t for t in tensors}
    names = {e.name for e in entries}
    if names != set(spec):
        diff = sorted(names ^ set(spec))
        raise CodecError("tensor_mismatch", f"payload tensors differ from the manifest: {', '.join(diff[:5])}")
    for e in entries:
        s = spec[e.name]
        if tf.dtype_name(e.dtype) != s.dtype or tuple(e.shape) != tuple(s.shape):
            raise CodecError("tensor_mismatch", f"tensor {e.name!r} is {tf.dtype_name(e.dtype)}{list(e.shape)}, "
                                                f"manifest says {s.dtype}{list(s.shape)}")


def _check_specs(have: Mapping[str, tuple[str, tuple[int, ...]]], reference: Mapping[str, torch.Tensor],
                 subject: str, says: str) -> None:
    """``have`` (name -> dtype name, shape) lists exactly the tensors of ``reference``."""
    if have.keys() != reference.keys():
        missing = sorted(set(reference) - set(have))
        extra = sorted(set(have) - set(reference))
        raise CodecError("tensor_mismatch", f"{subject}tensor names differ from the global model: "
                                            f"missing {missing[:5]}, unexpected {extra[:5]}")
    for k, r in reference.items():
        dtype, shape = have[k]
        if dtype != tf.dtype_name(r.dtype) or tuple(shape) != tuple(r.shape):
            raise CodecError("tensor_mismatch", f"{says}tensor {k!r} is {dtype}{list(shape)}, "
                                                f"the global model has {tf.dtype_name(r.dtype)}{list(r.shape)}")


def specs_of(state: Mapping[str, torch.Tensor]) -> tuple[TensorSpec, ...]:
    """The tensor list a manifest of ``state`` carries (as :func:`encode` writes it): a receiver
    that keeps it compares a manifest's list with it in one tuple comparison."""
    return _specs(tf.layout_of(state))


def check_manifest_matches(m: Manifest, reference: Mapping[str, torch.Tensor]) -> None:
    """Before any chunk is accepted: ``m`` declares exactly the tensors of ``reference`` (names,
    dtypes, shapes). Its own consistency, including a declared size those tensors can have, is
    :func:`check_manifest`, which :class:`Assembler` runs before it allocates anything."""
    _check_specs({t.name: (t.dtype, t.shape) for t in m.tensors}, reference, "manifest ", "manifest says ")


def assemble(manifest: Manifest, chunks: Iterable[bytes], pool: BufferPool | None = None) -> dict[str, torch.Tensor]:
    """Decode a whole stream of chunks for ``manifest`` (into a buffer of ``pool``, if given)."""
    a = Assembler(manifest, pool)
    for c in chunks:
        a.add(c)
    return a.finish()
