"""``fedrl up --linger`` as a real process for tests that look at a finished run's services."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.e2e.test_up import TINY


def stdout_until(proc, marker: str) -> str:
    """What ``proc`` printed up to and including the line containing ``marker``."""
    lines: list[str] = []
    while not any(marker in line for line in lines):
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    return "".join(lines)


def start_lingering_up(dataset, tmp_path, *flags: str):
    """A tiny 2-agent, 2-round ``fedrl up`` that stays up after its run; (proc, out folder)."""
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({**TINY, "round_timeout": 120}))
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedrl.cli", "up", "--config", str(cfg), "--dataset", str(dataset),
         "--agents", "2", "--trajectories", "2", "--rounds", "2", "--local-steps", "3", "--eval-episodes", "1",
         "--device", "cpu", "--out", str(out), "--linger", "120", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, out


@contextlib.contextmanager
def lingering_up(dataset, tmp_path, *flags: str):
    """:func:`start_lingering_up`; yields (proc, out, printed). Ctrl-C at the end must stop it
    with the run's exit status 0."""
    proc, out = start_lingering_up(dataset, tmp_path, *flags)
    try:
        yield proc, out, stdout_until(proc, "run over")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("fedrl up did not stop on Ctrl-C")
    assert rc == 0, "Ctrl-C during --linger keeps the run's exit status"
