"""D4RL HDF5 files: read (with d4rl's own transition semantics), validate, write.

Format: top-level datasets ``observations (N, O)``, ``actions (N, A)``, ``rewards (N,)``,
``terminals (N,)``, ``timeouts (N,)`` and optionally ``next_observations (N, O)``; row ``i`` is
the step taken from ``observations[i]``. ``terminals`` marks a true episode end (no bootstrap),
``timeouts`` a time-limit cut (the episode ends, but the state is not terminal).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from fedrl.data.errors import DatasetError

REQUIRED_KEYS = ("observations", "actions", "rewards", "terminals")
# d4rl.qlearning_dataset falls back to the env's time limit when a file has no timeouts.
DEFAULT_MAX_EPISODE_STEPS = 1000


@dataclass
class RawDataset:
    """A dataset as rows in file order (the D4RL layout), before any transition filtering."""

    observations: np.ndarray  # (N, O) float32
    actions: np.ndarray  # (N, A) float32
    rewards: np.ndarray  # (N,) float32
    terminals: np.ndarray  # (N,) bool
    timeouts: np.ndarray  # (N,) bool
    next_observations: np.ndarray | None = None  # (N, O) float32
    source: str = "<memory>"
    metadata: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rewards)

    @property
    def obs_dim(self) -> int:
        return int(self.observations.shape[1])

    @property
    def act_dim(self) -> int:
        return int(self.actions.shape[1])

    def episode_ids(self) -> np.ndarray:
        """Episode index of every row; an episode ends at a terminal or timeout row."""
        ends = self.terminals | self.timeouts
        return np.concatenate([[0], np.cumsum(ends[:-1])]).astype(np.int64)

    def episode_returns(self) -> np.ndarray:
        """Undiscounted return of every episode (a trailing unfinished one included)."""
        ids = self.episode_ids()
        return np.bincount(ids, weights=self.rewards.astype(np.float64))

    def validate(self) -> None:
        """Shapes, lengths, finiteness and action range; raises :class:`DatasetError`."""
        _validate(self)


@dataclass
class Transitions:
    """``(s, a, r, s', done)`` tuples with the episode each came from."""

    obs: np.ndarray  # (T, O)
    actions: np.ndarray  # (T, A)
    rewards: np.ndarray  # (T,)
    next_obs: np.ndarray  # (T, O)
    dones: np.ndarray  # (T,) float32, 1 where the episode terminated
    episode: np.ndarray  # (T,) int64 episode index in the source file

    def __len__(self) -> int:
        return len(self.rewards)

    def returns_to_go(self, gamma: float) -> np.ndarray:
        """Each row's discounted return from its state on, along its episode as the rows give it
        (``G_t = r_t + gamma (1 - done_t) G_{t+1}``; an episode's last row here, cut by a timeout,
        counts nothing after it). The Cal-QL reference value (``DRPOConfig.cql_calibration``)."""
        g = np.zeros(len(self.rewards), np.float64)
        nxt = 0.0
        for t in range(len(self.rewards) - 1, -1, -1):
            same = t + 1 < len(self.rewards) and self.episode[t + 1] == self.episode[t]
            nxt = float(self.rewards[t]) + gamma * (1.0 - float(self.dones[t])) * (nxt if same else 0.0)
            g[t] = nxt
        return g

    def digest(self) -> str:
        """SHA-256 of the rows (every field's dtype, shape and bytes, in order): the same on any
        machine for the same data, so a run's record says exactly what it trained on."""
        h = hashlib.sha256()
        for f in _TRANSITION_FIELDS:
            a = np.ascontiguousarray(getattr(self, f))
            h.update(f"{f}:{a.dtype.str}:{a.shape};".encode())
            h.update(a.tobytes())
        return h.hexdigest()

    def select(self, mask_or_idx: np.ndarray) -> "Transitions":
        """Rows picked by a boolean mask or index array."""
        return Transitions(*(getattr(self, f)[mask_or_idx] for f in _TRANSITION_FIELDS))

    def of_episodes(self, episodes: np.ndarray) -> "Transitions":
        """The transitions of the given episode indices."""
        return self.select(np.isin(self.episode, episodes))


_TRANSITION_FIELDS = ("obs", "actions", "rewards", "next_obs", "dones", "episode")


def to_transitions(raw: RawDataset) -> Transitions:
    """Transitions with ``d4rl.qlearning_dataset``'s semantics.

    - ``done`` is the ``terminals`` flag only: a timeout is not a terminal state.
    - Rows flagged ``timeouts`` are dropped, as d4rl does: without ``next_observations`` their
      successor row belongs to the next episode, so ``s'`` is unknown.
    - ``s'`` is ``next_observations[i]`` when the file has it, else ``observations[i+1]``.
    - The final row is dropped (d4rl never emits it) unless ``next_observations`` gives its
      successor.
    """
    n = len(raw)
    keep = ~raw.timeouts
    if raw.next_observations is not None:
        next_obs = raw.next_observations
    else:
        next_obs = np.concatenate([raw.observations[1:], raw.observations[-1:]], axis=0)
        keep = keep.copy()
        keep[n - 1] = False
    ids = raw.episode_ids()
    return Transitions(
        obs=raw.observations[keep],
        actions=raw.actions[keep],
        rewards=raw.rewards[keep],
        next_obs=next_obs[keep],
        dones=raw.terminals[keep].astype(np.float32),
        episode=ids[keep],
    )


def trajectories(raw: RawDataset) -> list[dict[str, np.ndarray]]:
    """Whole episodes as dicts of row arrays (observations, actions, rewards, terminals, timeouts)."""
    ids = raw.episode_ids()
    cuts = np.flatnonzero(np.diff(ids)) + 1
    out = []
    for rows in np.split(np.arange(len(raw)), cuts):
        ep = {k: getattr(raw, k)[rows] for k in ("observations", "actions", "rewards", "terminals", "timeouts")}
        if raw.next_observations is not None:
            ep["next_observations"] = raw.next_observations[rows]
        out.append(ep)
    return out


def load_d4rl(path: str | Path, max_episode_steps: int = DEFAULT_MAX_EPISODE_STEPS) -> RawDataset:
    """Read and validate a D4RL-format HDF5 file; every problem names the file."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(path, "no such file")
    with open_hdf5(path) as f:
        missing = [k for k in REQUIRED_KEYS if k not in f]
        if missing:
            raise DatasetError(
                path,
                f"missing dataset key(s) {', '.join(missing)}; a D4RL file has "
                "observations, actions, rewards, terminals, timeouts (next_observations optional)",
            )
        try:
            arrays = {k: f[k][()] for k in (*REQUIRED_KEYS, "timeouts", "next_observations") if k in f}
        except (OSError, KeyError, TypeError) as e:
            raise DatasetError(path, f"unreadable dataset ({e}); the file may be truncated") from None
        metadata = _read_metadata(f)
    for k in ("rewards", "terminals", "timeouts"):
        if k in arrays and arrays[k].ndim == 2 and arrays[k].shape[1] == 1:
            arrays[k] = arrays[k][:, 0]
    if "timeouts" in arrays:
        timeouts = arrays["timeouts"]
    else:
        timeouts = _timeouts_from_time_limit(np.asarray(arrays["terminals"], bool), max_episode_steps)
    raw = RawDataset(
        observations=_as(arrays["observations"], np.float32),
        actions=_as(arrays["actions"], np.float32),
        rewards=_as(arrays["rewards"], np.float32),
        terminals=np.asarray(arrays["terminals"]).astype(bool),
        timeouts=np.asarray(timeouts).astype(bool),
        next_observations=_as(arrays["next_observations"], np.float32) if "next_observations" in arrays else None,
        source=str(path),
        metadata=metadata,
    )
    raw.validate()
    return raw


def open_hdf5(path: Path) -> h5py.File:
    """Open an HDF5 file read-only; a file that is not HDF5 (or is truncated) names itself."""
    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise DatasetError(path, f"not a readable HDF5 file ({e})") from None


def write_d4rl(path: str | Path, raw: RawDataset, metadata: dict[str, Any] | None = None) -> Path:
    """Write ``raw`` as a D4RL-format HDF5 file, atomically (temp file, then rename).

    Metadata is stored as root attributes (strings; non-strings as JSON)."""
    raw.validate()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("observations", data=raw.observations, compression="gzip")
            f.create_dataset("actions", data=raw.actions, compression="gzip")
            f.create_dataset("rewards", data=raw.rewards)
            f.create_dataset("terminals", data=raw.terminals)
            f.create_dataset("timeouts", data=raw.timeouts)
            if raw.next_observations is not None:
                f.create_dataset("next_observations", data=raw.next_observations, compression="gzip")
            for k, v in {**raw.metadata, **(metadata or {})}.items():
                f.attrs[k] = v if isinstance(v, str) else json.dumps(v)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_env_dims(raw: RawDataset, obs_dim: int, act_dim: int, env_name: str) -> None:
    """Raise if the dataset's observation/action widths do not match the environment's."""
    if raw.act_dim != act_dim:
        raise DatasetError(raw.source, f"actions have {raw.act_dim} dims but {env_name} expects {act_dim}")
    if raw.obs_dim != obs_dim:
        raise DatasetError(raw.source, f"observations have {raw.obs_dim} dims but {env_name} expects {obs_dim}")


def _validate(raw: RawDataset) -> None:
    src = raw.source
    if raw.observations.ndim != 2:
        raise DatasetError(src, f"'observations' must be 2-D (N, obs_dim), got shape {raw.observations.shape}")
    if raw.actions.ndim != 2:
        raise DatasetError(src, f"'actions' must be 2-D (N, act_dim), got shape {raw.actions.shape}")
    n = len(raw.observations)
    if n == 0:
        raise DatasetError(src, "the dataset has no rows")
    named = {"actions": raw.actions, "rewards": raw.rewards, "terminals": raw.terminals, "timeouts": raw.timeouts}
    if raw.next_observations is not None:
        named["next_observations"] = raw.next_observations
        if raw.next_observations.shape != raw.observations.shape:
            raise DatasetError(src, f"'next_observations' has shape {raw.next_observations.shape} "
                                    f"but 'observations' has {raw.observations.shape}")
    for k, v in named.items():
        if len(v) != n:
            raise DatasetError(src, f"'{k}' has {len(v)} rows but 'observations' has {n}")
    for k in ("rewards", "terminals", "timeouts"):
        if getattr(raw, k).ndim != 1:
            raise DatasetError(src, f"'{k}' must be 1-D (N,), got shape {getattr(raw, k).shape}")
    for k in ("observations", "actions", "rewards", "next_observations"):
        v = getattr(raw, k)
        if v is None:
            continue
        bad = ~np.isfinite(v)
        if bad.any():
            row = int(np.argwhere(bad)[0][0])
            raise DatasetError(src, f"'{k}' contains {int(bad.sum())} NaN/Inf value(s), first at row {row}")
    amax = float(np.abs(raw.actions).max())
    if amax > 1.0 + 1e-4:
        raise DatasetError(src, f"actions must lie in [-1, 1] (tanh-squashed policies), found |a| = {amax:.4g}")


def _timeouts_from_time_limit(terminals: np.ndarray, max_steps: int) -> np.ndarray:
    # d4rl: final_timestep = (episode_step == max_episode_steps - 1) when a file has no timeouts.
    out = np.zeros_like(terminals, dtype=bool)
    step = 0
    for i, t in enumerate(terminals):
        if step == max_steps - 1 and not t:
            out[i] = True
        if t or out[i]:
            step = 0
        else:
            step += 1
    return out


def _read_metadata(f: h5py.File) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in f.attrs.items():
        if isinstance(v, bytes):
            v = v.decode()
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                pass
        elif isinstance(v, np.generic):
            v = v.item()
        elif isinstance(v, np.ndarray):
            v = v.tolist()
        out[k] = v
    return out


def _as(a: np.ndarray, dtype: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a), dtype=dtype)
