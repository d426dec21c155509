"""Process pools end with the process that made them, however it ends (fedrl.common.lifetime)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests import source
from tests.e2e.test_up import _alive, _children

ROOT = Path(__file__).resolve().parents[2]

PARENT = """
import time
from fedrl.common.lifetime import child_pool
ex = child_pool(2)
futs = [ex.submit(time.sleep, 120) for _ in range(2)]
print("submitted", flush=True)
time.sleep(120)
"""


def _workers(pid: int) -> list[int]:
    """The pool's workers among ``pid``'s children (not its resource tracker)."""
    found = []
    for c in _children(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes():
                found.append(c)
        except OSError:
            pass
    return found


def test_a_pools_workers_stop_when_its_process_is_killed():
    """A harness run stopped with SIGKILL (or SIGTERM) must not leave its workers training on,
    holding their cells' locks: the pool's workers get SIGTERM when their parent dies."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    workers: list[int] = []
    try:
        assert parent.stdout.readline().strip() == "submitted"
        end = time.monotonic() + 60
        while len(workers) < 2:
            assert time.monotonic() < end, f"the pool started {len(workers)} of 2 workers"
            time.sleep(0.1)
            workers = _workers(parent.pid)
        parent.kill()
        parent.wait(timeout=10)
        end = time.monotonic() + 15
        while any(_alive(w) for w in workers) and time.monotonic() < end:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)], "workers outlived the process that made them"
    finally:
        parent.kill()
        for w in workers:
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_every_process_pool_is_a_child_pool():
    """A pool made directly (not by child_pool) would outlive a killed run: none is."""
    made = [str(p.relative_to(ROOT)) for d in ("fedrl", "benchmarks", "aggregator_service", "agent_service",
                                               "evaluator_service")
            for p in source.files(d)
            if re.search(r"ProcessPoolExecutor\(|\.Pool\(", p.read_text()) and p.name != "lifetime.py"]
    assert made == []
