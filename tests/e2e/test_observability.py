"""``fedrl up --prometheus``: every process's /metrics passes promtool, holds every metric the
dashboard and the alert rules query, and a real Prometheus scrapes the run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from fedrl.ops.local_prometheus import RULES_FILE, rule_groups
from tests.conftest import require_tool
from tests.e2e.lingering import lingering_up, start_lingering_up, stdout_until
from tests.e2e.test_up import _alive, _children
from tests.service.test_federation import wait_for

pytestmark = pytest.mark.slow(reason="fedrl up with a real Prometheus server scraping it")

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/components/monitoring/dashboards/fedrl.json"
PROMQL_WORDS = {"sum", "by", "max", "rate", "increase", "histogram_quantile", "max_over_time", "time", "and",
                "on", "le", "or", "unless", "without"}


def metric_names(expr: str) -> set[str]:
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", re.sub(r'"[^"]*"|\{[^}]*\}|\[[^]]*\]', " ", expr)))
    return {n for n in names if n.startswith(("fedrl_", "grpc_", "process_")) and n not in PROMQL_WORDS}


def queried_metrics() -> set[str]:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    exprs += [r["expr"] for g in rule_groups() for r in g["rules"]]
    return set().union(*(metric_names(e) for e in exprs))


def scrape_names(text: str) -> set[str]:
    """Every metric a scrape exports: its samples' names, and the names its TYPE lines declare (a
    labelled metric whose series have not come yet, e.g. a run's privacy spent, is one too)."""
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    return names | {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_metric_name_extraction():
    assert metric_names('sum by (reason) (increase(fedrl_x_total{a="b"}[5m])) > 0') == {"fedrl_x_total"}
    assert metric_names("sum by (grpc_code) (rate(grpc_server_handled_total[1m]))") == {"grpc_server_handled_total"}
    assert "fedrl_aggregator_updates_rejected_total" in queried_metrics()
    assert "grpc_server_handled_total" in queried_metrics()
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total"} <= queried_metrics()


def test_every_endpoint_scrapes_clean_and_prometheus_reads_the_run(stand_dataset, tmp_path):
    promtool = require_tool("promtool")
    require_tool("prometheus")
    assert RULES_FILE.exists()
    with lingering_up(stand_dataset, tmp_path, "--prometheus") as (proc, out, printed):
        summary = json.loads((out / "summary.json").read_text())
        assert summary["state"] == "finished"
        targets = json.loads((out / "metrics_targets.json").read_text())
        assert sorted(targets) == ["agent-0", "agent-1", "aggregator", "evaluator"]

        found: set[str] = set()
        for name, url in targets.items():
            text = get(url)
            lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                                  timeout=30)
            assert lint.returncode == 0, f"{name}: {lint.stdout}{lint.stderr}"
            found |= scrape_names(text)
        expanded = found | {re.sub(r"_(bucket|count|sum)$", "", n) for n in found}
        missing = {m for m in queried_metrics() if m not in found and m not in expanded}
        assert not missing, f"queried by the dashboard or the rules but never exported: {sorted(missing)}"

        prom_url = re.search(r"prometheus on (http://127\.0\.0\.1:\d+)", printed)
        assert prom_url, "fedrl up did not print the Prometheus address"

        def rounds_completed():
            q = urllib.parse.urlencode({"query": "fedrl_aggregator_rounds_completed_total"})
            body = json.loads(get(f"{prom_url.group(1)}/api/v1/query?{q}"))
            res = body["data"]["result"]
            return res and float(res[0]["value"][1]) == 2.0 and res[0]["metric"]

        labels = wait_for(rounds_completed, 60, "Prometheus to scrape 2 completed rounds")
        assert labels["job"] == "fedrl-aggregator"
        rules = json.loads(get(f"{prom_url.group(1)}/api/v1/rules"))["data"]["groups"]
        assert {r["name"] for g in rules for r in g["rules"]} >= {"FedrlRoundStalled", "FedrlUpdatesRejected"}


def test_prometheus_stops_when_up_is_killed(stand_dataset, tmp_path):
    """SIGKILL gives ``fedrl up`` no chance to stop its Prometheus: like the services, it must
    get SIGTERM from the kernel and stop by itself, not stay behind holding its port."""
    require_tool("prometheus")
    proc, _ = start_lingering_up(stand_dataset, tmp_path, "--prometheus")
    prom: list[int] = []
    try:
        printed = stdout_until(proc, "prometheus on")
        assert "prometheus on" in printed, printed
        prom = [c for c in _children(proc.pid) if open(f"/proc/{c}/comm").read().strip() == "prometheus"]
        assert len(prom) == 1, printed
        proc.kill()
        proc.wait(10)
        end = time.monotonic() + 30
        while _alive(prom[0]) and time.monotonic() < end:
            time.sleep(0.2)
        assert not _alive(prom[0]), "prometheus outlived the fedrl up that started it"
    finally:
        for c in prom + _children(proc.pid):
            if _alive(c):
                os.kill(c, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
