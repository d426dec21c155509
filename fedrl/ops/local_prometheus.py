"""A real Prometheus server on loopback, scraping a ``fedrl up`` run (no cluster needed).

The alert rules are the ones the Kubernetes deployment ships
(``deploy/components/monitoring/prometheusrule.yaml``): the server loads their ``spec`` so the
same alerts evaluate locally. Data stays in ``<run>/prometheus/data``; reopen it later with
``prometheus --config.file <run>/prometheus/prometheus.yml --storage.tsdb.path <run>/prometheus/data``.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedrl.wire.devca import metrics_name

REPO_DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES_FILE = REPO_DEPLOY / "components" / "monitoring" / "rules" / "fedrl.rules.yml"  # plain Prometheus rules
PROMETHEUS_RULE = REPO_DEPLOY / "components" / "monitoring" / "prometheusrule.yaml"  # generated from it


class PrometheusError(RuntimeError):
    pass


def find_prometheus(binary: str | None = None) -> str:
    path = shutil.which(binary or "prometheus")
    if path is None:
        raise PrometheusError(f"{binary or 'prometheus'} is not installed or not on PATH "
                              "(Debian/Ubuntu: apt-get install prometheus; or download it from "
                              "prometheus.io and pass --prometheus-bin)")
    return path


def rule_groups(rules_file: Path = RULES_FILE) -> list[dict[str, Any]]:
    """The rule groups of a rules file (``groups:``) or of a PrometheusRule (``spec.groups``)."""
    import yaml

    doc = yaml.safe_load(Path(rules_file).read_text())
    if isinstance(doc, dict) and doc.get("kind") == "PrometheusRule":
        return doc["spec"]["groups"]
    if not isinstance(doc, dict) or not isinstance(doc.get("groups"), list):
        raise PrometheusError(f"{rules_file}: neither a Prometheus rules file (groups:) nor a PrometheusRule")
    return doc["groups"]


def prometheus_rule(rules_file: Path = RULES_FILE) -> str:
    """The Prometheus Operator's PrometheusRule for the rules file: its ``groups`` under ``spec``."""
    rel = Path(rules_file).relative_to(REPO_DEPLOY.parent) if Path(rules_file).is_relative_to(REPO_DEPLOY.parent) \
        else Path(rules_file)
    body = Path(rules_file).read_text().split("\ngroups:", 1)
    if len(body) != 2:
        raise PrometheusError(f"{rules_file}: no top-level 'groups:'")
    groups = "\n".join(("  " + line) if line else line for line in ("groups:" + body[1]).splitlines())
    return (f"# Generated from {rel} by python -m fedrl.ops.local_prometheus --write-prometheusrule;\n"
            "# edit that file (promtool checks and tests it as it is), not this one.\n"
            "apiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\nmetadata:\n  name: fedrl-alerts\n"
            "  labels: {app.kubernetes.io/name: fedrl-alerts}\nspec:\n" + groups.rstrip() + "\n")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m fedrl.ops.local_prometheus")
    ap.add_argument("--write-prometheusrule", action="store_true",
                    help=f"rewrite {PROMETHEUS_RULE.relative_to(REPO_DEPLOY.parent)} from {RULES_FILE.name}")
    ap.add_argument("--check", action="store_true", help="exit 1 if the PrometheusRule is not what the rules give")
    a = ap.parse_args(argv)
    want = prometheus_rule()
    if a.write_prometheusrule:
        PROMETHEUS_RULE.write_text(want)
        print(f"wrote {PROMETHEUS_RULE}")
        return 0
    if a.check:
        ok = PROMETHEUS_RULE.exists() and PROMETHEUS_RULE.read_text() == want
        print("the PrometheusRule matches the rules file" if ok else
              f"{PROMETHEUS_RULE} is stale: run python -m fedrl.ops.local_prometheus --write-prometheusrule")
        return 0 if ok else 1
    ap.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def write_config(folder: Path, targets: Mapping[str, Sequence[tuple[str, str]]],
                 scrape_interval: str = "2s", rules_file: Path | None = RULES_FILE,
                 tls_dir: Path | None = None, token: str | None = None) -> Path:
    """Write ``prometheus.yml`` (and ``rules.yml``) into ``folder``.

    ``targets`` maps a job name to ``(host:port, instance label)`` pairs; every target also
    gets the ``service`` label the Kubernetes ServiceMonitors attach, so rules and dashboard
    queries read the same either way. With ``tls_dir`` (ca.crt, tls.crt, tls.key) it scrapes
    over HTTPS, presenting that client certificate (the services' metrics under mutual TLS).
    With ``token`` it sends it as the bearer token the endpoints take as the scraper's
    (``FEDRL_METRICS_TOKEN``), so its scrapes get through whatever other clients hold.
    """
    folder.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = {"global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval}}
    if rules_file is not None and Path(rules_file).exists():
        (folder / "rules.yml").write_text(json.dumps({"groups": rule_groups(rules_file)}, indent=1))
        cfg["rule_files"] = [str((folder / "rules.yml").resolve())]
    cfg["scrape_configs"] = [
        {"job_name": job, "static_configs": [
            {"targets": [t], "labels": {"instance": inst, "service": job}} for t, inst in pairs]}
        for job, pairs in targets.items()]
    if token is not None:
        for sc in cfg["scrape_configs"]:
            sc["authorization"] = {"type": "Bearer", "credentials": token}
    if tls_dir is not None:
        d = Path(tls_dir).resolve()
        for sc in cfg["scrape_configs"]:
            sc["scheme"] = "https"
            # a metrics endpoint's certificate names its role, fedrl-metrics-<role>
            # (fedrl.wire.devca), whatever address it is scraped at; the job fedrl-<role> scrapes it
            sc["tls_config"] = {"ca_file": str(d / "ca.crt"), "cert_file": str(d / "tls.crt"),
                                "key_file": str(d / "tls.key"),
                                "server_name": metrics_name(sc["job_name"].removeprefix("fedrl-"))}
    path = folder / "prometheus.yml"
    path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalPrometheus:
    """``prometheus`` as a child process on ``127.0.0.1``; :meth:`query` reads its HTTP API."""

    def __init__(self, folder: Path, config: Path, binary: str | None = None, log_file=None,
                 preexec_fn: Callable[[], None] | None = None) -> None:
        """``preexec_fn`` runs in the child before exec (the launcher ties its life to its own)."""
        self.folder, self.config = Path(folder), Path(config)
        self.binary = find_prometheus(binary)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            stdout=log_file or subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=preexec_fn)

    def wait_ready(self, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with status {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise PrometheusError(f"prometheus not ready on {self.url} within {timeout:.0f}s")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the ``result`` vector of the API's answer."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise PrometheusError(f"query {expr!r} failed: {body}")
        return body["data"]["result"]

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
