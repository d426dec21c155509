"""Every service stops on SIGTERM, however many arrive at once.

A launcher that dies delivers SIGTERM to its children (PR_SET_PDEATHSIG), a supervisor may
repeat it, and a user may press Ctrl-C twice. A signal handler that takes a lock (an Event's
``set``) deadlocks the process when a second signal re-enters it while it holds that lock: an
agent stuck that way was seen in ``test_no_orphans_when_up_itself_is_killed``."""

from __future__ import annotations

import os
import signal
import time

from tests.e2e.test_faults import Procs, wait_for


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
