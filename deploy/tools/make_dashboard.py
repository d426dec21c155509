"""Writes deploy/components/monitoring/dashboards/fedrl.json (the Grafana dashboard).

Rerun after changing a panel: ``python deploy/tools/make_dashboard.py``. A test checks the
committed JSON is what this script writes and that every metric it queries exists.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "components" / "monitoring" / "dashboards" / "fedrl.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
RUN = '{run=~"$run"}'  # the runs the dashboard's run selector picks


def panel(pid: int, title: str, targets: list[tuple[str, str]], x: int, y: int, w: int = 12, h: int = 8,
          kind: str = "timeseries", unit: str = "short", description: str = "") -> dict:
    return {
        "id": pid, "type": kind, "title": title, "description": description, "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}} if kind == "timeseries" else {},
        "targets": [{"refId": chr(65 + i), "datasource": DS, "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(targets)],
    }


def dashboard() -> dict:
    # every run's series carry a `run` label: the run selector ($run, all by default) filters them
    panels = [
        panel(1, "Global version", [(f"max by (run) (fedrl_aggregator_global_version{RUN})", "{{run}}")],
              0, 0, 4, 4, "stat"),
        panel(2, "Rounds completed", [(f"sum(fedrl_aggregator_rounds_completed_total{RUN})", "rounds")],
              4, 0, 4, 4, "stat"),
        panel(3, "Agents connected / expected",
              [("sum(fedrl_aggregator_agents_connected)", "connected"),
               (f"sum(fedrl_aggregator_agents_expected{RUN})", "expected")], 8, 0, 8, 4, "stat",
              description="Agents heard from, and the agents the selected active runs ask for (an agent "
                          "in several runs counts once for each)."),
        panel(4, "Latest normalised score", [(f"max by (run) (fedrl_evaluator_normalized_score{RUN})", "{{run}}")],
              16, 0, 8, 4, "stat"),
        panel(5, "Evaluation score per global version",
              [(f"max by (run) (fedrl_evaluator_normalized_score{RUN})", "{{run}} score"),
               (f"max by (run) (fedrl_evaluator_evaluated_version{RUN})", "{{run}} version evaluated")], 0, 4, 12, 8,
              description="D4RL-normalised score (0 random, 100 expert) of each run's global versions as the "
                          "evaluator finishes them; the second series is the version each belongs to."),
        panel(6, "Evaluation return",
              [(f"max by (run) (fedrl_evaluator_return{RUN})", "{{run}} mean return"),
               (f"max by (run) (fedrl_evaluator_return_std{RUN})", "{{run}} std over episodes")], 12, 4, 12, 8),
        panel(7, "Round duration",
              [("histogram_quantile(0.5, sum by (le) (rate(fedrl_aggregator_round_duration_seconds_bucket[$__rate_interval])))", "p50"),
               ("rate(fedrl_aggregator_round_duration_seconds_sum[$__rate_interval]) / "
                "rate(fedrl_aggregator_round_duration_seconds_count[$__rate_interval])", "mean")],
              0, 12, 12, 8, unit="s"),
        panel(8, "Agents connected", [("sum(fedrl_aggregator_agents_connected)", "connected"),
                                      (f"sum(fedrl_aggregator_agents_expected{RUN})", "expected"),
                                      ("sum(fedrl_aggregator_runs_active)", "runs active")], 12, 12, 12, 8),
        panel(9, "Update rejections by reason",
              [("sum by (reason) (increase(fedrl_aggregator_updates_rejected_total[$__rate_interval])) > 0", "{{reason}}"),
               ("sum(increase(fedrl_aggregator_updates_accepted_total[$__rate_interval]))", "accepted")],
              0, 20, 12, 8),
        panel(10, "Weights moved", [("sum(rate(fedrl_aggregator_weights_received_bytes_total[$__rate_interval]))", "in"),
                                    ("sum(rate(fedrl_aggregator_weights_sent_bytes_total[$__rate_interval]))", "out")],
              12, 20, 12, 8, unit="Bps"),
        panel(11, "Critic loss per agent", [('fedrl_agent_loss{term="critic"}', "{{agent}}")], 0, 28, 8, 8),
        panel(12, "CQL penalty per agent", [('fedrl_agent_loss{term="cql_penalty"}', "{{agent}}")], 8, 28, 8, 8),
        panel(13, "Actor loss per agent", [('fedrl_agent_loss{term="actor"}', "{{agent}}")], 16, 28, 8, 8),
        panel(14, "Regularisers per agent (data NLL, global-policy NLL)",
              [('fedrl_agent_loss{term="reg_data"}', "{{agent}} data"),
               ('fedrl_agent_loss{term="reg_global"}', "{{agent}} global")], 0, 36, 12, 8),
        panel(15, "Local steps per second per agent",
              [("rate(fedrl_agent_local_steps_total[$__rate_interval])", "{{agent}}")], 12, 36, 12, 8),
        # CANCELLED is the caller going away (an agent's Session stream ends so when it stops)
        panel(16, "gRPC error rate by method",
              [('sum by (grpc_service, grpc_method, grpc_code) '
                '(rate(grpc_server_handled_total{grpc_code!~"OK|CANCELLED"}[$__rate_interval]))',
                "{{grpc_method}} {{grpc_code}}")], 0, 44, 12, 8, unit="reqps"),
        panel(17, "gRPC p95 latency (unary)",
              [('histogram_quantile(0.95, sum by (le, grpc_method) '
                '(rate(grpc_server_handling_seconds_bucket{grpc_type="unary"}[$__rate_interval])))', "{{grpc_method}}")],
              12, 44, 12, 8, unit="s"),
        panel(18, "Evaluator rollout speed", [("max(fedrl_evaluator_rollout_steps_per_second)", "env steps/s")],
              0, 52, 12, 8),
        panel(19, "Memory per process (RSS)",
              [('process_resident_memory_bytes{job=~".*fedrl.*"}', "{{job}} {{instance}}")], 12, 52, 12, 8,
              unit="bytes", description="Resident memory of every fedrl process. The aggregator's grows "
                                        "with the agents' update size times the agents per round."),
        panel(20, "CPU per process",
              [('rate(process_cpu_seconds_total{job=~".*fedrl.*"}[$__rate_interval])', "{{job}} {{instance}}")],
              0, 60, 12, 8, unit="percentunit", description="CPU seconds per second (1 = one core busy)."),
        panel(21, "Differential privacy",
              [(f"max by (run) (fedrl_aggregator_privacy_epsilon{RUN})", "{{run}} epsilon spent"),
               (f"max by (run) (fedrl_aggregator_privacy_clip_norm{RUN})", "{{run}} clipping norm")], 12, 60, 12, 8,
              description="Epsilon each run with dp_clip has spent (at its dp_delta) and the norm its next "
                          "round clips each update to (adaptive clipping moves it)."),
        panel(22, "Global versions evaluated / not evaluated",
              [("sum(increase(fedrl_evaluator_evaluations_total{origin=\"follower\"}[$__rate_interval]))", "evaluated"),
               ("sum(increase(fedrl_evaluator_evaluation_failures_total[$__rate_interval]))", "not evaluated")],
              0, 68, 12, 8,
              description="Versions the evaluator could not evaluate (a damaged file, or a policy whose actions are "
                          "not finite) are NOT_EVALUATED events with their reason: fedrl ctl watch."),
    ]
    return {
        "uid": "fedrl-federation", "title": "fedrl: federated DRPO", "tags": ["fedrl"],
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source", "current": {}},
            {"name": "run", "type": "query", "label": "Run", "datasource": DS, "refresh": 2, "sort": 2,
             "query": {"query": "label_values(fedrl_aggregator_run_active, run)", "refId": "runs"},
             "definition": "label_values(fedrl_aggregator_run_active, run)", "multi": True, "includeAll": True,
             "allValue": ".*", "current": {"selected": True, "text": ["All"], "value": ["$__all"]}},
        ]},
        "annotations": {"list": []}, "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
