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


def test_limit_malloc_arenas_makes_threads_share_one_arena():
    """What the aggregator sets first thing: with the limit, threads allocating at once share
    the arenas there are (glibc's malloc_stats lists one per arena); without it, each gets its own."""
    code = r"""
import ctypes, sys, threading
from fedrl.memory import limit_malloc_arenas
if sys.argv[1] == "limit":
    assert limit_malloc_arenas(1)
go = threading.Barrier(4)
def work():
    go.wait()  # all four allocate at the same time: contended arenas make glibc add more
    keep = [bytearray(200_000) for _ in range(50)]
    go.wait()
ts = [threading.Thread(target=work) for _ in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]
ctypes.CDLL(None).malloc_stats()
"""
    import subprocess
    import sys

    arenas = {}
    for mode in ("limit", "default"):
        env = {k: v for k, v in __import__("os").environ.items() if k != "MALLOC_ARENA_MAX"}
        r = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=60, env=env)
        if r.returncode != 0 and "malloc_stats" in r.stderr:
            pytest.skip("the C library has no malloc_stats (not glibc)")
        assert r.returncode == 0, r.stderr
        arenas[mode] = r.stderr.count("Arena ")
    assert arenas["limit"] == 1, arenas
    assert arenas["default"] > 1, arenas


def test_limit_malloc_arenas_leaves_an_operators_setting_alone(monkeypatch):
    from fedrl.memory import limit_malloc_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas(1) is False


def test_a_pooled_buffer_is_reused_only_once_nothing_reads_it():
    """The aggregator's receive buffers: handed out again only when the view and every tensor
    made from it are gone, so a payload still held (a submission, a global made of views) is
    never overwritten by the next one."""
    import gc

    import torch

    from fedrl.memory import BufferPool

    pool = BufferPool(keep=2)
    a = pool.take(4096)
    assert len(a) == 4096 and not a.readonly
    a[:8] = b"\x00\x00\x80?\x00\x00\x00@"  # float32 1.0, 2.0
    held = torch.frombuffer(a, dtype=torch.float32, count=2)
    del a
    gc.collect()
    b = pool.take(4096)  # the first is still read through ``held``: a fresh mapping
    b[:8] = b"\xff" * 8
    assert held.tolist() == [1.0, 2.0]
    assert (pool.mapped, pool.reused) == (2, 0)
    del held
    assert pool.free_buffers() == 1  # back as soon as its last tensor went
    c = pool.take(4096)
    assert (pool.mapped, pool.reused) == (2, 1)
    c[:4] = b"abcd"  # writable again
    del b, c
    assert pool.free_buffers() == 2


def test_a_pool_keeps_at_most_keep_buffers_of_the_size_taken_last():
    from fedrl.memory import BufferPool

    pool = BufferPool(keep=1)
    views = [pool.take(1 << 16) for _ in range(3)]
    del views
    assert pool.free_buffers() == 1  # the other two unmapped at once
    other = pool.take(1 << 17)  # another size (a new run's model): the kept one goes
    assert pool.free_buffers() == 0 and len(other) == 1 << 17
    del other
    assert pool.free_buffers() == 1
    pool.keep = 0  # the run ended
    assert pool.free_buffers() == 0
    v = pool.take(10)
    del v
    assert pool.free_buffers() == 0 and pool.reused == 0
