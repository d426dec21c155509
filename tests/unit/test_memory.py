"""fedrl.memory: freed heap memory goes back to the operating system when asked."""

from __future__ import annotations

import threading

import pytest

from fedrl.memory import release_free_memory


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_release_free_memory_returns_a_threads_freed_heap_to_the_os():
    """What the aggregator meets after a round of large updates: a thread's malloc heap full of
    freed blocks below a live one. free() keeps those pages resident; the release gives them back."""
    if not release_free_memory():
        pytest.skip("the C library has no malloc_trim (not glibc)")
    kept: list[bytearray] = []

    def fill() -> None:  # in a thread of its own, so in an arena of its own, as gRPC's handlers are
        blocks = [bytearray(b"\x01" * 60_000) for _ in range(3000)]  # ~180 MB, each below the mmap threshold
        kept.append(bytearray(b"\x01" * 60_000))  # allocated last: pins the heap's top
        blocks.clear()

    t = threading.Thread(target=fill)
    base = _rss_mb()
    t.start()
    t.join()
    held = _rss_mb() - base
    assert held > 100, f"the freed blocks should still be resident before the release ({held:.0f} MB)"
    assert release_free_memory()
    after = _rss_mb() - base
    assert after < held - 100, f"RSS above the start: {held:.0f} MB before the release, {after:.0f} MB after"
    assert len(kept) == 1 and kept[0][-1] == 1  # the live block is untouched
