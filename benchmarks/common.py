"""What several benchmarks share, so that none is another's library by accident: where the
results and documents live, the code revision a result records, the machine's name, and the
renderer that writes generated blocks into a document."""

from __future__ import annotations

import functools
import platform
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"


@functools.cache
def code_revision() -> str:
    """The git commit the run's code was at (``-dirty`` with uncommitted changes), or ``unknown``;
    read once per process, at its first run (a process imports the code once):
    the same cell run on another revision can differ at float rounding and grow from there
    (e.g. the critic's row blocks, 2026-11-25)."""
    root = ROOT
    try:
        rev = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return rev.stdout.strip() if rev.returncode == 0 and rev.stdout.strip() else "unknown"


def device_name(device: str) -> str:
    """What ran a cell, for its result file: the GPU's name, or the CPU's model."""
    import torch

    from fedrl.common.device import resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def replace_blocks(text: str, blocks: dict[str, str]) -> str:
    for name, body in blocks.items():
        pat = re.compile(rf"(<!-- generated:{re.escape(name)} -->\n)(?:.*?\n)?(<!-- end:{re.escape(name)} -->)", re.S)
        if not pat.search(text):
            raise ValueError(f"the document has no block {name!r}")
        text = pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)
    return text
