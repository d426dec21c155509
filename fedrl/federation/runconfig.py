"""The configuration of a service-run federation, parsed from JSON with errors that name the field.

Sent by ``fedrl ctl start`` / ``fedrl up`` to the aggregator's Control service, which refuses
anything that does not validate (INVALID_ARGUMENT) before a run starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from fedrl.algos import BCConfig, DRPOConfig
from fedrl.algos.config import config_to_dict
from fedrl.federation.options import FederationOptions

SERVICE_ALGOS = ("drpo", "fed-cql", "fed-bc")


class ConfigError(ValueError):
    """A run configuration that does not validate; the message names the field."""


@dataclass(frozen=True)
class RunConfig(FederationOptions):
    """One federated run driven by the aggregator: the options it shares with ``fedrl simulate``
    (:class:`FederationOptions`; ``agents`` are the agents the run waits for before round 1) and
    the service's own. The independent ``cql`` baseline has no server: use simulate."""

    min_agents: int = 0
    """Quorum: at its deadline a round closes if at least this many submitted (0 = all agents)."""
    round_timeout: float = 600.0
    """Seconds after which a round closes with the quorum."""
    join_timeout: float = 600.0
    """Seconds to wait for ``agents`` agents to join before the run fails."""

    algos: ClassVar[tuple[str, ...]] = SERVICE_ALGOS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_agents < 0:
            raise ValueError(f"min_agents: must be >= 0, got {self.min_agents}")
        if self.min_agents > self.agents:
            raise ValueError(f"min_agents: {self.min_agents} exceeds agents ({self.agents})")
        for k in ("round_timeout", "join_timeout"):
            if not getattr(self, k) > 0:
                raise ValueError(f"{k}: must be > 0 seconds, got {getattr(self, k)}")
        if self.secagg_threshold > self.agents:
            raise ValueError(f"secagg_threshold: {self.secagg_threshold} exceeds agents ({self.agents})")
        if self.secagg_threshold and self.agents > SECAGG_MAX_AGENTS:
            raise ValueError(f"agents: a secure run (secagg_threshold) takes at most {SECAGG_MAX_AGENTS} agents, got "
                             f"{self.agents}: its round holds each agent's masked vector (up to 8 MiB) and n^2 "
                             "sealed shares at the aggregator")
        hp = self.bc if self.algo == "fed-bc" else self.drpo  # the learner's settings (CQL: DRPO's, lambdas 0)
        if problem := check_step_bytes(hp, 1, 1):  # on the smallest task there is: one observation, one action
            raise ValueError(f"{'drpo' if hasattr(hp, 'cql_n_actions') else 'bc'}: {problem}")

    def to_json(self) -> str:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["drpo"], d["bc"] = config_to_dict(self.drpo), config_to_dict(self.bc)
        return json.dumps(d, sort_keys=True)


# A secure round holds, at the aggregator, every agent's masked vector (8 bytes a value: at most
# the 8 MiB message limit) and n^2 sealed shares of 60 bytes: with 100 agents at most 800 MiB and
# 0.6 MB, and unmasking expands about n ChaCha20 masks of the model's size.
SECAGG_MAX_AGENTS = 100

# Upper bounds a service enforces, so one run config cannot make the aggregator or an agent
# allocate without limit (a 10^9-wide layer, 10^12 agents) or wait for ever.
LIMITS = {"agents": 10_000, "min_agents": 10_000, "rounds": 1_000_000, "local_steps": 10_000_000,
          "eval_episodes": 1_000, "seed": 2**63 - 1, "round_timeout": 7 * 86400.0,
          "join_timeout": 7 * 86400.0}
SUB_LIMITS = {"batch_size": 65_536, "cql_n_actions": 1_024, "global_samples": 1_024}
# What an agent may declare when it joins (its shard): an index below the most agents a run may
# have, dimensions no MuJoCo task comes near, a sample count no dataset does.
JOIN_LIMITS = {"index": LIMITS["agents"] - 1, "obs_dim": 10_000, "act_dim": 1_000, "num_samples": 10**9}
# ... and the characters of its text fields: a gymnasium id is a few dozen, a device name a few.
JOIN_TEXT_LIMITS = {"env_id": 200, "device": 64}
# The longest reason an evaluation report may give for a version it could not evaluate.
NOT_EVALUATED_CHARS = 1000
MAX_WIDTH, MAX_DEPTH = 4096, 8
# The largest global model a run may make (its version 0: the policy, and the critics when they
# are federated), checked before it is built. 64 MiB holds the benchmarks' 30 MB model with
# room; the width and depth limits alone allowed 635 MiB (36 s and 1.5 GiB to build).
MAX_MODEL_BYTES = 64 << 20


def model_bytes(hidden, obs_dim: int, act_dim: int, federate_critic: bool) -> int:
    """Bytes (float32) of a run's global model: the tanh-Gaussian policy and, when federated, the
    twin critic and its target (each ``E=2`` members)."""
    def mlp(i: int, out: int) -> int:
        dims = [i, *hidden, out]
        return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))

    n = mlp(obs_dim, 2 * act_dim) + 2 * obs_dim  # + the normaliser's mean and std
    if federate_critic:
        n += 2 * 2 * mlp(obs_dim + act_dim, 1)
    return 4 * n

# The most memory one local step may need (an estimate, :func:`step_bytes`): a run whose first
# step no agent could allocate is refused, instead of its agents failing and the run waiting for
# ever. 32 GiB leaves the paper's sizes (~0.1 GiB a step) 300 times room.
MAX_STEP_BYTES = 32 << 30


def step_bytes(hp, obs_dim: int, act_dim: int) -> int:
    """An estimate of one local step's memory (float32): the activations of every network
    evaluation the step backpropagates through, their gradients and one temporary (x3). DRPO's
    and CQL's is dominated by the twin critic over B x (1 + 3N) state-action rows; BC's by the
    policy over B states."""
    width = sum(hp.hidden)
    if hasattr(hp, "cql_n_actions"):
        rows = hp.batch_size * (1 + 3 * hp.cql_n_actions) * 2 + hp.batch_size * 2  # critics; the TD target's
        floats = rows * (obs_dim + act_dim + width + 1) + hp.batch_size * (1 + hp.global_samples) * (obs_dim + width + 2 * act_dim)
    else:
        floats = hp.batch_size * (obs_dim + width + 2 * act_dim)
    return 4 * 3 * floats


def check_step_bytes(hp, obs_dim: int, act_dim: int) -> str:
    """Why a local step of ``hp`` on these dimensions is too large to run ('' when it is not)."""
    need = step_bytes(hp, obs_dim, act_dim)
    if need <= MAX_STEP_BYTES:
        return ""
    what = f"batch_size {hp.batch_size}" + (f" x (1 + 3 x cql_n_actions {hp.cql_n_actions}) critic rows"
                                             if hasattr(hp, "cql_n_actions") else "")
    return (f"one local step would need about {need / 2**30:,.0f} GiB ({what}, hidden {list(hp.hidden)}); "
            f"a run's step may need at most {MAX_STEP_BYTES >> 30} GiB")


_INTS = ("agents", "min_agents", "rounds", "local_steps", "seed", "eval_episodes", "secagg_threshold")
_FLOATS = ("round_timeout", "join_timeout", "trim_fraction", "dp_clip", "dp_noise", "dp_delta", "dp_epsilon_budget",
           "dp_clip_quantile", "dp_clip_lr", "dp_count_noise")
_STRINGS = ("algo", "obs_norm", "weighting", "aggregation", "federate")


def _sub_config(cls, value: Any, name: str):
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: expected an object, got {type(value).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ConfigError(f"{name}: unknown field(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    kw = {}
    defaults = cls()
    for k, v in value.items():
        if k == "hidden" and isinstance(v, list) and (len(v) > MAX_DEPTH or any(
                isinstance(x, int) and not isinstance(x, bool) and x > MAX_WIDTH for x in v)):
            raise ConfigError(f"{name}.hidden: at most {MAX_DEPTH} layers of at most {MAX_WIDTH} units, got {v!r}")
        if k in SUB_LIMITS and isinstance(v, int | float) and not isinstance(v, bool) and v > SUB_LIMITS[k]:
            raise ConfigError(f"{name}.{k}: at most {SUB_LIMITS[k]}, got {v!r}")
        d = getattr(defaults, k)
        if isinstance(d, bool):
            if not isinstance(v, bool):
                raise ConfigError(f"{name}.{k}: expected true/false, got {v!r}")
        elif isinstance(d, tuple):
            if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise ConfigError(f"{name}.{k}: expected a list of integers, got {v!r}")
            v = tuple(v)
        elif isinstance(d, int | float) and d is not None and not isinstance(d, str):
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                what = "an integer" if isinstance(d, int) else "a finite number"  # the words parse_run_config uses
                raise ConfigError(f"{name}.{k}: expected {what}, got {v!r}")
            if isinstance(d, int) and not float(v).is_integer():
                raise ConfigError(f"{name}.{k}: expected an integer, got {v!r}")
            v = type(d)(v)
        elif isinstance(d, str) and not isinstance(v, str):
            raise ConfigError(f"{name}.{k}: expected a string, got {v!r}")
        kw[k] = v
    try:
        return cls(**kw)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{name}: {e}") from None


def parse_run_config(text: str | bytes | dict) -> RunConfig:
    """A :class:`RunConfig` from JSON (or a dict); raises :class:`ConfigError` naming the problem."""
    if isinstance(text, dict):
        data = text
    else:
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError, TypeError) as e:  # ValueError: bad JSON, or a 4,300+ digit integer
            raise ConfigError(f"run config is not valid JSON: {e}") from None
        except RecursionError:
            raise ConfigError("run config is not valid JSON: it nests too deeply") from None
    if not isinstance(data, dict):
        raise ConfigError(f"run config must be a JSON object, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown field(s) {', '.join(map(str, unknown))}; known: {', '.join(sorted(known))}")
    kw: dict[str, Any] = {}
    for k, v in data.items():
        if k in _INTS:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{k}: expected an integer, got {v!r}")
        elif k in _FLOATS:
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ConfigError(f"{k}: expected a finite number, got {v!r}")
            v = float(v)
        elif k in _STRINGS:  # which strings are allowed: RunConfig's own check
            if not isinstance(v, str):
                raise ConfigError(f"{k}: expected a string, got {v!r}")
        elif k == "env":
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"env: expected a string, got {v!r}")
        elif k == "drpo":
            v = _sub_config(DRPOConfig, v, "drpo")
        elif k == "bc":
            v = _sub_config(BCConfig, v, "bc")
        kw[k] = v
    try:
        cfg = RunConfig(**kw)
    except (ValueError, ArithmeticError) as e:  # a field out of range (or one the arithmetic cannot take)
        raise ConfigError(str(e)) from None
    for k, top in LIMITS.items():
        if getattr(cfg, k) > top:
            raise ConfigError(f"{k}: at most {top}, got {getattr(cfg, k)}")
    if cfg.env is not None:
        from fedrl.envs import env_info
        try:
            env_info(cfg.env)
        except ValueError as e:
            raise ConfigError(f"env: {e}") from None
    return cfg
