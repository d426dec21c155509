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
from tests.service.test_federation import RPC_BOUND


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
    p = ctl("--json", "start", "--set", "agents=3", "--set", "rounds=2")  # a second run, beside the first
    assert p.returncode == 0, p.stderr
    second = json.loads(p.stdout)["run_id"]
    p = ctl("status", "--run", st["run_id"])
    assert f"run {st['run_id']}: waiting_for_agents, round 0 of 10" in p.stdout, p.stdout
    assert "drpo, 3 agents x 1000 local steps" in p.stdout and "{" not in p.stdout
    p = ctl("status")  # every run held, the newest's details first
    assert p.stdout.startswith(f"run {second}: waiting_for_agents, round 0 of 2") and "2 runs held" in p.stdout
    assert st["run_id"] in p.stdout
    p = ctl("stop")
    assert p.returncode == 1 and "2 runs are active" in p.stderr and "name the one to stop" in p.stderr
    p = ctl("--json", "stop", "--run", second)
    assert p.returncode == 0 and json.loads(p.stdout)["run_id"] == second
    p = ctl("--json", "stop", "--reason", "from the test")  # the only active run now
    assert p.returncode == 0 and json.loads(p.stdout)["message"] == "from the test"
    assert json.loads(p.stdout)["run_id"] == st["run_id"]
    p = ctl("--json", "watch", "--run", st["run_id"])
    assert p.returncode == 0 and json.loads(p.stdout.splitlines()[-1])["kind"] == "RUN_STOPPED"
    p = ctl("watch", "--run", st["run_id"])  # one readable line per event
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and "run started" in lines[0] and lines[-1].endswith("run stopped: from the test")
    p = ctl("watch")  # every run's, until all have ended
    assert p.returncode == 0 and [ln.split()[1] for ln in p.stdout.splitlines() if "run stopped" in ln] == [
        st["run_id"], second]
    p = ctl("runs")
    assert p.returncode == 0 and st["run_id"] in p.stdout and "stopped" in p.stdout and "from the test" in p.stdout
    p = ctl("--json", "versions")
    vs = json.loads(p.stdout)
    assert p.returncode == 0 and vs["run_id"] == second and vs["versions"] == []  # the newest; never began
    p = ctl("versions", "--run", "../../etc")
    assert p.returncode == 1 and "NOT_FOUND" in p.stderr
    p = _ctl("127.0.0.1:1", "status")  # nothing listens: said at once
    assert p.returncode == 1 and "nothing listens at 127.0.0.1:1 (connection refused)" in p.stderr
    p = _ctl("127.0.0.1:1", "--connect-timeout", "0.5", "status")  # asked to wait: it waits, then says so
    assert p.returncode == 1 and "no aggregator answering at 127.0.0.1:1 within 0.5 s" in p.stderr


def test_health_and_reflection(aggregator, caplog):
    h = health_pb2_grpc.HealthStub(aggregator.channel)
    with caplog.at_level("WARNING"):  # List (grpcurl's default) answers, and nothing is logged as an error
        listed = h.List(health_pb2.HealthListRequest(), timeout=RPC_BOUND).statuses
    assert {"", "fedrl.v1.Federation", "fedrl.v1.Control"} <= set(listed)
    assert all(s.status == health_pb2.HealthCheckResponse.SERVING for s in listed.values())
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    for svc in ("", "fedrl.v1.Federation", "fedrl.v1.Control"):
        assert h.Check(health_pb2.HealthCheckRequest(service=svc), timeout=RPC_BOUND).status == \
            health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as ei:
        h.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=RPC_BOUND)
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    r = reflection_pb2_grpc.ServerReflectionStub(aggregator.channel)
    resp = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=RPC_BOUND))
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
    import hashlib
    assert json.loads(p.stdout) == {"path": str(out), "run_id": run_id, "version": 0, "env_id": "Hopper-v5",
                                    "algo": "drpo", "sha256": hashlib.sha256(out.read_bytes()).hexdigest()}
    p = ctl("--json", "versions")  # version 0, stored, with its checksum
    v0 = json.loads(p.stdout)["versions"][0]
    path = aggregator.store.version_path(run_id, 0)
    assert v0["version"] == 0 and v0["size_bytes"] == path.stat().st_size
    assert v0["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() and v0["score_mean"] is None
    p = ctl("versions")
    assert p.returncode == 0 and v0["sha256"][:16] in p.stdout and f"run {run_id}: 1 stored version (" in p.stdout
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
    p = ctl("fetch", "--out", str(out), "--force")  # a second fetch of a version writes the same bytes
    assert p.returncode == 0, p.stderr
    assert out.read_bytes() == before and hashlib.sha256(before).hexdigest()[:16] in p.stdout


def test_services_write_json_logs_for_collectors(tmp_path):
    """The aggregator and the evaluator log in JSON, one object a line, their lifecycle included:
    why they stop (the signal, the run's state) and that they have stopped."""
    import signal
    import time

    pf, epf = tmp_path / "port", tmp_path / "eport"
    p = subprocess.Popen([sys.executable, "-m", "aggregator_service", "--port", "0", "--port-file", str(pf),
                          "--state-dir", str(tmp_path / "state"), "--log-format", "json"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    e = None
    try:
        end = time.monotonic() + 60
        while not pf.exists() and p.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        assert pf.exists(), "the aggregator did not start"
        e = subprocess.Popen([sys.executable, "-m", "evaluator_service", "--port", "0", "--port-file", str(epf),
                              "--aggregator", f"127.0.0.1:{pf.read_text()}", "--log-format", "json"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert _ctl(f"127.0.0.1:{pf.read_text()}", "start", "--set", "agents=1").returncode == 0
        while not epf.exists() and e.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        assert epf.exists(), "the evaluator did not start"
    finally:
        if e is not None:
            e.send_signal(signal.SIGTERM)
            e_out, _ = e.communicate(timeout=30)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    lines = [json.loads(x) for x in out.splitlines() if x.strip()]  # every line is one JSON object
    assert any(x["message"].startswith("serving on 127.0.0.1:") for x in lines)
    started = [x for x in lines if x.get("kind") == "RUN_STARTED"]
    assert started and started[0]["level"] == "INFO" and started[0]["run_id"]
    stopping = [x["message"] for x in lines if x["message"].startswith("received SIGTERM; stopping")]
    assert stopping and f"run {started[0]['run_id']} waiting_for_agents" in stopping[0], stopping
    assert lines[-1]["message"] == "stopped"
    e_lines = [json.loads(x) for x in e_out.splitlines() if x.strip()]
    assert any(x["message"].startswith("received SIGTERM; stopping (following 127.0.0.1:") for x in e_lines)
    assert e_lines[-1]["message"] == "stopped" and any("torch threads: 1" in x["message"] for x in e_lines)


def _finish_one_round_run(aggregator, **cfg):
    """A run of one round driven by hand: both agents send the global back; returns its id."""
    from fedrl.proto.v1 import control_pb2, federation_pb2
    from fedrl.wire.codec import assemble
    from fedrl.wire.serde import read_weight_parts, status_from_proto
    from tests.service.test_federation import submit

    st = status_from_proto(aggregator.control.StartRun(
        control_pb2.StartRunRequest(config_json=run_config(rounds=1, **cfg)), timeout=RPC_BOUND))
    g = assemble(*read_weight_parts(aggregator.fed.FetchGlobal(
        federation_pb2.FetchRequest(run_id=st["run_id"], version=0), timeout=RPC_BOUND)))
    for aid in ("a0", "a1"):
        submit(aggregator, aid, g, st["run_id"])
    assert wait_for(lambda: aggregator.coord.status()["state"] == "finished")
    return st["run_id"]


def test_ctl_fetches_any_stored_run_and_counts_rounds_per_run(aggregator, tmp_path):
    """After a second run started, ``fetch --run`` still gets the first run's model (its latest
    version by default) and names what it saved; without --run, the current run's. The status's
    rounds column counts the current run's rounds only."""
    from fedrl.algos.policy_io import load_policy

    def ctl(*args):
        return _ctl(aggregator.target, *args)

    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    first = _finish_one_round_run(aggregator)
    p = ctl("--json", "status")
    assert [a["rounds_submitted"] for a in json.loads(p.stdout)["agents"]] == [1, 1]
    with ControlClient(aggregator.target) as c:
        second = c.start(json.loads(run_config(agents=2)))["run_id"]
        assert wait_for(lambda: c.status()["state"] == "running")
    p = ctl("--json", "status")
    assert [a["rounds_submitted"] for a in json.loads(p.stdout)["agents"]] == [0, 0]  # none yet in this run
    assert "rounds of this run" in ctl("status").stdout
    out = tmp_path / "first.safetensors"
    p = ctl("fetch", "--run", first, "--out", str(out))
    assert p.returncode == 0 and f"saved version 1 of run {first} (drpo, Hopper-v5)" in p.stdout, p.stdout + p.stderr
    _, meta = load_policy(out)
    assert (meta["run_id"], meta["version"]) == (first, 1)
    p = ctl("--json", "fetch", "--run", first, "--version", "0", "--out", str(tmp_path / "v0.safetensors"))
    assert json.loads(p.stdout)["version"] == 0
    p = ctl("--json", "fetch", "--out", str(tmp_path / "now.safetensors"))
    assert (json.loads(p.stdout)["run_id"], json.loads(p.stdout)["version"]) == (second, 0)
    p = ctl("fetch", "--run", "20990101-000000-abcdef", "--out", str(tmp_path / "x.safetensors"))
    assert p.returncode == 1 and p.stderr.startswith("fedrl ctl: error: NOT_FOUND") and "unknown run" in p.stderr
    p = ctl("fetch", "--version", "-2", "--out", str(tmp_path / "y.safetensors"))
    assert p.returncode == 2 and "usage: fedrl ctl fetch" in p.stderr


def test_watch_ends_with_the_run_unless_an_evaluator_follows_it(aggregator):
    """A finished run's watch waits for its evaluations only while an evaluator follows the run
    (its WatchRounds carries the evaluator header); with none, it ends as the run does."""
    import threading

    from fedrl.proto.v1 import control_pb2
    from fedrl.wire.rpc import EVALUATOR_HEADER

    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    _finish_one_round_run(aggregator, eval_episodes=2)
    with ControlClient(aggregator.target) as c:  # under the 120 s grace, a wait would end in DEADLINE_EXCEEDED
        kinds = [e["kind"] for e in c.watch(timeout=RPC_BOUND)]
    assert kinds[-1] == "RUN_FINISHED"
    follower = aggregator.control.WatchRounds(control_pb2.WatchRequest(after_version=-1), timeout=30,
                                              metadata=((EVALUATOR_HEADER, "1"),))
    def drain():
        try:
            list(follower)
        except grpc.RpcError:  # cancelled below
            pass

    threading.Thread(target=drain, daemon=True).start()
    assert wait_for(lambda: aggregator.coord.evaluators == 1)
    with ControlClient(aggregator.target) as c, pytest.raises(grpc.RpcError) as ei:
        list(c.watch(timeout=1.5))  # version 1 is not evaluated yet and an evaluator follows
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    follower.cancel()
    assert wait_for(lambda: aggregator.coord.evaluators == 0)


def test_ctl_stop_reaches_agents_in_the_middle_of_their_round(step_deadline, aggregator, agent_threads, stand_dataset,
                                                               caplog):
    """Agents training a long local round (a million steps) abandon it at their next probe after
    ``ctl stop``, with one INFO line each, and send no update to be refused."""
    import time

    with caplog.at_level("INFO"):
        agent_threads.start(aggregator.target, str(stand_dataset), 2, 2, seed=1, probe_seconds=0.2,
                            progress_seconds=0.2)
        wait_for(lambda: len(aggregator.coord.status()["agents"]) == 2, what="agents to join")
        with ControlClient(aggregator.target) as c:
            c.start(json.loads(run_config(local_steps=1_000_000)))
            wait_for(lambda: all(a["steps_done"] > 0 for a in c.status()["agents"]), what="agents training")
            p = _ctl(aggregator.target, "stop", "--reason", "enough")
            assert p.returncode == 0, p.stderr
            t0 = time.monotonic()  # the run is stopped: ctl returned after the aggregator applied it
            wait_for(lambda: sum("abandoned" in r.getMessage() for r in caplog.records) == 2, timeout=RPC_BOUND,
                     what="both agents to abandon their round")
            took = time.monotonic() - t0
    abandoned = [r for r in caplog.records if "abandoned" in r.getMessage()]
    assert all(r.levelname == "INFO" and "was stopped" in r.getMessage() for r in abandoned), abandoned
    # the agents' part: their next probe (every 0.2 s here) sees the stop, within a step's time on
    # this machine as loaded now (step_deadline: 8 measured secure rounds, at least 4 s); ctl's own
    # start-up (a Python process, loaded or not) is not theirs to answer for and is not counted
    assert took < step_deadline, (took, step_deadline)
    assert not [r for r in caplog.records if "update refused" in r.getMessage() or "not taken" in r.getMessage()]


def test_without_tokens_only_a_few_watchers_count_as_evaluators(aggregator):
    """Without tokens anyone can send the evaluator header; 40 such streams held a plain watcher
    open long after its run. Now at most MAX_UNVERIFIED_FOLLOWERS of them count."""
    import threading

    from aggregator_service.servicer import MAX_UNVERIFIED_FOLLOWERS
    from fedrl.proto.v1 import control_pb2
    from fedrl.wire.rpc import EVALUATOR_HEADER

    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config()), timeout=RPC_BOUND)
    calls = [aggregator.control.WatchRounds(control_pb2.WatchRequest(after_version=-1), timeout=60,
                                            metadata=((EVALUATOR_HEADER, "1"),)) for _ in range(10)]
    settled = []  # a stream's first event (RUN_STARTED) comes after it was counted or not; the
    for c in calls:  # streams past the per-caller limit end at once (RESOURCE_EXHAUSTED)
        threading.Thread(target=_drain, args=(c, settled), daemon=True).start()
    assert wait_for(lambda: len(settled) == len(calls))
    assert aggregator.coord.evaluators == MAX_UNVERIFIED_FOLLOWERS
    for c in calls:
        c.cancel()
    assert wait_for(lambda: aggregator.coord.evaluators == 0)


def _drain(call, settled=None):
    """Read ``call`` to its end; ``settled`` gets one entry when its first message or its end
    comes, whichever is first."""
    first = True
    try:
        for _ in call:
            if first and settled is not None:
                settled.append(True)
            first = False
    except grpc.RpcError:
        if first and settled is not None:
            settled.append(True)


def _read_until_cancelled(stream) -> None:
    """An evaluator's watch, read to its end; cancelled or cut when its test ends."""
    try:
        for _ in stream:
            pass
    except grpc.RpcError as e:
        if e.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
            raise


@pytest.mark.parametrize("how", ["budget", "operator"])
def test_a_stopped_runs_watch_waits_for_the_last_versions_evaluation(aggregator, how):
    """A run stopped by its privacy budget (or by ctl stop) after storing its last version: the
    watch (what fedrl up reads) goes on until that version's evaluation comes, so the last round
    the run paid for gets its line, its evaluation and summary.json's final."""
    import threading

    from fedrl.federation.privacy import epsilon
    from fedrl.proto.v1 import control_pb2
    from fedrl.wire.codec import encode
    from fedrl.wire.rpc import EVALUATOR_HEADER

    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    budget = {"dp_clip": 1.0, "dp_noise": 1.1, "dp_epsilon_budget": epsilon(1.1, 1, 1e-5) + 1e-9} if how == "budget" else {}
    run_id = aggregator.coord.start_run(run_config(rounds=3, eval_episodes=2, obs_norm="none", **budget))["run_id"]
    follower = aggregator.control.WatchRounds(control_pb2.WatchRequest(after_version=-1), timeout=60,
                                              metadata=((EVALUATOR_HEADER, "1"),))
    threading.Thread(target=_read_until_cancelled, args=(follower,), daemon=True).start()
    assert wait_for(lambda: aggregator.coord.evaluators == 1)
    g = aggregator.coord.run.global_state
    for a in ("a0", "a1"):
        aggregator.coord.submit(a, encode(g, run_id, 1, 0, 100).manifest, g, {}, 0.0)
    if how == "operator":
        aggregator.coord.stop_run("enough")
    assert wait_for(lambda: aggregator.coord.status()["state"] == "stopped")
    seen: list[str] = []

    def read():
        with ControlClient(aggregator.target) as c:
            seen.extend(e["kind"] for e in c.watch(timeout=30))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert wait_for(lambda: "RUN_STOPPED" in seen)
    reader.join(0.5)
    assert reader.is_alive(), seen  # version 1 is not evaluated yet: the stream waits
    aggregator.coord.report_evaluation({"run_id": run_id, "version": 1, "return_mean": 1.0, "return_std": 0.0,
                                        "score_mean": 1.0, "score_std": 0.0, "episodes": 2})
    reader.join(30)
    assert not reader.is_alive() and seen[-1] == "EVALUATED", seen
    follower.cancel()


SETS = ["--set", "agents=2", "--set", "drpo.alpha_lr=1e-4", "--set", 'bc={"lr": 0.002}', "--set", "drpo.lambda1=0.3"]


def _check_sets(cfg) -> None:
    assert (cfg.agents, cfg.drpo.alpha_lr, cfg.bc.lr, cfg.drpo.lambda1) == (2, 1e-4, 0.002, 0.3)


def test_set_takes_the_same_forms_in_ctl_start_up_and_simulate(aggregator, monkeypatch, tmp_path):
    """KEY=VALUE, drpo.FIELD=VALUE and drpo={...} mean the same to all three (fedrl up refused the
    dotted form that fedrl simulate's help shows)."""
    import fedrl.cli.launcher as launcher
    from fedrl.cli import build_parser
    from fedrl.cli.simulate import _sim_settings
    from fedrl.cli.up import _cmd_up
    from fedrl.federation.runconfig import parse_run_config

    p = _ctl(aggregator.target, "start", *SETS)
    assert p.returncode == 0, p.stderr
    _check_sets(parse_run_config(aggregator.coord.run.config_json))
    got = {}
    monkeypatch.setattr(launcher, "up", lambda cfg, *a, **k: got.setdefault("up", cfg) and 0)
    _cmd_up(build_parser().parse_args(["up", *SETS, "--out", str(tmp_path / "r")]))
    _check_sets(got["up"].run)
    ns = build_parser().parse_args(["simulate", *SETS])
    ns.given = set()  # as main sets it: no flag given, so none overrides a --set
    _check_sets(_sim_settings(ns))
    assert _ctl(aggregator.target, "start", "--set", "x.y=1").returncode != 0


def test_ctl_fetch_writes_the_policy_file_save_policy_writes_and_loads_no_torch(aggregator, tmp_path):
    """``ctl fetch`` moves a file: it writes the bytes ``save_policy`` writes of the policy rebuilt
    from the version (torch's way, kept for the learners), in a process that never loads torch
    (it took 14 s at load 8 when it did), and ``fedrl evaluate`` reads it."""
    import json

    from fedrl.algos.policy_io import load_policy, policy_from_state, save_policy

    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    run_id = _finish_one_round_run(aggregator)
    out = tmp_path / "p.safetensors"
    probe = ("import sys; from fedrl.cli import main; rc = main(sys.argv[1:]); "
             "sys.exit(rc or (3 if 'torch' in sys.modules else 0))")
    p = subprocess.run([sys.executable, "-c", probe, "ctl", "--target", aggregator.target, "fetch", "--out", str(out),
                        "--json"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr  # 3: torch was loaded
    with ControlClient(aggregator.target) as c:
        state, info, v, rid = c.fetch_version(run_id, -1)
    hp = json.loads(info.get("hparams") or "{}")
    meta = {"env_id": info.get("env_id", ""), "algo": info.get("algo", ""), "run_id": rid, "version": v, "hparams": hp}
    ref = save_policy(policy_from_state(state, hp.get("log_std_min", -5.0), hp.get("log_std_max", 2.0)),
                      tmp_path / "ref.safetensors", meta)
    assert out.read_bytes() == ref.read_bytes()
    policy, read = load_policy(out)
    assert read["run_id"] == run_id and read["version"] == 1
