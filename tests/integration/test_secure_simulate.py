"""``fedrl simulate --secagg-threshold``: the round's average taken by the secure aggregation
protocol equals plain FedAvg within the stated rounding bound, with and without an agent that
drops after sharing its keys, and so do the pooled observation moments (round 0); settings it
cannot run are refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedrl.data.normalize import ObsStats

from fedrl.federation.aggregate import fedavg
from fedrl.federation.secagg import SecAggError, SecAggParams
from fedrl.federation.secagg_sums import (
    moments_from_sum,
    moments_params,
    moments_vector,
    secure_fedavg,
    secure_moments,
)
from fedrl.federation.simulate import run
from tests.integration.test_simulate import tiny


def _states(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"policy.w": torch.randn(64, 32, generator=g), "policy.b": torch.randn(32, generator=g) * 5}
            for _ in range(n)]


@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0, 1.0], [120.0, 3_000.0, 45.0, 900.0]])
def test_the_secure_average_is_fedavg_within_its_bound(weights):
    states = _states(4)
    got, rec = secure_fedavg(states, weights, SecAggParams(threshold=3, context=b"t"))
    want = fedavg(states, weights)
    for k in want:
        diff = (got[k].double() - want[k].double()).abs().max().item()
        ulp = float(want[k].abs().max()) * 2 ** -23  # the float32 the average is returned in
        assert diff <= rec["bound"] + ulp, (k, diff, rec["bound"])
    assert rec["survivors"] == 4 and rec["dropped"] == 0 and 0 < rec["bound"] < 1e-7


def test_an_agent_that_drops_after_sharing_is_left_out_of_the_average():
    states, weights = _states(5, seed=1), [1.0, 2.0, 3.0, 4.0, 5.0]
    got, rec = secure_fedavg(states, weights, SecAggParams(threshold=3, context=b"t"), drop=[1])
    want = fedavg([s for i, s in enumerate(states) if i != 1], [w for i, w in enumerate(weights) if i != 1])
    for k in want:
        assert torch.allclose(got[k].double(), want[k].double(), atol=rec["bound"] + 1e-5), k
    assert (rec["survivors"], rec["dropped"]) == (4, 1)
    with pytest.raises(SecAggError, match="fewer than the threshold"):
        secure_fedavg(states, weights, SecAggParams(threshold=4, context=b"t"), drop=[0, 2])


def test_an_agent_checks_its_own_update():
    bad = _states(3, seed=2)
    bad[2]["policy.b"][0] = float("nan")
    with pytest.raises(SecAggError, match="NaN or Inf"):
        secure_fedavg(bad, [1.0] * 3, SecAggParams(threshold=2, context=b"t"))
    big = _states(3, seed=3)
    big[0]["policy.w"][0, 0] = 1e6
    with pytest.raises(SecAggError, match="past the clipping range"):
        secure_fedavg(big, [1.0] * 3, SecAggParams(threshold=2, context=b"t", clip=1e4))


@pytest.mark.parametrize("first, share", [(1e-4, 0.0), (1e3, 1.0)])  # far below every update, far above
def test_adaptive_clipping_under_secure_aggregation_moves_the_norm_as_in_the_clear(tmp_path, random_dataset, first,
                                                                                    share):
    """Without noise, the share of updates within the norm that the agents' bits give under the
    masks is the one the aggregator counts in the clear, so the norm moves the same way round by
    round (within the fixed point's rounding); the agents clip to each round's norm themselves."""
    clips = {}
    for sa in (0, 2):
        cfg = tiny(random_dataset, algo="fed-bc", agents=3, rounds=3, eval_episodes=0, dp_clip=first,
                   dp_clip_quantile=0.5, dp_clip_lr=0.5, secagg_threshold=sa)
        run(cfg, tmp_path / f"r{sa}", log=lambda m: None)
        rows = [json.loads(x)["privacy"] for x in (tmp_path / f"r{sa}" / "rounds.jsonl").read_text().splitlines()]
        clips[sa] = [(r["clip"], r["unclipped_fraction"], r["clip_next"]) for r in rows]
    assert [f for _, f, _ in clips[0]] == [share] * 3
    for (c0, f0, n0), (c2, f2, n2) in zip(clips[0], clips[2]):
        assert c2 == pytest.approx(c0, rel=1e-6) and f2 == pytest.approx(f0, abs=1e-8)
        assert n2 == pytest.approx(n0, rel=1e-6)


def test_simulate_with_secure_aggregation_matches_plain_fedavg(tmp_path, random_dataset):
    """Round 1's global policy, by the protocol and by plain FedAvg (same seeds, same training):
    equal within the bound the round records."""
    seen = {}
    for sa in (0, 2):
        run(tiny(random_dataset, rounds=1, eval_episodes=0, agents=3, secagg_threshold=sa), tmp_path / f"r{sa}",
            log=lambda m: None, on_round=lambda r, g, sa=sa: seen.__setitem__(sa, g))
    line = json.loads((tmp_path / "r2" / "rounds.jsonl").read_text().splitlines()[0])
    rec = line["secure_aggregation"]
    assert rec["threshold"] == 2 and rec["survivors"] == 3
    # what an aggregator would learn of an agent: its sample count and time, none of its metrics
    assert all(set(a) == {"agent", "num_samples", "seconds"} for a in line["agents"]), line["agents"]
    plain = json.loads((tmp_path / "r0" / "rounds.jsonl").read_text().splitlines()[0])["agents"]
    assert all("critic_td" in a for a in plain)
    moments = json.loads((tmp_path / "r2" / "config.json").read_text())["secure_moments"]
    assert moments["survivors"] == 3 and 0 < moments["bound"] < 1e-6
    for k, v in seen[0].items():
        if v.is_floating_point():
            diff = (seen[2][k].double() - v.double()).abs().max().item()
            assert diff <= rec["bound"] + float(v.abs().max()) * 2 ** -23, (k, diff)


@pytest.mark.parametrize("kw, says", [
    ({"aggregation": "median"}, "cannot run with --secagg-threshold"),
    ({"aggregation": "trimmed-mean"}, "needs the individual updates"),
    ({"algo": "cql"}, "shares nothing to aggregate"),
    ({"obs_norm": "local"}, "each agent's moments in the clear"),
    ({"secagg_threshold": 1}, "0 (off) or an integer >= 2"),
])
def test_settings_secure_aggregation_cannot_run_are_refused_by_name(random_dataset, kw, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        tiny(random_dataset, **{"secagg_threshold": 2, **kw})


def test_a_threshold_above_the_agents_is_refused_in_simulate_and_the_services(tmp_path, random_dataset):
    with pytest.raises(ValueError, match="more than the run's 2 agents"):
        run(tiny(random_dataset, secagg_threshold=3), tmp_path / "r", log=lambda m: None)
    from fedrl.federation.runconfig import ConfigError, parse_run_config

    with pytest.raises(ConfigError, match=r"secagg_threshold: 4 exceeds agents \(3\)"):
        parse_run_config(json.dumps({"algo": "drpo", "agents": 3, "secagg_threshold": 4}))
    assert parse_run_config(json.dumps({"algo": "drpo", "agents": 3, "secagg_threshold": 3})).secagg_threshold == 3


def _moments(counts, seed=0):
    """Observations of agents with different counts, means and spreads (float64)."""
    rng = np.random.default_rng(seed)
    return [ObsStats.of(rng.normal(loc=rng.uniform(-30, 30, 6), scale=rng.uniform(0.01, 20, 6), size=(n, 6)))
            for n in counts]


def _close(got, want, bound):
    mean_g, std_g = got
    mean_w, std_w = want
    # the float32 the normaliser is kept in, beside the protocol's bound on the mean and mean square
    tol_mean = bound + np.abs(mean_w) * 2.0 ** -23
    assert (np.abs(mean_g - mean_w) <= tol_mean).all(), (mean_g - mean_w)
    assert np.allclose(std_g, std_w, rtol=1e-5, atol=1e-6), (std_g - std_w)


def test_the_secure_moments_are_the_pooled_moments_within_the_bound():
    """Pooled by the protocol (each agent's mean and mean square weighted by its share of the
    samples) or from the plain sums: the same normaliser. Counts differ by 100x, so an agent
    weighted by anything else than its count would move the mean by whole units."""
    stats, counts = _moments([40, 4_000, 700, 90]), [40, 4_000, 700, 90]
    got, rec = secure_moments(stats, counts, moments_params(3, b"t"))
    _close(got, ObsStats.pool(stats).mean_std(), rec["bound"])
    assert rec["survivors"] == 4 and 0 < rec["bound"] < 1e-5
    equal = np.average([s.total / s.count for s in stats], axis=0)  # what equal weights would give
    assert np.abs(equal - ObsStats.pool(stats).mean_std()[0]).max() > 1.0


def test_the_secure_moments_of_the_survivors_when_one_drops():
    stats, counts = _moments([300, 50, 1_000], seed=1), [300, 50, 1_000]
    got, rec = secure_moments(stats, counts, moments_params(2, b"t"), drop=[2])
    _close(got, ObsStats.pool(stats[:2]).mean_std(), rec["bound"])
    assert (rec["survivors"], rec["dropped"]) == (2, 1)


def test_an_agent_refuses_moments_past_the_range_naming_the_dimension():
    p = moments_params(2, b"t")
    x = np.zeros((10, 4))
    x[:, 2] = 1e3  # a mean square of 10^6: past 2^19
    s = ObsStats.of(x)
    with pytest.raises(SecAggError, match="the mean square of dimension 2"):
        moments_vector(s.count, s.total, s.total_sq, 1.0, p)
    s = ObsStats.of(np.full((3, 4), np.nan))
    with pytest.raises(SecAggError, match="NaN or Inf"):
        moments_vector(s.count, s.total, s.total_sq, 0.5, p)
    with pytest.raises(SecAggError, match="needs 9"):
        moments_from_sum(np.ones(7), 4)
