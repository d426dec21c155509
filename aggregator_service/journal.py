"""A run's journal: each event made, logged, kept in the run and appended to the state directory,
and a run failed saying why. Used by every other part under the lock; reads nothing of theirs."""

from __future__ import annotations

import logging
import time
from typing import Any

from aggregator_service.records import Run
from aggregator_service.store import Store

log = logging.getLogger("fedrl.aggregator")


class Journal:
    def __init__(self, store: Store) -> None:
        self.store = store

    @staticmethod
    def new_event(run: Run, kind: str, **kw: Any) -> dict[str, Any]:
        return {"kind": kind, "run_id": run.run_id, "round": kw.pop("round", run.round),
                "version": kw.pop("version", run.version), "time_unix": time.time(), **kw}

    @staticmethod
    def log_event(run: Run, e: dict[str, Any]) -> None:
        """The run's lifecycle in the log, one line per event (its fields in --log-format json)."""
        k = e["kind"]
        if k == "RUN_STARTED":
            msg = f"run {run.run_id} started: {run.cfg.algo}, {run.cfg.agents} agents, {run.cfg.rounds} rounds x " \
                  f"{run.cfg.local_steps} local steps; waiting for agents"
        elif k == "ROUND_OPENED":
            msg = f"run {run.run_id}: round {e['round']}/{run.cfg.rounds} opened for {len(e.get('agents', []))} agents " \
                  f"(global version {e['version']})"
        elif k == "ROUND_CLOSED":
            msg = f"run {run.run_id}: round {e['round']}/{run.cfg.rounds} closed with {len(e.get('agents', []))} " \
                  f"updates in {e.get('seconds', 0):.1f}s; version {e['version']} stored"
        elif k == "EVALUATED":
            ev = e.get("evaluation") or {}
            msg = f"run {run.run_id}: version {e['version']} evaluated: return {ev.get('return_mean', 0):.1f}, " \
                  f"score {ev.get('score_mean', 0):.1f}"
        elif k == "NOT_EVALUATED":
            msg = f"run {run.run_id}: version {e['version']} not evaluated: {e.get('message', '')}"
        elif k == "RUN_FINISHED":
            msg = f"run {run.run_id} finished after {run.round} rounds (version {e['version']})"
        elif k == "RUN_RESUMED":
            msg = f"run {run.run_id} resumed at version {e['version']}"
        else:
            msg = f"run {run.run_id} {k.lower().removeprefix('run_')}" + (f": {e['message']}" if e.get("message") else "")
        fields = {k2: v for k2, v in e.items() if k2 not in ("metrics", "evaluation")}
        level = {"RUN_FAILED": logging.ERROR, "RUN_STOPPED": logging.WARNING,
                 "NOT_EVALUATED": logging.WARNING}.get(k, logging.INFO)
        log.log(level, msg, extra={"event": fields})

    def event(self, run: Run, kind: str, **kw: Any) -> None:
        e = self.new_event(run, kind, **kw)
        self.log_event(run, e)
        run.events.append(e)
        try:
            self.store.append_event(run.run_id, e)
        except OSError as err:
            log.error("cannot append event to the store: %s", err)

    def fail(self, run: Run, message: str) -> None:
        run.end("failed", message)
        self.event(run, "RUN_FAILED", message=message)

