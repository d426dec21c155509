"""Virtual environments a benchmark makes for a peer whose pins conflict with this project's
(d3rlpy pins gymnasium 1.0.0, Flower protobuf < 7): made once under ``benchmarks/.venv-*``
(git-ignored), reused after."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def ensure_venv(venv: Path, imports: str, packages: list[str], what: str) -> Path:
    """The python of ``venv``, made with ``packages`` unless ``import <imports>`` already works there."""
    py = venv / "bin" / "python"
    ok = py.exists() and subprocess.run([str(py), "-c", f"import {imports}"], capture_output=True, check=False).returncode == 0
    if not ok:
        print(f"making {venv} ({what}; once, a minute or two)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *packages], check=True)
    return py
