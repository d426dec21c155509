"""Progress of long jobs: plain periodic lines with an ETA when not on a terminal, a tqdm bar on one."""

from __future__ import annotations

import io
import re
import time

from fedrl.common.progress import Progress


def test_plain_lines_come_periodically_with_an_eta_and_a_last_line():
    out = io.StringIO()
    with Progress(40, "making x", "steps", stream=out, every=0.05, tty=False) as p:
        for i in range(40):
            time.sleep(0.005)
            p.update(1)
            if i == 20:
                p.note("episode 3")
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3  # some while running, one at the end
    assert all(line.startswith("making x: ") for line in lines)
    assert any(re.search(r"\(\d+%\), \d\d:\d\d elapsed, ETA \d\d:\d\d", line) for line in lines[:-1])
    assert lines[-1].startswith("making x: 40/40 steps (100%)") and "ETA" not in lines[-1]
    assert lines[-1].endswith("episode 3")


def test_set_write_resume_and_disabled():
    out = io.StringIO()
    p = Progress(100, "run", "steps", stream=out, every=3600, tty=False, initial=50)
    p.set(75)
    p.set(60)  # never backwards
    p.write("round 1/2 closed")
    p.close()
    text = out.getvalue()
    assert "round 1/2 closed\n" in text and "run: 75/100 steps (75%)" in text
    quiet = io.StringIO()
    with Progress(10, "x", stream=quiet, tty=False, enabled=False) as q:
        q.update(10)
    assert quiet.getvalue() == ""


def test_a_terminal_gets_a_tqdm_bar():
    out = io.StringIO()
    with Progress(10, "bar", "steps", stream=out, tty=True) as p:
        p.update(10)
    assert "bar: 100%" in out.getvalue() and "10/10" in out.getvalue()


def test_ctl_watch_shows_local_steps_between_events():
    import io
    import threading

    from fedrl.cli import show

    release = threading.Event()

    class Client:
        def watch(self, after, run_id=""):
            yield {"kind": "RUN_STARTED", "run_id": "r1", "round": 0, "version": 0, "time_unix": 0}
            release.wait(5)
            yield {"kind": "RUN_STOPPED", "run_id": "r1", "round": 1, "version": 0, "time_unix": 0,
                   "message": "done"}

        def status(self, run_id=""):
            release.set()
            return {"state": "running", "run_id": "r1", "round": 1,
                    "agents": [{"agent_id": "a0", "steps_done": 640, "steps_total": 1000},
                               {"agent_id": "a1", "steps_done": 0, "steps_total": 0}]}

    out = io.StringIO()
    show.follow(Client(), every=0.05, out=out)
    lines = out.getvalue().splitlines()
    assert "run started" in lines[0] and lines[-1].endswith("run stopped: done")
    assert any(line.endswith("round 1: local steps a0 640/1000") for line in lines[1:-1]), lines


def test_ctl_watch_shows_every_running_runs_local_steps():
    """Without --run, the progress lines between events are those of every running run."""
    from fedrl.cli import show

    def st(run_id, done):
        return {"state": "running", "run_id": run_id, "round": 2,
                "agents": [{"agent_id": "a0", "steps_done": done, "steps_total": 1000}]}

    class Client:
        def status(self, run_id=""):
            if run_id:
                return st(run_id, {"r1": 100, "r2": 700}[run_id])
            return {**st("r2", 700), "runs": [{"run_id": "r0", "state": "finished"},
                                              {"run_id": "r1", "state": "running"},
                                              {"run_id": "r2", "state": "running"}]}

    lines = show.progress_lines(Client())
    assert [ln.split("  ", 2)[1:] for ln in lines] == [["r1", "round 2: local steps a0 100/1000"],
                                                      ["r2", "round 2: local steps a0 700/1000"]]
    assert [ln.split("  ", 2)[1] for ln in show.progress_lines(Client(), "r1")] == ["r1"]
