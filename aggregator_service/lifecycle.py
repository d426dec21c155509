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
import math
import secrets
import time
from collections.abc import Iterator
from typing import Any

import grpc

from aggregator_service.agents import AgentRegistry
from aggregator_service.journal import Journal
from aggregator_service.records import (
    ACTIVE,
    MAX_RUNS,
    RUN_ID,
    Run,
    Shared,
    encode_version,
    env_mismatch,
    replay_journal,
)
from aggregator_service.rounds import Rounds
from aggregator_service.store import Store
from fedrl.federation.machine import Plan, RoundMachine, resumed_clip
from fedrl.federation.privacy import privacy_spent, warm_epsilon
from fedrl.federation.runconfig import (
    JOIN_TEXT_LIMITS,
    LIMITS,
    NOT_EVALUATED_CHARS,
    ConfigError,
    parse_run_config,
)
from fedrl.wire.rpc import ServiceError

log = logging.getLogger("fedrl.aggregator")

class RunLifecycle:
    def __init__(self, shared: Shared, registry: AgentRegistry, journal: Journal, rounds: Rounds, store: Store,
                 eval_grace: float, max_runs: int = MAX_RUNS) -> None:
        self.s, self.registry, self.journal, self.rounds, self.store = shared, registry, journal, rounds, store
        self.eval_grace, self.max_runs = eval_grace, max_runs
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
            active = self.s.active()
            if len(active) >= self.max_runs:
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"this aggregator runs {len(active)} runs at once (--max-runs {self.max_runs}): "
                                   f"{', '.join(r.run_id for r in active)}; stop one or wait for one to end",
                                   "too_many_runs")
            if problem := self._unservable(cfg):
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"the fleet cannot serve this run: {problem}",
                                   "unservable")
            run_id = self._new_run_id()
            run = Run(run_id, cfg, cfg.to_json(), time.time())
            try:
                self.store.create_run(run_id, run.config_json)
            except OSError as e:  # nothing of the run was kept, and the aggregator's state is unchanged
                full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED if full else grpc.StatusCode.FAILED_PRECONDITION,
                                   f"cannot store the run in the state directory "
                                   f"({'full' if full else 'not writable'}: {e.strerror or e})", "state_dir") from None
            self.s.add(run)
            self.journal.event(run, "RUN_STARTED", message=f"waiting for {cfg.agents} agents")
            self.rounds.maybe_begin()
            self.s.cond.notify_all()
            return self._status(run)

    def _new_run_id(self) -> str:
        """A new run's id: its start time and 6 random hex digits, after every id stored or held
        (ids sort in the order runs started, and a restart resumes them in that order). Under the lock."""
        prefix = time.strftime("%Y%m%d-%H%M%S-")
        try:
            stored = self.store.run_ids()[-1:]
        except OSError:  # an unreadable state directory: creating the run says so, with its status
            stored = []
        newest = max([*self.s.runs, *stored, ""])
        if not newest.startswith(prefix):
            return prefix + secrets.token_hex(3)
        low = int(newest[-6:], 16) + 1  # a run started this second already: a larger suffix
        if low > 0xFFFFFF:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many runs started this second; try again",
                               "too_many_runs")
        return prefix + f"{low + secrets.randbelow((0x1000000 - low + 1) // 2):06x}"

    def _unservable(self, cfg) -> str:
        """Why the agents this aggregator holds can never serve a run of ``cfg`` ("" when they
        may): it names a task that every agent connected now, of a full registry, is not of (no
        agent of its task could join). Under the lock."""
        now = time.time()
        live = [a for a in self.registry.agents.values() if self.registry.connected(a, now)]
        if cfg.env is None or len(live) < self.registry.max_agents:
            return ""
        if all(env_mismatch(cfg.env, {a.env_id} if a.env_id else set(), a.obs_dim, a.act_dim) for a in live):
            return (f"env {cfg.env}, but all {len(live)} agents this aggregator holds (--max-agents "
                    f"{self.registry.max_agents}) are connected, and none has data of it")
        return ""

    def held(self, run_id: str) -> Run:
        """The run ``run_id`` names (empty: the newest), among those held; NOT_FOUND otherwise."""
        run = self.s.runs.get(run_id) if run_id else self.s.run
        if run is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND if run_id else grpc.StatusCode.FAILED_PRECONDITION,
                               f"unknown run {run_id[:80]!r} (runs held: {', '.join(self.s.runs) or 'none'})"
                               if run_id else "no run yet", "unknown_run" if run_id else "no_run")
        return run

    def stop_run(self, reason: str, run_id: str = "") -> dict[str, Any]:
        """Stop ``run_id`` (empty: the only active run; refused while several are)."""
        with self.s.cond:
            active = self.s.active()
            if not run_id and len(active) > 1:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"{len(active)} runs are active ({', '.join(r.run_id for r in active)}): "
                                   "name the one to stop", "which_run")
            run = self.held(run_id) if run_id else (active[0] if active else None)
            if run is None or run.state not in ACTIVE:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"run {run.run_id} is {run.state}: nothing to stop" if run else "no active run to stop",
                                   "no_run")
            run.end("stopped", reason or "stopped by operator")
            self.journal.event(run, "RUN_STOPPED", message=run.message)
            self.s.cond.notify_all()
            return self._status(run)

    def report_evaluation(self, report: dict[str, Any]) -> None:
        """An evaluator's report of a stored version: checked (:func:`report_problem`), then kept
        with an EVALUATED event, or, when it says why the version could not be evaluated
        (``not_evaluated``), with a NOT_EVALUATED event. The first report of a version stands; a
        later one (a second evaluator that raced the first) is acknowledged and changes nothing,
        so reports cannot grow a run's journal beyond one per version."""
        if problem := report_problem(report):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"evaluation report of run "
                               f"{str(report.get('run_id'))[:80]!r}: {problem}", "bad_report")
        with self.s.cond:
            run = self.s.runs.get(str(report.get("run_id")))
            if run is None:
                raise ServiceError(grpc.StatusCode.NOT_FOUND, f"unknown run {str(report.get('run_id'))[:80]!r}",
                                   "unknown_run")
            v = int(report["version"])
            if not 0 <= v <= run.version:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"version {v} does not exist (latest {run.version})", "unknown_version")
            if v in run.evaluations or v in run.not_evaluated:
                return
            if why := report.get("not_evaluated"):
                run.not_evaluable(v, why)
                self.journal.event(run, "NOT_EVALUATED", version=v, round=v, message=why)
            else:
                run.evaluated(v, report)
                self.journal.event(run, "EVALUATED", version=v, round=v, evaluation=dict(report))
            self.s.cond.notify_all()

    def status(self, run_id: str = "") -> dict[str, Any]:
        """``run_id``'s status; without it, the newest run's, with every run held in ``runs``."""
        with self.s.cond:
            if run_id:
                return self._status(self.held(run_id))
            out = self._status(self.s.run)
            if self.s.runs:
                out["runs"] = [self._status(r, agents=False) for r in self.s.runs.values()]
            return out

    def list_runs(self, limit: int = 100) -> list[dict[str, Any]]:
        limit = 100 if limit <= 0 else min(limit, 1000)
        with self.s.cond:
            active = {r.run_id: (r.state, r.message) for r in self.s.runs.values()}
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

    def gauges(self) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """The numbers the aggregator's state gauges show (read at scrape time): the aggregator's,
        and each run's held, by run."""
        with self.s.cond:
            now = time.time()
            runs = {r.run_id: {"agents_expected": r.cfg.agents if r.state in ACTIVE else 0,
                               "global_version": r.version, "round": r.round,
                               "run_active": 1.0 if r.state in ACTIVE else 0.0,
                               "round_deadline": r.deadline if r.state == "running" else 0.0}
                    for r in self.s.runs.values()}
            return ({"agents_connected": sum(self.registry.connected(a, now) for a in self.registry.agents.values()),
                     "runs_active": float(len(self.s.active()))}, runs)

    def _status(self, run: Run | None, agents: bool = True) -> dict[str, Any]:
        now = time.time()
        listed = [{"agent_id": a.agent_id, "agent_index": a.index, "num_samples": a.num_samples,
                   "connected": self.registry.connected(a, now),
                   "last_seen_unix": a.last_seen, "rounds_submitted": self.registry.rounds_in(a, run),
                   **self.registry.progress_of(a, run)}
                  for a in sorted(self.registry.agents.values(), key=lambda a: (a.index, a.agent_id))] if agents else []
        if run is None:
            return {"state": "idle", "agents": listed, "evaluators_following": self.registry.evaluators_following()}
        last = run.evaluations[max(run.evaluations)] if run.evaluations else None
        return {"run_id": run.run_id, "state": run.state, "round": run.round, "rounds": run.cfg.rounds,
                "global_version": run.version, "agents": listed, "message": run.message,
                "last_evaluation": last, "config_json": run.config_json, "env_id": run.env_id,
                "evaluated_versions": sorted(run.evaluations), "not_evaluated_versions": sorted(run.not_evaluated),
                "evaluators_following": self.registry.evaluators_following(),
                **({"privacy": privacy_spent(run.cfg, run.version, run.machine.clip if run.machine else None)}
                   if run.cfg.dp_clip else {})}

    def watch(self, after_version: int, is_active=lambda: True, poll: float = 0.5,
              run_id: str = "") -> Iterator[dict[str, Any]]:
        """Events of ``run_id`` (empty: of every run held, and of those started while the stream
        is open) with version > ``after_version``, then live ones, until each is over."""
        with self.s.cond:
            if run_id:
                only = [self.held(run_id)]
            elif not self.s.runs:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "no run to watch", "no_run")
        sent: dict[str, int] = {}
        while is_active():
            with self.s.cond:
                followed = only if run_id else list(self.s.runs.values())
                new = []
                for run in followed:
                    new += run.events[sent.get(run.run_id, 0):]
                    sent[run.run_id] = len(run.events)
                ended = all(self._watch_over(run) for run in followed)
                if not new and not ended:
                    self.s.cond.wait(poll)
                    continue
            for e in new:
                if (e["kind"] in ("ROUND_OPENED", "ROUND_CLOSED", "EVALUATED", "NOT_EVALUATED")
                        and e["version"] <= after_version):
                    continue
                yield e
            if ended and not new:
                return

    def resume(self) -> None:
        """Pick up every run of the state directory that never ended (the aggregator was killed),
        of its newest ``max_runs``, oldest first.

        Each run's newest stored global version becomes its current one, bit for bit; its next
        round opens from it. Agents and evaluators reconnect by themselves; the selected agents are
        recognised when they rejoin. A run that was still waiting for agents waits again.
        """
        for run_id in self.store.run_ids()[-self.max_runs:]:
            saved = self.store.read_run(run_id)
            if not any(e["kind"] in ("RUN_FINISHED", "RUN_FAILED", "RUN_STOPPED") for e in saved["events"]):
                self._resume(run_id, saved)

    def _resume(self, run_id: str, saved: dict[str, Any]) -> None:
        cfg = parse_run_config(saved["config_json"])
        run = Run(run_id, cfg, saved["config_json"], time.time(), events=saved["events"])
        self.s.add(run)
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
        run.chosen(part["selected"], part["env_id"], run.dims, {a: (m, sd) for a, (m, sd) in part["norms"].items()})
        events = replay_journal(saved["events"], v)
        last = next((e.get("metrics") for e in reversed(events) if e["kind"] == "ROUND_CLOSED"
                     and e["version"] == v), None)
        # the public sample counts the run was started with (a state directory of an earlier version
        # kept none: the agents' own, as they joined again, or 1)
        samples = part.get("samples") or [getattr(self.registry.agents.get(a), "num_samples", 1) for a in run.selected]
        plan = Plan.of(cfg, run.selected, samples, run_id)
        run.restored(events, v, encode_version(run, v, state))
        run.begin(RoundMachine(plan, state, version=v, rounds_done=v, clip=resumed_clip(plan, last)))
        self.journal.event(run, "RUN_RESUMED", message=f"restarted; resuming from stored version {v}")
        self.rounds.follow(run, run.machine.begin(time.time()))
        log.info("resumed run %s at version %d (%s)", run_id, v, run.state)

    def _watch_over(self, run: Run) -> bool:
        """A run's event stream ends once it is over, however it ended (finished, stopped by its
        privacy budget or an operator, failed), and every version it stored has been evaluated
        (or found not evaluable, or evaluation is off, or no evaluator follows the run, or
        ``eval_grace`` seconds passed):
        a stop keeps the rounds it paid for."""
        if run.state in ACTIVE:
            return False
        if run.cfg.eval_episodes == 0 or not self.registry.evaluators_following():
            return True
        missing = [v for v in range(1, run.version + 1) if v not in run.evaluations and v not in run.not_evaluated]
        return not missing or time.time() - run.ended > self.eval_grace



def report_problem(report: dict[str, Any]) -> str | None:
    """What makes an evaluation report one the aggregator cannot keep, or None: more returns than
    a run evaluates episodes, a value that is not finite, a negative count, time or spread, an
    env_id longer than a Join's may be (``JOIN_TEXT_LIMITS``); a ``not_evaluated`` reason with
    returns or of more than ``NOT_EVALUATED_CHARS`` characters."""
    returns = report.get("returns", ())
    n = len(returns)
    if why := report.get("not_evaluated"):
        if n:
            return f"{n} returns with not_evaluated: a report has returns or says why it has none"
        if len(why) > NOT_EVALUATED_CHARS:
            return f"a not_evaluated reason of {len(why)} characters (at most {NOT_EVALUATED_CHARS})"
    if n > LIMITS["eval_episodes"]:
        return f"{n} returns; a run evaluates at most {LIMITS['eval_episodes']} episodes"
    scalars = ("return_mean", "return_std", "score_mean", "score_std", "seconds")
    bad = [k for k in scalars if not math.isfinite(report.get(k, 0.0))]
    if not all(math.isfinite(r) for r in returns):
        bad.append("returns")
    if bad:
        return f"{', '.join(bad)} not finite"
    negative = [k for k in ("return_std", "score_std", "seconds", "env_steps") if report.get(k, 0) < 0]
    if negative:
        return f"{', '.join(negative)} negative"
    env_id = str(report.get("env_id", ""))
    if len(env_id) > (top := JOIN_TEXT_LIMITS["env_id"]):
        return f"an env_id of {len(env_id)} characters (at most {top})"
    return None
