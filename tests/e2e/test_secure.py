"""``fedrl up --secure``: every process over mutual TLS with its own token, as real processes;
``fedrl ctl`` without the admin token is refused, with it it reads the status."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.e2e.lingering import lingering_up


def test_up_secure_runs_and_refuses_callers_without_credentials(stand_dataset, tmp_path):
    with lingering_up(stand_dataset, tmp_path, "--secure") as (proc, out, printed):
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
