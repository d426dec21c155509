"""The alert rules: promtool accepts the shipped rules file and its unit tests as they are, every
alert passes its tests, and the PrometheusRule is the one generated from the rules file."""

from __future__ import annotations

import shutil
import subprocess

import yaml

from fedrl.ops.local_prometheus import PROMETHEUS_RULE, RULES_FILE, prometheus_rule, rule_groups
from tests.conftest import require_tool

TESTS_FILE = RULES_FILE.parent.parent / "tests" / "alerts.test.yaml"


def write_rules(tmp_path):
    """A copy of the rules and their tests in the shipped layout (to break a rule in the copy)."""
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    shutil.copy(TESTS_FILE, tmp_path / "tests" / "alerts.test.yaml")
    shutil.copy(RULES_FILE, tmp_path / "rules" / RULES_FILE.name)
    return tmp_path / "rules" / RULES_FILE.name, tmp_path / "tests" / "alerts.test.yaml"


def test_the_prometheusrule_is_generated_from_the_rules_file():
    assert PROMETHEUS_RULE.read_text() == prometheus_rule(), \
        "stale: python -m fedrl.ops.local_prometheus --write-prometheusrule"
    assert rule_groups(PROMETHEUS_RULE) == rule_groups(RULES_FILE)


def test_promtool_checks_the_rules_as_shipped():
    promtool = require_tool("promtool")
    rules = RULES_FILE
    p = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS: 7 rules found" in p.stdout + p.stderr


def test_every_alert_has_a_unit_test_and_they_pass_as_shipped():
    promtool = require_tool("promtool")
    tests = TESTS_FILE
    alerts = {r["alert"] for g in rule_groups() for r in g["rules"] if "alert" in r}
    assert alerts == {"FedrlRoundStalled", "FedrlAgentMissing", "FedrlScoreRegression", "FedrlUpdatesRejected",
                      "FedrlVersionsNotEvaluated", "FedrlAggregatorDown", "FedrlProcessDown"}
    tested = {t["alertname"] for case in yaml.safe_load(tests.read_text())["tests"] for t in case["alert_rule_test"]}
    assert tested == alerts
    # each alert is shown firing somewhere (not only quiet)
    firing = {t["alertname"] for case in yaml.safe_load(tests.read_text())["tests"]
              for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert firing == alerts
    p = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_broken_rule_makes_the_unit_tests_fail(tmp_path):
    promtool = require_tool("promtool")
    rules, tests = write_rules(tmp_path)
    groups = rule_groups(rules)
    groups[0]["rules"][1]["expr"] = "fedrl_aggregator_agents_connected > fedrl_aggregator_agents_expected"
    rules.write_text(yaml.safe_dump({"groups": groups}))
    p = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "FedrlAgentMissing" in p.stdout + p.stderr


def test_local_prometheus_config_loads_the_deployments_rules_and_says_when_it_cannot(tmp_path):
    import json

    from fedrl.ops.local_prometheus import RULES_FILE, rule_groups, write_config

    cfg = json.loads(write_config(tmp_path / "a", {"fedrl-aggregator": [("127.0.0.1:9", "aggregator")]}).read_text())
    assert cfg["rule_files"] == [str((tmp_path / "a" / "rules.yml").resolve())]
    assert json.loads((tmp_path / "a" / "rules.yml").read_text())["groups"] == rule_groups(RULES_FILE)
    cfg = json.loads(write_config(tmp_path / "b", {"fedrl-aggregator": [("127.0.0.1:9", "aggregator")]},
                                  rules_file=tmp_path / "missing.yaml").read_text())
    assert "rule_files" not in cfg and not (tmp_path / "b" / "rules.yml").exists()
    assert cfg["scrape_configs"][0]["static_configs"][0]["labels"] == {"instance": "aggregator",
                                                                       "service": "fedrl-aggregator"}


def test_local_prometheus_scrapes_with_the_metrics_token_and_each_roles_certificate_name(tmp_path):
    """``fedrl up``'s Prometheus sends the metrics token (its scrapes come first) and, under TLS,
    verifies each job's role name: an agent's metrics certificate cannot pass for the aggregator's."""
    import json

    from fedrl.ops.local_prometheus import write_config

    jobs = {"fedrl-aggregator": [("127.0.0.1:9", "aggregator")], "fedrl-agent": [("127.0.0.1:8", "agent-0")]}
    cfg = json.loads(write_config(tmp_path / "c", jobs, tls_dir=tmp_path, token="t" * 32, rules_file=None).read_text())
    by_job = {sc["job_name"]: sc for sc in cfg["scrape_configs"]}
    assert {j: sc["tls_config"]["server_name"] for j, sc in by_job.items()} == {
        "fedrl-aggregator": "fedrl-metrics-aggregator", "fedrl-agent": "fedrl-metrics-agent"}
    assert all(sc["authorization"] == {"type": "Bearer", "credentials": "t" * 32} for sc in by_job.values())
