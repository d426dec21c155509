"""How many CPU threads a service's torch takes when it is not told (no torch import here: the
services' ``--help`` stays fast)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_quota() -> float | None:
    """The CPU limit of this process's cgroup in CPUs (a container's ``resources.limits.cpu``),
    or None where there is none (cgroup v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``)."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        q = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        p = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if q <= 0 else q / p
    except (OSError, ValueError):
        return None


THREADS_RULE = ("0 (the default): the CPU limit of the process's container (cgroup quota) when it has one, "
                "else 1, so that processes sharing a machine (fedrl up's agents, agents started by hand) "
                "never oversubscribe its cores: torch's own default, every core in every process, made two "
                "agents on two cores 13-14x slower")


def default_threads() -> tuple[int, str]:
    """The torch thread count a service takes when not told (:data:`THREADS_RULE`) and why."""
    quota = cpu_quota()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    if quota is not None:
        return max(1, min(usable, int(quota))), f"the container's CPU limit ({quota:g})"
    return 1, "one per process (no container CPU limit)"


def set_threads(requested: int) -> tuple[int, str]:
    """Set torch's intra-op threads: ``requested`` if > 0, else :func:`default_threads`."""
    import torch

    n, why = (requested, "--threads") if requested > 0 else default_threads()
    torch.set_num_threads(n)
    return n, why
