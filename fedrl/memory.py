"""Giving freed heap memory back to the operating system.

glibc's malloc keeps memory freed in the middle of its heaps (one per thread arena) resident:
only the free space at a heap's top is returned on its own. A process that receives many large
messages at once on many threads (the aggregator taking ten 30 MB updates in one round: gRPC's
read buffers, the protobuf messages, the assembled payloads) is left holding its high-water mark
and a bit more each round. ``malloc_trim(0)`` hands every whole free page back (madvise), at
the cost of walking the free lists: ~0.1 ms with little to give back, tens of ms after a round
of 30 MB updates (measured in this project's transfer benchmark; see docs/PERFORMANCE.md).
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


M_ARENA_MAX = -8  # mallopt's parameter number for the arena limit (glibc's malloc.h)


def limit_malloc_arenas(n: int) -> bool:
    """Let at most ``n`` malloc arenas serve this process's threads (glibc; call it first thing,
    before threads allocate). True if the limit was set; False where malloc is not glibc's, or
    when ``MALLOC_ARENA_MAX`` is set in the environment (the operator's choice stands).

    glibc gives threads up to 8 arenas per core, and memory freed in one arena serves only
    the threads of that arena. The aggregator's gRPC threads each take ~1 MiB messages into
    whichever arena they got: with ten agents sending 30 MB updates a round, the resident set
    climbed ~20 MB a round (1.1 GB to 1.9 GB in 40 rounds, measured) unless every round's free
    pages were handed back (:func:`release_free_memory`), which then cost the next round ~47,000
    page faults to touch them again. With two arenas the freed memory is found again: the
    resident set stays at ~1.1 GB with no trim at all.
    """
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_ARENA_MAX, n) == 1


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
    about a quarter of the aggregator's whole CPU time in such a round (docs/PERFORMANCE.md).
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
