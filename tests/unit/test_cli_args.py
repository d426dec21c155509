"""A bad number on a service's or the CLI's command line is refused at parse time, by name."""

from __future__ import annotations

import pytest

from aggregator_service.__main__ import build_parser as aggregator_parser
from agent_service.__main__ import build_parser as agent_parser
from evaluator_service.__main__ import build_parser as evaluator_parser
from fedrl.cli import build_parser as fedrl_parser

AGENT = ["--aggregator", "127.0.0.1:1", "--dataset", "d.hdf5"]
CASES = [
    (aggregator_parser, ["--state-dir", "s", "--port", "99999"], "--port: a port is 0-65535, got 99999"),
    (aggregator_parser, ["--state-dir", "s", "--port", "-1"], "--port: a port is 0-65535, got -1"),
    (aggregator_parser, ["--state-dir", "s", "--health-port", "x"], "--health-port: expected an integer, got 'x'"),
    (aggregator_parser, ["--state-dir", "s", "--max-workers", "0"], "--max-workers: must be >= 1, got 0"),
    (aggregator_parser, ["--state-dir", "s", "--task-wait", "nan"], "--task-wait: must be a positive number"),
    (aggregator_parser, ["--state-dir", "s", "--metrics-port", "70000"], "--metrics-port: a port is 0-65535"),
    (agent_parser, [*AGENT, "--trajectories", "0"], "--trajectories: must be >= 1, got 0"),
    (agent_parser, [*AGENT, "--shards", "0"], "--shards: must be >= 1, got 0"),
    (agent_parser, [*AGENT, "--threads", "-1"], "--threads: must be >= 0, got -1"),
    (agent_parser, [*AGENT, "--health-port", "65536"], "--health-port: a port is 0-65535, got 65536"),
    (evaluator_parser, ["--num-envs", "0"], "--num-envs: must be >= 1, got 0"),
    (evaluator_parser, ["--port", "100000"], "--port: a port is 0-65535, got 100000"),
    (fedrl_parser, ["simulate", "--threads", "-2"], "--threads: must be >= 0, got -2"),
    (fedrl_parser, ["up", "--agent-threads", "-1"], "--agent-threads: must be >= 0, got -1"),
    (fedrl_parser, ["up", "--linger", "-5"], "--linger: must be a finite number of seconds >= 0, got -5"),
    (fedrl_parser, ["ctl", "--connect-timeout", "inf", "status"], "--connect-timeout: must be a positive number"),
]


@pytest.mark.parametrize("parser, argv, message", CASES, ids=[" ".join(c[1][-2:]) for c in CASES])
def test_a_bad_number_is_refused_by_name(parser, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_good_numbers_pass_through():
    a = aggregator_parser().parse_args(["--state-dir", "s", "--port", "0", "--health-port", "65535",
                                        "--task-wait", "2.5", "--max-workers", "8"])
    assert (a.port, a.health_port, a.task_wait, a.max_workers) == (0, 65535, 2.5, 8)
    assert evaluator_parser().parse_args(["--num-envs", "1"]).num_envs == 1
    assert fedrl_parser().parse_args(["up", "--linger", "0"]).linger == 0.0


@pytest.mark.parametrize("given, target", [("localhost", "localhost:50051"), ("10.0.0.7", "10.0.0.7:50051"),
                                           ("agg.example:7000", "agg.example:7000"), ("[::1]", "[::1]:50051"),
                                           ("[::1]:9", "[::1]:9"), ("::1", "::1:50051")])
def test_a_ctl_target_without_a_port_gets_the_aggregators_default(given, target):
    assert fedrl_parser().parse_args(["ctl", "--target", given, "status"]).target == target


@pytest.mark.parametrize("argv", [["ctl", "--target", "agg:7", "--json", "--connect-timeout", "3", "--tls-dir", "t",
                                    "status"],
                                   ["ctl", "status", "--target", "agg:7", "--json", "--connect-timeout", "3",
                                    "--tls-dir", "t"],
                                   ["ctl", "--aggregator", "agg:7", "--connect-timeout", "3", "status", "--json",
                                    "--tls-dir", "t"],
                                   ["ctl", "--target", "other:1", "status", "--aggregator", "agg:7", "--json",
                                    "--connect-timeout", "3", "--tls-dir", "t"]])
def test_ctls_own_options_go_before_or_after_the_command(argv):
    # the agents' flag name, --aggregator, names the same target; after the command wins
    a = fedrl_parser().parse_args(argv)
    assert (a.target, a.json, a.connect_timeout, a.tls_dir) == ("agg:7", True, 3.0, "t")


def test_ctls_options_left_out_keep_their_defaults():
    a = fedrl_parser().parse_args(["ctl", "watch"])
    assert (a.target, a.json, a.connect_timeout, a.tls_dir) == ("127.0.0.1:50051", False, None, None)


def test_a_ctl_target_with_a_bad_port_is_named(capsys):
    with pytest.raises(SystemExit):
        fedrl_parser().parse_args(["ctl", "--target", "host:99999", "status"])
    assert "'host:99999': the port must be a number in 1-65535" in capsys.readouterr().err


@pytest.mark.parametrize("argv, usage", [(["ctl", "status", "--bogus"], "usage: fedrl ctl status"),
                                         (["ctl", "fetch", "--out", "x", "--nope"], "usage: fedrl ctl fetch"),
                                         (["data", "info", "x", "--zap"], "usage: fedrl data info"),
                                         (["up", "--what"], "usage: fedrl up")])
def test_a_bad_flag_shows_the_usage_of_the_subcommand_it_was_given_to(argv, usage, capsys):
    from fedrl.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(usage) and "unrecognized arguments" in err, err


def test_the_thread_default_follows_the_container_limit_else_one(monkeypatch, tmp_path):
    from fedrl.common import threads

    monkeypatch.setattr(threads, "cpu_quota", lambda: None)
    assert threads.default_threads()[0] == 1
    monkeypatch.setattr(threads, "cpu_quota", lambda: 1.5)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert threads.default_threads() == (1, "the container's CPU limit (1.5)")
    monkeypatch.setattr(threads, "cpu_quota", lambda: 3.0)
    assert threads.default_threads()[0] == 3
    monkeypatch.setattr(threads, "cpu_quota", lambda: 64.0)
    assert threads.default_threads()[0] == 4  # never more than the CPUs it may run on


def _simulate_settings(argv: list[str]):
    from fedrl.cli import _chosen_parser, _given
    from fedrl.cli.simulate import _sim_settings

    p = fedrl_parser()
    a = p.parse_args(["simulate", *argv])
    a.given = _given(_chosen_parser(p, a), argv)
    return _sim_settings(a)


def test_simulate_takes_every_setting_from_a_file_and_set_and_the_flags_given_win(tmp_path):
    f = tmp_path / "s.json"
    f.write_text('{"agents": 3, "rounds": 7, "drpo": {"alpha_lr": 1e-4, "cql_calibration": "none", "lambda1": 0.5}}')
    c = _simulate_settings(["--config", str(f), "--set", "drpo.lambda1=0.3", "--set", "final_eval_episodes=50",
                            "--set", 'bc={"lr": 0.001}', "--agents", "4", "--hidden", "8", "8"])
    assert (c.agents, c.rounds, c.final_eval_episodes) == (4, 7, 50)  # the flag over the file
    assert (c.drpo.alpha_lr, c.drpo.cql_calibration, c.drpo.lambda1) == (1e-4, "none", 0.3)  # --set over the file
    assert c.drpo.hidden == c.bc.hidden == (8, 8) and c.bc.lr == 0.001
    # a flag left at its default does not undo the file
    c = _simulate_settings(["--config", str(f)])
    assert c.agents == 3 and c.drpo.lambda1 == 0.5


@pytest.mark.parametrize("argv, message", [
    (["--set", "nope=1"], "unknown field(s) nope"),
    (["--set", "drpo.nope=1"], "drpo: unknown field(s) nope"),
    (["--set", 'agents="x"'], "agents: expected an integer, got 'x'"),
    (["--set", "agents"], "expected KEY=VALUE"),
    (["--set", "rounds.x=1"], "only drpo.FIELD and bc.FIELD"),
])
def test_simulate_names_a_bad_setting(argv, message):
    with pytest.raises(ValueError) as e:
        _simulate_settings(argv)
    assert message in str(e.value)


def test_ctl_json_goes_before_or_after_its_command():
    p = fedrl_parser()
    assert p.parse_args(["ctl", "watch", "--json"]).json and p.parse_args(["ctl", "--json", "watch"]).json
    assert not p.parse_args(["ctl", "watch"]).json


def test_ctl_loads_no_torch_and_a_closed_port_is_an_error_at_once():
    """ctl only talks to the aggregator: it must not pay torch's import (1-2 s), and with nothing
    listening it says so instead of waiting out its connect timeout."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import sys; from fedrl.cli import main; rc = main(['ctl', '--target', '127.0.0.1:%d', 'status']); "
            "print('torch' in sys.modules); sys.exit(rc)" % port)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 1 and "nothing listens at 127.0.0.1:%d (connection refused)" % port in p.stderr
    assert p.stdout.split()[0] == "False", "fedrl ctl imported torch"
    assert took < 8, f"a closed port took {took:.1f}s (the connect timeout is 10 s)"


def test_simulates_errors_name_a_flag_that_exists_or_the_set_key():
    """An error about a SimConfig field names the flag the user can pass: its own flag where
    ``fedrl simulate`` has one, else ``--set KEY`` (no error names a flag argparse would refuse)."""
    import dataclasses

    from fedrl.federation.simconfig import SimConfig

    sim = next(a for a in fedrl_parser()._subparsers._group_actions[0].choices.items() if a[0] == "simulate")[1]
    flags = {s for a in sim._actions for s in a.option_strings}
    for f in dataclasses.fields(SimConfig):
        name = SimConfig.option_name(f.name)
        assert name in flags or name == f"--set {f.name}", (f.name, name)
        if "--" + f.name.replace("_", "-") in flags:
            assert name in flags, f"{f.name} has a flag its errors should name"
    with pytest.raises(ValueError, match=r"^--set dp_noise: needs --set dp_clip > 0"):
        SimConfig(dp_noise=1.0)
