"""Every service stops on SIGTERM, however many arrive at once.

A launcher that dies delivers SIGTERM to its children (PR_SET_PDEATHSIG), a supervisor may
repeat it, and a user may press Ctrl-C twice. A signal handler that takes a lock (an Event's
``set``) deadlocks the process when a second signal re-enters it while it holds that lock: an
agent stuck that way was seen in ``test_no_orphans_when_up_itself_is_killed``."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fedrl.cli.client import ControlClient
from tests.e2e.test_faults import Procs, wait_for

pytestmark = pytest.mark.slow(reason="real service processes stopped mid-round")


def _storm(pid: int, seconds: float) -> None:
    """SIGTERM after SIGTERM, as fast as they can be sent, for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return


def test_every_service_stops_under_a_storm_of_sigterms(tmp_path, stand_dataset):
    ps = Procs(tmp_path, stand_dataset)
    try:
        target = ps.aggregator()
        ps.agent(0, target)
        ps.evaluator(target)
        # up and idle: the agent has joined and long-polls for a task, the evaluator follows
        wait_for(lambda: "joined" in (tmp_path / "logs" / "agent-0.log").read_text(), 60, "the agent to join",
                 ps.alive())
        time.sleep(1.0)
        for name in ("agent-0", "evaluator", "aggregator"):
            p = ps.procs[name]
            _storm(p.pid, 0.5)
            try:
                p.wait(20)
            except Exception:
                raise AssertionError(f"{name} did not stop within 20 s of a SIGTERM storm; "
                                     f"log: {(tmp_path / 'logs' / f'{name}.log').read_text()[-1500:]}") from None
    finally:
        ps.close()


def _stop_seconds(p, name: str, log: Path, limit: float = 20) -> float:
    """SIGTERM ``p``; how long it took to exit (fails past ``limit``)."""
    t = time.monotonic()
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(limit)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{name} still running {limit:.0f} s after SIGTERM; log: {log.read_text()[-1500:]}") \
            from None
    return time.monotonic() - t


def test_an_agent_stops_within_seconds_while_training_or_long_polling(tmp_path, stand_dataset):
    """SIGTERM must not wait for the end of a local round (minutes at the paper's sizes on a
    CPU) nor for a long-poll to return (the agent asks for 10 s; the aggregator allows 30)."""
    ps = Procs(tmp_path, stand_dataset)
    logs = tmp_path / "logs"
    try:
        target = ps.aggregator(task_wait=30)
        ps.agent(0, target)
        wait_for(lambda: "joined" in (logs / "agent-0.log").read_text(), 60, "agent-0 to join", ps.alive())
        with ControlClient(target) as c:
            # one round far too long to finish here: 10^6 DRPO steps at the paper's sizes
            c.start({"agents": 1, "rounds": 1, "local_steps": 1_000_000, "eval_episodes": 0, "seed": 3})
            wait_for(lambda: c.status()["state"] == "running", 60, "the run to start", ps.alive())
        ps.agent(1, target)  # not selected: its Session stream brings a WAIT every 10 s
        wait_for(lambda: "joined" in (logs / "agent-1.log").read_text(), 60, "agent-1 to join", ps.alive())
        with ControlClient(target) as c:  # agent-0 is into its local steps, agent-1 into a long-poll
            wait_for(lambda: any(a["agent_id"] == "agent-0" and a["steps_done"] > 0 for a in c.status()["agents"]),
                     60, "agent-0 to train", ps.alive())
        took, sent = {}, {}
        for name in ("agent-0", "agent-1"):
            sent[name] = time.strftime("%H:%M:%S") + f",{int(time.time() * 1000) % 1000:03d}"
            took[name] = _stop_seconds(ps.procs[name], name, logs / f"{name}.log")
        print("seconds from SIGTERM to exit:", took)
        for name, s in took.items():
            text = (logs / f"{name}.log").read_text()
            # the log's timestamps say where the time went: before "received", between it and
            # "stopped", or after it (the interpreter's exit)
            assert s < 5.0, f"{name} took {s:.1f} s to stop after SIGTERM at {sent[name]}; its log: {text[-600:]}"
            assert "Traceback" not in text, name
            # why it stops, and that it has: one line each
            assert "stopping (SIGTERM)" in text and text.rstrip().endswith("stopped (SIGTERM)"), text[-800:]
    finally:
        ps.close()


def test_the_aggregator_and_the_evaluator_stop_within_seconds_mid_round(tmp_path, stand_dataset):
    """Mid-round, agents training and the evaluator following, with the default 30 s long polls:
    SIGTERM ends the aggregator, then the evaluator, within 5 s each (a supervisor's short grace
    period would otherwise SIGKILL them), logging why and that they have stopped."""
    ps = Procs(tmp_path, stand_dataset)
    logs = tmp_path / "logs"
    try:
        target = ps.aggregator(task_wait=30)
        ps.evaluator(target)
        for i in range(2):
            ps.agent(i, target)
        with ControlClient(target) as c:
            c.start({"agents": 2, "rounds": 1, "local_steps": 1_000_000, "eval_episodes": 1, "seed": 3})
            wait_for(lambda: len(st := c.status()["agents"]) == 2 and all(a["steps_done"] > 0 for a in st), 120,
                     "both agents to train", ps.alive())
        took, sent = {}, {}
        for name in ("aggregator", "evaluator"):
            sent[name] = time.strftime("%H:%M:%S") + f",{int(time.time() * 1000) % 1000:03d}"
            took[name] = _stop_seconds(ps.procs[name], name, logs / f"{name}.log")
        print("seconds from SIGTERM to exit:", took)
        for name, s in took.items():
            text = (logs / f"{name}.log").read_text()
            # the log's timestamps say where the time went: before "received", between it and
            # "stopped", or after it (the interpreter's exit)
            assert s < 5.0, f"{name} took {s:.1f} s to stop after SIGTERM at {sent[name]}; its log: {text[-600:]}"
            assert "Traceback" not in text and "stopped" in text.rstrip().splitlines()[-1], text[-800:]
    finally:
        ps.close()


# A service whose announcement of its port is itself a SIGTERM: the worst case of a launcher or
# supervisor that stops a service as soon as it is up (seen: an evaluator stopped right after its
# port file appeared died silently, its handler not yet installed).
_STOP_AT_ANNOUNCE = """
import os, signal, sys
import fedrl.wire.rpc as rpc
announce = rpc.announce_port
def announce_and_stop(port_file, port):
    if port_file:
        os.kill(os.getpid(), signal.SIGTERM)
    announce(port_file, port)
rpc.announce_port = announce_and_stop
from {module}.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_service_stopped_as_it_announces_its_port_stops_cleanly(tmp_path, stand_dataset):
    import sys

    services = {
        "aggregator_service": ["--port", "0", "--port-file", str(tmp_path / "a.port"), "--state-dir",
                               str(tmp_path / "state")],
        "evaluator_service": ["--port", "0", "--port-file", str(tmp_path / "e.port"), "--aggregator", "127.0.0.1:9"],
        "agent_service": ["--aggregator", "127.0.0.1:9", "--dataset", str(stand_dataset), "--metrics-port", "0",
                          "--metrics-port-file", str(tmp_path / "m.port")],
    }
    for module, argv in services.items():
        p = subprocess.run([sys.executable, "-c", _STOP_AT_ANNOUNCE.format(module=module), *argv],
                           capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
        out = p.stdout + p.stderr
        assert p.returncode == 0, f"{module} exited {p.returncode} (-15: killed by the default handler): {out[-1500:]}"
        assert "received SIGTERM" in out or "stopping (SIGTERM)" in out, f"{module}: {out[-1500:]}"
        assert "Traceback" not in out and out.rstrip().splitlines()[-1].endswith(("stopped", "stopped (SIGTERM)")), \
            f"{module}: {out[-1500:]}"
