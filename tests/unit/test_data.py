"""D4RL/Minari loading semantics, writing, validation errors, shards, normalisation."""

import time

import h5py
import numpy as np
import pytest

from fedrl.data.d4rl import RawDataset, load_d4rl, to_transitions, trajectories, write_d4rl
from fedrl.data.errors import DatasetError
from fedrl.data.minari import load_minari
from fedrl.data.normalize import ObsStats, agent_normalizers
from fedrl.data.partition import ShardSource, partition
from fedrl.data.registry import check_one_env, infer_env, load, resolve
from tests.conftest import tiny_raw


def write_h5(path, **arrays):
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f.create_dataset(k, data=v)
    return path


def raw_arrays(raw: RawDataset):
    d = {k: getattr(raw, k) for k in ("observations", "actions", "rewards", "terminals", "timeouts")}
    if raw.next_observations is not None:
        d["next_observations"] = raw.next_observations
    return d


def test_transitions_follow_qlearning_dataset_semantics(tmp_path):
    raw = load_d4rl(write_h5(tmp_path / "t.hdf5", **raw_arrays(tiny_raw())))
    tr = to_transitions(raw)
    # rows 4 (timeout) and 6 (last row, successor unknown) are dropped
    assert tr.obs[:, 0].tolist() == [0, 1, 2, 3, 5]
    # s' = the next row's observation
    assert tr.next_obs[:, 0].tolist() == [1, 2, 3, 4, 6]
    # done only on the terminal (row 2), never on the timeout
    assert tr.dones.tolist() == [0, 0, 1, 0, 0]
    assert tr.rewards.tolist() == [0, 10, 20, 30, 50]
    assert tr.episode.tolist() == [0, 0, 0, 1, 2]


def test_next_observations_are_used_when_present(tmp_path):
    raw = load_d4rl(write_h5(tmp_path / "t.hdf5", **raw_arrays(tiny_raw(next_obs=True))))
    tr = to_transitions(raw)
    assert tr.obs[:, 0].tolist() == [0, 1, 2, 3, 5, 6]  # last row kept: its successor is known
    assert tr.next_obs[:, 0].tolist() == [100, 101, 102, 103, 105, 106]


def test_missing_timeouts_fall_back_to_time_limit(tmp_path):
    a = raw_arrays(tiny_raw())
    del a["timeouts"]
    a["terminals"] = np.zeros(7, bool)
    raw = load_d4rl(write_h5(tmp_path / "t.hdf5", **a), max_episode_steps=3)
    assert raw.timeouts.tolist() == [0, 0, 1, 0, 0, 1, 0]


def test_trajectories_and_returns():
    raw = tiny_raw()
    eps = trajectories(raw)
    assert [len(e["rewards"]) for e in eps] == [3, 2, 2]
    assert raw.episode_returns().tolist() == [30, 70, 110]


def test_write_read_round_trip_with_metadata(tmp_path):
    raw = tiny_raw(next_obs=True)
    p = write_d4rl(tmp_path / "sub" / "x.hdf5", raw, {"env_id": "Hopper-v5", "seed": 3, "returns": [1.5]})
    back = load_d4rl(p)
    for k, v in raw_arrays(raw).items():
        assert np.array_equal(getattr(back, k), v), k
    assert back.metadata == {"env_id": "Hopper-v5", "seed": 3, "returns": [1.5]}
    assert [q.name for q in p.parent.iterdir()] == ["x.hdf5"]  # no temp file left behind


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.pop("rewards"), "missing dataset key.*rewards"),
    (lambda a: a.__setitem__("actions", a["actions"][:-1]), "'actions' has 6 rows but 'observations' has 7"),
    (lambda a: a["observations"].__setitem__((3, 1), np.nan), "'observations' contains 1 NaN/Inf value.*row 3"),
    (lambda a: a["rewards"].__setitem__(5, np.inf), "'rewards' contains 1 NaN/Inf.*row 5"),
    (lambda a: a.__setitem__("actions", a["actions"] * 3), r"actions must lie in \[-1, 1\]"),
    (lambda a: a.__setitem__("observations", a["observations"][:, 0]), "'observations' must be 2-D"),
])
def test_bad_files_name_the_file_and_the_problem(tmp_path, mutate, message):
    a = {k: v.copy() for k, v in raw_arrays(tiny_raw()).items()}
    mutate(a)
    path = write_h5(tmp_path / "bad.hdf5", **a)
    with pytest.raises(DatasetError, match=message) as e:
        load_d4rl(path)
    assert str(path) in str(e.value)


def test_not_hdf5_and_missing_file(tmp_path):
    junk = tmp_path / "junk.hdf5"
    junk.write_bytes(b"not an hdf5 file at all")
    with pytest.raises(DatasetError, match="not a readable HDF5") as e:
        load_d4rl(junk)
    assert str(junk) in str(e.value)
    with pytest.raises(DatasetError, match="no such file"):
        load_d4rl(tmp_path / "nope.hdf5")


def test_wrong_dims_for_env(tmp_path, random_dataset):
    from fedrl.data.d4rl import check_env_dims
    raw = load_d4rl(random_dataset)
    with pytest.raises(DatasetError, match="observations have 11 dims but Walker2d-v5 expects 17"):
        check_env_dims(raw, 17, 3, "Walker2d-v5")


def make_minari(root, episodes):
    (root / "data").mkdir(parents=True)
    with h5py.File(root / "data" / "main_data.hdf5", "w") as f:
        f.attrs["env_spec"] = '{"id": "Hopper-v5"}'
        for i, (length, terminated) in enumerate(episodes):
            g = f.create_group(f"episode_{i}")
            g.create_dataset("observations", data=np.full((length + 1, 2), i, np.float32)
                             + np.arange(length + 1, dtype=np.float32)[:, None])
            g.create_dataset("actions", data=np.zeros((length, 1), np.float32))
            g.create_dataset("rewards", data=np.ones(length, np.float32))
            term = np.zeros(length, bool)
            trunc = np.zeros(length, bool)
            (term if terminated else trunc)[-1] = True
            g.create_dataset("terminations", data=term)
            g.create_dataset("truncations", data=trunc)
    return root


def test_minari_directory(tmp_path):
    root = make_minari(tmp_path / "hopper-test-v0", [(3, True), (2, False)])
    raw = load_minari(root)
    assert len(raw) == 5 and raw.metadata["env_id"] == "Hopper-v5"
    assert raw.terminals.tolist() == [0, 0, 1, 0, 0] and raw.timeouts.tolist() == [0, 0, 0, 0, 1]
    tr = to_transitions(raw)
    assert tr.next_obs[:, 0].tolist() == [1, 2, 3, 2]  # s' from the episode's own observations
    assert load(str(root)).source == str(root)
    assert infer_env(raw, str(root)).gym_id == "Hopper-v5"


def test_minari_bad_episode_is_named(tmp_path):
    root = make_minari(tmp_path / "m", [(3, True)])
    with h5py.File(root / "data" / "main_data.hdf5", "a") as f:
        del f["episode_0/rewards"]
    with pytest.raises(DatasetError, match=r"episode_0.*missing key\(s\) rewards"):
        load_minari(root)


def synthetic_transitions(n_episodes=20, length=4):
    raw = RawDataset(
        observations=np.random.default_rng(0).normal(size=(n_episodes * length, 3)).astype(np.float32),
        actions=np.zeros((n_episodes * length, 1), np.float32),
        rewards=np.zeros(n_episodes * length, np.float32),
        terminals=np.tile([0] * (length - 1) + [1], n_episodes).astype(bool),
        timeouts=np.zeros(n_episodes * length, bool),
    )
    return to_transitions(raw)


def test_shards_disjoint_whole_trajectories_seeded():
    tr = synthetic_transitions()
    shards = partition([ShardSource("f", tr, 4)], trajectories=3, seed=7)
    eps = [set(s.episodes) for s in shards]
    assert all(len(e) == 3 for e in eps)
    assert len(set().union(*eps)) == 12  # disjoint
    for s in shards:  # exactly the transitions of its episodes, whole
        assert set(s.transitions.episode.tolist()) == set(s.episodes)
        assert len(s.transitions) == sum((tr.episode == e).sum() for e in s.episodes)
    again = partition([ShardSource("f", tr, 4)], trajectories=3, seed=7)
    assert [s.episodes for s in again] == [s.episodes for s in shards]
    other = partition([ShardSource("f", tr, 4)], trajectories=3, seed=8)
    assert [s.episodes for s in other] != [s.episodes for s in shards]


def test_a_shards_digest_is_its_rows_and_nothing_else():
    """The record a run keeps: equal rows give one digest (a copy, another path), and any change to
    a value, a row's episode or a field's type gives another."""
    import dataclasses
    import hashlib

    tr = synthetic_transitions()
    shard = partition([ShardSource("/one/f.hdf5", tr, 2)], trajectories=3, seed=7)[0]
    rec = shard.record()
    copy = partition([ShardSource("/two/f.hdf5", tr.select(np.arange(len(tr))), 2)], trajectories=3, seed=7)[0]
    assert copy.record() == {**rec, "source": "/two/f.hdf5"}
    assert rec["transitions"] == len(shard.transitions) and rec["episodes"] == list(shard.episodes)
    t = shard.transitions
    h = hashlib.sha256()  # written out: every field's name, dtype and shape, then its bytes, in order
    for f in ("obs", "actions", "rewards", "next_obs", "dones", "episode"):
        a = np.ascontiguousarray(getattr(t, f))
        h.update(f"{f}:{a.dtype.str}:{a.shape};".encode() + a.tobytes())
    assert rec["sha256"] == h.hexdigest()
    for field, change in (("rewards", lambda a: np.where(np.arange(len(a)) == 3, a + 1, a).astype(a.dtype)),
                          ("next_obs", lambda a: np.where(np.arange(a.size).reshape(a.shape) == 0, a + 1, a)),
                          ("episode", lambda a: a[::-1].copy()), ("dones", lambda a: a.astype(np.float64))):
        changed = dataclasses.replace(t, **{field: change(getattr(t, field))})
        assert changed.digest() != t.digest(), field


def test_heterogeneous_mix_and_not_enough_episodes():
    expert, medium = synthetic_transitions(20), synthetic_transitions(10)
    shards = partition([ShardSource("expert", expert, 4), ShardSource("medium", medium, 1)], 5, seed=0)
    assert [s.source for s in shards] == ["expert"] * 4 + ["medium"]
    assert [s.agent for s in shards] == [0, 1, 2, 3, 4]
    with pytest.raises(DatasetError, match="5 agents x 5 trajectories need 25 episodes, the file has 20"):
        partition([ShardSource("expert", expert, 5)], 5, seed=0)


def test_shards_sized_by_transitions_take_whole_episodes_until_full():
    """--transitions: at least K episodes and at least T transitions, whole episodes, disjoint,
    seeded; an agent's shard does not depend on how many agents come after it."""
    tr = synthetic_transitions(n_episodes=40, length=4)  # 4 transitions an episode
    shards = partition([ShardSource("f", tr, 3)], trajectories=2, seed=1, transitions=10)
    for s in shards:
        assert len(s.episodes) == 3 and len(s.transitions) == 12  # 2 episodes = 8 < 10: a third
        assert set(s.transitions.episode.tolist()) == set(s.episodes)
    assert len(set().union(*(set(s.episodes) for s in shards))) == 9
    few = partition([ShardSource("f", tr, 3)], trajectories=5, seed=1, transitions=10)
    assert all(len(s.episodes) == 5 for s in few)  # the trajectory count is a floor too
    first_two = partition([ShardSource("f", tr, 2)], trajectories=2, seed=1, transitions=10)
    assert [s.episodes for s in first_two] == [s.episodes for s in shards[:2]]
    assert [s.episodes for s in partition([ShardSource("f", tr, 3)], 2, 1, transitions=10)] == \
        [s.episodes for s in shards]
    with pytest.raises(DatasetError, match="agent 3 ran out"):
        partition([ShardSource("f", tr, 4)], trajectories=2, seed=1, transitions=40)
    with pytest.raises(ValueError, match="transitions per agent must be >= 0"):
        partition([ShardSource("f", tr, 1)], trajectories=2, seed=1, transitions=-1)


def test_named_datasets_of_two_tasks_are_refused_before_any_is_made(tmp_path, monkeypatch):
    from fedrl.federation.simulate import load_shards

    monkeypatch.setenv("FEDRL_CACHE_DIR", str(tmp_path / "cache"))
    check_one_env(["hopper-medium-v2", "hopper-expert-v2", str(tmp_path / "any.hdf5")])  # one task: fine
    with pytest.raises(DatasetError, match="hopper-random-v2 is Hopper-v5, walker2d-random-v2 is Walker2d-v5"):
        load_shards(["hopper-random-v2:1", "walker2d-random-v2:1"], 1, 1, 0, None, print)
    assert not (tmp_path / "cache").exists()


def test_normalisation_modes():
    rng = np.random.default_rng(0)
    a, b = rng.normal(1, 2, (50, 3)), rng.normal(-1, 1, (30, 3))
    pooled = agent_normalizers("pooled", [a, b])
    both = np.concatenate([a, b])
    assert np.allclose(pooled[0][0], both.mean(0), atol=1e-5) and np.allclose(pooled[1][1], both.std(0), atol=1e-5)
    local = agent_normalizers("local", [a, b])
    assert np.allclose(local[1][0], b.mean(0), atol=1e-5)
    none = agent_normalizers("none", [a, b])
    assert np.all(none[0][0] == 0) and np.all(none[0][1] == 1)
    const = ObsStats.of(np.ones((5, 2))).mean_std()
    assert np.all(const[1] > 0)  # constant features do not divide by zero
    with pytest.raises(ValueError, match="pooled, local, none"):
        agent_normalizers("zscore", [a])


def test_named_dataset_resolution(tmp_path, monkeypatch, random_dataset):
    d4rl_dir = tmp_path / "d4rl"
    d4rl_dir.mkdir()
    (d4rl_dir / "hopper-medium-v2.hdf5").write_bytes(random_dataset.read_bytes())
    monkeypatch.setenv("D4RL_DATASET_DIR", str(d4rl_dir))
    assert resolve("hopper-medium-v2") == d4rl_dir / "hopper-medium-v2.hdf5"
    with pytest.raises(DatasetError, match="unknown quality 'great'.*medium-replay"):
        resolve("hopper-great-v2")
    with pytest.raises(DatasetError, match="unknown environment 'pong'"):
        resolve("pong-medium-v2")
    import fedrl.behavior.shipped as shipped
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path / "no-sets")  # an install with no behaviour set
    with pytest.raises(DatasetError, match="not found in.*can make only random"):
        resolve("ant-expert-v2")  # nothing to make it from, and the message says what can be made


def test_random_dataset_is_made_on_demand_once(monkeypatch):
    import fedrl.data.registry as reg
    monkeypatch.setattr(reg, "NAMED_TRANSITIONS", 300)
    messages = []
    path = resolve("hopper-random-v2", progress=messages.append)
    assert path.parent == reg.cache_dir() / "datasets" and len(messages) == 1
    raw = load_d4rl(path)
    assert len(raw) == 300 and raw.metadata["quality"] == "random" and raw.metadata["env_id"] == "Hopper-v5"
    assert resolve("hopper-random-v2", progress=messages.append) == path and len(messages) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["hopper-random-v2.hdf5"]


def test_agents_asking_together_for_a_missing_dataset_make_it_once(monkeypatch):
    """Processes started together (agents by hand, --jobs) that each resolve one missing name:
    one makes it, the others wait and read it; none makes it again."""
    import threading

    import fedrl.data.make as make
    import fedrl.data.registry as reg
    monkeypatch.setattr(reg, "NAMED_TRANSITIONS", 300)
    real, calls, start = make.make_dataset, [], threading.Barrier(2, timeout=30)

    def slow_make(*a, **kw):  # long enough that the second asker comes while the first makes
        calls.append(kw["out"])
        time.sleep(0.5)
        return real(*a, **kw)

    monkeypatch.setattr(make, "make_dataset", slow_make)
    paths, messages = [], []

    def ask():
        start.wait()
        paths.append(resolve("hopper-random-v2", progress=messages.append))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert len(calls) == 1 and len(paths) == 2 and paths[0] == paths[1]
    assert any(m.startswith("waiting for another process") for m in messages)
    assert len(load_d4rl(paths[0])) == 300


def test_a_cache_on_a_file_system_without_locks_still_makes_the_dataset(monkeypatch):
    """flock refused (ENOLCK, as some network file systems answer): the dataset is made anyway."""
    import errno
    import fcntl

    import fedrl.data.registry as reg
    monkeypatch.setattr(reg, "NAMED_TRANSITIONS", 300)

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "no locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert len(load_d4rl(resolve("hopper-random-v2", progress=lambda m: None))) == 300


def test_truncated_and_foreign_hdf5_name_the_file(tmp_path, random_dataset):
    cut = tmp_path / "cut.hdf5"
    data = random_dataset.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError, match="cut.hdf5"):
        load_d4rl(cut)
    foreign = tmp_path / "foreign.hdf5"
    import h5py
    with h5py.File(foreign, "w") as f:
        f.create_dataset("images", data=np.zeros((3, 4)))
    with pytest.raises(DatasetError, match=r"foreign.hdf5.*observations"):
        load_d4rl(foreign)


def test_the_pool_leaves_out_only_moments_far_from_the_majoritys():
    from fedrl.data.normalize import ObsStats, consistent, global_normalizer

    rng = np.random.default_rng(0)
    honest = [ObsStats.of(rng.normal(loc=3 * i, scale=1 + i, size=(500, 4))) for i in range(4)]  # of one task
    assert consistent(honest) == [True] * 4
    exact = ObsStats.pool(honest).mean_std()
    assert all(np.array_equal(a, b) for a, b in zip(global_normalizer("pooled", honest), exact))  # unchanged
    poison = ObsStats(500, np.full(4, 500 * 1e6), np.full(4, 500 * 1e12))
    assert consistent([*honest, poison]) == [True] * 4 + [False]
    assert all(np.array_equal(a, b) for a, b in zip(global_normalizer("pooled", [*honest, poison]), exact))
    tiny = ObsStats(500, np.full(4, 500 * 0.5), np.full(4, 500 * 0.25 + 500 * 1e-8))  # std 1e-4: far narrower
    assert consistent([*honest, tiny])[-1] is False
    # two agents: nothing to judge by, both enter; a majority decides, even one of poisoners
    assert consistent([honest[0], poison]) == [True, True]
    assert consistent([honest[0], poison, poison]) == [False, True, True]


@pytest.mark.parametrize("scale", [1e-2, 1.0, 1e3])  # stds above the floor (STD_FLOOR)
def test_the_outlier_rule_measures_distance_in_the_agents_median_std(scale):
    """An agent's mean is left out at OUTLIER_FACTOR of the agents' median std from their median
    mean, whatever the data's scale and however far apart the honest means are: just inside
    enters, just outside does not (in every dimension's own std)."""
    from fedrl.data.normalize import OUTLIER_FACTOR, ObsStats, consistent

    def agent(mean, std, n=1000):  # moments of n observations with this mean and std per dimension
        mean, std = np.asarray(mean, np.float64), np.asarray(std, np.float64)
        return ObsStats(n, n * mean, n * (std ** 2 + mean ** 2))

    stds = np.array([2.0, 0.5]) * scale  # two dimensions of different spread
    means = np.array([[0.0, -1.0], [1.0, 0.0], [2.0, 0.5], [3.0, 1.0]]) * scale
    honest = [agent(m, stds) for m in means]
    median_mean = means[2]  # with one agent beyond the four, in each dimension: the third of five
    for dim in (0, 1):
        for k, enters in ((0.99, True), (1.01, False)):
            m = median_mean.copy()
            m[dim] += k * OUTLIER_FACTOR * stds[dim]
            assert consistent([*honest, agent(m, stds)])[-1] is enters, (dim, k)


def _agent(mean, std, n):
    from fedrl.data.normalize import ObsStats

    mean, std = np.asarray(mean, np.float64), np.asarray(std, np.float64)
    return ObsStats(n, n * mean, n * (std ** 2 + mean ** 2))


@pytest.mark.parametrize("n", [3, 5, 9])
def test_one_agent_moves_the_pooled_mean_by_at_most_the_stated_bound(n):
    """n - 1 honest agents (mean 0, std 1, 1,000 observations each) and one just under the outlier
    rule (99 median stds away) declaring a billion observations: plain pooling put the honest
    agents' data ~99 of their stds off centre; the bounded pool moves its mean by at most
    2 MEAN_CLIP / (n + 1) median stds, and here by exactly that (the boundary)."""
    from fedrl.data.normalize import MEAN_CLIP, OUTLIER_FACTOR, ObsStats, consistent, global_normalizer

    honest = [_agent([0.0, 0.0], [1.0, 1.0], 1000) for _ in range(n - 1)]
    poison = _agent([0.99 * OUTLIER_FACTOR, -0.99 * OUTLIER_FACTOR], [1.0, 1.0], 10 ** 9)
    assert all(consistent([*honest, poison]))  # the outlier rule lets it in
    plain = ObsStats.pool([*honest, poison]).mean_std()[0]
    assert np.all(np.abs(plain) > 0.98 * OUTLIER_FACTOR)
    mean, std = global_normalizer("pooled", [*honest, poison])
    bound = 2 * MEAN_CLIP / (n + 1)
    assert np.allclose(np.abs(mean), bound, rtol=1e-6), (mean, bound)
    assert np.all(np.isfinite(std)) and np.all(std < MEAN_CLIP)


def test_the_bounded_pool_of_honest_agents_is_the_exact_pool_bit_for_bit():
    """Counts within twice the median and means within ten median stds: nothing is capped or
    clipped, and the pool is the exact pooled moments (the normaliser every run had)."""
    from fedrl.data.normalize import ObsStats, global_normalizer

    rng = np.random.default_rng(3)
    honest = [ObsStats.of(rng.normal(loc=0.5 * i, scale=1 + 0.2 * i, size=(600 + 300 * i, 4))) for i in range(4)]
    exact = ObsStats.pool(honest).mean_std()
    assert all(np.array_equal(a, b) for a, b in zip(global_normalizer("pooled", honest), exact))


def test_a_tiny_or_huge_std_enters_clipped():
    from fedrl.data.normalize import MEAN_CLIP, global_normalizer

    honest = [_agent([0.0], [1.0], 1000) for _ in range(4)]
    for odd in (1e-9, 50.0):  # inside the outlier rule (100 x), outside the clip (10 x)
        _, std = global_normalizer("pooled", [*honest, _agent([0.0], [odd], 1000)])
        plain_var = (4 + odd ** 2) / 5
        assert std[0] != pytest.approx(np.sqrt(plain_var), rel=1e-3) or odd < 1
        assert std[0] <= np.sqrt((4 + MEAN_CLIP ** 2) / 5) + 1e-6
