"""A run's lifecycle: start, stop, evaluations, status and the watch stream, the state
directory's runs and versions, and resuming after a restart.

A part of :class:`aggregator_service.coordinator.Coordinator`, the top one: it uses the agent
registry, the journal and the rounds (given at construction) and the shared state. Its methods
whose names start with an underscore run with the lock held."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Iterator
from typing import Any

import grpc

from aggregator_service.agents import AgentRegistry
from aggregator_service.journal import Journal
from aggregator_service.records import (
    ACTIVE,
    RUN_ID,
    Run,
    Shared,
    encode_version,
    replay_journal,
)
from aggregator_service.rounds import Rounds
from aggregator_service.store import Store
from fedrl.federation.machine import Plan, RoundMachine, resumed_clip
from fedrl.federation.privacy import privacy_spent, warm_epsilon
from fedrl.federation.runconfig import (
    ConfigError,
    parse_run_config,
)
from fedrl.wire.rpc import ServiceError

log = logging.getLogger("fedrl.aggregator")

class RunLifecycle:
    def __init__(self, shared: Shared, registry: AgentRegistry, journal: Journal, rounds: Rounds, store: Store,
                 eval_grace: float) -> None:
        self.s, self.registry, self.journal, self.rounds, self.store = shared, registry, journal, rounds, store
        self.eval_grace = eval_grace
        self._digests: dict[tuple[str, int, int], str] = {}  # stored versions' sha256, by file state

    def start_run(self, config_json: str) -> dict[str, Any]:
        try:
            cfg = parse_run_config(config_json)
        except ConfigError as e:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"invalid run config: {e}", "bad_config") from None
        if cfg.agents > self.registry.max_agents:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"invalid run config: agents: {cfg.agents} is more than this aggregator keeps "
                               f"(--max-agents {self.registry.max_agents})", "bad_config")
        if cfg.dp_clip:  # the accountant's first call imports it (seconds at load): here, not under the lock
            try:
                privacy_spent(cfg, cfg.rounds)
                warm_epsilon(cfg, 1)  # round 1's close and round 2's budget check find them computed
            except (ArithmeticError, ValueError) as e:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"invalid run config: the privacy accountant cannot take these settings: {e}",
                                   "bad_config") from None
        with self.s.cond:
            if self.s.run is not None and self.s.run.state in ACTIVE:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"run {self.s.run.run_id} is {self.s.run.state}; stop it first", "run_active")
            run_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
            run = Run(run_id, cfg, cfg.to_json(), time.time())
            try:
                self.store.create_run(run_id, run.config_json)
            except OSError as e:  # nothing of the run was kept, and the aggregator's state is unchanged
                full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED if full else grpc.StatusCode.FAILED_PRECONDITION,
                                   f"cannot store the run in the state directory "
                                   f"({'full' if full else 'not writable'}: {e.strerror or e})", "state_dir") from None
            self.s.run = run
            self.journal.event(run, "RUN_STARTED", message=f"waiting for {cfg.agents} agents")
            self.rounds.maybe_begin()
            self.s.cond.notify_all()
            return self._status()

    def stop_run(self, reason: str) -> dict[str, Any]:
        with self.s.cond:
            run = self.s.run
            if run is None or run.state not in ACTIVE:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "no active run to stop", "no_run")
            run.state, run.message, run.ended = "stopped", reason or "stopped by operator", time.time()
            self.journal.event(run, "RUN_STOPPED", message=run.message)
            self.s.cond.notify_all()
            return self._status()

    def report_evaluation(self, report: dict[str, Any]) -> None:
        with self.s.cond:
            run = self.s.run
            if run is None or report.get("run_id") != run.run_id:
                raise ServiceError(grpc.StatusCode.NOT_FOUND, f"unknown run {report.get('run_id')!r}", "unknown_run")
            v = int(report["version"])
            if not 0 <= v <= run.version:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"version {v} does not exist (latest {run.version})", "unknown_version")
            run.evaluations[v] = dict(report)
            self.journal.event(run, "EVALUATED", version=v, round=v, evaluation=dict(report))
            self.s.cond.notify_all()

    def status(self) -> dict[str, Any]:
        with self.s.cond:
            return self._status()

    def list_runs(self, limit: int = 100) -> list[dict[str, Any]]:
        limit = 100 if limit <= 0 else min(limit, 1000)
        with self.s.cond:
            active = {self.s.run.run_id: (self.s.run.state, self.s.run.message)} if self.s.run is not None else {}
        out = []
        for run_id in reversed(self.store.run_ids()[-limit:]):
            try:
                saved = self.store.read_run(run_id)
                cfg = json.loads(saved["config_json"])
            except (OSError, ValueError):
                continue  # a run folder being written or damaged: not listed
            events = saved["events"]
            state, message = active.get(run_id, (None, ""))
            if state is None:
                ends = {"RUN_FINISHED": "finished", "RUN_STOPPED": "stopped", "RUN_FAILED": "failed"}
                last = next((e for e in reversed(events) if e["kind"] in ends), None)
                state = ends[last["kind"]] if last else "interrupted"
                message = last.get("message", "") if last else ""
            scores = {e["version"]: e["evaluation"].get("score_mean") for e in events
                      if e["kind"] == "EVALUATED" and isinstance(e.get("evaluation"), dict)}
            scores = {v: s for v, s in scores.items() if isinstance(s, (int, float))}
            versions = self.store.versions(run_id)
            best = max(scores, key=scores.get) if scores else None
            out.append({"run_id": run_id, "state": state, "algo": cfg.get("algo", ""),
                        "agents": int(cfg.get("agents", 0)), "rounds": int(cfg.get("rounds", 0)),
                        "latest_version": versions[-1] if versions else -1,
                        "started_unix": next((e["time_unix"] for e in events if e["kind"] == "RUN_STARTED"), 0.0),
                        "best_score": scores[best] if best is not None else None, "best_version": best,
                        "message": message})
        return out

    def list_versions(self, run_id: str = "") -> tuple[str, list[dict[str, Any]]]:
        if not run_id:
            run_id = self.store.latest_run() or ""
            if not run_id:
                raise ServiceError(grpc.StatusCode.NOT_FOUND, "no run stored yet", "unknown_run")
        if not RUN_ID.fullmatch(run_id) or run_id not in self.store.run_ids():
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"unknown run {run_id[:80]!r}", "unknown_run")
        evals = {e["version"]: e["evaluation"] for e in self.store.read_run(run_id)["events"]
                 if e["kind"] == "EVALUATED" and isinstance(e.get("evaluation"), dict)}
        out = []
        for v in self.store.versions(run_id):
            path = self.store.version_path(run_id, v)
            try:
                st = path.stat()
                digest = self._digest(path, st)
            except OSError:
                continue
            ev = evals.get(v) or {}
            out.append({"version": v, "time_unix": st.st_mtime, "size_bytes": st.st_size, "sha256": digest,
                        "evaluated": bool(ev), "score_mean": ev.get("score_mean", 0.0),
                        "return_mean": ev.get("return_mean", 0.0), "episodes": len(ev.get("returns", []))})
        return run_id, out

    def _digest(self, path, st) -> str:
        key = (str(path), st.st_mtime_ns, st.st_size)
        d = self._digests.get(key)
        if d is None:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            d = self._digests[key] = h.hexdigest()
            if len(self._digests) > 10_000:
                self._digests.clear()
        return d

    def gauges(self) -> dict[str, float]:
        """The numbers the aggregator's state gauges show (read at scrape time)."""
        with self.s.cond:
            run, now = self.s.run, time.time()
            active = run is not None and run.state in ACTIVE
            return {"agents_connected": sum(self.registry.connected(a, now) for a in self.registry.agents.values()),
                    "agents_expected": run.cfg.agents if active else 0,
                    "global_version": run.version if run else 0, "round": run.round if run else 0,
                    "run_active": 1.0 if active else 0.0,
                    "round_deadline": run.deadline if run is not None and run.state == "running" else 0.0}

    def _status(self) -> dict[str, Any]:
        run = self.s.run
        now = time.time()
        agents = [{"agent_id": a.agent_id, "agent_index": a.index, "num_samples": a.num_samples,
                   "connected": self.registry.connected(a, now),
                   "last_seen_unix": a.last_seen, "rounds_submitted": self.registry.rounds_in(a, run),
                   **self.registry.progress_of(a, run)}
                  for a in sorted(self.registry.agents.values(), key=lambda a: (a.index, a.agent_id))]
        if run is None:
            return {"state": "idle", "agents": agents, "evaluators_following": self.registry.evaluators_following()}
        last = run.evaluations[max(run.evaluations)] if run.evaluations else None
        return {"run_id": run.run_id, "state": run.state, "round": run.round, "rounds": run.cfg.rounds,
                "global_version": run.version, "agents": agents, "message": run.message,
                "last_evaluation": last, "config_json": run.config_json, "env_id": run.env_id,
                "evaluated_versions": sorted(run.evaluations), "evaluators_following": self.registry.evaluators_following(),
                **({"privacy": privacy_spent(run.cfg, run.version, run.machine.clip if run.machine else None)}
                   if run.cfg.dp_clip else {})}

    def watch(self, after_version: int, is_active=lambda: True, poll: float = 0.5) -> Iterator[dict[str, Any]]:
        """Events of the current run with version > ``after_version``, then live ones, until it ends."""
        sent = 0
        with self.s.cond:
            run = self.s.run
        if run is None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "no run to watch", "no_run")
        while is_active():
            with self.s.cond:
                new = run.events[sent:]
                sent = len(run.events)
                ended = self._watch_over(run)
                if not new and not ended:
                    self.s.cond.wait(poll)
                    continue
            for e in new:
                if e["kind"] in ("ROUND_OPENED", "ROUND_CLOSED", "EVALUATED") and e["version"] <= after_version:
                    continue
                yield e
            if ended and not new:
                return

    def resume(self) -> None:
        """Pick up the state directory's latest run if it never ended (the aggregator was killed).

        Its newest stored global version becomes the current one, bit for bit; the next round
        opens from it. Agents and evaluators reconnect by themselves; the selected agents are
        recognised when they rejoin. A run that was still waiting for agents waits again.
        """
        run_id = self.store.latest_run()
        if run_id is None:
            return
        saved = self.store.read_run(run_id)
        if any(e["kind"] in ("RUN_FINISHED", "RUN_FAILED", "RUN_STOPPED") for e in saved["events"]):
            return
        cfg = parse_run_config(saved["config_json"])
        run = Run(run_id, cfg, saved["config_json"], time.time(), events=saved["events"])
        self.s.run = run
        part = saved["participants"]
        if part is None:
            self.journal.event(run, "RUN_RESUMED", message=f"restarted; waiting for {cfg.agents} agents again")
            log.info("resumed run %s: waiting for agents", run_id)
            return
        versions = self.store.versions(run_id)
        state = None
        while versions:
            v = versions.pop()
            try:
                state = self.store.load_version(run_id, v)
                break
            except Exception as e:  # unreadable or damaged: fall back to the one before (logged loudly)
                log.error("run %s: version %d in the state directory cannot be resumed (%s); trying %d",
                          run_id, v, e, v - 1)
        if state is None:
            self.journal.fail(run, "restarted, but no stored global version could be read")
            return
        run.selected, run.env_id = list(part["selected"]), part["env_id"]
        run.norms = {a: (m, sd) for a, (m, sd) in part["norms"].items()}
        run.events = replay_journal(saved["events"], v)
        last = next((e.get("metrics") for e in reversed(run.events) if e["kind"] == "ROUND_CLOSED"
                     and e["version"] == v), None)
        # the public sample counts the run was started with (a state directory of an earlier version
        # kept none: the agents' own, as they joined again, or 1)
        samples = part.get("samples") or [getattr(self.registry.agents.get(a), "num_samples", 1) for a in run.selected]
        plan = Plan.of(cfg, run.selected, samples, run_id)
        run.machine = RoundMachine(plan, state, version=v, rounds_done=v, clip=resumed_clip(plan, last))
        run.encoded = {v: encode_version(run, v, state)}
        for e in run.events:
            if e["kind"] == "EVALUATED":
                run.evaluations[e["version"]] = e["evaluation"]
        # Who contributed to the versions kept (a round whose version was unreadable runs again):
        # a rejoining agent's count and its last accepted round continue from before the restart.
        for e in run.events:
            if e["kind"] == "ROUND_CLOSED":
                for a in e.get("agents", []):
                    n, _ = run.accepted_before.get(a, (0, 0))
                    run.accepted_before[a] = (n + 1, e["round"])
        run.state = "running"
        self.journal.event(run, "RUN_RESUMED", message=f"restarted; resuming from stored version {v}")
        self.rounds.follow(run, run.machine.begin(time.time()))
        log.info("resumed run %s at version %d (%s)", run_id, v, run.state)

    def _watch_over(self, run: Run) -> bool:
        """A run's event stream ends once it is over, however it ended (finished, stopped by its
        privacy budget or an operator, failed), and every version it stored has been evaluated
        (or evaluation is off, or no evaluator follows the run, or ``eval_grace`` seconds passed):
        a stop keeps the rounds it paid for."""
        if run.state in ACTIVE:
            return False
        if run.cfg.eval_episodes == 0 or not self.registry.evaluators_following():
            return True
        missing = [v for v in range(1, run.version + 1) if v not in run.evaluations]
        return not missing or time.time() - run.ended > self.eval_grace
