"""fedrl.wire.memory: freed heap memory goes back to the operating system when asked."""

from __future__ import annotations

import threading

import pytest

from fedrl.wire.memory import release_free_memory


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


def _run(code: str, *args: str, env_drop: tuple[str, ...] = ()) -> str:
    """``code`` run by a fresh interpreter (malloc settings are per process); its stderr."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    return r.stderr


MALLOC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def test_keep_heap_for_reuse_makes_threads_share_the_arenas_it_allows():
    """What the aggregator sets first thing: threads allocating at once share the arenas there
    are (glibc's malloc_stats lists one per arena); without it, each gets its own."""
    if not release_free_memory():
        pytest.skip("not glibc's malloc")
    code = r"""
import ctypes, sys, threading
from fedrl.wire.memory import keep_heap_for_reuse
if sys.argv[1] == "tuned":
    assert keep_heap_for_reuse(arenas=1)
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
    arenas = {mode: _run(code, mode, env_drop=MALLOC_ENV).count("Arena ") for mode in ("tuned", "default")}
    assert arenas["tuned"] == 1 and arenas["default"] > 1, arenas


def test_keep_heap_for_reuse_lets_a_large_freed_block_serve_the_next_one():
    """A 40 MB block freed and taken again, as the aggregator's encoded versions are each round:
    by default glibc maps it afresh every time (a page fault per 4 KiB touched); tuned, the
    heap keeps it and the next one is served from it."""
    if not release_free_memory():
        pytest.skip("not glibc's malloc")
    code = r"""
import ctypes, resource, sys
from fedrl.wire.memory import keep_heap_for_reuse
if sys.argv[1] == "tuned":
    assert keep_heap_for_reuse()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(40 << 20)
    ctypes.memset(p, 1, 40 << 20)  # touch every page
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]), file=sys.stderr)
"""
    again = {mode: int(_run(code, mode, env_drop=MALLOC_ENV)) for mode in ("tuned", "default")}
    pages = 3 * (40 << 20) // 4096  # three more blocks' worth of 4 KiB pages
    assert again["default"] > pages // 2, again
    assert again["tuned"] < pages // 20, again


def test_keep_heap_for_reuse_leaves_an_operators_settings_alone(monkeypatch):
    code = "import sys; from fedrl.wire.memory import keep_heap_for_reuse; print(keep_heap_for_reuse(), file=sys.stderr)"
    for name, value in (("MALLOC_ARENA_MAX", "4"), ("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert _run(code, env_drop=tuple(k for k in MALLOC_ENV if k != name)).strip() == "False"


def test_a_pooled_buffer_is_reused_only_once_nothing_reads_it():
    """The aggregator's receive buffers: handed out again only when the view and every tensor
    made from it are gone, so a payload still held (a submission, a global made of views) is
    never overwritten by the next one."""
    import gc

    import torch

    from fedrl.wire.memory import BufferPool

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
    from fedrl.wire.memory import BufferPool

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


def test_a_learner_holding_an_adopted_download_rotates_two_pooled_buffers():
    """As an agent does with a large model: each round's global is assembled in a pooled buffer
    and adopted by the learner (no copy), which holds it until the next round's adoption. The
    agent's pool (keep=1) then settles on two buffers taken in turn: none mapped afresh after
    the second round, none leaked."""
    import torch

    from fedrl.algos import BCConfig, BCLearner
    from fedrl.common.device import make_generator
    from fedrl.wire.codec import assemble, encode
    from fedrl.wire.memory import BufferPool

    cpu = torch.device("cpu")
    learner = BCLearner(5, 2, BCConfig(hidden=(32, 32)), cpu, make_generator(0, cpu))
    pool = BufferPool(keep=1)
    for r in range(6):
        g = {k: v + r for k, v in learner.shared_state().items()}
        enc = encode(g, "run", r, r)
        state = assemble(enc.manifest, [enc.payload[:100], enc.payload[100:]], pool)
        learner.begin_round(state, adopt=True)
        del state
        assert all(torch.equal(v, g[k]) for k, v in learner.shared_state().items())
    assert pool.mapped == 2 and pool.reused == 4
