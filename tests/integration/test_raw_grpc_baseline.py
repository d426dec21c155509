"""benchmarks.system.services raw_grpc: the transfer target's baseline times exactly its measured rounds."""

from __future__ import annotations

from benchmarks.system.raw_grpc import raw_grpc


def test_the_clock_covers_the_measured_rounds_and_not_the_warm_up():
    agents, payload_mb, rounds = 2, 1, 2
    r = raw_grpc(agents, payload_mb, rounds)
    # Every client ran a warm-up round first: the server saw its uploads, but before the clock.
    assert r["bytes_uploaded_timed"] == agents * rounds * payload_mb << 20
    assert r["bytes"] == 2 * r["bytes_uploaded_timed"]  # each round: the payload down, then up
    assert r["seconds"] > 0 and r["mb_per_s"] == r["bytes"] / r["seconds"] / 1e6
    assert r["cpu_ms_per_round"]["server"] > 0 and r["cpu_ms_per_round"]["clients_total"] > 0
