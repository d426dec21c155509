"""Device choice and seeding: CUDA when present, CPU otherwise, always selectable."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import random
import sys
import threading
from collections.abc import Iterator

import numpy as np
import torch

from fedrl.common.argtypes import DEVICE_CHOICES  # noqa: E402 - re-exported


def resolve_device(name: str = "auto") -> torch.device:
    """Map ``auto|cpu|cuda[:N]`` to a torch device; ``auto`` picks CUDA when available.

    Asking for CUDA on a machine without it is an error, never a silent fall-back.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:  # torch's own message lists its two dozen backends
        raise ValueError(f"--device {name}: expected one of auto, cpu, cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA was requested but torch.cuda.is_available() is False")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: expected one of auto, cpu, cuda[:N]")
    return dev


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A private RNG stream on ``device``: every sampling call in the learners takes one."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def derive_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (run seed, agent index, ...), independent of process."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h ^= (int(p) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)) & 0xFFFFFFFFFFFFFFFF
        h = (h * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_allocator_tuned = False


def tune_allocator() -> bool:
    """Keep freed large buffers in the process heap (glibc only; a no-op elsewhere).

    A training step allocates and frees tens of MB of activations. By default glibc serves such
    blocks with mmap and returns them to the OS on free, so every step page-faults its whole
    working set again; on a 2-core CPU that cost ~20-30% of the DRPO update's time. Raising the
    mmap and trim thresholds keeps the memory mapped (peak RSS is reached each step anyway).
    """
    global _allocator_tuned
    if _allocator_tuned or not sys.platform.startswith("linux"):
        return _allocator_tuned
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 512 * 1024 * 1024) == 1
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, 1024 * 1024 * 1024) == 1
    except (OSError, AttributeError):
        return False
    _allocator_tuned = bool(ok)
    return _allocator_tuned


_flushing = threading.local()
_SET_FLUSH = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# what each of torch's OpenMP worker threads runs to set its own flag (kept: ctypes needs them alive)
_ON_WORKERS = {on: _SET_FLUSH(lambda _data, on=on: torch.set_flush_denormal(on)) for on in (False, True)}
_gomp: ctypes.CDLL | None | bool = False  # not looked up yet


def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch's intra-op threads run in (the libgomp its Linux wheels ship), or
    None where there is none to reach (another build: only the calling thread is then set)."""
    global _gomp
    if _gomp is False:
        path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
        try:
            _gomp = ctypes.CDLL(path) if os.path.exists(path) else None
            if _gomp is not None and not hasattr(_gomp, "GOMP_parallel"):
                _gomp = None
        except OSError:
            _gomp = None
    return _gomp


def _set_flush(on: bool) -> None:
    """This thread's flag, and its OpenMP workers' (torch's intra-op threads compute a parallel
    op's chunks each with its own flag, set only by code run on it: one parallel region runs the
    setting on every worker of this thread's team)."""
    torch.set_flush_denormal(on)
    n = torch.get_num_threads()
    if n > 1 and (omp := _openmp()) is not None:
        omp.GOMP_parallel(_ON_WORKERS[on], None, ctypes.c_uint(n), ctypes.c_uint(0))


@contextlib.contextmanager
def subnormals_flushed() -> Iterator[None]:
    """Within: this thread's CPU float arithmetic treats subnormal numbers (below float32's
    1.2e-38, float64's 2.2e-308) as zero, and rounds results that would be subnormal to zero.

    A CQL critic's logsumexp over sampled actions gives the actions far below the best one
    weights of exp(-100) and less; as Q grows through a run, more of its backward pass holds
    such numbers, which x86 CPUs compute many times slower than normal ones: a paper-scale
    cell's steps slowed several-fold by its middle rounds (docs/performance.md). What is
    flushed is below float32's smallest normal number: its share of any sum it joins is below
    float rounding. On exit the thread's setting is off again (the process default);
    entered again inside, it leaves the setting to the outermost. With several torch threads,
    their OpenMP workers are set too (where torch's libgomp can be reached; elsewhere only the
    calling thread's share of a parallel op is flushed). No effect on CUDA tensors."""
    depth = getattr(_flushing, "depth", 0)
    if depth == 0:
        _set_flush(True)
    _flushing.depth = depth + 1
    try:
        yield
    finally:
        _flushing.depth = depth
        if depth == 0:
            _set_flush(False)
