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


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where malloc is not glibc's (musl, macOS, Windows)."""
    try:  # the symbols already loaded into this process, libc's among them (no library search)
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_free_memory() -> bool:
    """Return the free pages of every malloc heap to the OS. True if the C library could be
    asked (glibc), False where it has no such call."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
