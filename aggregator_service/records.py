"""What the aggregator keeps: agent records, runs, submissions, and the checks on what agents
declare (their moments, their task). No gRPC message types."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import torch

from fedrl.algos.config import config_to_dict
from fedrl.data.normalize import ObsStats
from fedrl.federation.machine import RoundMachine, Update
from fedrl.federation.round import algo_config
from fedrl.federation.runconfig import RunConfig
from fedrl.wire.codec import INLINE_MAX_BYTES, Encoded, encode
from fedrl.wire.serde import chunk_frame
from fedrl.wire.rpc import ServiceError

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
    # per run this agent took part in, of those the aggregator holds: (updates taken, last round taken)
    accepted: dict[str, tuple[int, int]] = field(default_factory=dict)
    stops_sent: set[str] = field(default_factory=set)  # runs whose STOP this agent was given
    declined: set[tuple[str, int]] = field(default_factory=set)  # (run, round) it answered without taking part
    progress: tuple[str, int, int, int] = ("", 0, 0, 0)  # (run, round, steps done, steps total) reported


@dataclass
class Run:
    """One run the aggregator holds. Its rounds are its machine's; its other fields change only
    through its own methods (``chosen``, ``begin``, ``opened``, ``written``, ``end``, ...), which
    the aggregator's parts call under the lock, and its journal appends its events."""

    run_id: str
    cfg: RunConfig
    config_json: str
    created: float
    state: str = "waiting_for_agents"
    message: str = ""
    selected: list[str] = field(default_factory=list)
    # The rounds (fedrl.federation.machine), secure aggregation and round 0 included: made once
    # the run's agents are chosen, so None while the run waits for agents.
    machine: RoundMachine | None = None
    encoded: dict[int, Encoded] = field(default_factory=dict)
    round_opened: float = 0.0
    norms: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    env_id: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    evaluations: dict[int, dict[str, Any]] = field(default_factory=dict)
    not_evaluated: dict[int, str] = field(default_factory=dict)  # versions the evaluator could not evaluate: why
    ended: float = 0.0
    hparams_json: str = ""  # the learner's hyperparameters, written into every stored version
    # A resumed run's accepted updates per agent before the restart, from its stored ROUND_CLOSED
    # events: (how many, last round). Given back to each agent when it rejoins.
    accepted_before: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The ROUND_CLOSED event journaled for a close whose version is not yet written.
    closing: dict[str, Any] | None = None
    # The round's updates refused as non-finite, by agent: (what the last one said, when). When
    # every selected agent's is, and each agent has since gone silent (an agent whose update is
    # refused so gives up), the run cannot train and fails instead of waiting for ever.
    non_finite: dict[str, tuple[str, float]] = field(default_factory=dict)
    dims: tuple[int, int] = (0, 0)  # (obs_dim, act_dim) of the selected agents, from round 0 on

    # The run's own transitions: the parts call these rather than writing its fields themselves.
    def chosen(self, selected: list[str], env_id: str, dims: tuple[int, int],
               norms: dict[str, tuple[list[float], list[float]]] | None = None) -> None:
        """Its agents, their task and (once known) each one's normaliser."""
        self.selected, self.env_id, self.dims = list(selected), env_id, dims
        if norms is not None:
            self.normalised(norms)

    def normalised(self, norms: dict[str, tuple[list[float], list[float]]]) -> None:
        """Each selected agent's observation normaliser, fixed with version 0."""
        self.norms = dict(norms)

    def restored(self, events: list[dict[str, Any]], version: int, enc: Encoded) -> None:
        """Picked up after a restart at its stored ``version``: its journal as replayed, its
        evaluations, and who had contributed to the versions kept (each rejoining agent's count
        and last accepted round go on from them)."""
        self.events, self.encoded = events, {version: enc}
        for e in events:
            if e["kind"] == "EVALUATED":
                self.evaluations[e["version"]] = e["evaluation"]
            elif e["kind"] == "NOT_EVALUATED":
                self.not_evaluated[e["version"]] = e.get("message", "")
            elif e["kind"] == "ROUND_CLOSED":
                for a in e.get("agents", []):
                    n, _ = self.accepted_before.get(a, (0, 0))
                    self.accepted_before[a] = (n + 1, e["round"])

    def begin(self, machine: RoundMachine) -> None:
        """Its agents are chosen (``selected``, ``env_id``, ``dims``): its rounds run on ``machine``."""
        self.machine, self.state = machine, "running"

    def end(self, state: str, message: str = "") -> None:
        """Over: ``finished``, ``stopped`` or ``failed``, saying why."""
        self.state, self.message, self.ended = state, message, time.time()

    def opened(self) -> None:
        """A round (or round 0) opened now: the last round's refusals are forgotten."""
        self.non_finite, self.round_opened = {}, time.time()

    def written(self, version: int, enc: Encoded) -> None:
        """``version`` is on disk as ``enc``: it is served, with the one before it (late agents)."""
        self.encoded = {k: e for k, e in self.encoded.items() if k >= version - 1}
        self.encoded[version] = enc
        self.message, self.closing = "", None

    def closing_journaled(self, event: dict[str, Any]) -> None:
        """The round's close is journaled (``event``), its version not yet written."""
        self.closing = event

    def says(self, message: str) -> bool:
        """Why the run waits, shown in its status; True when it is news (worth a log line)."""
        news, self.message = self.message != message, message
        return news

    def non_finite_refused(self, agent_id: str, detail: str) -> None:
        """``agent_id``'s update of the open round was refused as non-finite, saying ``detail``."""
        self.non_finite[agent_id] = (detail, time.time())

    def evaluated(self, version: int, report: dict[str, Any]) -> None:
        self.evaluations[version] = dict(report)

    def not_evaluable(self, version: int, why: str) -> None:
        """The evaluator could not evaluate ``version``, saying ``why``."""
        self.not_evaluated[version] = why

    def versions_dropped(self) -> None:
        """Over: its versions are served from the state directory from now on."""
        self.encoded = {}

    @property
    def hparams(self) -> str:
        """The learner's hyperparameters as JSON (written into every stored version), made once."""
        if not self.hparams_json:
            self.hparams_json = json.dumps(config_to_dict(algo_config(self.cfg.algo, self.cfg.drpo, self.cfg.bc)))
        return self.hparams_json

    @property
    def round(self) -> int:
        """The open round (or the last one, once the run is over); 0 before round 1."""
        return self.machine.round if self.machine is not None else 0

    @property
    def deadline(self) -> float:
        """The open round's deadline (unix time; 0 while none is open)."""
        m = self.machine
        return m.deadline if m is not None and m.phase in ("open", "gather") else 0.0

    @property
    def version(self) -> int:
        return self.machine.version if self.machine is not None else 0

    @property
    def global_state(self) -> dict[str, torch.Tensor]:
        return self.machine.global_state if self.machine is not None else {}

    @property
    def submissions(self) -> dict[str, Update]:
        """The open round's updates taken so far."""
        return self.machine.taken if self.machine is not None else {}


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


def check_moments(rec: AgentRecord) -> None:
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


def task_of(a: AgentRecord) -> tuple[str, int, int]:
    """The task an agent's data is from: its env (or '' when it named none) and dimensions."""
    return (a.env_id or "", a.obs_dim, a.act_dim)


def env_mismatch(env_name: str, agent_envs: set[str], obs_dim: int, act_dim: int) -> str:
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



def encode_version(run: Run, version: int, state: dict[str, torch.Tensor]) -> Encoded:
    """A global version as sent and as stored: the same bytes, its provenance in the header."""
    meta = {"run_id": run.run_id, "version": str(version), "algo": run.cfg.algo,
            "env_id": run.env_id, "hparams": run.hparams}
    # A version too large to go inline in tasks is fetched as chunk messages: they are built
    # here, each chunk hashed in its message (one pass over the average, not two).
    fetched = sum(t.nbytes for t in state.values()) > INLINE_MAX_BYTES
    return encode(state, run.run_id, version, version, metadata=meta, frame=chunk_frame if fetched else None)



# Runs an aggregator holds at once unless told otherwise (--max-runs): each keeps its current and
# previous versions in memory, and its agents train their rounds in turn.
MAX_RUNS = 8


# Runs that ended kept in memory besides the active ones (the newest): their status, their watchers'
# last events and their evaluations. Older ones are read from the state directory.
ENDED_KEPT = 4


class Shared:
    """What every part of the aggregator reads and none owns alone: the one lock (re-entrant) and
    its condition, the runs held (by id, in the order they started), and whether the aggregator is
    closing. The coordinator makes it and hands it to each part."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.runs: dict[str, Run] = {}
        self.closed = False
        self.on_forget: Callable[[str], None] = lambda run_id: None  # a run no longer held (its metrics go)

    @property
    def run(self) -> Run | None:
        """The newest run held (None before the first)."""
        return next(reversed(self.runs.values()), None)

    def active(self) -> list[Run]:
        """The runs waiting for agents or running, oldest first."""
        return [r for r in self.runs.values() if r.state in ACTIVE]

    def add(self, run: Run) -> None:
        """Hold ``run`` as the newest, forgetting the oldest ended runs past ``ENDED_KEPT``."""
        self.runs[run.run_id] = run
        ended = [r for r in self.runs.values() if r.state not in ACTIVE]
        for r in ended[: max(0, len(ended) - ENDED_KEPT)]:
            del self.runs[r.run_id]
            self.on_forget(r.run_id)

    def of_agent(self, agent_id: str) -> list[Run]:
        """The active runs ``agent_id`` takes part in, oldest first."""
        return [r for r in self.runs.values() if r.state in ACTIVE and agent_id in r.selected]
