"""``fedrl up`` as a user runs it: real processes on loopback, a finished run folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

from tests import source

pytestmark = pytest.mark.slow(reason="fedrl up end to end: every service a real process, rounds trained")

TINY = {"drpo": {"hidden": [32, 32], "batch_size": 16, "cql_n_actions": 2},
        "bc": {"hidden": [32, 32], "batch_size": 16}}


def fedrl(*args, timeout=240, **kw):
    return subprocess.run([sys.executable, "-m", "fedrl.cli", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


def test_up_runs_the_federation_and_writes_the_run_folder(stand_dataset, tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({**TINY, "round_timeout": 120}))
    out = tmp_path / "run"
    p = fedrl("up", "--config", str(cfg), "--dataset", str(stand_dataset), "--agents", "2",
              "--trajectories", "2", "--rounds", "2", "--local-steps", "3", "--eval-episodes", "1",
              "--device", "cpu", "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "round   2/2" in p.stdout and "return" in p.stdout
    rows = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all("return_mean" in r["eval"] for r in rows)
    for r in rows:
        source.check_round_record(r, "up")  # the schema fedrl simulate writes, as documented
    head = (out / "rounds.csv").read_text().splitlines()[0].split(",")
    assert head[:4] == ["round", "version", "seconds", "agents"] and "critic_td" in head and "return_mean" in head
    assert (out / "learning_curve.png").stat().st_size > 1000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["env_id"] == "Hopper-v5"
    with safe_open(str(out / "global_policy.safetensors"), "pt") as f:
        assert "policy.head.weight" in f.keys() and f.metadata()["env_id"] == '"Hopper-v5"'
    assert sorted(p.name for p in (out / "state" / "runs" / summary["run_id"]).glob("v*.safetensors")) == \
        ["v000000.safetensors", "v000001.safetensors", "v000002.safetensors"]
    logs = sorted(p.name for p in (out / "logs").iterdir())
    assert logs == ["agent-0.log", "agent-1.log", "aggregator.log", "evaluator.log"]
    # The saved policy evaluates with the CLI a user would use next.
    ev = fedrl("evaluate", str(out / "global_policy.safetensors"), "--episodes", "1", "--json")
    assert ev.returncode == 0 and json.loads(ev.stdout)["env_id"] == "Hopper-v5"
    ev = fedrl("evaluate", str(out / "global_policy.safetensors"), "--episodes", "1")  # for a person: a table
    assert ev.returncode == 0 and "on Hopper-v5, 1 episode (seed" in ev.stdout and "D4RL score" in ev.stdout


def test_a_privacy_budget_stop_keeps_every_round_it_paid_for(stand_dataset, tmp_path):
    """The budget allows 2 of 3 rounds: round 2 is trained, stored and evaluated, and fedrl up
    waits for that evaluation before it stops everything: its line, its rounds.jsonl row with
    the evaluation, and summary.json's final are round 2's; the stop is said last."""
    from fedrl.federation.privacy import epsilon

    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({**TINY, "round_timeout": 120}))
    out = tmp_path / "run"
    budget = (epsilon(1.1, 2, 1e-5) + epsilon(1.1, 3, 1e-5)) / 2
    p = fedrl("up", "--config", str(cfg), "--dataset", str(stand_dataset), "--agents", "2", "--trajectories", "2",
              "--rounds", "3", "--local-steps", "3", "--eval-episodes", "1", "--device", "cpu", "--out", str(out),
              "--set", "dp_clip=1.0", "--set", "dp_noise=1.1", "--set", f"dp_epsilon_budget={budget}")
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    last_round = max(i for i, x in enumerate(lines) if x.startswith("round   2/3"))
    assert "return" in lines[last_round], p.stdout
    stop = next(i for i, x in enumerate(lines) if x.startswith("run stopped: privacy budget"))
    assert stop > last_round, p.stdout
    rows = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all("return_mean" in r["eval"] for r in rows)
    for r in rows:
        source.check_round_record(r, "up")
        assert r["privacy"]["epsilon"] == pytest.approx(epsilon(1.1, r["round"], 1e-5)) and "loss_privacy_epsilon" not in r
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "stopped" and summary["final"]["round"] == 2, summary


def test_up_refuses_a_missing_dataset_before_starting_anything(tmp_path):
    p = fedrl("up", "--dataset", str(tmp_path / "missing.hdf5"), "--agents", "2", "--out", str(tmp_path / "r"))
    assert p.returncode == 2 and "missing.hdf5" in p.stderr
    assert not (tmp_path / "r").exists()


def test_up_refuses_data_its_agents_would_refuse_before_starting_anything(stand_dataset, tmp_path):
    # The agents' own checks run once in the launcher: no process starts, no run folder is left.
    p = fedrl("up", "--dataset", str(stand_dataset), "--agents", "2", "--trajectories", "1000",
              "--out", str(tmp_path / "r"))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "2 agents x 1000 trajectories need 2000 episodes" in p.stderr and "hopper-stand.hdf5" in p.stderr
    assert "starting" not in p.stdout and not (tmp_path / "r").exists()


def test_up_never_writes_over_an_earlier_run(tmp_path):
    out = tmp_path / "r"
    (out / "state").mkdir(parents=True)
    (out / "summary.json").write_text('{"state": "finished"}')
    p = fedrl("up", "--out", str(out))
    assert p.returncode == 2 and f"{out} already holds a run (summary.json, state)" in p.stderr, p.stderr
    assert sorted(x.name for x in out.iterdir()) == ["state", "summary.json"]
    assert (out / "summary.json").read_text() == '{"state": "finished"}'


def test_up_refuses_a_device_this_machine_lacks_before_starting_anything(tmp_path):
    bad = "garbage" if torch.cuda.is_available() else "cuda"
    p = fedrl("up", "--device", bad, "--out", str(tmp_path / "r"))
    assert p.returncode == 2 and f"--device {bad}:" in p.stderr, p.stdout + p.stderr
    assert not (tmp_path / "r").exists()


def test_up_refuses_named_datasets_of_two_tasks_before_making_either(tmp_path):
    cache = tmp_path / "cache"
    p = fedrl("up", "--dataset", "hopper-medium-v2:2", "--dataset", "halfcheetah-expert-v2:1",
              "--agents", "3", "--out", str(tmp_path / "r"), env={**os.environ, "FEDRL_CACHE_DIR": str(cache)})
    assert p.returncode == 2, p.stdout + p.stderr
    assert "mix environments: hopper-medium-v2 is Hopper-v5, halfcheetah-expert-v2 is HalfCheetah-v5" in p.stderr
    assert "making" not in p.stdout and not cache.exists() and not (tmp_path / "r").exists()


def _start_long_run(stand_dataset, tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps(TINY))
    out = tmp_path / "run"
    # Output to a file: an unread pipe would fill up and block the launcher's prints.
    console = open(tmp_path / "console.txt", "w")
    proc = subprocess.Popen([sys.executable, "-m", "fedrl.cli", "up", "--config", str(cfg), "--dataset",
                             str(stand_dataset), "--agents", "2", "--trajectories", "2", "--rounds", "100000",
                             "--local-steps", "20", "--eval-episodes", "0", "--device", "cpu", "--out", str(out)],
                            stdout=console, stderr=subprocess.STDOUT, text=True)
    end = time.monotonic() + 120
    while not any((out / "state" / "runs").glob("*/v000002.safetensors")):
        assert proc.poll() is None, (tmp_path / "console.txt").read_text()
        assert time.monotonic() < end, "the run did not reach round 2"
        time.sleep(0.1)
    return proc, console


@pytest.mark.parametrize("presses", [1, 6], ids=["once", "again-and-again"])
def test_up_stops_every_child_on_ctrl_c(stand_dataset, tmp_path, presses):
    """Users press Ctrl-C twice: the presses after the first must not cut the clean-up short."""
    proc, console = _start_long_run(stand_dataset, tmp_path)
    try:
        children = _children(proc.pid)
        assert len(children) >= 3
        proc.send_signal(signal.SIGINT)
        for _ in range(presses - 1):  # again and again while it stops its children
            time.sleep(0.1)
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        console.close()
    text = (tmp_path / "console.txt").read_text()
    assert rc == 130 and "Traceback" not in text, text[-2000:]
    assert "interrupted; stopping every process" in text
    assert _still_alive(children, 30) == []  # up waits for them; a SIGKILLed one may take a moment


def test_no_orphans_when_up_itself_is_killed(stand_dataset, tmp_path):
    """SIGKILL gives fedrl up no chance to clean up: its children notice and stop by themselves."""
    proc, console = _start_long_run(stand_dataset, tmp_path)
    try:
        children = _children(proc.pid)
        assert len(children) >= 3
        proc.kill()
        proc.wait(10)
        left = _still_alive(children, 30)
    finally:
        for c in _children(proc.pid) + children:
            if _alive(c):
                os.kill(c, signal.SIGKILL)
        console.close()
    assert left == [], f"orphaned services still running: {left}"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _still_alive(pids: list[int], within: float) -> list[int]:
    """Those of ``pids`` still running after up to ``within`` seconds (returns once none is)."""
    end = time.monotonic() + within
    while (left := [c for c in pids if _alive(c)]) and time.monotonic() < end:
        time.sleep(0.1)
    return left


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose.
    stat = open(f"/proc/{pid}/stat").read().split()[2] if os.path.exists(f"/proc/{pid}/stat") else "X"
    return stat not in ("Z", "X")


@pytest.mark.parametrize("content, says", [
    (None, "cannot read the run settings (No such file or directory)"),
    ("{rounds: 3", "not valid JSON (Expecting property name"),
    ("[1, 2]", "expected a JSON object of run settings, got list"),
])
def test_a_bad_settings_file_is_named_before_anything_starts(tmp_path, capsys, content, says):
    """`fedrl up --config` and `fedrl ctl start --config`: the file and its problem, exit 2,
    before any process starts or any connection is tried (the target here answers nothing)."""
    from fedrl.cli import main

    cfg = tmp_path / "run.json"
    if content is not None:
        cfg.write_text(content)
    for argv in (["up", "--config", str(cfg), "--out", str(tmp_path / "r")],
                 ["ctl", "--target", "127.0.0.1:1", "--connect-timeout", "30", "start", "--config", str(cfg)]):
        t = time.monotonic()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{cfg}: {says}" in err, err
        assert time.monotonic() - t < 10  # not after waiting for the aggregator
    assert not (tmp_path / "r").exists()
