"""Behaviour policies and dataset making: SAC training/resume, shipping a set, every quality."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from fedrl.algos.nets import TanhGaussianPolicy
from fedrl.algos.policy_io import load_policy, save_policy
from fedrl.behavior.sac import SACConfig, train
from fedrl.behavior.shipped import _apportion, behavior_set, ship
from fedrl.cli import main
from fedrl.data.d4rl import load_d4rl, to_transitions
from fedrl.data.make import make_dataset, return_stats
from fedrl.envs.rollout import NumpyPolicy

TINY = dict(start_steps=50, eval_every=100, eval_episodes=1, max_episode_steps=60,
            hidden=(16, 16), batch_size=32)


@pytest.fixture(scope="module")
def sac_run(tmp_path_factory):
    """A tiny SAC run trained in two sittings (300 steps on one torch thread, then resumed to 500
    on the test's own thread count)."""
    out = tmp_path_factory.mktemp("sac") / "run"
    logs: list[str] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = train("Hopper-v5", SACConfig(total_steps=300, **TINY), out, "cpu", logs.append)
    finally:
        torch.set_num_threads(threads)
    second = train("Hopper-v5", SACConfig(total_steps=500, **TINY), out, "cpu", logs.append)
    return out, first, second, logs


def test_sac_checkpoints_progress_and_resume(sac_run):
    out, first, second, logs = sac_run
    assert [r["step"] for r in first] == [100, 200, 300]
    assert [r["step"] for r in second] == [100, 200, 300, 400, 500]
    assert any(m.startswith("resuming") and "step 300" in m for m in logs)
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == [f"step-{s:09d}.safetensors" for s in (100, 200, 300, 400, 500)]
    pol, meta = load_policy(out / "checkpoints" / ckpts[-1])
    assert meta["env_id"] == "Hopper-v5" and meta["step"] == 500 and pol.obs_dim == 11
    # One consistent resume state: the newest step's files only.
    state = json.loads((out / "state" / "meta.json").read_text())
    assert state["step"] == 500
    assert sorted(p.name for p in (out / "state").glob("*.safetensors")) == sorted(state["files"].values())
    lines = (out / "progress.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [100, 200, 300, 400, 500]
    assert all(np.isfinite(json.loads(x)["stochastic_return_mean"]) for x in lines)
    assert [json.loads(x)["torch_threads"] for x in lines] == [1] * 3 + [torch.get_num_threads()] * 2


def test_sac_and_random_data_on_ant_use_the_27_dim_layout(tmp_path):
    """Ant-v5's default observation has 105 dims (78 contact forces); what SAC trains on, what its
    checkpoints expect and what a made dataset holds is the 27-dim layout, the same for all three."""
    train("Ant-v5", SACConfig(total_steps=100, **TINY), tmp_path / "ant", "cpu", lambda m: None)
    pol, meta = load_policy(sorted((tmp_path / "ant" / "checkpoints").iterdir())[-1])
    assert meta["env_id"] == "Ant-v5" and pol.obs_dim == 27
    out = make_dataset("Ant-v5", "random", 0, tmp_path / "ant-random.hdf5", episodes=1, progress=False)
    with h5py.File(out) as f:
        assert f["observations"].shape[1] == 27 and f["actions"].shape[1] == 8


def test_sac_resume_refuses_a_different_config(sac_run):
    out = sac_run[0]
    with pytest.raises(ValueError, match="different configuration"):
        train("Hopper-v5", SACConfig(total_steps=600, **{**TINY, "batch_size": 64}), out, "cpu")


def test_sac_learns_weights_that_change(sac_run):
    out = sac_run[0]
    a = load_policy(out / "checkpoints" / "step-000000100.safetensors")[0]
    b = load_policy(out / "checkpoints" / "step-000000500.safetensors")[0]
    assert not torch.equal(a.head.weight, b.head.weight)


@pytest.fixture(scope="module")
def behavior_dir(sac_run, tmp_path_factory):
    d = tmp_path_factory.mktemp("ship") / "hopper"
    manifest = ship(sac_run[0], d, replay_checkpoints=3, episodes=2, candidates=2, expert_min=0.0,
                    log=lambda m: None)
    return d, manifest


def test_ship_chooses_expert_medium_and_replay(behavior_dir, sac_run):
    d, m = behavior_dir
    assert m["env_id"] == "Hopper-v5"
    assert m["medium"]["step"] < m["expert"]["step"]
    rp = m["medium_replay"]
    steps = [c["step"] for c in rp["checkpoints"]]
    assert steps == sorted(steps) and steps[-1] == m["medium"]["step"] and len(steps) <= 3
    assert rp["buffer_transitions"] == m["medium"]["step"]
    assert rp["uniform_share"] + sum(c["share"] for c in rp["checkpoints"]) == pytest.approx(1.0)
    for f in d.glob("*.safetensors"):
        pol, meta = load_policy(f)
        assert meta["env_id"] == "Hopper-v5"
    # Shipped weights are float16 on disk.
    from safetensors import safe_open
    with safe_open(str(d / "expert.safetensors"), "pt") as f:
        assert f.get_tensor("policy.head.weight").dtype == torch.float16
    assert json.loads((d / "manifest.json").read_text()) == m
    # The training's thread counts (not those of the process that ships): they set its speed.
    assert m["training"]["torch_threads"] == sorted({1, torch.get_num_threads()})


@pytest.mark.parametrize("quality", ["random", "medium", "expert", "medium-replay", "medium-expert"])
def test_make_every_quality(quality, behavior_dir, tmp_path):
    d, m = behavior_dir
    out = tmp_path / f"hopper-{quality}.hdf5"
    make_dataset("Hopper-v5", quality, seed=3, out=out, transitions=400, behavior_dir=d)
    with h5py.File(out) as f:
        assert {"observations", "actions", "rewards", "terminals", "timeouts",
                "next_observations"} <= set(f.keys())
        assert f["observations"].shape == (400, 11) and f["actions"].shape == (400, 3)
    raw = load_d4rl(out)
    md = raw.metadata
    assert md["quality"] == quality and md["env_id"] == "Hopper-v5" and md["seed"] == 3
    assert md["transitions"] == 400 and md["episodes"] == len(raw.episode_returns())
    assert raw.timeouts[-1] or raw.terminals[-1]  # the file's last episode is closed
    # The core loader reads it with D4RL's semantics (timeout rows are dropped).
    assert len(to_transitions(raw)) == 400 - int(raw.timeouts.sum())
    if quality in ("medium", "expert"):
        assert md["behavior"]["checkpoint"] == f"{quality}.safetensors"
        assert md["behavior"]["sha256"] == m[quality]["sha256"]
    if quality == "medium-replay":
        parts = md["behavior"]["checkpoints"]
        assert md["behavior"]["uniform"] + sum(p["amount"] for p in parts) == 400


def test_make_by_episodes_and_is_seeded(behavior_dir, tmp_path):
    d, _ = behavior_dir
    a = make_dataset("Hopper-v5", "medium", seed=5, out=tmp_path / "a.hdf5", episodes=3, behavior_dir=d)
    b = make_dataset("Hopper-v5", "medium", seed=5, out=tmp_path / "b.hdf5", episodes=3, behavior_dir=d)
    ra, rb = load_d4rl(a), load_d4rl(b)
    assert len(ra.episode_returns()) == 3 and ra.metadata["episodes"] == 3
    assert np.array_equal(ra.observations, rb.observations)
    c = load_d4rl(make_dataset("Hopper-v5", "medium", seed=6, out=tmp_path / "c.hdf5", episodes=3,
                               behavior_dir=d))
    assert not np.array_equal(ra.observations[:50], c.observations[:50])


def test_make_errors_name_the_problem(behavior_dir, tmp_path):
    d, _ = behavior_dir
    with pytest.raises(ValueError, match="unknown quality 'great'.*medium-replay"):
        make_dataset("Hopper-v5", "great", 0, tmp_path / "x.hdf5")
    with pytest.raises(ValueError, match="unknown environment 'pong'"):
        make_dataset("pong", "random", 0, tmp_path / "x.hdf5")
    with pytest.raises(ValueError, match="no behaviour checkpoints for Hopper-v5"):
        make_dataset("Hopper-v5", "medium", 0, tmp_path / "x.hdf5", behavior_dir=tmp_path)
    with pytest.raises(ValueError, match="behaviour set is for Hopper-v5, not Walker2d-v5"):
        make_dataset("Walker2d-v5", "medium", 0, tmp_path / "x.hdf5", behavior_dir=d)
    # A damaged checkpoint is detected by its checksum; nothing is written.
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in d.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    raw = bytearray((bad / "expert.safetensors").read_bytes())
    raw[-8:] = b"\x00" * 8
    (bad / "expert.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="checksum"):
        make_dataset("Hopper-v5", "expert", 0, tmp_path / "y.hdf5", transitions=10, behavior_dir=bad)
    assert not (tmp_path / "y.hdf5").exists() and not list(tmp_path.glob(".y.hdf5*"))
    # A checkpoint the manifest lists but the folder lacks (an incomplete install) is named.
    (bad / "medium.safetensors").unlink()
    with pytest.raises(ValueError, match=r"medium.safetensors: listed in .*manifest.json but missing"):
        make_dataset("Hopper-v5", "medium", 0, tmp_path / "y.hdf5", transitions=10, behavior_dir=bad)
    assert not (tmp_path / "y.hdf5").exists()


def test_cli_make_and_info(behavior_dir, tmp_path, capsys):
    d, _ = behavior_dir
    out = tmp_path / "m.hdf5"
    assert main(["data", "make", "--env", "Hopper-v5", "--quality", "medium", "--episodes", "2",
                 "--seed", "1", "--out", str(out), "--behavior-dir", str(d)]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["episodes"] == 2 and made["quality"] == "medium"
    assert main(["data", "info", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["episodes"] == 2 and info["metadata"]["quality"] == "medium"
    assert info["transitions"] == made["transitions"] == info["metadata"]["transitions"]  # the file's rows
    assert 0 < info["training_transitions"] <= info["transitions"]
    assert info["env_id"] == "Hopper-v5" and "score_mean" in info
    assert main(["data", "make", "--env", "Hopper-v5", "--quality", "medium", "--out",
                 str(tmp_path / "z.hdf5"), "--behavior-dir", str(tmp_path / "none")]) == 2
    assert "no behaviour checkpoints" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["data", "make", "--env", "Hopper-v5", "--quality", "superb", "--out", "x"])
    assert "invalid choice: 'superb'" in capsys.readouterr().err


def test_numpy_policy_matches_torch_policy():
    torch.manual_seed(0)
    pol = TanhGaussianPolicy(11, 3, (32, 32))
    pol.set_normalizer(torch.randn(11), torch.rand(11) + 0.5)
    obs = np.random.default_rng(0).standard_normal(11).astype(np.float32)
    det = NumpyPolicy(pol, stochastic=False)(obs, np.random.default_rng(0))
    ref = pol.act(torch.from_numpy(obs)[None])[0].numpy()
    np.testing.assert_allclose(det, ref, atol=1e-5)
    s1 = NumpyPolicy(pol)(obs, np.random.default_rng(1))
    assert not np.allclose(s1, det) and np.all(np.abs(s1) <= 1)


def test_policy_file_roundtrip_and_errors(tmp_path):
    pol = TanhGaussianPolicy(5, 2, (8, 4))
    p = save_policy(pol, tmp_path / "p.safetensors", {"env_id": "Hopper-v5", "step": 3})
    back, meta = load_policy(p)
    assert meta["step"] == 3 and [l.out_features for l in back.trunk if hasattr(l, "out_features")] == [8, 4]
    for k, v in pol.state_dict().items():
        assert torch.equal(v, back.state_dict()[k])
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="junk.safetensors: not a readable safetensors"):
        load_policy(tmp_path / "junk.safetensors")


def test_return_stats_ignore_a_cut_final_episode(tmp_path):
    from tests.conftest import tiny_raw
    raw = tiny_raw()  # episodes end at rows 2 (terminal), 4 (timeout); rows 5-6 are unfinished
    s = return_stats(raw)
    assert s["episodes"] == 3
    assert s["return_mean"] == pytest.approx(np.mean([0 + 10 + 20, 30 + 40]))


def test_apportion_sums_exactly():
    assert _apportion(10, [0.5, 0.25, 0.25]) == [5, 3, 2]
    for total in (1, 7, 400, 12345):
        assert sum(_apportion(total, [0.1, 0.3, 0.6, 0.05])) == total


def test_behavior_set_reports_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="Train one with 'fedrl data train-behavior'"):
        behavior_set("walker2d", tmp_path)


def test_ship_without_an_expert_when_the_bar_is_not_met(sac_run, tmp_path):
    d = tmp_path / "hopper"
    m = ship(sac_run[0], d, replay_checkpoints=2, episodes=1, candidates=1, log=lambda m: None)
    assert m["expert"] is None and "below 2500" in m["expert_missing_reason"]
    assert not (d / "expert.safetensors").exists() and (d / "medium.safetensors").exists()
    assert m["selection"]["medium_target"] == pytest.approx(3234.3 / 3, abs=0.1)
    with pytest.raises(ValueError, match="no expert behaviour policy is shipped for Hopper-v5: best"):
        make_dataset("Hopper-v5", "expert", 0, tmp_path / "e.hdf5", transitions=10, behavior_dir=d)
    raw = load_d4rl(make_dataset("Hopper-v5", "medium", 0, tmp_path / "m.hdf5", transitions=50, behavior_dir=d))
    assert len(raw) == 50


def _final_state(out):
    from safetensors.torch import load_file

    meta = json.loads((out / "state" / "meta.json").read_text())
    return meta, load_file(str(out / "state" / meta["files"]["agent"]))


def test_sac_resumes_exactly_from_its_folder_and_from_a_kept_state(tmp_path):
    """Stopped at step 300 (mid-episode: episodes here last up to 60 steps) and resumed, a run
    ends with the same networks, moments, temperature, random streams and evaluations as one that
    never stopped; from the run folder, and from the compact kept state in a fresh folder (the
    replay buffer rebuilt from the kept actions). Every state is compared bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = lambda n: SACConfig(total_steps=n, **TINY)
        whole = train("Hopper-v5", cfg(500), tmp_path / "whole", "cpu", lambda m: None)
        logs: list[str] = []
        train("Hopper-v5", cfg(300), tmp_path / "split", "cpu", logs.append, keep=tmp_path / "keep")
        split = train("Hopper-v5", cfg(500), tmp_path / "split", "cpu", logs.append)
        kept = train("Hopper-v5", cfg(500), tmp_path / "fresh", "cpu", logs.append, keep=tmp_path / "keep")
    finally:
        torch.set_num_threads(threads)
    assert any("resuming" in m and "step 300" in m and "exactly" in m for m in logs), logs
    assert any("kept state" in m and "exactly" in m and "not exactly" not in m for m in logs), logs
    m_whole, t_whole = _final_state(tmp_path / "whole")
    for other in ("split", "fresh"):
        m, t = _final_state(tmp_path / other)
        assert m["rng"] == m_whole["rng"] and m["episodes"] == m_whole["episodes"]
        assert sorted(t) == sorted(t_whole)
        for k in t:
            assert torch.equal(t[k], t_whole[k]), (other, k)
    strip = lambda recs: [{k: v for k, v in r.items() if k not in ("wall_seconds", "steps_per_second")}
                          for r in recs]
    assert strip(split) == strip(whole) and strip(kept) == strip(whole)
    # the kept folder holds chunks of actions and rewards and one agent file, nothing else
    names = sorted(p.name for p in (tmp_path / "keep").iterdir())
    assert names == ["agent-000000500.safetensors", "meta.json", "steps-000000000-000000500.npz"]


def test_a_damaged_kept_state_is_named(tmp_path):
    from fedrl.behavior import keep

    cfg = SACConfig(total_steps=100, **TINY)
    train("Hopper-v5", cfg, tmp_path / "a", "cpu", lambda m: None, keep=tmp_path / "keep")
    chunk = next((tmp_path / "keep").glob("steps-*.npz"))
    chunk.write_bytes(chunk.read_bytes()[:-3] + b"xyz")
    with pytest.raises(ValueError, match="SHA-256"):
        keep.load(tmp_path / "keep", keep.read_meta(tmp_path / "keep"))
    chunk.unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        train("Hopper-v5", SACConfig(total_steps=200, **TINY), tmp_path / "b", "cpu", lambda m: None,
              keep=tmp_path / "keep")


def test_sac_stops_at_the_bar_and_the_same_command_does_not_train_on(tmp_path):
    logs: list[str] = []
    cfg = SACConfig(total_steps=400, **TINY)
    recs = train("Hopper-v5", cfg, tmp_path / "r", "cpu", logs.append, stop_return=-1e9)
    assert [r["step"] for r in recs] == [100] and any("stopping at step 100" in m for m in logs)
    again = train("Hopper-v5", cfg, tmp_path / "r", "cpu", logs.append, stop_return=-1e9)
    assert [r["step"] for r in again] == [100] and any("reached" in m and "already" in m for m in logs)
    assert main(["data", "train-behavior", "--env", "Hopper-v5", "--out", str(tmp_path / "c"),
                 "--stop-return", "lots"]) == 2
