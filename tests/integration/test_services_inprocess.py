"""benchmarks.services inprocess: the round's own work, in one process, runs every round it times."""

from __future__ import annotations

from benchmarks.services import WARMUP_ROUNDS, bench_inprocess


def test_inprocess_round_closes_every_timed_round_and_splits_the_cpu():
    r = bench_inprocess(agents=2, rounds=4, repeats=2)
    # warm-up rounds plus two blocks of two, each closed by both agents' checked updates
    assert r["rounds_closed"] == WARMUP_ROUNDS + 4
    assert r["aggregator_cpu_ms_per_round"] > 0 and r["agents_cpu_ms_per_round"] > 0
    assert r["cpu_ms_per_round"] >= 0.9 * (r["aggregator_cpu_ms_per_round"] + r["agents_cpu_ms_per_round"])
    assert r["agent_train_us"] > 0
