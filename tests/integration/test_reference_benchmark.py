"""benchmarks.studies.reference's own machinery on a tiny file: the data's return, chunked resume."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from benchmarks.studies import reference, reference_worker


def test_mc_return_is_the_discounted_return_to_go_within_episodes():
    rewards = np.array([1.0, 1.0, 1.0, 2.0, 2.0])
    episode = np.array([0, 0, 0, 1, 1])
    dones = np.array([0, 0, 1, 0, 0], dtype=np.float32)  # episode 1 ends on a timeout (no done)
    # episode 0: 1.75, 1.5, 1; episode 1: 3, 2
    assert reference_worker.mc_return(rewards, dones, episode, 0.5) == pytest.approx((1.75 + 1.5 + 1 + 3 + 2) / 5)


def test_split_run_names_learner_and_data_and_refuses_unknowns():
    assert reference_worker.split_run("cql-ours-td1-5traj") == ("cql-ours-td1", "5traj")
    with pytest.raises(SystemExit, match="unknown run"):
        reference_worker.split_run("cql-nobody-5traj")


def _tiny_data(work, n=64, obs_dim=11, act_dim=3):
    g = np.random.default_rng(0)
    work.mkdir(parents=True, exist_ok=True)
    np.savez(work / "data-5traj.npz", obs=g.normal(size=(n, obs_dim)).astype(np.float32),
             next_obs=g.normal(size=(n, obs_dim)).astype(np.float32),
             actions=g.uniform(-1, 1, (n, act_dim)).astype(np.float32), rewards=g.normal(size=n).astype(np.float32),
             dones=np.zeros(n, np.float32), obs_mean=np.zeros(obs_dim, np.float32),
             obs_std=np.ones(obs_dim, np.float32), probe=np.arange(n), mc_return=np.float64(0), episodes=np.int64(2))


@pytest.mark.parametrize("run", ["cql-ours-5traj", "bc-ours-5traj"])
def test_a_run_in_chunks_equals_the_run_in_one_go(tmp_path, run):
    """The worker checkpoints at the end of every chunk; two chunks compute what one does."""
    settings = {**reference.shared_settings(), "batch_size": 16}
    _tiny_data(tmp_path / "a")
    _tiny_data(tmp_path / "b")
    one = reference_worker.worker(run, 0, 6, settings, tmp_path / "a")
    reference_worker.worker(run, 0, 3, settings, tmp_path / "b")
    two = reference_worker.worker(run, 0, 6, settings, tmp_path / "b")
    assert one["step"] == two["step"] == 6
    for k in ("q_data", "nll_data", "temperature"):
        assert (np.isnan(one[k]) and np.isnan(two[k])) or one[k] == two[k], k
    a = load_file(tmp_path / "a" / f"{run}-s0" / "policy.safetensors")
    b = load_file(tmp_path / "b" / f"{run}-s0" / "policy.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_committed_reference_results_render(tmp_path):
    results = reference.load_all()
    if not results:
        pytest.skip("no committed reference results")
    md = reference.table_md(results)
    assert md.splitlines()[0].startswith("| data | learner |")
    text = (reference.ROOT / "BENCHMARKS.md").read_text()
    block = text.split("<!-- generated:reference -->\n", 1)[1].split("\n<!-- end:reference -->", 1)[0]
    assert block == md, "BENCHMARKS.md's reference block is stale: python -m benchmarks.studies.reference render"
    assert all(r["rows"] and r["settings"]["td_weight"] in (1.0, 2.0) for r in results)
    assert reference.curves_png(results, tmp_path / "c.png") and (tmp_path / "c.png").stat().st_size > 1000
    json.dumps(results)


@pytest.mark.slow(reason="reruns a reference benchmark's rows")
def test_a_run_whose_checkpoint_is_lost_recomputes_its_rows_and_goes_on(tmp_path, monkeypatch, capsys):
    """Rows recorded on another machine, no checkpoint here: the driver retrains them in the same
    chunks, says each matches, and appends only the new rows."""
    settings = {**reference.shared_settings(), "batch_size": 16}
    monkeypatch.setattr(reference, "shared_settings", lambda: settings)
    monkeypatch.setattr(reference, "evaluate_snapshot", lambda home, seed: {"return_mean": 0.0, "return_std": 0.0,
                                                                            "score_mean": 0.0})
    work, results = tmp_path / "work", tmp_path / "results"
    _tiny_data(work)
    first = reference.drive("bc-ours-5traj", 0, 4, 2, results, work)
    assert [r["step"] for r in first["rows"]] == [2, 4]
    (work / "bc-ours-5traj-s0" / "checkpoint.pt").unlink()
    capsys.readouterr()
    more = reference.drive("bc-ours-5traj", 0, 6, 2, results, work)
    out = capsys.readouterr().out
    assert "recomputing them" in out and out.count("same as recorded") == 2 and "DIFFERS" not in out
    assert [r["step"] for r in more["rows"]] == [2, 4, 6] and more["rows"][:2] == first["rows"]
