"""benchmarks.system.services inprocess: the round's own work, in one process, runs every round it times;
and the federation benchmark does not wait for a process that is gone."""

from __future__ import annotations

import time

import pytest

from benchmarks.system.inprocess import bench_inprocess
from benchmarks.system.procs import WARMUP_ROUNDS
from benchmarks.system.services import federation_rounds


def test_inprocess_round_closes_every_timed_round_and_splits_the_cpu():
    r = bench_inprocess(agents=2, rounds=4, repeats=2)
    # warm-up rounds plus two blocks of two, each closed by both agents' checked updates
    assert r["rounds_closed"] == WARMUP_ROUNDS + 4
    assert r["aggregator_cpu_ms_per_round"] > 0 and r["agents_cpu_ms_per_round"] > 0
    assert r["cpu_ms_per_round"] >= 0.9 * (r["aggregator_cpu_ms_per_round"] + r["agents_cpu_ms_per_round"])
    assert r["agent_train_us"] > 0


def test_the_federation_benchmark_stops_with_a_process_that_exited(tmp_path):
    """An agent that cannot start (here: a transport it does not know) used to leave the
    federation benchmark waiting for it without end; now the run stops and says who exited."""
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exited before the run finished: agent 0 \(exit code 2\)"):
        federation_rounds(1, 3, {"algo": "drpo"}, tmp_path, transport="no-such-transport")
    assert time.monotonic() - t < 90
