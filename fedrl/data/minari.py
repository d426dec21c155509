"""Minari dataset directories (``<dir>/data/main_data.hdf5`` with ``episode_<id>`` groups).

Each episode group holds ``observations (L+1, O)`` (initial and final observation included),
``actions (L, A)``, ``rewards``, ``terminations`` and ``truncations`` ``(L,)``. Episodes are
flattened into D4RL rows with ``next_observations``; ``truncations`` become ``timeouts``.
Only Box observations are supported (dict observations are an error naming the episode).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import h5py
import numpy as np

from fedrl.data.d4rl import RawDataset, open_hdf5
from fedrl.data.errors import DatasetError

_EPISODE = re.compile(r"^episode_(\d+)$")


def is_minari_dir(path: str | Path) -> bool:
    return (Path(path) / "data" / "main_data.hdf5").is_file()


def load_minari(path: str | Path) -> RawDataset:
    """Read a local Minari dataset directory into D4RL-style rows."""
    root = Path(path)
    main = root / "data" / "main_data.hdf5"
    if not main.is_file():
        raise DatasetError(root, "not a Minari dataset directory (no data/main_data.hdf5)")
    f = open_hdf5(main)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in
                                          ("obs", "next_obs", "act", "rew", "term", "trunc")}
    metadata: dict = {"format": "minari"}
    with f:
        names = sorted((n for n in f if _EPISODE.match(n)), key=lambda n: int(_EPISODE.match(n)[1]))
        if not names:
            raise DatasetError(main, "no episode_<id> groups")
        for k in ("env_spec", "dataset_id"):
            if k in f.attrs:
                v = f.attrs[k]
                metadata[k] = v.decode() if isinstance(v, bytes) else str(v)
        for name in names:
            ep = f[name]
            where = f"{main} [{name}]"
            missing = [k for k in ("observations", "actions", "rewards", "terminations", "truncations")
                       if k not in ep]
            if missing:
                raise DatasetError(where, f"missing key(s) {', '.join(missing)}")
            if not isinstance(ep["observations"], h5py.Dataset):
                raise DatasetError(where, "dict/tuple observations are not supported (Box only)")
            obs = np.asarray(ep["observations"][()], np.float32)
            act = np.asarray(ep["actions"][()], np.float32)
            length = len(act)
            if len(obs) != length + 1:
                raise DatasetError(where, f"'observations' has {len(obs)} rows, expected "
                                          f"len(actions) + 1 = {length + 1}")
            for k in ("rewards", "terminations", "truncations"):
                if len(ep[k]) != length:
                    raise DatasetError(where, f"'{k}' has {len(ep[k])} rows but 'actions' has {length}")
            parts["obs"].append(obs[:-1])
            parts["next_obs"].append(obs[1:])
            parts["act"].append(act.reshape(length, -1))
            parts["rew"].append(np.asarray(ep["rewards"][()], np.float32).reshape(length))
            parts["term"].append(np.asarray(ep["terminations"][()], bool).reshape(length))
            trunc = np.asarray(ep["truncations"][()], bool).reshape(length).copy()
            # An episode that neither terminates nor truncates at its last step still ends there.
            if length and not (trunc[-1] or parts["term"][-1][-1]):
                trunc[-1] = True
            parts["trunc"].append(trunc)
    meta_file = root / "metadata.json"
    if meta_file.is_file():
        try:
            metadata.update({k: v for k, v in json.loads(meta_file.read_text()).items()
                             if isinstance(v, (str, int, float))})
        except ValueError:
            pass
    if "env_spec" in metadata:
        try:
            metadata["env_id"] = json.loads(metadata["env_spec"])["id"]
        except (ValueError, KeyError, TypeError):
            pass
    raw = RawDataset(
        observations=np.concatenate(parts["obs"]),
        actions=np.concatenate(parts["act"]),
        rewards=np.concatenate(parts["rew"]),
        terminals=np.concatenate(parts["term"]),
        timeouts=np.concatenate(parts["trunc"]),
        next_observations=np.concatenate(parts["next_obs"]),
        source=str(root),
        metadata=metadata,
    )
    raw.validate()
    return raw
