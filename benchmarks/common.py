"""What several benchmarks share, so that none is another's library by accident: where the
results and documents live, the code revision a result records, the machine's name, the
renderer that writes generated blocks into a document, the virtual environments a peer's pins
need, and the synthetic data the speed benchmarks train on."""

from __future__ import annotations

import functools
import platform
import re
import subprocess
import sys
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


def ensure_venv(venv: Path, imports: str, packages: list[str], what: str) -> Path:
    """The python of ``venv``, made with ``packages`` unless ``import <imports>`` already works
    there: a peer whose pins conflict with this project's (d3rlpy pins gymnasium 1.0.0, Flower
    protobuf < 7) runs in its own virtualenv under ``benchmarks/.venv-*`` (git-ignored), made once."""
    py = venv / "bin" / "python"
    ok = py.exists() and subprocess.run([str(py), "-c", f"import {imports}"], capture_output=True, check=False).returncode == 0
    if not ok:
        print(f"making {venv} ({what}; once, a minute or two)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *packages], check=True)
    return py


def synthetic_transitions(obs_dim: int, act_dim: int, n: int = 5000):
    """``n`` seeded random transitions: what the speed benchmarks train on (speed only)."""
    import numpy as np

    from fedrl.data.d4rl import Transitions

    rng = np.random.default_rng(0)
    return Transitions(
        obs=rng.normal(size=(n, obs_dim)).astype(np.float32),
        actions=rng.uniform(-1, 1, (n, act_dim)).astype(np.float32),
        rewards=rng.normal(size=n).astype(np.float32),
        next_obs=rng.normal(size=(n, obs_dim)).astype(np.float32),
        dones=(rng.random(n) < 0.01).astype(np.float32),
        episode=np.zeros(n, np.int64),
    )


def sync(device) -> None:
    """Wait for ``device``'s queued work (a CUDA device's; the CPU's is done when it returns)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
