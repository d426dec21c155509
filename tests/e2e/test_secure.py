"""``fedrl up --secure``: every process over mutual TLS with its own token, as real processes;
``fedrl ctl`` without the admin token is refused, with it it reads the status."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.e2e.test_observability import stdout_until
from tests.e2e.test_up import TINY


def test_up_secure_runs_and_refuses_callers_without_credentials(stand_dataset, tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({**TINY, "round_timeout": 120}))
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedrl.cli", "up", "--config", str(cfg), "--dataset", str(stand_dataset),
         "--agents", "2", "--trajectories", "2", "--rounds", "2", "--local-steps", "3", "--eval-episodes", "1",
         "--device", "cpu", "--out", str(out), "--secure", "--linger", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        printed = stdout_until(proc, "run over")
        assert "round   2/2" in printed, printed
        assert json.loads((out / "summary.json").read_text())["state"] == "finished"
        log = (out / "logs" / "aggregator.log").read_text()
        assert "(mutual TLS, tokens required)" in log
        target = re.search(r"aggregator on (127\.0\.0\.1:\d+)", printed).group(1)
        env = {k: v for k, v in os.environ.items() if k != "FEDRL_ADMIN_TOKEN"}

        def ctl(*args, **extra):
            return subprocess.run([sys.executable, "-m", "fedrl.cli", "ctl", "--target", target, *args, "status"],
                                  capture_output=True, text=True, timeout=60, env={**env, **extra})

        p = ctl("--tls-dir", str(out / "tls" / "admin"))
        assert p.returncode == 1 and "UNAUTHENTICATED" in p.stderr, p.stdout + p.stderr
        p = ctl("--connect-timeout", "3")  # plaintext to a TLS port: never connects
        assert p.returncode == 1 and "no aggregator answering" in p.stderr, p.stderr
        # an agent's certificate and a made-up token: still no
        p = ctl("--tls-dir", str(out / "tls" / "agent-0"), FEDRL_ADMIN_TOKEN="x" * 32)
        assert p.returncode == 1 and "UNAUTHENTICATED" in p.stderr
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("fedrl up did not stop on Ctrl-C")
    assert rc == 0
