"""Weights on the wire: ``state_dict`` <-> a manifest plus ~1 MiB chunks of one safetensors file.

No pickle anywhere: the payload is a safetensors file (a JSON header and raw little-endian
tensor bytes). The decoder checks the declared size, the sha256, that the payload's tensors are
exactly the manifest's (names, dtypes, shapes) and that every float is finite, before any tensor
is used. Protobuf types stop at the servicers: this module knows plain Python only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load, save as st_save

CHUNK_BYTES = 1 << 20
ENCODING = "safetensors"
# Message size limit set on every channel and server: a chunk plus headroom for the manifest.
MAX_MESSAGE_BYTES = 8 << 20
MAX_PAYLOAD_BYTES = 2 << 30  # refuse manifests declaring more than 2 GiB

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8",
           torch.uint8: "U8", torch.bool: "BOOL"}


class CodecError(ValueError):
    """Weights that cannot be accepted. ``reason`` is a stable, bounded label (metrics, tests)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class TensorSpec:
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
    sha256: str
    encoding: str = ENCODING

    def spec(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}


@dataclass
class Encoded:
    manifest: Manifest
    payload: bytes
    chunk_bytes: int = CHUNK_BYTES

    def chunks(self) -> Iterator[bytes]:
        """The payload in ``chunk_bytes`` pieces."""
        mv = memoryview(self.payload)
        for i in range(0, len(mv), self.chunk_bytes):
            yield bytes(mv[i:i + self.chunk_bytes])


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise CodecError("bad_dtype", f"dtype {dtype} cannot be sent") from None


def encode(state: Mapping[str, torch.Tensor], run_id: str = "", round: int = 0,
           base_version: int = 0, num_samples: int = 0,
           chunk_bytes: int = CHUNK_BYTES) -> Encoded:
    """Serialise ``state`` (CPU tensors) as safetensors and describe it in a manifest."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    payload = st_save(tensors)
    specs = tuple(TensorSpec(k, dtype_name(v.dtype), tuple(v.shape)) for k, v in sorted(tensors.items()))
    m = Manifest(run_id, int(round), int(base_version), specs, int(num_samples), len(payload),
                 hashlib.sha256(payload).hexdigest())
    return Encoded(m, payload, chunk_bytes)


class Assembler:
    """Receives chunks for a manifest; refuses anything past the declared size."""

    def __init__(self, manifest: Manifest) -> None:
        check_manifest(manifest)
        self.manifest = manifest
        self.buf = bytearray()

    def add(self, chunk: bytes) -> None:
        if len(self.buf) + len(chunk) > self.manifest.total_bytes:
            raise CodecError("oversize", f"chunks exceed the declared {self.manifest.total_bytes} bytes")
        self.buf += chunk

    def finish(self) -> dict[str, torch.Tensor]:
        return decode(self.manifest, self.buf)


def check_manifest(m: Manifest) -> None:
    """A manifest's own consistency, before any chunk is accepted."""
    if m.encoding != ENCODING:
        raise CodecError("bad_encoding", f"encoding {m.encoding!r} is not accepted (only {ENCODING!r})")
    if not 0 < m.total_bytes <= MAX_PAYLOAD_BYTES:
        raise CodecError("bad_manifest", f"declared size {m.total_bytes} is outside (0, {MAX_PAYLOAD_BYTES}]")
    if len(m.sha256) != 64 or any(c not in "0123456789abcdef" for c in m.sha256):
        raise CodecError("bad_manifest", "sha256 must be 64 lower-case hex digits")
    if not m.tensors:
        raise CodecError("bad_manifest", "manifest lists no tensors")
    names = [t.name for t in m.tensors]
    if len(set(names)) != len(names):
        raise CodecError("bad_manifest", "manifest lists a tensor name twice")
    for t in m.tensors:
        if t.dtype not in _DTYPES.values():
            raise CodecError("bad_dtype", f"tensor {t.name!r}: unknown dtype {t.dtype!r}")
        if any(d < 0 for d in t.shape):
            raise CodecError("bad_manifest", f"tensor {t.name!r}: negative dimension in {list(t.shape)}")
    if m.num_samples < 0:
        raise CodecError("bad_manifest", f"num_samples must be >= 0, got {m.num_samples}")


def decode(m: Manifest, payload: bytes | bytearray) -> dict[str, torch.Tensor]:
    """Verify ``payload`` against ``m`` and return its tensors."""
    if len(payload) != m.total_bytes:
        raise CodecError("truncated", f"received {len(payload)} of {m.total_bytes} declared bytes")
    if hashlib.sha256(payload).hexdigest() != m.sha256:
        raise CodecError("sha256_mismatch", "payload sha256 does not match the manifest")
    try:
        state = st_load(bytes(payload))
    except (SafetensorError, ValueError, RuntimeError, json.JSONDecodeError) as e:
        raise CodecError("bad_payload", f"payload is not a valid safetensors file: {e}") from None
    spec = m.spec()
    if set(state) != set(spec):
        diff = sorted(set(state) ^ set(spec))
        raise CodecError("tensor_mismatch", f"payload tensors differ from the manifest: {', '.join(diff[:5])}")
    for k, v in state.items():
        s = spec[k]
        if dtype_name(v.dtype) != s.dtype or tuple(v.shape) != s.shape:
            raise CodecError("tensor_mismatch", f"tensor {k!r} is {dtype_name(v.dtype)}{list(v.shape)}, "
                                                f"manifest says {s.dtype}{list(s.shape)}")
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise CodecError("non_finite", f"tensor {k!r} contains NaN or Inf")
    return state


def check_matches(state: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> None:
    """``state`` has exactly the tensor names, dtypes and shapes of ``reference`` (the global)."""
    if state.keys() != reference.keys():
        missing = sorted(set(reference) - set(state))
        extra = sorted(set(state) - set(reference))
        raise CodecError("tensor_mismatch", f"tensor names differ from the global model: "
                                            f"missing {missing[:5]}, unexpected {extra[:5]}")
    for k, v in state.items():
        r = reference[k]
        if v.dtype != r.dtype or v.shape != r.shape:
            raise CodecError("tensor_mismatch", f"tensor {k!r} is {dtype_name(v.dtype)}{list(v.shape)}, "
                                                f"the global model has {dtype_name(r.dtype)}{list(r.shape)}")


def assemble(manifest: Manifest, chunks: Iterable[bytes]) -> dict[str, torch.Tensor]:
    """Decode a whole stream of chunks for ``manifest``."""
    a = Assembler(manifest)
    for c in chunks:
        a.add(c)
    return a.finish()
