"""``fedrl up --secure``: every process over mutual TLS with its own token, as real processes;
``fedrl ctl`` without the admin token is refused, with it it reads the status."""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests.conftest import require_tool
from tests.e2e.lingering import lingering_up
from tests.service.test_federation import RPC_BOUND, wait_for

pytestmark = pytest.mark.slow(reason="fedrl up over mutual TLS, every service a real process")


def test_up_secure_runs_and_refuses_callers_without_credentials(stand_dataset, tmp_path):
    require_tool("prometheus")
    with lingering_up(stand_dataset, tmp_path, "--secure", "--prometheus") as (proc, out, printed):
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

        # metrics: HTTPS that wants a client certificate; the local Prometheus has one
        targets = json.loads((out / "metrics_targets.json").read_text())
        assert all(u.startswith("https://") for u in targets.values())
        ctx = ssl.create_default_context(cafile=str(out / "tls" / "ca.crt"))
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(targets["aggregator"], context=ctx, timeout=5).read()
        ctx.load_cert_chain(str(out / "tls" / "admin" / "tls.crt"), str(out / "tls" / "admin" / "tls.key"))
        assert re.search(r'^fedrl_aggregator_rounds_completed_total\{run="[^"]+"\} 2\.0$', urllib.request.urlopen(
            targets["aggregator"], context=ctx, timeout=RPC_BOUND).read().decode(), re.M)
        prom = re.search(r"prometheus on (http://127\.0\.0\.1:\d+)", printed).group(1)

        def scraped():
            q = urllib.parse.urlencode({"query": "fedrl_aggregator_rounds_completed_total"})
            res = json.loads(urllib.request.urlopen(f"{prom}/api/v1/query?{q}", timeout=5).read())["data"]["result"]
            return res and res[0]["value"][1] == "2"

        wait_for(scraped, 60, "Prometheus to scrape the aggregator over mutual TLS")
