"""deploy/: every overlay renders with kustomize, validates strictly against a recent Kubernetes,
and keeps the promises the manifests make (non-root, read-only root, limits, gRPC probes,
metrics ports, GPUs only where asked). Offline: no cluster is needed or used."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.conftest import require_tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("local", "gpu")


def _k8s_version() -> str:
    import kubernetes_validate

    return kubernetes_validate.latest_version()  # the newest release it has schemas for


K8S_VERSION = _k8s_version()


def render(overlay: str) -> list[dict]:
    kubectl = require_tool("kubectl")
    p = subprocess.run([kubectl, "kustomize", str(DEPLOY / "overlays" / overlay)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return [d for d in yaml.safe_load_all(p.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request):
    return request.param, render(request.param)


def builtin(docs):
    return [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com/")]


def workloads(docs):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")}


def test_every_builtin_kind_validates_strictly(rendered):
    import kubernetes_validate

    _, docs = rendered
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet", "Service", "ConfigMap", "Job"}
    for d in builtin(docs):
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def test_the_validator_would_catch_a_mistake(rendered):
    import kubernetes_validate

    _, docs = rendered
    dep = copy.deepcopy(workloads(docs)["fedrl-aggregator"])
    dep["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def test_pods_are_hardened_sized_and_probed(rendered):
    overlay, docs = rendered
    scripts = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
    for name, w in workloads(docs).items():
        spec = w["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["automountServiceAccountToken"] is False, name
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and \
                {"cpu", "memory"} <= set(c["resources"]["limits"]), (name, c["name"])
            assert c["image"].startswith("fedrl:0.1.0"), c["image"]
        for c in spec["containers"]:
            assert c["command"][0] in scripts, f"{name}: {c['command'][0]} is not a console script"
        if w["kind"] != "Job":
            c = spec["containers"][0]
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert "metrics" in ports, name
            assert str(ports["metrics"]) == c["args"][c["args"].index("--metrics-port") + 1]
            for probe in (c.get("livenessProbe"), c.get("readinessProbe"), c.get("startupProbe")):
                if probe:  # on the plaintext health-only port, which answers without TLS or tokens
                    assert probe["grpc"]["port"] == ports["health"], name
            assert str(ports["health"]) == c["args"][c["args"].index("--health-port") + 1]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert {p["name"] for p in services["fedrl-aggregator"]["spec"]["ports"]} == {"grpc", "metrics"}


def test_every_container_command_line_parses_with_the_cli_it_names(rendered, monkeypatch, capsys):
    # A flag renamed or a value now refused (a port, a count) would otherwise show first as a
    # crash-looping pod on a user's cluster.
    import importlib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    monkeypatch.setenv("HOSTNAME", "fedrl-agent-3")  # what a StatefulSet pod's --shard ordinal reads
    checked = []
    for name, w in workloads(rendered[1]).items():
        for c in w["spec"]["template"]["spec"]["containers"]:
            module = importlib.import_module(scripts[c["command"][0]].split(":")[0])
            try:
                module.build_parser().parse_args([*c["command"][1:], *c.get("args", [])])
            except SystemExit:
                pytest.fail(f"{name}/{c['name']}: {c['command'] + c.get('args', [])}: {capsys.readouterr().err}")
            checked.append(c["command"][0])
    assert set(checked) == set(scripts)  # every service and the control CLI (the start Job)


def test_agents_get_gpus_only_in_the_gpu_overlay(rendered):
    overlay, docs = rendered
    agent = workloads(docs)["fedrl-agent"]
    c = agent["spec"]["template"]["spec"]["containers"][0]
    gpus = c["resources"]["limits"].get("nvidia.com/gpu")
    device = c["args"][c["args"].index("--device") + 1]
    if overlay == "gpu":
        assert gpus == 1 and device == "cuda" and c["image"] == "fedrl:0.1.0-gpu"
        assert agent["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    else:
        assert gpus is None and device == "cpu"
    cfg = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "fedrl-run-config")
    run = json.loads(cfg["data"]["run.json"])
    assert run["agents"] == agent["spec"]["replicas"], "the run waits for as many agents as the StatefulSet has"
    from fedrl.federation.runconfig import parse_run_config
    parse_run_config(run)  # the aggregator would accept it


def test_tls_and_tokens_are_optional_in_local_and_mandatory_in_gpu(rendered):
    overlay, docs = rendered
    for name, w in workloads(docs).items():
        spec = w["spec"]["template"]["spec"]
        c = spec["containers"][0]
        env = {e["name"]: e for e in c.get("env", [])}
        tls_volume = next(v for v in spec["volumes"] if v["name"] == "tls")
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["tls"] == "/etc/fedrl/tls", name
        secret_refs = [e["valueFrom"]["secretKeyRef"] for e in env.values() if "valueFrom" in e
                       and "secretKeyRef" in e["valueFrom"]]
        assert secret_refs and all(r["name"] == "fedrl-tokens" for r in secret_refs), name
        if overlay == "gpu":
            assert env["FEDRL_TLS_DIR"]["value"] == "/etc/fedrl/tls", name
            assert tls_volume["secret"]["optional"] is False and all(r["optional"] is False for r in secret_refs)
        else:
            assert "FEDRL_TLS_DIR" not in env, name
            assert tls_volume["secret"]["optional"] is True and all(r["optional"] is True for r in secret_refs)
    monitors = [d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor")]
    for m in monitors:  # metrics are mutual TLS too where the services are
        ep = (m["spec"].get("endpoints") or m["spec"]["podMetricsEndpoints"])[0]
        assert ep.get("scheme") == "https" and ep["tlsConfig"]["keySecret"]["name"] == "fedrl-tls-admin"
        role = {"ServiceMonitor": m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"],
                "PodMonitor": "agent"}[m["kind"]]
        assert ep["tlsConfig"]["serverName"] == f"fedrl-metrics-{role}", m["metadata"]["name"]  # its role's
    assert (overlay == "gpu") == bool(monitors)
    agg_env = {e["name"] for e in workloads(docs)["fedrl-aggregator"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {"FEDRL_ADMIN_TOKEN", "FEDRL_EVALUATOR_TOKEN", "FEDRL_AGENT_TOKENS"} <= agg_env


def test_monitoring_component_ships_rules_monitors_and_the_dashboard():
    docs = render("gpu")
    kinds = {d["kind"] for d in docs}
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule"} <= kinds
    board = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "fedrl-grafana-dashboard")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    committed = (DEPLOY / "components/monitoring/dashboards/fedrl.json").read_text()
    assert board["data"]["fedrl.json"] == committed
    assert {p["title"] for p in json.loads(committed)["panels"]} >= {
        "Evaluation score per global version", "Round duration", "Agents connected",
        "Update rejections by reason", "Critic loss per agent", "gRPC error rate by method"}
    # every port a monitor scrapes exists under that name
    pm = next(d for d in docs if d["kind"] == "PodMonitor")
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_committed_dashboard_is_what_its_generator_writes():
    p = subprocess.run([sys.executable, "-c", "import runpy,sys; sys.argv=['x']; "
                        "m=runpy.run_path('deploy/tools/make_dashboard.py'); print(m['render'](), end='')"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout == (DEPLOY / "components/monitoring/dashboards/fedrl.json").read_text(), \
        "stale dashboard: run python deploy/tools/make_dashboard.py"


def test_dashboard_is_well_formed_for_grafana():
    board = json.loads((DEPLOY / "components/monitoring/dashboards/fedrl.json").read_text())
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 30
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "run"]
    run = board["templating"]["list"][1]  # the run selector: every run's series by default
    assert run["query"]["query"] == "label_values(fedrl_aggregator_run_active, run)" and run["includeAll"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in board["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        assert p["targets"] and all(t["expr"] and t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
    # no two panels overlap on the grid
    cells = set()
    for p in board["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
