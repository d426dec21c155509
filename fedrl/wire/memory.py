"""Memory of a process that takes large payloads round after round (the aggregator).

- :func:`release_free_memory`: glibc's malloc keeps memory freed in the middle of its heaps
  resident; ``malloc_trim(0)`` hands every whole free page back (madvise), at the cost of walking
  the free lists (~0.1 ms with little to give back, tens of ms after a round of 30 MB updates).
  The aggregator calls it when a run ends.
- :func:`keep_heap_for_reuse`: while a run lasts, the opposite: few arenas and fixed thresholds,
  so that what a round frees serves the next round instead of being faulted in afresh.
- :class:`BufferPool`: receive buffers written again round after round, handed back by
  themselves once nothing reads them.

Measurements behind each: docs/performance.md (*Page faults, the close, and a bracketed
baseline*, and *Memory*).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading
import weakref


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where malloc is not glibc's (musl, macOS, Windows)."""
    try:  # the symbols already loaded into this process, libc's among them (no library search)
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


# mallopt's parameter numbers (glibc's malloc.h), and the environment variables an operator
# would set instead (which then stand).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
_MALLOPT_ENV = {M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_", M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_",
                M_ARENA_MAX: "MALLOC_ARENA_MAX"}


def keep_heap_for_reuse(arenas: int = 2, mmap_threshold: int = 64 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Set glibc's malloc up for a process that frees and takes back large buffers every round
    (the aggregator: ten 30 MB updates, a 30 MB average and its encoding a round). Call it first
    thing, before threads allocate. True if every setting was made; settings the environment
    already makes (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
    or any ``GLIBC_TUNABLES``) are left to it; False where malloc is not glibc's.

    - At most ``arenas`` arenas. glibc gives threads up to 8 per core, and memory freed in one
      serves only its threads: the aggregator's gRPC threads each took ~1 MiB messages into
      their own, and its resident set climbed ~20 MB a round (1.1 to 1.9 GB in 40 rounds,
      measured) unless every round's free pages were handed back, which cost the next round
      tens of thousands of page faults to touch them again. With two it stays at ~1.1 GB.
    - Blocks up to ``mmap_threshold`` come from the heap, and free space at a heap's top is
      handed back only past ``trim_threshold``. glibc's defaults adapt both to the blocks
      freed, and still mapped each new 30 MB block afresh often enough to cost ~9,000 page
      faults a round (the encode of each new version took 73-101 ms, 26 ms with these).

    The process keeps what it freed, up to its high-water mark, for as long as it runs: the
    aggregator hands it back when a run ends (:func:`release_free_memory`).
    """
    if os.environ.get("GLIBC_TUNABLES"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = True
    for param, value in ((M_ARENA_MAX, arenas), (M_MMAP_THRESHOLD, mmap_threshold), (M_TRIM_THRESHOLD, trim_threshold)):
        if os.environ.get(_MALLOPT_ENV[param]):
            done = False
        elif mallopt(param, value) != 1:
            done = False
    return done


def release_free_memory() -> bool:
    """Return the free pages of every malloc heap to the OS. True if the C library could be
    asked (glibc), False where it has no such call."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


class BufferPool:
    """Receive buffers that outlive the payloads they held, for a process that takes payloads
    of one size round after round (the aggregator: every agent's update, every round).

    A fresh buffer costs a page fault for each 4 KiB page its bytes first land in: 36 ms of CPU
    per 30 MB on the 2-core VM this project is measured on, 0.36 s a round for ten 30 MB updates,
    about a quarter of the aggregator's whole CPU time in such a round (docs/performance.md).
    A buffer taken from here is written in place again instead.

    :meth:`take` hands out a writable memoryview of an anonymous mapping (outside malloc's heaps,
    so it neither fragments them nor is touched by :func:`release_free_memory`). The mapping
    comes back by itself once that view and everything made from it are gone: tensors made by
    ``torch.frombuffer`` hold the view, so a buffer is reused only when no tensor can still read
    it. Up to :attr:`keep` free buffers are kept (only of the size taken last: a run's updates
    all have one size); the others are unmapped at once. ``keep = 0`` (the default) keeps none.
    """

    def __init__(self, keep: int = 0) -> None:
        # Reentrant: a view may die (and give its buffer back) inside a locked section of the
        # same thread, when a garbage collection runs there.
        self._lock = threading.RLock()
        self._free: list[mmap.mmap] = []
        self._keep = keep
        self.reused = 0  # buffers handed out again (for tests and metrics)
        self.mapped = 0  # buffers mapped fresh

    @property
    def keep(self) -> int:
        return self._keep

    @keep.setter
    def keep(self, n: int) -> None:
        """At most ``n`` free buffers kept from now on (the rest unmapped)."""
        with self._lock:
            self._keep = max(0, n)
            drop, self._free = self._free[self._keep:], self._free[:self._keep]
        _unmap(drop)

    def take(self, size: int) -> memoryview:
        """A writable buffer of exactly ``size`` (> 0) bytes. Its content is undefined: a reused
        buffer holds the bytes of an earlier payload until they are overwritten."""
        buf = None
        with self._lock:
            if self._free and len(self._free[-1]) != size:  # another size: a new run's model
                drop, self._free = self._free, []
            else:
                drop = []
            if self._free:
                buf = self._free.pop()
                self.reused += 1
        _unmap(drop)
        if buf is None:
            buf = mmap.mmap(-1, size)
            with self._lock:
                self.mapped += 1
        view = memoryview(buf)
        done = weakref.finalize(view, self._give_back, buf)
        done.atexit = False
        return view

    def free_buffers(self) -> int:
        with self._lock:
            return len(self._free)

    def _give_back(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self._keep and (not self._free or len(self._free[0]) == len(buf)):
                self._free.append(buf)
                return
        _unmap([buf])


def _unmap(bufs: list[mmap.mmap]) -> None:
    for b in bufs:
        try:
            b.close()
        except BufferError:  # still exported somewhere: the mapping goes when its last user does
            pass
