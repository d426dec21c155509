"""The aggregator's round state machine, free of gRPC message types.

States of a run: ``waiting_for_agents`` -> ``running`` -> ``finished`` (or ``stopped`` /
``failed``). A round opens with the current global version; every selected agent fetches it,
trains and submits; the round closes when all selected agents have submitted, or at its
deadline if at least ``min_agents`` have. The new global version is written to the store
*before* it is announced; if it cannot be written the round stays open and the run reports why.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import torch

from aggregator_service.store import Store
from fedrl.algos.config import config_to_dict
from fedrl.data.normalize import ObsStats, global_normalizer
from fedrl.federation.aggregate import AggregationError, agent_weights, aggregate
from fedrl.federation.round import algo_config, initial_global_state
from fedrl.federation.runconfig import (
    JOIN_LIMITS,
    ConfigError,
    RunConfig,
    parse_run_config,
)
from fedrl.ops.metrics import AggregatorMetrics
from fedrl.wire.codec import (
    INLINE_MAX_BYTES,
    CodecError,
    Encoded,
    Flat,
    Manifest,
    check_manifest_matches,
    encode,
    encoded_from_payload,
)
from fedrl.wire.memory import BufferPool, release_free_memory
from fedrl.wire.rpc import ServiceError
from fedrl.wire.serde import chunk_frame

log = logging.getLogger("fedrl.aggregator")
ACTIVE = ("waiting_for_agents", "running")
# Free average buffers kept while a run is active: a close writes the new average while the
# current version and the one before are still held, and the one before that comes back once
# its last reader is gone; a second spare covers a fetcher that holds a version a little longer.
AVERAGES_KEPT = 2
AVERAGE_POOL_MIN_BYTES = 1 << 20  # smaller averages (a Hopper policy: 280 KB) are malloc's


@dataclass
class AgentRecord:
    agent_id: str
    index: int
    num_samples: int
    obs_dim: int
    act_dim: int
    env_id: str
    stats: ObsStats | None
    device: str = ""
    last_seen: float = 0.0
    rounds_submitted: int = 0
    stop_sent_for: str = ""
    last_accepted: tuple[str, int] = ("", 0)  # (run, round) of the agent's last accepted update
    progress: tuple[str, int, int, int] = ("", 0, 0, 0)  # (run, round, steps done, steps total) reported


@dataclass
class Submission:
    state: dict[str, torch.Tensor]
    num_samples: int
    metrics: dict[str, float]
    seconds: float
    flat: Flat | None = None  # the state as its one flat tensor, where the decoder had one


@dataclass
class Run:
    run_id: str
    cfg: RunConfig
    config_json: str
    created: float
    state: str = "waiting_for_agents"
    message: str = ""
    round: int = 0
    version: int = 0
    selected: list[str] = field(default_factory=list)
    global_state: dict[str, torch.Tensor] = field(default_factory=dict)
    encoded: dict[int, Encoded] = field(default_factory=dict)
    submissions: dict[str, Submission] = field(default_factory=dict)
    round_opened: float = 0.0
    deadline: float = 0.0
    norms: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    env_id: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    evaluations: dict[int, dict[str, Any]] = field(default_factory=dict)
    ended: float = 0.0
    hparams_json: str = ""  # the learner's hyperparameters, written into every stored version
    # A resumed run's accepted updates per agent before the restart, from its stored ROUND_CLOSED
    # events: (how many, last round). Given back to each agent when it rejoins.
    accepted_before: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The ROUND_CLOSED event journaled for a close whose version is not yet written.
    closing: dict[str, Any] | None = None


def replay_journal(events: list[dict[str, Any]], stored_version: int) -> list[dict[str, Any]]:
    """A run's history as its event journal and its stored versions tell it, for a restart.

    A round's close is journaled before its version is written, so the journal may be ahead of
    the disk: events past ``stored_version`` are dropped (that round runs again). A round that
    ran again after an earlier restart closed the same version twice: its second close replaces
    everything the journal holds from that version on."""
    out: list[dict[str, Any]] = []
    newest = -1
    for e in events:
        if e["kind"] == "ROUND_CLOSED" and e["version"] <= newest:
            out = [x for x in out if x["version"] < e["version"]]
        newest = max(newest, e["version"])
        out.append(e)
    return [x for x in out if x["version"] <= stored_version]


# Agent records the aggregator keeps (each holds its shard's observation moments): a Join past
# them first drops the records of agents gone (not connected, not in the active run), oldest first.
# An evaluator waiting for a run asks for one at least this often (evaluator_service.follower's
# MAX_IDLE_SECONDS, 5 s, with its jitter and slack): seen within it, it counts as following.
EVALUATOR_SEEN_SECONDS = 12.0
AGENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # no NUL, no bidi marks, no path parts
# What an observation's moments may be (a Join's shared sums): a finite mean of magnitude at most
# OBS_MEAN_MAX, a standard deviation at most OBS_STD_MAX, a non-negative variance (up to float
# rounding); a constant dimension (std 0) is fine, normalised with the STD_FLOOR of fedrl.data.normalize.
OBS_MEAN_MAX, OBS_STD_MAX = 1e6, 1e6
RUN_ID = re.compile(r"\d{8}-\d{6}-[0-9a-f]{6}")  # what start_run names runs
MAX_AGENTS = 1024
AGENT_TTL = 3600.0  # a record not seen for this long, and not in the active run, is dropped


class Coordinator:
    """Thread-safe: every public method takes the one lock; waiters use its condition."""

    def __init__(self, store: Store, max_task_wait: float = 30.0, tick: float = 0.1,
                 eval_grace: float = 120.0, metrics: AggregatorMetrics | None = None,
                 resume: bool = False, max_agents: int = MAX_AGENTS, agent_ttl: float = AGENT_TTL) -> None:
        self.store, self.eval_grace = store, eval_grace
        self.evaluators = 0  # evaluators following the runs now (their watch streams)
        self.evaluator_seen = 0.0  # when an evaluator's watch last opened or closed
        self.max_agents, self.agent_ttl = max_agents, agent_ttl
        self._digests: dict[tuple[str, int, int], str] = {}  # stored versions' sha256, by file state
        self.metrics = metrics or AggregatorMetrics()
        self.metrics.bind(self.gauges)
        self.max_task_wait = max_task_wait
        self.cond = threading.Condition()
        self.agents: dict[str, AgentRecord] = {}
        self.run: Run | None = None
        self._closed = False
        # Where received updates are assembled: each agent's buffer is written again the next
        # round instead of being faulted in afresh. Kept only while a run is active (the ticker
        # sets how many), one per agent of the run.
        self.buffers = BufferPool()
        # Where each round's average is written: the buffer of a version no longer held (neither
        # current, nor the one before, which late agents may still fetch, nor cached for
        # FetchGlobal) serves the next, instead of 30 MB of fresh pages faulted in at the close,
        # where every agent waits. Kept only while a run is active (the ticker sets it).
        self.averages = BufferPool()
        if resume:
            self._resume()
        self._ticker = threading.Thread(target=self._tick_loop, args=(tick,), daemon=True,
                                        name="aggregator-ticker")
        self._ticker.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self.cond:
            self._closed = True
            self.cond.notify_all()
        self._ticker.join(timeout=2)

    # -- agents ----------------------------------------------------------------------------
    def _check_task(self, rec: AgentRecord, run) -> None:
        """While a run is active, an agent of another task is refused at Join (naming the
        difference): the run's task is its env and the dimensions of the agents it has (those it
        selected, or those connected while it waits), so one agent cannot end a run."""
        if run is None or run.state not in ACTIVE:
            return
        now = time.time()
        if run.state == "running":
            peers = [self.agents[a] for a in run.selected if a in self.agents and a != rec.agent_id]
        else:
            peers = [a for a in self.agents.values() if a.agent_id != rec.agent_id and self._connected(a, now)]
        env = run.env_id or run.cfg.env or next((a.env_id for a in peers if a.env_id), "")
        dims = next(((a.obs_dim, a.act_dim) for a in peers), None)
        diff = []
        if env and rec.env_id and rec.env_id != env:
            diff.append(f"env {rec.env_id} (the run's: {env})")
        if dims is not None and (rec.obs_dim, rec.act_dim) != dims:
            diff.append(f"obs_dim {rec.obs_dim}, act_dim {rec.act_dim} (the run's: {dims[0]}, {dims[1]})")
        if diff:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"agent {rec.agent_id}: another task than run {run.run_id}'s: {'; '.join(diff)}",
                               "other_task")

    def join(self, rec: AgentRecord) -> str:
        if not AGENT_ID.fullmatch(rec.agent_id or ""):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"agent_id {rec.agent_id[:40]!r}: 1-128 characters of letters, digits and . _ - "
                               "(starting with a letter or digit)")
        if rec.obs_dim <= 0 or rec.act_dim <= 0 or rec.num_samples <= 0:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"agent {rec.agent_id}: obs_dim, act_dim and num_samples must be positive")
        for name, top in JOIN_LIMITS.items():
            v = getattr(rec, name)
            if not 0 <= v <= top:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"agent {rec.agent_id}: {name} must be in "
                                   f"[0, {top}], got {v}")
        if rec.stats is not None and (len(rec.stats.total) != rec.obs_dim or len(rec.stats.total_sq) != rec.obs_dim
                                      or rec.stats.count <= 0):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"agent {rec.agent_id}: observation moments must have obs_dim={rec.obs_dim} "
                               "entries and a positive count")
        if rec.stats is not None:
            if rec.stats.count > JOIN_LIMITS["num_samples"]:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"agent {rec.agent_id}: observation count must "
                                   f"be at most {JOIN_LIMITS['num_samples']}, got {rec.stats.count}")
            _check_moments(rec)
            with np.errstate(all="ignore"):
                derived = rec.stats.mean_std()
            if not all(np.isfinite(x).all() for x in (rec.stats.total, rec.stats.total_sq, *derived)):
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"agent {rec.agent_id}: observation moments (sums, sums of squares, and the mean "
                                   "and std they give) must be finite")
        with self.cond:
            old = self.agents.get(rec.agent_id)
            run = self.run
            self._check_task(rec, run)
            if old is not None and run is not None and run.state == "running" and rec.agent_id in run.selected:
                if (old.obs_dim, old.act_dim) != (rec.obs_dim, rec.act_dim):
                    raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                       f"agent {rec.agent_id} rejoined with different dimensions")
            if old is not None:  # its count is of the run its last accepted update belongs to
                rec.last_accepted, rec.rounds_submitted = old.last_accepted, old.rounds_submitted
            elif run is not None and rec.agent_id in run.accepted_before:  # first join since a restart
                n, last = run.accepted_before[rec.agent_id]
                rec.rounds_submitted, rec.last_accepted = n, (run.run_id, last)
            rec.last_seen = now = time.time()
            self._expire(now)
            if old is None and len(self.agents) >= self.max_agents:
                self._expire(now, make_room=True)
                if len(self.agents) >= self.max_agents:
                    raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       f"agent {rec.agent_id}: this aggregator holds {len(self.agents)} agents, "
                                       f"all connected or in the run (--max-agents {self.max_agents})",
                                       "too_many_agents")
            self.agents[rec.agent_id] = rec
            log.info("agent %s joined (index %d, %d samples)", rec.agent_id, rec.index, rec.num_samples,
                     extra={"event": {"kind": "AGENT_JOINED", "agent_id": rec.agent_id, "agent_index": rec.index,
                                      "num_samples": rec.num_samples}})
            self._maybe_begin()
            self.cond.notify_all()
            return run.run_id if run else ""

    def _in_run(self, agent_id: str) -> bool:
        run = self.run
        return run is not None and run.state in ACTIVE and agent_id in run.selected

    def _expire(self, now: float, make_room: bool = False) -> None:
        """Drop the records of agents gone: not seen for ``agent_ttl`` (or, with ``make_room``,
        not connected now), and not selected in the active run. Under the lock."""
        gone = [a for a in self.agents.values() if not self._in_run(a.agent_id)
                and (now - a.last_seen > self.agent_ttl or (make_room and not self._connected(a, now)))]
        for a in sorted(gone, key=lambda a: a.last_seen):
            del self.agents[a.agent_id]
            log.info("agent %s forgotten (last seen %.0fs ago)", a.agent_id, now - a.last_seen,
                     extra={"event": {"kind": "AGENT_FORGOTTEN", "agent_id": a.agent_id}})

    def last_accepted_round(self, agent_id: str, run_id: str) -> int:
        """The last round of ``run_id`` whose update from ``agent_id`` was accepted, 0 if none.
        A restarted aggregator knows those of the rounds whose close it stored (events)."""
        with self.cond:
            a = self.agents.get(agent_id)
            return a.last_accepted[1] if a is not None and run_id and a.last_accepted[0] == run_id else 0

    def _agent(self, agent_id: str) -> AgentRecord:
        a = self.agents.get(agent_id)
        if a is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"unknown agent {agent_id!r}: call Join first",
                               "unknown_agent")
        a.last_seen = time.time()
        return a

    def progress(self, agent_id: str, round_: int, done: int, total: int) -> None:
        """An agent's local steps on a round it trains (a Session's progress message): keeps it
        connected while it trains, and shows in the status."""
        if not (0 <= done <= total <= 10**12):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"progress {done}/{total}: expected 0 <= steps_done <= steps_total", "bad_progress")
        with self.cond:
            a = self._agent(agent_id)
            a.progress = (self.run.run_id if self.run else "", round_, done, total)

    def next_task(self, agent_id: str, wait: float) -> dict[str, Any]:
        """A task for the agent: TRAIN, STOP, or WAIT after at most ``wait`` seconds."""
        end = time.monotonic() + max(0.0, min(wait, self.max_task_wait))
        with self.cond:
            while True:
                a = self._agent(agent_id)
                run = self.run
                if run is not None and agent_id in run.selected:
                    if (run.state == "running" and agent_id not in run.submissions):
                        mean, std = run.norms[agent_id]
                        task = {"kind": "TRAIN", "run_id": run.run_id, "round": run.round,
                                "base_version": run.version, "local_steps": run.cfg.local_steps,
                                "run_config_json": run.config_json, "obs_mean": mean, "obs_std": std,
                                "deadline_unix": run.deadline}
                        enc = run.encoded[run.version]
                        if enc.manifest.total_bytes <= INLINE_MAX_BYTES:
                            task["base"] = enc  # sent inline: one RPC less per agent per round
                        return task
                    if run.state not in ACTIVE and a.stop_sent_for != run.run_id:
                        a.stop_sent_for = run.run_id
                        return {"kind": "STOP", "run_id": run.run_id}
                left = end - time.monotonic()
                if left <= 0 or self._closed:
                    return {"kind": "WAIT"}
                self.cond.wait(left)

    def global_weights(self, run_id: str, version: int) -> Encoded:
        """A global version: of the current run (``run_id`` empty or its id), or a stored version
        of an earlier run of the state directory; ``version`` -1 is the latest."""
        if version < -1:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"version {version}: expected a version >= 0, or -1 for the latest", "bad_version")
        with self.cond:
            run = self.run
            current = run is not None and (not run_id or run_id == run.run_id)
            if current:
                if run.state == "waiting_for_agents":
                    raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "the run has not started yet")
                v = run.version if version < 0 else version
                enc = run.encoded.get(v)
                if enc is not None:
                    return enc
                if v > run.version:
                    raise ServiceError(grpc.StatusCode.NOT_FOUND, f"version {v} does not exist yet "
                                       f"(latest is {run.version})", "unknown_version")
        if current:
            run_id = run.run_id
        else:  # an earlier run's stored version
            if not run_id or not RUN_ID.fullmatch(run_id) or run_id not in self.store.run_ids():
                raise ServiceError(grpc.StatusCode.NOT_FOUND, f"unknown run {run_id[:80]!r}", "unknown_run")
            stored = self.store.versions(run_id)
            if not stored:
                raise ServiceError(grpc.StatusCode.NOT_FOUND, f"run {run_id} has no stored version", "unknown_version")
            v = stored[-1] if version < 0 else version
        try:  # an older version: its stored bytes, sent as written
            payload = self.store.version_path(run_id, v).read_bytes()
        except FileNotFoundError:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"version {v} of run {run_id} is not stored",
                               "unknown_version") from None
        try:
            return encoded_from_payload(payload, run_id, v, v)
        except CodecError as e:
            raise ServiceError(grpc.StatusCode.DATA_LOSS, f"stored version {v} is unreadable: {e}",
                               "corrupt_version") from None

    def check_header(self, agent_id: str, m: Manifest) -> None:
        """Refuse an update before its chunks are read (unknown agent, wrong run/round, duplicate,
        tensors or a declared size the global model cannot have: a CodecError, which the servicer
        maps to its status like any other verification failure)."""
        with self.cond:
            self._check_tensors(self._check_submission(agent_id, m), m)

    @staticmethod
    def _check_tensors(run: Run, m: Manifest) -> None:
        """``m`` lists exactly the global model's tensors: compared as the specs of the global
        version's own manifest (one tuple comparison), and only when they differ tensor by
        tensor, to name the difference."""
        if m.tensors != run.encoded[run.version].manifest.tensors:
            check_manifest_matches(m, run.global_state)

    def _check_submission(self, agent_id: str, m: Manifest) -> Run:
        self._agent(agent_id)
        run = self.run
        if run is None or run.run_id != m.run_id:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"update for run {m.run_id!r}, but the active run is "
                               f"{run.run_id if run else 'none'!r}", "wrong_run")
        if agent_id not in run.selected:
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                               f"agent {agent_id!r} is not a participant of run {run.run_id}", "not_selected")
        if run.state != "running":
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"run {run.run_id} is {run.state}; no round is open", "closed_round")
        if m.round < run.round:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"round {m.round} is closed (round {run.round} is open)", "stale_round")
        if m.round > run.round:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"round {m.round} is in the future (round {run.round} is open)", "future_round")
        if m.base_version != run.version:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"update trained from version {m.base_version}, round {run.round} "
                               f"distributes version {run.version}", "wrong_base")
        if agent_id in run.submissions:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"agent {agent_id!r} already submitted for round {run.round}", "duplicate")
        return run

    def submit(self, agent_id: str, m: Manifest, state: dict[str, torch.Tensor],
               metrics: Mapping[str, float], seconds: float, flat: Flat | None = None) -> int:
        """Accept a verified update (``state`` decoded from a payload checked against ``m``,
        and ``flat``, its decoder's flat tensor, where it had one); closes the round when it
        completes. Returns the round."""
        with self.cond:
            run = self._check_submission(agent_id, m)
            self._check_tensors(run, m)
            clean = {k: float(v) for k, v in metrics.items() if np.isfinite(v)}
            run.submissions[agent_id] = Submission(state, m.num_samples, clean, seconds, flat)
            rec = self.agents[agent_id]
            same_run = rec.last_accepted is not None and rec.last_accepted[0] == run.run_id
            rec.rounds_submitted = (rec.rounds_submitted if same_run else 0) + 1  # counted per run
            rec.last_accepted = (run.run_id, run.round)
            self.metrics.accepted.inc()
            r = run.round
            if len(run.submissions) == len(run.selected):
                self._close_round(run)
                self.cond.notify_all()  # only a closed round changes what waiters look for
            return r

    # -- runs ------------------------------------------------------------------------------
    def start_run(self, config_json: str) -> dict[str, Any]:
        try:
            cfg = parse_run_config(config_json)
        except ConfigError as e:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"invalid run config: {e}", "bad_config") from None
        if cfg.agents > self.max_agents:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"invalid run config: agents: {cfg.agents} is more than this aggregator keeps "
                               f"(--max-agents {self.max_agents})", "bad_config")
        with self.cond:
            if self.run is not None and self.run.state in ACTIVE:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"run {self.run.run_id} is {self.run.state}; stop it first", "run_active")
            run_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
            run = Run(run_id, cfg, cfg.to_json(), time.time())
            try:
                self.store.create_run(run_id, run.config_json)
            except OSError as e:  # nothing of the run was kept, and the aggregator's state is unchanged
                full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED if full else grpc.StatusCode.FAILED_PRECONDITION,
                                   f"cannot store the run in the state directory "
                                   f"({'full' if full else 'not writable'}: {e.strerror or e})", "state_dir") from None
            self.run = run
            self._event(run, "RUN_STARTED", message=f"waiting for {cfg.agents} agents")
            self._maybe_begin()
            self.cond.notify_all()
            return self._status()

    def stop_run(self, reason: str) -> dict[str, Any]:
        with self.cond:
            run = self.run
            if run is None or run.state not in ACTIVE:
                raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "no active run to stop", "no_run")
            run.state, run.message = "stopped", reason or "stopped by operator"
            self._event(run, "RUN_STOPPED", message=run.message)
            self.cond.notify_all()
            return self._status()

    def report_evaluation(self, report: dict[str, Any]) -> None:
        with self.cond:
            run = self.run
            if run is None or report.get("run_id") != run.run_id:
                raise ServiceError(grpc.StatusCode.NOT_FOUND, f"unknown run {report.get('run_id')!r}", "unknown_run")
            v = int(report["version"])
            if not 0 <= v <= run.version:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"version {v} does not exist (latest {run.version})", "unknown_version")
            run.evaluations[v] = dict(report)
            self._event(run, "EVALUATED", version=v, round=v, evaluation=dict(report))
            self.cond.notify_all()

    def status(self) -> dict[str, Any]:
        with self.cond:
            return self._status()

    # -- the state directory's runs and versions (files read outside the lock) -------------------
    def list_runs(self, limit: int = 100) -> list[dict[str, Any]]:
        limit = 100 if limit <= 0 else min(limit, 1000)
        with self.cond:
            active = {self.run.run_id: (self.run.state, self.run.message)} if self.run is not None else {}
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
        with self.cond:
            run, now = self.run, time.time()
            active = run is not None and run.state in ACTIVE
            return {"agents_connected": sum(self._connected(a, now) for a in self.agents.values()),
                    "agents_expected": run.cfg.agents if active else 0,
                    "global_version": run.version if run else 0, "round": run.round if run else 0,
                    "run_active": 1.0 if active else 0.0,
                    "round_deadline": run.deadline if run is not None and run.state == "running" else 0.0}

    def _connected(self, a: AgentRecord, now: float) -> bool:
        return now - a.last_seen < 2 * self.max_task_wait + 5

    @staticmethod
    def _rounds_in(a: AgentRecord, run) -> int:
        """Rounds of ``run`` (the current one) whose update from ``a`` was taken."""
        return a.rounds_submitted if run is not None and a.last_accepted and a.last_accepted[0] == run.run_id else 0

    @staticmethod
    def _progress_of(a: AgentRecord, run) -> dict[str, int]:
        pr_run, pr_round, done, total = a.progress
        if run is None or pr_run != run.run_id or pr_round != run.round or run.state != "running":
            return {"steps_done": 0, "steps_total": 0}
        return {"steps_done": done, "steps_total": total}

    def _status(self) -> dict[str, Any]:
        run = self.run
        now = time.time()
        agents = [{"agent_id": a.agent_id, "agent_index": a.index, "num_samples": a.num_samples,
                   "connected": self._connected(a, now),
                   "last_seen_unix": a.last_seen, "rounds_submitted": self._rounds_in(a, run),
                   **self._progress_of(a, run)}
                  for a in sorted(self.agents.values(), key=lambda a: (a.index, a.agent_id))]
        if run is None:
            return {"state": "idle", "agents": agents, "evaluators_following": self.evaluators_following()}
        last = run.evaluations[max(run.evaluations)] if run.evaluations else None
        return {"run_id": run.run_id, "state": run.state, "round": run.round, "rounds": run.cfg.rounds,
                "global_version": run.version, "agents": agents, "message": run.message,
                "last_evaluation": last, "config_json": run.config_json, "env_id": run.env_id,
                "evaluated_versions": sorted(run.evaluations), "evaluators_following": self.evaluators_following()}

    def watch(self, after_version: int, is_active=lambda: True, poll: float = 0.5) -> Iterator[dict[str, Any]]:
        """Events of the current run with version > ``after_version``, then live ones, until it ends."""
        sent = 0
        with self.cond:
            run = self.run
        if run is None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "no run to watch", "no_run")
        while is_active():
            with self.cond:
                new = run.events[sent:]
                sent = len(run.events)
                ended = self._watch_over(run)
                if not new and not ended:
                    self.cond.wait(poll)
                    continue
            for e in new:
                if e["kind"] in ("ROUND_OPENED", "ROUND_CLOSED", "EVALUATED") and e["version"] <= after_version:
                    continue
                yield e
            if ended and not new:
                return

    # -- restart ---------------------------------------------------------------------------
    def _resume(self) -> None:
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
        self.run = run
        part = saved["participants"]
        if part is None:
            self._event(run, "RUN_RESUMED", message=f"restarted; waiting for {cfg.agents} agents again")
            log.info("resumed run %s: waiting for agents", run_id)
            return
        versions = self.store.versions(run_id)
        state = None
        while versions:
            v = versions.pop()
            try:
                state = self.store.load_version(run_id, v)
                break
            except Exception as e:  # unreadable: fall back to the one before (logged loudly)
                log.error("run %s: version %d in the state directory is unreadable (%s); trying %d",
                          run_id, v, e, v - 1)
        if state is None:
            self._fail(run, "restarted, but no stored global version could be read")
            return
        run.selected, run.env_id = list(part["selected"]), part["env_id"]
        run.norms = {a: (m, sd) for a, (m, sd) in part["norms"].items()}
        run.version, run.global_state = v, state
        run.encoded = {v: self._encode(run, v, state)}
        run.events = replay_journal(saved["events"], v)
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
        run.round = v
        run.state = "running"
        msg = f"restarted; resuming from stored version {v}"
        if v >= cfg.rounds:
            run.state, run.ended = "finished", time.time()
            self._event(run, "RUN_RESUMED", message=msg)
            self._event(run, "RUN_FINISHED")
        else:
            self._event(run, "RUN_RESUMED", message=msg)
            self._open_round(run, v + 1)
        log.info("resumed run %s at version %d (%s)", run_id, v, run.state)

    # -- internals (lock held) ---------------------------------------------------------------
    def evaluator_attached(self, delta: int) -> None:
        """An evaluator's watch stream opened (+1) or closed (-1); either way it was just seen."""
        with self.cond:
            self.evaluators += delta
            self.evaluator_seen = time.time()
            self.cond.notify_all()

    def evaluators_following(self) -> int:
        """Evaluators following the runs: streams open now, or 1 for an evaluator seen within
        ``EVALUATOR_SEEN_SECONDS`` (one waiting for a run asks again at least that often)."""
        if self.evaluators > 0:
            return self.evaluators
        return int(time.time() - self.evaluator_seen < EVALUATOR_SEEN_SECONDS)

    def _watch_over(self, run: Run) -> bool:
        """A run's event stream ends once it is over and every version has been evaluated
        (or evaluation is off, or no evaluator follows the run, or ``eval_grace`` seconds passed)."""
        if run.state in ACTIVE:
            return False
        if run.state != "finished" or run.cfg.eval_episodes == 0 or not self.evaluators_following():
            return True
        missing = [v for v in range(1, run.version + 1) if v not in run.evaluations]
        return not missing or time.time() - run.ended > self.eval_grace

    @staticmethod
    def _new_event(run: Run, kind: str, **kw: Any) -> dict[str, Any]:
        return {"kind": kind, "run_id": run.run_id, "round": kw.pop("round", run.round),
                "version": kw.pop("version", run.version), "time_unix": time.time(), **kw}

    @staticmethod
    def _log_event(run: Run, e: dict[str, Any]) -> None:
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
        elif k == "RUN_FINISHED":
            msg = f"run {run.run_id} finished after {run.round} rounds (version {e['version']})"
        elif k == "RUN_RESUMED":
            msg = f"run {run.run_id} resumed at version {e['version']}"
        else:
            msg = f"run {run.run_id} {k.lower().removeprefix('run_')}" + (f": {e['message']}" if e.get("message") else "")
        fields = {k2: v for k2, v in e.items() if k2 not in ("metrics", "evaluation")}
        level = {"RUN_FAILED": logging.ERROR, "RUN_STOPPED": logging.WARNING}.get(k, logging.INFO)
        log.log(level, msg, extra={"event": fields})

    def _event(self, run: Run, kind: str, **kw: Any) -> None:
        e = self._new_event(run, kind, **kw)
        self._log_event(run, e)
        run.events.append(e)
        try:
            self.store.append_event(run.run_id, e)
        except OSError as err:
            log.error("cannot append event to the store: %s", err)

    def _maybe_begin(self) -> None:
        run = self.run
        if run is None or run.state != "waiting_for_agents" or len(self.agents) < run.cfg.agents:
            return
        now = time.time()  # a run takes agents that are connected now, never records of agents gone
        present = [a for a in self.agents.values() if self._connected(a, now)]
        if len(present) < run.cfg.agents:
            return
        chosen = sorted(present, key=lambda a: (a.index, a.agent_id))[: run.cfg.agents]
        dims = {(a.obs_dim, a.act_dim) for a in chosen}
        envs = {a.env_id for a in chosen if a.env_id}
        if len(dims) != 1 or len(envs) > 1:
            self._fail(run, f"agents disagree on the task: dims {sorted(dims)}, envs {sorted(envs)}")
            return
        obs_dim, act_dim = dims.pop()
        cfg = run.cfg
        if cfg.env is not None:  # the evaluation env must be the agents' task
            problem = _env_mismatch(cfg.env, envs, obs_dim, act_dim)
            if problem:
                self._fail(run, problem)
                return
        if cfg.obs_norm != "none" and any(a.stats is None for a in chosen):
            self._fail(run, f"obs_norm={cfg.obs_norm} needs every agent's observation moments")
            return
        stats = [a.stats for a in chosen] if cfg.obs_norm != "none" else [ObsStats(1, np.zeros(obs_dim), np.zeros(obs_dim))]
        with np.errstate(all="ignore"):
            g_mean, g_std = global_normalizer(cfg.obs_norm, stats)
        if not (np.isfinite(g_mean).all() and np.isfinite(g_std).all()):  # each agent's were finite; their pool overflowed
            self._fail(run, "the agents' pooled observation moments are not finite")
            return
        hp = algo_config(cfg.algo, cfg.drpo, cfg.bc)
        state = initial_global_state(hp, obs_dim, act_dim, cfg.seed, g_mean, g_std,
                                     cfg.federate == "policy+critic")
        run.env_id = cfg.env or (envs.pop() if envs else "")
        enc = self._encode(run, 0, state)
        try:
            self.store.save_version(run.run_id, 0, enc.pieces())
        except OSError as e:
            self._fail(run, f"cannot write version 0 to the state directory: {e}")
            return
        run.selected = [a.agent_id for a in chosen]
        for a in chosen:
            own = a.stats.mean_std() if cfg.obs_norm == "local" else (g_mean, g_std)
            run.norms[a.agent_id] = (own[0].tolist(), own[1].tolist())
        try:
            self.store.save_participants(run.run_id, {"selected": run.selected, "norms": run.norms,
                                                      "env_id": run.env_id})
        except OSError as e:
            self._fail(run, f"cannot write the participants to the state directory: {e}")
            return
        run.global_state = state
        run.encoded = {0: enc}
        run.state = "running"
        self._open_round(run, 1)

    def _encode(self, run: Run, version: int, state: dict[str, torch.Tensor]) -> Encoded:
        """A global version as sent and as stored: the same bytes, its provenance in the header."""
        if not run.hparams_json:
            run.hparams_json = json.dumps(config_to_dict(algo_config(run.cfg.algo, run.cfg.drpo, run.cfg.bc)))
        meta = {"run_id": run.run_id, "version": str(version), "algo": run.cfg.algo,
                "env_id": run.env_id, "hparams": run.hparams_json}
        # A version too large to go inline in tasks is fetched as chunk messages: they are built
        # here, each chunk hashed in its message (one pass over the average, not two).
        fetched = sum(t.nbytes for t in state.values()) > INLINE_MAX_BYTES
        return encode(state, run.run_id, version, version, metadata=meta, frame=chunk_frame if fetched else None)

    def _average_memory(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor for a round's average: in a buffer from :attr:`averages` from
        AVERAGE_POOL_MIN_BYTES up; below, malloc's (a small block comes from memory malloc
        already holds, and the pool's bookkeeping would cost more than it saves)."""
        nbytes = numel * dtype.itemsize
        if nbytes < AVERAGE_POOL_MIN_BYTES:
            return torch.empty(numel, dtype=dtype)
        return torch.frombuffer(self.averages.take(nbytes), dtype=dtype)

    def _open_round(self, run: Run, r: int) -> None:
        run.round, run.submissions = r, {}
        run.round_opened = time.time()
        run.deadline = run.round_opened + run.cfg.round_timeout
        self._event(run, "ROUND_OPENED", agents=list(run.selected))

    def _close_round(self, run: Run) -> None:
        order = [a for a in run.selected if a in run.submissions]
        subs = [run.submissions[a] for a in order]
        try:
            w = agent_weights(run.cfg.weighting, [s.num_samples for s in subs])
            new = aggregate(run.cfg.aggregation, [s.state for s in subs], w, run.cfg.trim_fraction,
                            [s.flat for s in subs], self._average_memory)
        except AggregationError as e:
            self._fail(run, f"aggregation failed in round {run.round}: {e}")
            return
        v = run.version + 1
        enc = self._encode(run, v, new)
        metrics: dict[str, float] = {}
        for s in subs:
            for k, x in s.metrics.items():
                metrics[k] = metrics.get(k, 0.0) + x / len(subs)
        seconds = time.time() - run.round_opened
        try:
            # Journal first, then the version: a restart that finds version v also finds whose
            # updates made it (a journal line whose version never got written is dropped then).
            # The line is fsynced (durable) so not even a power cut keeps the version without
            # it. A close retried after a failed write is journaled once.
            if run.closing is None or (run.closing["version"], run.closing["agents"]) != (v, order):
                closing = self._new_event(run, "ROUND_CLOSED", version=v, agents=order,
                                          metrics=metrics, seconds=seconds)
                self.store.append_event(run.run_id, closing, durable=True)
                run.closing = closing
            self.store.save_version(run.run_id, v, enc.pieces())
        except OSError as e:
            msg = f"cannot persist version {v}; round {run.round} stays open: {e}"
            if run.message != msg:
                log.error(msg)
            run.message = msg
            return
        run.message = ""
        run.version, run.global_state = v, new
        run.encoded = {k: e for k, e in run.encoded.items() if k >= v - 1}
        run.encoded[v] = enc
        self.metrics.round_closed(seconds)
        self._log_event(run, run.closing)
        run.events.append(run.closing)  # announced only now that the version is on disk
        run.closing = None
        if run.round >= run.cfg.rounds:
            run.state, run.ended = "finished", time.time()
            self._event(run, "RUN_FINISHED")
        else:
            self._open_round(run, run.round + 1)

    def _fail(self, run: Run, message: str) -> None:
        run.state, run.message = "failed", message
        self._event(run, "RUN_FAILED", message=message)

    def _tick_loop(self, tick: float) -> None:
        was_active = False
        while True:
            run = self.run
            active = run is not None and run.state in ACTIVE
            # Outside the lock, as either can take tens of ms after 30 MB rounds. While a run is
            # active its memory is kept for its next rounds: a buffer per agent, and the heap
            # (malloc arenas are few, see aggregator_service.__main__, so it does not climb).
            # Once it ends, both go back to the OS.
            self.buffers.keep = run.cfg.agents if active else 0
            self.averages.keep = AVERAGES_KEPT if active else 0
            if was_active and not active:
                release_free_memory()
            was_active = active
            with self.cond:
                if self._closed:
                    return
                self.cond.wait(tick)
                run = self.run
                if run is None:
                    continue
                now = time.time()
                if run.state == "waiting_for_agents" and now - run.created > run.cfg.join_timeout:
                    present = sum(self._connected(a, now) for a in self.agents.values())
                    self._fail(run, f"only {present} of the {run.cfg.agents} agents the run needs were connected "
                                    f"within {run.cfg.join_timeout:.0f}s")
                    self.cond.notify_all()
                elif run.state == "running" and now >= run.deadline and len(run.submissions) < run.cfg.quorum:
                    msg = (f"round {run.round} is past its deadline with {len(run.submissions)} of the "
                           f"{run.cfg.quorum} updates it needs; waiting for agents")
                    if run.message != msg:
                        log.warning(msg)
                        run.message = msg
                elif run.state == "running" and (now >= run.deadline or run.message) and run.submissions:
                    if len(run.submissions) >= run.cfg.quorum:
                        self._close_round(run)
                        self.cond.notify_all()


def _check_moments(rec: AgentRecord) -> None:
    """Refuse observation moments no observation can have (see ``OBS_MEAN_MAX``), naming them."""
    st = rec.stats
    with np.errstate(all="ignore"):
        total, total_sq = np.asarray(st.total, np.float64), np.asarray(st.total_sq, np.float64)
        mean = total / st.count
        var = total_sq / st.count - mean * mean
    bad = []
    if not (np.isfinite(total).all() and np.isfinite(total_sq).all()):
        bad.append("sums must be finite")
    elif (total_sq < 0).any():
        bad.append(f"a sum of squares is negative ({float(total_sq.min()):.3g})")
    elif (np.abs(mean) > OBS_MEAN_MAX).any():
        bad.append(f"a mean of magnitude {float(np.abs(mean).max()):.3g} exceeds {OBS_MEAN_MAX:g}")
    elif (var < -1e-6 * (1.0 + mean * mean)).any():
        bad.append(f"a variance is negative ({float(var.min()):.3g}): the sums of squares are below the squared sums")
    elif (np.sqrt(np.maximum(var, 0.0)) > OBS_STD_MAX).any():
        bad.append(f"a standard deviation of {float(np.sqrt(np.maximum(var, 0.0)).max()):.3g} exceeds {OBS_STD_MAX:g}")
    if bad:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"agent {rec.agent_id}: observation moments: {bad[0]}",
                           "bad_moments")


def _env_mismatch(env_name: str, agent_envs: set[str], obs_dim: int, act_dim: int) -> str:
    """Why the run config's ``env`` cannot evaluate the agents' policies ("" when it can)."""
    from fedrl.envs import env_info

    env = env_info(env_name)  # validated with the config

    def key(name: str) -> str | None:
        try:
            return env_info(name).key
        except ValueError:  # a task this installation does not know is not the config's
            return None

    other = sorted(e for e in agent_envs if key(e) != env.key)
    if other:
        return f"env {env_name} in the run config, but the agents' data is for {', '.join(other)}"
    if act_dim != env.act_dim:
        return f"env {env_name} in the run config has {env.act_dim} action dims, the agents' data {act_dim}"
    try:
        env.gym_kwargs(obs_dim)
    except ValueError as e:
        return f"env in the run config cannot evaluate the agents' {obs_dim}-dim observations: {e}"
    return ""
