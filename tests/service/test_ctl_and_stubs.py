"""The operator's tools (Python client, ``fedrl ctl``), health/reflection, and stub freshness."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from fedrl.cli.client import ControlClient
from fedrl.federation.runconfig import ConfigError
from fedrl.proto.generate import stale
from tests.service.test_federation import join, run_config, wait_for


def test_committed_stubs_match_the_protos():
    assert stale() == [], "run `python -m fedrl.proto.generate`"


def test_python_client_drives_a_run(aggregator):
    join(aggregator, "a0", 0)
    with ControlClient(aggregator.target) as c:
        with pytest.raises(ConfigError, match="agents: must be >= 1"):
            c.start({"agents": 0})  # validated before it is sent
        st = c.start(json.loads(run_config(agents=2)))
        assert st["state"] == "waiting_for_agents"
        join(aggregator, "a1", 1)
        assert wait_for(lambda: c.status()["state"] == "running")
        assert c.fetch_global()["policy.head.weight"].shape == (6, 32)
        assert c.stop("enough")["state"] == "stopped"
        kinds = [e["kind"] for e in c.watch()]
        assert kinds[0] == "RUN_STARTED" and kinds[-1] == "RUN_STOPPED"


def _ctl(target: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedrl.cli", "ctl", "--target", target, *args],
                          capture_output=True, text=True, timeout=60)


def test_ctl_command_line(aggregator):
    def ctl(*args):
        return _ctl(aggregator.target, *args)

    p = ctl("--json", "status")
    assert p.returncode == 0 and json.loads(p.stdout)["state"] == "idle"
    p = ctl("status")  # for people: no JSON, no escaped config
    assert p.returncode == 0 and p.stdout.startswith("no run yet") and "no agents joined" in p.stdout
    p = ctl("start")  # the defaults take the agents joined now: none yet
    assert p.returncode == 1 and "no agent has joined" in p.stderr and "--set agents=N" in p.stderr
    p = ctl("start", "--set", "agents=1", "--set", "rounds=1", "--set", "algo=ppo")
    assert p.returncode == 2 and "algo: 'ppo' is not one of" in p.stderr
    p = ctl("--json", "start", "--set", "agents=3", "--set", 'drpo={"hidden": [16, 16]}')
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout)
    assert st["state"] == "waiting_for_agents"
    cfg = json.loads(st["config_json"])  # ctl start's documented defaults, --set on top
    assert (cfg["agents"], cfg["rounds"], cfg["local_steps"], cfg["eval_episodes"]) == (3, 10, 1000, 10)
    p = ctl("start", "--set", "agents=3")
    assert p.returncode == 1 and "FAILED_PRECONDITION" in p.stderr
    p = ctl("status")
    assert f"run {st['run_id']}: waiting_for_agents, round 0 of 10" in p.stdout, p.stdout
    assert "drpo, 3 agents x 1000 local steps" in p.stdout and "{" not in p.stdout
    p = ctl("--json", "stop", "--reason", "from the test")
    assert p.returncode == 0 and json.loads(p.stdout)["message"] == "from the test"
    p = ctl("--json", "watch")
    assert p.returncode == 0 and json.loads(p.stdout.splitlines()[-1])["kind"] == "RUN_STOPPED"
    p = ctl("watch")  # one readable line per event
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and "run started" in lines[0] and lines[-1].endswith("run stopped: from the test")
    p = ctl("runs")
    assert p.returncode == 0 and st["run_id"] in p.stdout and "stopped" in p.stdout and "from the test" in p.stdout
    p = ctl("--json", "versions")
    vs = json.loads(p.stdout)
    assert p.returncode == 0 and vs["run_id"] == st["run_id"] and vs["versions"] == []  # never began
    p = ctl("versions", "--run", "../../etc")
    assert p.returncode == 1 and "NOT_FOUND" in p.stderr
    p = _ctl("127.0.0.1:1", "status")
    assert p.returncode == 1 and "no aggregator answering at 127.0.0.1:1" in p.stderr


def test_health_and_reflection(aggregator, caplog):
    h = health_pb2_grpc.HealthStub(aggregator.channel)
    with caplog.at_level("WARNING"):  # List (grpcurl's default) answers, and nothing is logged as an error
        listed = h.List(health_pb2.HealthListRequest(), timeout=5).statuses
    assert {"", "fedrl.v1.Federation", "fedrl.v1.Control"} <= set(listed)
    assert all(s.status == health_pb2.HealthCheckResponse.SERVING for s in listed.values())
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    for svc in ("", "fedrl.v1.Federation", "fedrl.v1.Control"):
        assert h.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as ei:
        h.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    r = reflection_pb2_grpc.ServerReflectionStub(aggregator.channel)
    resp = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
    names = {s.name for s in resp.list_services_response.service}
    assert {"fedrl.v1.Federation", "fedrl.v1.Control", "grpc.health.v1.Health"} <= names


def test_ctl_fetch_saves_a_global_version_as_a_policy_file(aggregator, tmp_path):
    from fedrl.algos.policy_io import load_policy

    def ctl(*args):
        return _ctl(aggregator.target, *args)

    out = tmp_path / "policies" / "global.safetensors"
    p = ctl("fetch", "--out", str(out))
    assert p.returncode == 1 and "no run" in p.stderr and not out.exists()
    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    with ControlClient(aggregator.target) as c:
        c.start(json.loads(run_config(agents=2)))
        assert wait_for(lambda: c.status()["state"] == "running")
        served = c.fetch_global()
        run_id = c.status()["run_id"]
    p = ctl("--json", "fetch", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"path": str(out), "run_id": run_id, "version": 0, "env_id": "Hopper-v5",
                                    "algo": "drpo"}
    p = ctl("--json", "versions")  # version 0, stored, with its checksum
    v0 = json.loads(p.stdout)["versions"][0]
    import hashlib
    path = aggregator.store.version_path(run_id, 0)
    assert v0["version"] == 0 and v0["size_bytes"] == path.stat().st_size
    assert v0["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() and v0["score_mean"] is None
    p = ctl("versions")
    assert p.returncode == 0 and v0["sha256"][:16] in p.stdout and f"run {run_id}: 1 stored versions" in p.stdout
    policy, meta = load_policy(out)  # what `fedrl evaluate` reads
    assert (meta["run_id"], meta["version"], meta["algo"]) == (run_id, 0, "drpo")
    state = {f"policy.{k}": v for k, v in policy.state_dict().items()}
    assert state.keys() == served.keys()
    assert all(torch.equal(state[k], served[k]) for k in served)
    p = ctl("fetch", "--version", "7", "--out", str(tmp_path / "v7.safetensors"))
    assert p.returncode == 1 and "NOT_FOUND" in p.stderr and "version 7 does not exist yet" in p.stderr
    assert not (tmp_path / "v7.safetensors").exists()
    before = out.read_bytes()  # an existing file is kept unless --force
    p = ctl("fetch", "--out", str(out))
    assert p.returncode == 1 and "exists; pass --force" in p.stderr and out.read_bytes() == before
    p = ctl("fetch", "--out", str(out), "--force")
    assert p.returncode == 0, p.stderr


def test_services_write_json_logs_for_collectors(tmp_path):
    import signal
    import time

    pf = tmp_path / "port"
    p = subprocess.Popen([sys.executable, "-m", "aggregator_service", "--port", "0", "--port-file", str(pf),
                          "--state-dir", str(tmp_path / "state"), "--log-format", "json"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 60
        while not pf.exists() and p.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        assert pf.exists(), "the aggregator did not start"
        assert _ctl(f"127.0.0.1:{pf.read_text()}", "start", "--set", "agents=1").returncode == 0
    finally:
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    lines = [json.loads(x) for x in out.splitlines() if x.strip()]  # every line is one JSON object
    assert any(x["message"].startswith("serving on 127.0.0.1:") for x in lines)
    started = [x for x in lines if x.get("kind") == "RUN_STARTED"]
    assert started and started[0]["level"] == "INFO" and started[0]["run_id"]
