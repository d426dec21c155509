"""Shared fixtures: tiny datasets the tests write themselves, an isolated cache."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from fedrl.data.d4rl import RawDataset, write_d4rl
from fedrl.data.make import rollout_dataset


def pytest_configure(config):
    """Each pytest-xdist worker's torch takes its share of the cores, not every core: torch's
    default (one thread per core in every process) put 4 threads on 2 cores under ``-n auto`` and
    made four learning-check modules run alone 2.9x slower (217 s against 74 s; the same
    rule as the services' ``--threads 0``, :data:`fedrl.common.threads.THREADS_RULE`). Processes
    a test starts inherit it through ``OMP_NUM_THREADS``."""
    import os

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        import torch

        n = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(n)
        os.environ.setdefault("OMP_NUM_THREADS", str(n))


def pytest_collection_modifyitems(config, items):
    """The slow checks (marked ``slow``) first, in their order: under pytest-xdist the longest
    start first and the many short ones fill the workers around them, so that no worker is left
    with a long check at the end while the others idle (``--no-loadscope-reorder`` keeps this
    order: by default xdist sends the modules with the most tests first, which left the image's
    five at the end, alone on one worker for five minutes)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def float64():
    """torch's default float type float64 for one test (equality checks at float64 rounding)."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Never touch the user's ~/.cache/fedrl or ~/.d4rl from a test."""
    root = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("FEDRL_CACHE_DIR", str(root / "fedrl"))
    monkeypatch.setenv("D4RL_DATASET_DIR", str(root / "d4rl"))


def once_per_session(tmp_path_factory, name: str, make):
    """``make(folder)``'s result (a path), made once per test session: under pytest-xdist, by the
    first worker that asks, the others waiting on a file lock and reading its path. ``folder``
    is new and empty."""
    import fcntl
    import os

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent / "once"  # the session's, shared by its workers
    root.mkdir(exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        made = root / f"{name}.path"
        if not made.exists():
            folder = root / name
            folder.mkdir()
            made.write_text(str(make(folder)))
        return Path(made.read_text())


@pytest.fixture(scope="session")
def _named_once(tmp_path_factory):
    """Named datasets (``hopper-medium-v2``) made by the registry, as a user's first use makes
    them, once per session: making one takes ~25 s, and every test has its own empty cache."""
    from fedrl.data.registry import resolve

    def make(name: str, root: Path) -> Path:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FEDRL_CACHE_DIR", str(root / "fedrl"))
            mp.setenv("D4RL_DATASET_DIR", str(root / "d4rl"))
            return resolve(name, progress=lambda message: None)

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = once_per_session(tmp_path_factory, f"named-{name}", lambda root: make(name, root))
        return made[name]

    return get


@pytest.fixture
def hopper_medium(_named_once, _isolated_cache) -> Path:
    """``hopper-medium-v2`` as the registry makes it, copied into this test's own cache (a copy: a
    test that writes there changes no other test's data)."""
    import shutil

    from fedrl.data.registry import cache_dir

    out = cache_dir() / "datasets" / "hopper-medium-v2.hdf5"
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_named_once("hopper-medium-v2"), out)
    return out


def stand_policy(obs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A PD controller holding Hopper's joints at zero: ~1 reward per step, rarely falls."""
    return np.clip(-2.0 * obs[2:5] - 0.2 * obs[8:11], -1.0, 1.0).astype(np.float32)


@pytest.fixture(scope="session")
def stand_dataset(tmp_path_factory) -> Path:
    """Hopper-v5 rollouts of :func:`stand_policy`, 200-step episodes (D4RL format)."""
    raw = rollout_dataset("Hopper-v5", stand_policy, transitions=2000, seed=1, max_episode_steps=200)
    return write_d4rl(tmp_path_factory.mktemp("data") / "hopper-stand.hdf5", raw,
                      {"env_id": "Hopper-v5", "quality": "stand-pd"})


@pytest.fixture(scope="session")
def dart_stand_dataset(tmp_path_factory) -> Path:
    """Hopper-v5 rollouts of :func:`stand_policy` with Gaussian noise (sigma 0.3) on the actions
    executed, each row labelled with the controller's clean action (DART, Laskey et al. 2017).

    The data then covers the states a slightly wrong imitator drifts into, so BC on a few
    trajectories learns to stand whatever the seed or thread count. BC on the noise-free
    :func:`stand_dataset` stood up for 1 of 3 seeds (measured): the test it fed was luck.
    """
    rng = np.random.default_rng(5)

    def noisy(obs, r):
        return np.clip(stand_policy(obs, r) + 0.3 * rng.standard_normal(3), -1.0, 1.0).astype(np.float32)

    raw = rollout_dataset("Hopper-v5", noisy, transitions=2000, seed=1, max_episode_steps=200)
    raw = dataclasses.replace(raw, actions=np.stack([stand_policy(o, rng) for o in raw.observations]))
    return write_d4rl(tmp_path_factory.mktemp("data") / "hopper-stand-dart.hdf5", raw,
                      {"env_id": "Hopper-v5", "quality": "stand-pd-dart"})


@pytest.fixture(scope="session")
def random_dataset(tmp_path_factory) -> Path:
    """Hopper-v5 uniform-action rollouts: many short episodes."""
    rng = np.random.default_rng(0)
    raw = rollout_dataset("Hopper-v5", lambda o, r: rng.uniform(-1, 1, 3).astype(np.float32),
                          transitions=3000, seed=2)
    return write_d4rl(tmp_path_factory.mktemp("data") / "hopper-rand.hdf5", raw, {"env_id": "Hopper-v5"})


def tiny_raw(next_obs: bool = False) -> RawDataset:
    """Seven rows, three episodes: ends by terminal (row 2), timeout (row 4), file end (row 6)."""
    obs = np.arange(7, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    return RawDataset(
        observations=obs,
        actions=np.full((7, 1), 0.5, np.float32),
        rewards=np.arange(7, dtype=np.float32) * 10,
        terminals=np.array([0, 0, 1, 0, 0, 0, 0], bool),
        timeouts=np.array([0, 0, 0, 0, 1, 0, 0], bool),
        next_observations=(obs + 100) if next_obs else None,
    )


TOOL_PACKAGES = {"promtool": "prometheus", "prometheus": "prometheus", "buildah": "buildah",
                 "debootstrap": "debootstrap"}


def require_tool(name: str) -> str:
    """The path of an external tool a test needs. Missing: skipped on a developer's machine,
    a failure where ``FEDRL_REQUIRE_TOOLS=1`` (CI, whose ``.ci/run`` installs them)."""
    import os
    import shutil

    path = shutil.which(name)
    if path is None:
        how = f"Debian: apt-get install {TOOL_PACKAGES[name]}" if name in TOOL_PACKAGES else "see its project's install guide"
        msg = f"{name} is not installed ({how})"
        if os.environ.get("FEDRL_REQUIRE_TOOLS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return path
