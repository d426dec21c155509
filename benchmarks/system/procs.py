"""What the system benchmarks read about a run of the real processes: its data (a small random
Hopper set, made once per run), its aggregator's address and agent processes, and a process's CPU
time, minor page faults and peak memory from ``/proc``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def dataset(tmp: Path) -> Path:
    from fedrl.data.make import make_dataset

    return make_dataset("Hopper-v5", "random", 0, tmp / "hopper-random.hdf5", transitions=20_000)


def aggregator_target(port_file: Path, aggregator: subprocess.Popen, limit: float = 60.0) -> str:
    """The started aggregator's address, once it has written its port file."""
    end = time.monotonic() + limit
    while not port_file.exists():
        assert time.monotonic() < end and aggregator.poll() is None, "aggregator did not start"
        time.sleep(0.05)
    return f"127.0.0.1:{port_file.read_text()}"


def start_agents(target: str, data: Path, agents: int, env: dict, *flags: str) -> list[subprocess.Popen]:
    """``agents`` agent processes, one shard each of ``data``, one torch thread, with ``flags``."""
    return [subprocess.Popen([sys.executable, "-m", "agent_service", "--aggregator", target, "--dataset",
                              f"{data}:{agents}", "--shard", str(i), "--trajectories", "5", "--threads", "1",
                              "--device", "cpu", "--log-level", "WARNING", *flags], env=env)
            for i in range(agents)]


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
