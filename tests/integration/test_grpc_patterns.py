"""benchmarks/system/grpc_patterns.py runs every message pattern to the end with real processes."""

from __future__ import annotations

import pytest

from benchmarks.system.grpc_patterns import PATTERNS, WARMUP_ROUNDS, rounds


@pytest.mark.parametrize("pattern", PATTERNS)
def test_each_pattern_completes_every_round(pattern):
    r = rounds(pattern, agents=2, n_rounds=8, payload_bytes=4096, timeout=60)
    assert r["pattern"] == pattern
    assert r["rounds_measured"] == 8 - WARMUP_ROUNDS  # every round closed, each after both updates
    assert r["round_ms_median"] > 0 and r["server_cpu_ms_per_round"] > 0 and r["clients_cpu_ms_per_round"] > 0


def test_unknown_pattern_and_too_few_rounds_are_refused():
    with pytest.raises(ValueError, match="pattern must be one of"):
        rounds("carrier-pigeon", 2, 8, 16)
    with pytest.raises(ValueError, match="more than"):
        rounds("session", 2, WARMUP_ROUNDS, 16)
