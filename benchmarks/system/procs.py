"""What the system benchmarks read about a run of the real processes: its data (a small random
Hopper set, made once per run), and a process's CPU time, minor page faults and peak memory from
``/proc``."""

from __future__ import annotations

import os
from pathlib import Path


def dataset(tmp: Path) -> Path:
    from fedrl.data.make import make_dataset

    return make_dataset("Hopper-v5", "random", 0, tmp / "hopper-random.hdf5", transitions=20_000)


WARMUP_ROUNDS = 3  # the first rounds include connection set-up


def peak_rss_mb(pid: int) -> float:
    """Peak resident memory of a live process (VmHWM), MB."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def minor_faults(pid: int) -> int:
    """Minor page faults a process has taken so far (Linux /proc; -1 if it is gone)."""
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[7])
    except OSError:
        return -1
