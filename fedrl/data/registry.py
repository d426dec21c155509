"""Datasets by path or by the names D4RL users know (``hopper-random-v2``, ...).

A name resolves, in order, to d4rl's own download cache (``$D4RL_DATASET_DIR`` or
``~/.d4rl/datasets/<name>.hdf5``), then to this project's cache (``$FEDRL_CACHE_DIR`` or
``~/.cache/fedrl``)/datasets, where qualities the project can make are made on demand (from
the shipped behaviour checkpoints, :mod:`fedrl.behavior.shipped`) and kept.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path

from fedrl.data import QUALITIES
from fedrl.data.d4rl import RawDataset, load_d4rl
from fedrl.data.errors import DatasetError
from fedrl.data.minari import is_minari_dir, load_minari
from fedrl.envs import ENVS, EnvInfo, env_info

# Size of a named dataset made on demand. D4RL's files have 1M rows; 200k (~200 expert episodes,
# ~30 s to make) is far more than a federation of 10 agents x 5 trajectories samples from. A
# full-size file made with ``fedrl data make --transitions 1000000 --out <cache>/<name>.hdf5``
# is picked up instead. medium-replay is always its replay buffer's size.
NAMED_TRANSITIONS = 200_000
_NAME = re.compile(r"^(?P<env>[a-z0-9]+)-(?P<quality>[a-z-]+?)-v(?P<version>\d+)$")


def cache_dir() -> Path:
    return Path(os.environ.get("FEDRL_CACHE_DIR", Path.home() / ".cache" / "fedrl"))


def d4rl_dir() -> Path:
    return Path(os.environ.get("D4RL_DATASET_DIR", Path.home() / ".d4rl" / "datasets"))


def is_dataset_name(spec: str) -> bool:
    return bool(_NAME.match(spec)) and not Path(spec).exists()


def resolve(spec: str, progress=print) -> Path:
    """A dataset path for ``spec``: an existing file/directory, or a name (made if possible)."""
    p = Path(spec).expanduser()
    if p.exists():
        return p
    m = _NAME.match(spec)
    if not m:
        raise DatasetError(spec, "no such file or directory, and not a dataset name like "
                                 "'hopper-medium-v2'")
    if m["env"] not in ENVS:
        raise DatasetError(spec, f"unknown environment {m['env']!r}; known: {', '.join(ENVS)}")
    if m["quality"] not in QUALITIES:
        raise DatasetError(spec, f"unknown quality {m['quality']!r}; known: {', '.join(QUALITIES)}")
    for cand in (d4rl_dir() / f"{spec}.hdf5", cache_dir() / "datasets" / f"{spec}.hdf5"):
        if cand.is_file():
            return cand
    made = makeable(m["env"])
    if m["quality"] in made:
        from fedrl.data.make import make_dataset

        out = cache_dir() / "datasets" / f"{spec}.hdf5"
        waiting = f"waiting for another process making a dataset in {out.parent}"
        with _cache_locked(out.parent, lambda: progress(waiting)):
            if out.is_file():  # made by another process while this one waited
                return out
            progress(f"making {spec} in {ENVS[m['env']].gym_id} "
                     f"(once, ~30 s) -> {out}")
            return make_dataset(m["env"], m["quality"], seed=0, out=out,
                                transitions=None if m["quality"] == "medium-replay" else NAMED_TRANSITIONS)
    raise DatasetError(
        spec,
        f"not found in {d4rl_dir()} or {cache_dir() / 'datasets'}; for {m['env']} this project can "
        f"make only {', '.join(made)}. Put D4RL's file there or pass a path.",
    )


@contextmanager
def _cache_locked(folder: Path, on_wait):
    """Hold an exclusive lock on the cache folder ``folder`` (released however this process
    leaves): processes started together (agents by hand, ``--jobs``) that all ask for one missing
    dataset make it once, not once each. ``on_wait()`` is called when another holds it."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: each asker makes it (the write is atomic)
            pass
        yield
    finally:
        os.close(fd)


def check_one_env(specs: list[str] | tuple[str, ...]) -> None:
    """Refuse dataset names of different environments before any is loaded or made (a mix is
    an error either way; found here it costs no data making). Paths are checked on loading."""
    named = [(s, ENVS[m["env"]]) for s in specs
             if is_dataset_name(s) and (m := _NAME.match(s)) and m["env"] in ENVS]
    for spec, env in named[1:]:
        if env.key != named[0][1].key:
            raise DatasetError(spec, f"datasets mix environments: {named[0][0]} is {named[0][1].gym_id}, "
                                     f"{spec} is {env.gym_id}; a federation trains one task")


def makeable(env_key: str) -> tuple[str, ...]:
    """Qualities this installation can make for ``env_key`` (random always; the others need a
    shipped behaviour set, expert-based ones an expert checkpoint in it)."""
    from fedrl.behavior.shipped import behavior_set, shipped_envs

    if env_key not in shipped_envs():
        return ("random",)
    if behavior_set(env_key).manifest.get("expert") is None:
        return ("random", "medium", "medium-replay")
    return QUALITIES


def load(spec: str, progress=print) -> RawDataset:
    """Load a D4RL HDF5 file, a Minari directory, or a named dataset."""
    path = resolve(spec, progress)
    raw = load_minari(path) if path.is_dir() and is_minari_dir(path) else None
    if raw is None:
        if path.is_dir():
            raise DatasetError(path, "a directory, but not a Minari dataset (no data/main_data.hdf5)")
        raw = load_d4rl(path)
    if is_dataset_name(spec):
        raw.metadata.setdefault("dataset_name", spec)
    return raw


def infer_env(raw: RawDataset, spec: str, explicit: str | None = None) -> EnvInfo:
    """The environment of a dataset: ``--env``, else its metadata, else its file name."""
    for cand in (explicit, raw.metadata.get("env_id"), raw.metadata.get("dataset_name"),
                 Path(spec).stem):
        if cand:
            try:
                return env_info(str(cand))
            except ValueError:
                if cand is explicit:
                    raise
    raise DatasetError(raw.source, "cannot tell which environment this dataset is for; pass --env")
