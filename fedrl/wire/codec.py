"""Weights on the wire: ``state_dict`` <-> a manifest plus ~1 MiB chunks of one safetensors file.

No pickle anywhere: the payload is a safetensors file (a JSON header and raw little-endian
tensor bytes). The decoder checks the declared size, the checksum (XXH3-128, since wire contract
v2; v1 carried a sha256: see docs/performance.md), that the payload's tensors are
exactly the manifest's (names, dtypes, shapes) and that every float is finite, before any tensor
is used. Protobuf types stop at the servicers: this module knows plain Python only.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import groupby
from typing import Any, NamedTuple

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

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8",
           torch.uint8: "U8", torch.bool: "BOOL"}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise CodecError("bad_dtype", f"dtype {dtype} cannot be sent") from None


def write_safetensors(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """A safetensors file of contiguous CPU ``tensors``, written with one copy of their bytes.

    ``metadata`` (string to string) goes in the header's ``__metadata__``, as the format allows.

    Tensors are laid out widest dtype first, then by name, so every offset is aligned to its
    element size; the JSON header is padded with spaces to a multiple of 8 bytes (as the format
    allows). The safetensors library reads it (tested); it is several times faster than the
    library's writer on the small tensors a round sends.
    """
    return _write(tensors, _layout_of(tensors), metadata)


def _layout_of(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
    return tuple((k, t.dtype, tuple(t.shape)) for k, t in tensors.items())


def _write(tensors: Mapping[str, torch.Tensor], layout: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...],
           metadata: Mapping[str, str] | None) -> bytes:
    return b"".join(_pieces(tensors, layout, metadata))


def _pieces(tensors: Mapping[str, torch.Tensor], layout: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...],
            metadata: Mapping[str, str] | None) -> list:
    """A safetensors file of ``tensors`` as its pieces, in order: the header, then each tensor's
    bytes (views of the tensors)."""
    if metadata and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("safetensors metadata must map strings to strings")
    head, order = _header(layout, tuple(metadata.items()) if metadata else ())
    return [head, *(_bytes_of(tensors[k]) for k in order if tensors[k].numel())]


def _bytes_of(t: torch.Tensor):
    """A contiguous CPU tensor's bytes, as an array over its memory (no copy): one torch call
    where numpy has the dtype (a policy's tensors), three for the rest (bfloat16, 0-d)."""
    if t.ndim and t.dtype in _NUMPY_DTYPES:
        return t.numpy()
    return t.reshape(-1).view(torch.uint8).numpy()


_NUMPY_DTYPES = frozenset({torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
                           torch.uint8, torch.bool})


@functools.lru_cache(maxsize=16)
def _header(layout: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...],
            metadata: tuple[tuple[str, str], ...]) -> tuple[bytes, tuple[str, ...]]:
    """The length-prefixed JSON header of a safetensors file of tensors (name, dtype, shape),
    and the order of their bytes after it. Cached: an agent sends the same layout every round."""
    by_name = {k: (dtype, shape) for k, dtype, shape in layout}
    order = sorted(by_name, key=lambda k: (-by_name[k][0].itemsize, k))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    pos = 0
    for k in order:
        dtype, shape = by_name[k]
        n = math.prod(shape) * dtype.itemsize
        header[k] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return len(h).to_bytes(8, "little") + h, tuple(order)


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
    layout = _layout_of(tensors)
    pieces = [memoryview(x).cast("B") for x in _pieces(tensors, layout, metadata)]
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
    return tuple(TensorSpec(k, dtype_name(dtype), shape) for k, dtype, shape in sorted(layout, key=lambda e: e[0]))


def _plain(t: torch.Tensor) -> bool:
    """Already what the writer reads: a contiguous CPU tensor outside autograd (attribute
    checks, cheaper than three no-op tensor calls per tensor each round)."""
    return t.device.type == "cpu" and not t.requires_grad and t.is_contiguous()


def encoded_from_payload(payload: bytes, run_id: str = "", round: int = 0, base_version: int = 0,
                         num_samples: int = 0, chunk_bytes: int = CHUNK_BYTES) -> Encoded:
    """An already written safetensors file (e.g. a stored global version) ready to send as is:
    its tensors are checked and listed in the manifest, nothing is re-serialised."""
    tensors = parse_safetensors(payload)
    specs = tuple(TensorSpec(k, dtype_name(v.dtype), tuple(v.shape)) for k, v in sorted(tensors.items()))
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
        if t.dtype not in _BY_NAME:
            raise CodecError("bad_dtype", f"tensor {t.name!r}: unknown dtype {t.dtype!r}")
        if any(d < 0 for d in t.shape):
            raise CodecError("bad_manifest", f"tensor {t.name!r}: negative dimension in {list(t.shape)}")
    return sum(math.prod(t.shape) * _BY_NAME[t.dtype].itemsize for t in tensors)


_FINITE_BLOCK = 1 << 20  # elements summed per step: bounds all_finite's float64 temporary to 8 MB


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element is finite, without materialising a mask.

    Fast path (float32/float64): the dot product of the values with themselves. It is a sum of
    squares, so nothing cancels: any NaN or Inf makes it NaN or Inf, and if it is finite every
    element is. One BLAS pass, no temporary, several times cheaper than the alternatives. It can
    also overflow on finite values (any |x| above ~1.8e19 in float32), so a non-finite result is
    only a suspicion, settled by the exact check below.

    Exact check: a float64 sum of a (b)float16/32 block cannot overflow (3.4e38 x 2^31 elements <
    1.8e308), so it is NaN/Inf exactly when some element of the block is (Inf - Inf is NaN). The
    sum converts its input to float64 first, so it runs over blocks of 2^20 elements: a whole
    30 MB tensor would need a 60 MB temporary per concurrent upload. float64 tensors take the
    mask path.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return True
    flat = t.reshape(-1)
    if t.dtype in (torch.float32, torch.float64) and math.isfinite(torch.dot(flat, flat).item()):
        return True
    for i in range(0, flat.numel(), _FINITE_BLOCK):
        block = flat[i:i + _FINITE_BLOCK]
        ok = torch.isfinite(block).all() if t.dtype == torch.float64 else torch.isfinite(
            torch.sum(block, dtype=torch.float64))
        if not bool(ok):
            return False
    return True


_BY_NAME = {v: k for k, v in _DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20


def _bad(msg: str) -> CodecError:
    return CodecError("bad_payload", f"payload is not a valid safetensors file: {msg}")


class _Entry(NamedTuple):
    begin: int  # byte offsets in the data area
    end: int
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    numel: int


def parse_safetensors(buf: bytes | bytearray) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file held in memory, as views of ``buf`` (no copy).

    Checks what the format promises: an 8-byte little-endian header length, a JSON header of
    ``{name: {dtype, shape, data_offsets}}`` (plus optional ``__metadata__`` strings), known
    dtypes, byte ranges that match their shapes and tile the data area exactly, in order, with
    no gap or overlap. Anything else is a ``bad_payload`` CodecError. Little-endian hosts only
    (x86, arm64), as the format's byte order.
    """
    if not isinstance(buf, bytearray):
        buf = bytearray(buf)  # tensors must own writable memory (one copy; the receiver passes a bytearray)
    start, entries = _layout(buf)
    return _views(buf, start, entries)


def _layout(buf: bytearray) -> tuple[int, tuple[_Entry, ...]]:
    """The data area's start and the tensors' entries, sorted by offset (see parse_safetensors)."""
    if len(buf) < 8:
        raise _bad("shorter than its 8-byte header length")
    n = int.from_bytes(bytes(buf[:8]), "little")
    if n > min(len(buf) - 8, MAX_HEADER_BYTES):
        raise _bad(f"header length {n} exceeds the payload")
    raw, end_of_data = bytes(buf[8:8 + n]), len(buf) - 8 - n
    if n > CACHED_HEADER_BYTES:
        return 8 + n, _parse_header(raw, end_of_data)
    if raw.startswith(_META_OPEN):
        rest = _without_metadata(raw)
        if rest is not None:
            return 8 + n, _parse_header_cached(rest, end_of_data)
    return 8 + n, _parse_header_cached(raw, end_of_data)


# How this module's writer opens a header with metadata. A global version's metadata names the
# version, so its header differs from the last one's only there: the tensors' entries after it
# are parsed once per layout (below), not once per version.
_META_OPEN = b'{"__metadata__":'
_SCAN = json.JSONDecoder()


def _without_metadata(raw: bytes) -> bytes | None:
    """A header that opens with ``__metadata__`` without it, once its value is found sound
    (strings to strings; else a ``bad_payload`` CodecError, as a full parse would raise); None
    where it cannot be split here (the full parse then reads it)."""
    try:
        text = raw.decode()
        meta, end = _SCAN.raw_decode(text, len(_META_OPEN))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None  # the full parse names the problem
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad("__metadata__ must map strings to strings")
    tail = text[end:].lstrip(" \t\n\r")  # JSON's whitespace, no other
    if tail.startswith(","):
        return ("{" + tail[1:]).encode()
    if tail.startswith("}"):
        return ("{" + tail).encode()  # the metadata alone: no tensors
    return None


def _parse_header(raw: bytes, end_of_data: int) -> tuple[_Entry, ...]:
    """The entries a header describes, checked against a data area of ``end_of_data`` bytes."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:  # ValueError: bad JSON, or an integer of 4,300+ digits
        raise _bad(f"header is not JSON ({e})") from None
    except RecursionError:
        raise _bad("header nests too deeply") from None
    if not isinstance(header, dict):
        raise _bad("header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad("__metadata__ must map strings to strings")
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _bad(f"entry {name!r} needs exactly dtype, shape, data_offsets")
        dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _BY_NAME:
            raise _bad(f"entry {name!r} has unknown dtype {dtype!r}")
        if (not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
                or not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)):
            raise _bad(f"entry {name!r} has a malformed shape or data_offsets")
        td = _BY_NAME[dtype]
        numel = math.prod(shape)
        if offs[1] - offs[0] != numel * td.itemsize or not 0 <= offs[0] <= offs[1] <= end_of_data:
            raise _bad(f"entry {name!r}: byte range {offs} does not hold {dtype}{shape}")
        entries.append(_Entry(offs[0], offs[1], name, td, tuple(shape), numel))
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = 0
    for e in entries:
        if e.begin != pos:
            raise _bad(f"entry {e.name!r} starts at byte {e.begin}, expected {pos} (gap or overlap)")
        pos = e.end
    if pos != end_of_data:
        raise _bad(f"tensors end at byte {pos} of a {end_of_data}-byte data area")
    return tuple(entries)


# Every agent's update, every round, has the same header: small ones are parsed once (a refusal
# is not cached).
CACHED_HEADER_BYTES = 1 << 16
_parse_header_cached = functools.lru_cache(maxsize=16)(_parse_header)


def _views(buf: bytearray, start: int, entries: Sequence[_Entry]) -> dict[str, torch.Tensor]:
    """The tensors as views of ``buf``: of one storage (the whole buffer) where each is aligned
    to its element size, as this module's writer and the safetensors library lay them out, so
    neighbours can be read as one span (``fedrl.federation.aggregate.fedavg`` does)."""
    out: dict[str, torch.Tensor] = {}
    whole = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else None
    for e in entries:
        begin = start + e.begin
        if e.numel == 0:
            out[e.name] = torch.empty(e.shape, dtype=e.dtype)
        elif begin % e.dtype.itemsize == 0:
            out[e.name] = whole[begin:start + e.end].view(e.dtype).view(e.shape)
        else:  # a header whose length is not padded: unaligned, a tensor of its own
            out[e.name] = torch.frombuffer(buf, dtype=e.dtype, count=e.numel, offset=begin).view(e.shape)
    return out


def _first_non_finite(buf: bytearray, start: int, entries: Sequence[_Entry]) -> str | None:
    """The name of the first tensor holding NaN or Inf, or None.

    The entries tile the data area, so neighbours of one float dtype are checked as one span:
    one pass over a policy's bytes instead of one per tensor. Only a failing span is searched
    tensor by tensor, to name the culprit."""
    def finite(first: _Entry, last: _Entry) -> bool:  # entries first..last, as one flat tensor
        count = (last.end - first.begin) // first.dtype.itemsize
        return count == 0 or all_finite(torch.frombuffer(buf, dtype=first.dtype, count=count,
                                                         offset=start + first.begin))

    for dtype, group in groupby(entries, key=lambda e: e.dtype):
        span = list(group)
        if dtype.is_floating_point and not finite(span[0], span[-1]):
            return next(e.name for e in span if not finite(e, e))
    return None


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
    start, entries = _layout(buf)
    _check_entries(entries, tuple(m.tensors))
    plan = _one_span(entries)
    if plan is not None and start % plan.dtype.itemsize == 0:
        # The usual payload (a policy, a policy and its critics): one dtype, every tensor
        # non-empty and aligned. Checked as one flat tensor over the data area and cut into
        # the tensors in one call: a few torch calls instead of a few per tensor.
        flat = torch.frombuffer(buf, dtype=plan.dtype, count=plan.count, offset=start)
        if not all_finite(flat):
            bad = _first_non_finite(buf, start, entries)
            raise CodecError("non_finite", f"tensor {bad!r} contains NaN or Inf")
        return plan.cut(flat), Flat(plan, flat)
    bad = _first_non_finite(buf, start, entries)
    if bad is not None:
        raise CodecError("non_finite", f"tensor {bad!r} contains NaN or Inf")
    return _views(buf, start, entries), None


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
def _one_span(entries: tuple[_Entry, ...]) -> Span | None:
    """The entries (sorted, tiling the data area) as one span of a single dtype where every
    tensor is non-empty; None otherwise (mixed dtypes, an empty tensor: taken one by one)."""
    if not entries or len({e.dtype for e in entries}) != 1 or any(e.numel == 0 for e in entries):
        return None
    return Span(entries[0].dtype, sum(e.numel for e in entries), tuple(e.name for e in entries),
                 tuple(e.numel for e in entries), tuple(e.shape for e in entries))


@functools.lru_cache(maxsize=64)
def _check_entries(entries: tuple[_Entry, ...], tensors: tuple[TensorSpec, ...]) -> None:
    """A payload's tensors (its parsed header) are exactly the manifest's: names, dtypes,
    shapes. Cached: every update of a run pairs the same header with the same tensor list."""
    spec = {t.name: t for t in tensors}
    names = {e.name for e in entries}
    if names != set(spec):
        diff = sorted(names ^ set(spec))
        raise CodecError("tensor_mismatch", f"payload tensors differ from the manifest: {', '.join(diff[:5])}")
    for e in entries:
        s = spec[e.name]
        if dtype_name(e.dtype) != s.dtype or tuple(e.shape) != tuple(s.shape):
            raise CodecError("tensor_mismatch", f"tensor {e.name!r} is {dtype_name(e.dtype)}{list(e.shape)}, "
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
        if dtype != dtype_name(r.dtype) or tuple(shape) != tuple(r.shape):
            raise CodecError("tensor_mismatch", f"{says}tensor {k!r} is {dtype}{list(shape)}, "
                                                f"the global model has {dtype_name(r.dtype)}{list(r.shape)}")


def specs_of(state: Mapping[str, torch.Tensor]) -> tuple[TensorSpec, ...]:
    """The tensor list a manifest of ``state`` carries (as :func:`encode` writes it): a receiver
    that keeps it compares a manifest's list with it in one tuple comparison."""
    return _specs(_layout_of(state))


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


def payload_metadata(chunks: Iterable[bytes | memoryview]) -> dict[str, str]:
    """The ``__metadata__`` strings of a safetensors payload given as its chunks (a global version
    names its run, version, algorithm, environment and hyperparameters there); ``{}`` if none."""
    head = bytearray()
    for c in chunks:
        head += c
        if len(head) >= 8 and len(head) >= 8 + int.from_bytes(head[:8], "little"):
            break
    if len(head) < 8:
        raise _bad("shorter than its 8-byte header length")
    n = int.from_bytes(head[:8], "little")
    if n > min(len(head) - 8, MAX_HEADER_BYTES):
        raise _bad(f"header length {n} exceeds the payload")
    try:
        header = json.loads(bytes(head[8:8 + n]))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _bad(f"header is not JSON ({e})") from None
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad("__metadata__ must map strings to strings")
    return meta
