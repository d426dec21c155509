"""Before/after speed of a change to the critic's fused MLP, interleaved in one process.

    python -m benchmarks.ab_critic [--rev 75a4f43] [--seconds 60] [--algo drpo]

Loads ``fedrl/algos/nets.py`` as it was at git revision ``--rev`` next to the working tree's, and
times the paper-size DRPO (or CQL) update alternately with each version's ``_EnsembleReluMLP``
(windows of 4 steps, same learner, same data stream). Alternating in one process is what makes
a few-percent difference measurable on a noisy machine; separate runs differ by more than that.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import fedrl.algos.nets as nets
from benchmarks.throughput import synthetic_transitions
from fedrl.algos import DRPOConfig, cql_config
from fedrl.data.buffer import TensorBuffer
from fedrl.federation.round import build_learner

ROOT = Path(__file__).resolve().parent.parent


def nets_at(rev: str):
    """``fedrl/algos/nets.py`` of a git revision, imported as a separate module."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:fedrl/algos/nets.py"], check=True,
                         capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"nets_{rev}", f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    Path(f.name).unlink()
    return mod


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", default="75a4f43", help="the 'before' revision (default: before the one-column head)")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--algo", choices=("drpo", "cql"), default="drpo")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    before, after = nets_at(a.rev)._EnsembleReluMLP, nets._EnsembleReluMLP
    cfg = DRPOConfig() if a.algo == "drpo" else cql_config()
    dev = torch.device("cpu")
    learner = build_learner(cfg, 11, 3, dev, 0, 0)
    buf = TensorBuffer(synthetic_transitions(11, 3), np.zeros(11, np.float32), np.ones(11, np.float32), dev)
    for _ in range(3):
        learner.update(buf.sample(cfg.batch_size, learner.gen))
    times: dict[str, list[float]] = {"before": [], "after": []}
    end = time.monotonic() + a.seconds
    try:
        while time.monotonic() < end:
            for name, cls in (("before", before), ("after", after)):
                nets._EnsembleReluMLP = cls
                t0 = time.perf_counter()
                for _ in range(4):
                    learner.update(buf.sample(cfg.batch_size, learner.gen))
                times[name].append((time.perf_counter() - t0) / 4)
    finally:
        nets._EnsembleReluMLP = after
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(f"{a.algo} update, Hopper sizes, {torch.get_num_threads()} threads, {len(times['after'])} windows of 4 steps each")
    for k in ("before", "after"):
        print(f"  {k:6s} ({a.rev if k == 'before' else 'working tree'}): {med[k] * 1e3:.1f} ms/step (median)")
    print(f"  speed-up: {med['before'] / med['after']:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
