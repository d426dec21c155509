"""``fedrl simulate --secagg-threshold``: the round's average taken by the secure aggregation
protocol equals plain FedAvg within the stated rounding bound, with and without an agent that
drops after sharing its keys; settings it cannot run are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from fedrl.federation.aggregate import fedavg
from fedrl.federation.secagg import SecAggError, SecAggParams, secure_fedavg
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


def test_simulate_with_secure_aggregation_matches_plain_fedavg(tmp_path, random_dataset):
    """Round 1's global policy, by the protocol and by plain FedAvg (same seeds, same training):
    equal within the bound the round records."""
    seen = {}
    for sa in (0, 2):
        run(tiny(random_dataset, rounds=1, eval_episodes=0, agents=3, secagg_threshold=sa), tmp_path / f"r{sa}",
            log=lambda m: None, on_round=lambda r, g, sa=sa: seen.__setitem__(sa, g))
    rec = json.loads((tmp_path / "r2" / "rounds.jsonl").read_text().splitlines()[0])["secure_aggregation"]
    assert rec["threshold"] == 2 and rec["survivors"] == 3
    for k, v in seen[0].items():
        if v.is_floating_point():
            diff = (seen[2][k].double() - v.double()).abs().max().item()
            assert diff <= rec["bound"] + float(v.abs().max()) * 2 ** -23, (k, diff)


@pytest.mark.parametrize("kw, says", [
    ({"aggregation": "median"}, "cannot run with --secagg-threshold"),
    ({"aggregation": "trimmed-mean"}, "needs the individual updates"),
    ({"algo": "cql"}, "shares nothing to aggregate"),
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
