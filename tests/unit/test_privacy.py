"""Agent-level differential privacy (DP-FedAvg): clipping, the noise, the accountant, the settings.

Each protection's test fails when the protection is removed: an unclipped update breaks the norm
bound, a missing noise breaks the std test, an accountant that is not the library's (or none)
breaks the epsilon checks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedrl.algos import BCConfig, DRPOConfig
from fedrl.data.d4rl import Transitions
from fedrl.federation.privacy import CLIP_RANGE, NOISE_RANGE, clip_update, epsilon, noisy_average, update_norm
from fedrl.federation.round import LocalTrainer
from fedrl.federation.runconfig import parse_run_config
from fedrl.federation.simulate import SimConfig

O, A = 5, 2


def transitions(n: int = 300) -> Transitions:
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(n + 1, O))
    return Transitions(obs[:-1], np.tanh(rng.normal(size=(n, A))) * 0.9, rng.uniform(0, 1, n), obs[1:],
                       np.zeros(n), np.arange(n) // 50)


def test_clipping_scales_the_update_into_the_ball_and_leaves_the_normaliser():
    g = torch.Generator().manual_seed(0)
    base = {"policy.w": torch.randn(30, 20, generator=g), "policy.obs_mean": torch.zeros(4),
            "policy.obs_std": torch.ones(4)}
    state = {"policy.w": base["policy.w"] + 3 * torch.randn(30, 20, generator=g), "policy.obs_mean": torch.zeros(4),
             "policy.obs_std": torch.ones(4)}
    before = update_norm(state, base)
    out, norm = clip_update(state, base, 1.5)
    assert norm == pytest.approx(before) and before > 10
    assert update_norm(out, base) == pytest.approx(1.5, rel=1e-6)
    d0, d1 = (state["policy.w"] - base["policy.w"]).flatten(), (out["policy.w"] - base["policy.w"]).flatten()
    assert torch.nn.functional.cosine_similarity(d0, d1, dim=0) > 1 - 1e-6  # the same direction
    assert torch.equal(out["policy.obs_std"], state["policy.obs_std"])
    small, _ = clip_update(state, base, 1e6)  # inside the ball: unchanged
    assert torch.equal(small["policy.w"], state["policy.w"])
    with pytest.raises(ValueError, match="global model lacks: policy.v"):
        clip_update({**state, "policy.v": torch.ones(2)}, base, 1.0)


@pytest.mark.parametrize("cfg", [DRPOConfig(hidden=(16, 16), batch_size=32, cql_n_actions=2, actor_lr=1e-2,
                                            critic_lr=1e-2),
                                 BCConfig(hidden=(16, 16), batch_size=32, lr=1e-2)], ids=["drpo", "bc"])
def test_an_agents_round_returns_an_update_of_norm_at_most_the_clip(cfg):
    torch.set_num_threads(1)
    t = LocalTrainer(0, cfg, transitions(), np.zeros(O), np.ones(O), seed=3, device=torch.device("cpu"),
                     federate_critic=isinstance(cfg, DRPOConfig), update_clip=0.05)
    g0 = t.learner.shared_state(isinstance(cfg, DRPOConfig))
    res = t.train_round(g0, 20, copy=False)
    assert res.metrics["update_norm"] > 0.05 and res.metrics["clipped"] == 1.0  # it had to cut
    assert update_norm(res.state, g0) <= 0.05 * (1 + 1e-5)
    if isinstance(cfg, DRPOConfig):
        assert any(k.startswith("critic.") for k in res.state)  # the critics are clipped with the policy


def test_the_noise_has_the_mechanisms_std_on_every_learned_coordinate():
    n, clip, sigma = 5, 2.0, 1.3
    mean = {"policy.w": torch.zeros(400, 500), "policy.obs_mean": torch.full((7,), 3.0)}
    out = noisy_average(mean, n, clip, sigma, torch.Generator().manual_seed(1))
    z = out["policy.w"].double().flatten()
    want = sigma * clip / n  # std of N(0, (sigma C)^2) on the sum, divided by n
    # 200,000 draws: the sample std is within 0.5% of the truth with overwhelming probability
    assert float(z.std()) == pytest.approx(want, rel=5e-3)
    assert abs(float(z.mean())) < 5 * want / math.sqrt(z.numel())
    assert float(((z / want) ** 4).mean()) == pytest.approx(3.0, rel=0.05)  # Gaussian tails (kurtosis 3)
    assert torch.equal(out["policy.obs_mean"], mean["policy.obs_mean"])
    a = noisy_average(mean, n, clip, sigma, torch.Generator().manual_seed(2))["policy.w"]
    assert abs(float(torch.corrcoef(torch.stack([a.flatten(), out["policy.w"].flatten()]))[0, 1])) < 0.02


def test_epsilon_is_the_libraries_and_within_the_closed_form_rdp_bound():
    from dp_accounting import dp_event, rdp

    for sigma, rounds, delta in ((1.0, 20, 1e-5), (4.0, 10, 1e-5), (0.8, 3, 1e-6)):
        acc = rdp.RdpAccountant()
        acc.compose(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(sigma), rounds))
        assert epsilon(sigma, rounds, delta) == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
        # the Gaussian mechanism's RDP is alpha / (2 sigma^2) a round (Mironov 2017); with the
        # classic conversion eps <= min_alpha rounds * alpha / (2 sigma^2) + log(1/delta) / (alpha - 1);
        # the library's conversion is tighter, never looser
        bound = min(rounds * a / (2 * sigma**2) + math.log(1 / delta) / (a - 1) for a in np.linspace(1.01, 200, 20000))
        assert 0.8 * bound < epsilon(sigma, rounds, delta) <= bound
    assert epsilon(1.0, 0, 1e-5) == 0.0 and epsilon(0.0, 1, 1e-5) == math.inf
    assert epsilon(1.0, 10, 1e-5) < epsilon(1.0, 20, 1e-5)  # composition spends more


@pytest.mark.parametrize("settings, says", [
    ({"dp_noise": 1.0}, "dp_noise: needs dp_clip > 0"),
    ({"dp_clip": 1.0, "aggregation": "median"}, "aggregation: 'median' cannot run with dp_clip"),
    ({"dp_clip": 1.0, "aggregation": "trimmed-mean"}, "aggregation: 'trimmed-mean' cannot run with dp_clip"),
    ({"dp_clip": 1.0, "weighting": "samples"}, "weighting: 'samples' cannot run with dp_clip"),
    ({"dp_clip": 1.0, "obs_norm": "local"}, "obs_norm: 'local' cannot run with dp_clip"),
    ({"dp_clip": 1.0, "dp_epsilon_budget": 5.0}, "dp_epsilon_budget: without dp_noise"),
    ({"dp_clip": -1.0}, "dp_clip: must be a finite number >= 0"),
    ({"dp_clip": 1.0, "dp_delta": 1.0}, "dp_delta: must be in (0, 1)"),
])
def test_settings_that_void_the_guarantee_are_refused_by_name(settings, says):
    with pytest.raises(ValueError) as e:
        parse_run_config(settings)
    assert says in str(e.value)


def test_the_agents_alone_baseline_has_nothing_to_privatise():
    with pytest.raises(ValueError, match="algo: 'cql' cannot run with --set dp_clip"):
        SimConfig(algo="cql", dp_clip=1.0)


# -- adaptive clipping (Andrew et al. 2021) --------------------------------------------------
def _machine(norms, clip=None, **plan):
    """A machine over len(norms) agents (``clip``: where a resumed run's norm stands)."""
    from fedrl.federation.machine import Plan, RoundMachine

    agents = tuple(f"a{i}" for i in range(len(norms)))
    g = {"policy.w": torch.zeros(1000, dtype=torch.float64)}
    m = RoundMachine(Plan(rounds=10_000, agents=agents, weighting="uniform", **plan), g, clip=clip)
    return m, agents


def _round(m, agents, norms, noise=None):
    from fedrl.federation.machine import Update

    for a, n in zip(agents, norms):  # each update moves the global model by n
        w = m.global_state["policy.w"].clone()
        w[0] += n
        m.take(a, m.round, m.version, Update({"policy.w": w}, 1))
    closed = m.close(noise)
    return closed, m.commit(closed)


def test_adaptive_clipping_moves_the_norm_geometrically_to_the_target_quantile():
    from fedrl.federation.machine import Open

    norms = [0.5, 1.5, 2.0, 3.0, 4.0]
    m, agents = _machine(norms, dp_clip=1.0, dp_clip_quantile=0.5, dp_clip_lr=0.2)
    assert isinstance(m.begin(), Open)
    closed, _ = _round(m, agents, norms)
    # one of five updates within 1.0: the share is 0.2 (no count noise without dp_noise)
    assert closed.metrics["dp_clip"] == 1.0 and closed.metrics["dp_unclipped_fraction"] == pytest.approx(0.2)
    assert closed.metrics["dp_clip_next"] == pytest.approx(math.exp(-0.2 * (0.2 - 0.5)))
    assert m.clip == pytest.approx(math.exp(0.06))
    # the round clipped to 1.0: the update the average moved is the clipped updates' mean
    assert float(closed.state["policy.w"][0]) == pytest.approx((0.5 + 1 + 1 + 1 + 1) / 5)
    for _ in range(300):
        _round(m, agents, norms)
    # the median of the norms is 2.0: the norm settles within one step of it
    assert 2.0 * math.exp(-0.2 * 0.5) <= m.clip <= 2.0 * math.exp(0.2 * 0.5)
    m2, agents2 = _machine(norms, dp_clip=10.0, dp_clip_quantile=0.2, dp_clip_lr=0.2)
    m2.begin()
    for _ in range(300):
        _round(m2, agents2, norms)
    assert 0.5 <= m2.clip <= 1.5 * math.exp(0.2 * 0.8)  # the 0.2 quantile: between the smallest two


def test_a_resumed_machine_clips_to_the_norm_adaptive_clipping_had_reached():
    norms = [5.0, 5.0]
    m, agents = _machine(norms, dp_clip=1.0, dp_clip_quantile=0.5, clip=3.0)
    m.begin()
    closed, _ = _round(m, agents, norms)
    assert closed.metrics["dp_clip"] == 3.0 and float(closed.state["policy.w"][0]) == pytest.approx(3.0)


def test_the_clipped_counts_noise_has_its_std_and_the_updates_noise_the_adjusted_multiplier():
    from fedrl.federation.privacy import noisy_unclipped_fraction, update_noise

    g = torch.Generator().manual_seed(3)
    fr = np.array([noisy_unclipped_fraction([0.5, 2.0, 2.0, 2.0, 2.0], 1.0, 1.5, g) for _ in range(20_000)])
    # the centred count is -1.5 +- N(0, 1.5^2); over 5 agents, plus 1/2: 0.2 +- 0.3
    assert float(fr.mean()) == pytest.approx(0.2, abs=0.3 * 5 / math.sqrt(20_000))
    assert float(fr.std()) == pytest.approx(1.5 / 5, rel=0.03)
    sigma, sb = 1.1, 1.0
    su = update_noise(sigma, sb)
    assert su == pytest.approx((sigma ** -2 - (2 * sb) ** -2) ** -0.5) and su > sigma
    norms = [0.0] * 5
    m, agents = _machine(norms, dp_clip=2.0, dp_noise=sigma, dp_clip_quantile=0.5, dp_count_noise=sb)
    m.begin()
    closed, _ = _round(m, agents, norms, torch.Generator().manual_seed(4))
    z = closed.state["policy.w"]  # the updates are zero: the average is the noise
    assert float(z.std()) == pytest.approx(su * 2.0 / 5, rel=0.08)  # 1,000 draws
    assert noisy_unclipped_fraction([1.0, 1.0 + 1e-12, 0.2], 1.0, 0.0, None) == pytest.approx(2 / 3)  # at it: within
    with pytest.raises(ValueError, match="must be above 0.55"):
        update_noise(1.1, 0.5)


def test_adaptive_clipping_spends_what_one_gaussian_of_the_runs_multiplier_does():
    """The two mechanisms of a round (the updates' and the count's), composed by the accountant,
    spend the epsilon of one Gaussian of multiplier sigma: the run's budget means what it says."""
    from dp_accounting import dp_event, rdp

    for sigma, sb, rounds in ((1.1, 1.0, 10), (4.0, 2.5, 20), (0.8, 5.0, 3)):
        adaptive = epsilon(sigma, rounds, 1e-5, sb)
        assert adaptive == pytest.approx(epsilon(sigma, rounds, 1e-5), rel=1e-6)
        acc = rdp.RdpAccountant()  # without the adjustment the two would spend more
        acc.compose(dp_event.SelfComposedDpEvent(dp_event.ComposedDpEvent(
            [dp_event.GaussianDpEvent(sigma), dp_event.GaussianDpEvent(2 * sb)]), rounds))
        assert acc.get_epsilon(1e-5) > adaptive * (1 + 1e-3)


@pytest.mark.parametrize("settings, says", [
    ({"dp_clip": 1.0, "dp_clip_quantile": 1.0}, "dp_clip_quantile: a share in (0, 1)"),
    ({"dp_clip_quantile": 0.5}, "dp_clip_quantile: needs dp_clip > 0"),
    ({"dp_clip": 1.0, "dp_count_noise": 1.0}, "dp_count_noise: needs dp_clip_quantile"),
    ({"dp_clip": 1.0, "dp_clip_quantile": 0.5, "dp_clip_lr": 0.0}, "dp_clip_lr: must be in (0, 10]"),
    # settings the arithmetic cannot take (each once ended the aggregator's clock, or stored Inf)
    ({"dp_clip": 1.0, "dp_clip_quantile": 0.5, "dp_clip_lr": 1e4}, "dp_clip_lr: must be in (0, 10], got 10000"),
    ({"dp_clip": 1.0, "dp_clip_quantile": 0.5, "dp_noise": 1.0, "dp_count_noise": 1e300},
     "dp_count_noise: 0 (off) or in [0.001, 10000], got 1e+300"),
    ({"dp_clip": 1.0, "dp_clip_quantile": 0.5, "dp_count_noise": 1e-160}, "dp_count_noise: 0 (off) or in [0.001"),
    ({"dp_clip": 1.0, "dp_noise": 1e155}, "dp_noise: 0 (off) or in [0.001, 1000], got 1e+155"),
    ({"dp_clip": 1.0, "dp_noise": 1e308, "dp_epsilon_budget": 8.0}, "dp_noise: 0 (off) or in [0.001, 1000]"),
    ({"dp_clip": 1e20, "dp_noise": 1e20}, "dp_clip: 0 (off) or in [1e-06, 1e+06], got 1e+20"),
    ({"dp_clip": 1e-300}, "dp_clip: 0 (off) or in [1e-06, 1e+06], got 1e-300"),
    ({"dp_clip": 1.0, "dp_clip_quantile": 0.5, "dp_noise": 1.1, "agents": 5},
     "dp_count_noise: 0.25 (agents / 20, as it is unset) leaves nothing of dp_noise 1.1 for the updates: set it "
     "above 0.55"),
])
def test_adaptive_clipping_settings_are_checked_by_name(settings, says):
    with pytest.raises(ValueError) as e:
        parse_run_config(settings)
    assert says in str(e.value)
    for name, (low, high) in (("dp_clip", CLIP_RANGE), ("dp_noise", NOISE_RANGE)):  # the ends are taken
        for v in (low, high):
            assert getattr(parse_run_config({"dp_clip": 1.0, name: v}), name) == v
    assert parse_run_config({"dp_clip": 1.0, "dp_clip_quantile": 0.5, "dp_noise": 1.1, "agents": 30}).dp_clip_lr == 0.2


def test_under_secure_aggregation_each_agent_adds_its_share_of_both_noises():
    """Any t agents' shares add up to the central mechanisms: the update's noise at the raised
    multiplier times the round's norm, and the count's at its std (a statistical test)."""
    from fedrl.federation.privacy import count_share, noise_share_std, update_noise

    cfg = parse_run_config({"agents": 5, "secagg_threshold": 3, "dp_clip": 1.0, "dp_noise": 1.1,
                            "dp_clip_quantile": 0.5, "dp_count_noise": 1.0})
    assert noise_share_std(cfg, 2.5) == pytest.approx(update_noise(1.1, 1.0) * 2.5 / math.sqrt(3))
    fixed = parse_run_config({"agents": 5, "secagg_threshold": 3, "dp_clip": 1.0, "dp_noise": 1.1})
    assert noise_share_std(fixed, 1.0) == pytest.approx(1.1 / math.sqrt(3))
    assert noise_share_std(parse_run_config({"agents": 5, "secagg_threshold": 3, "dp_clip": 1.0}), 1.0) == 0.0
    g = torch.Generator().manual_seed(5)
    sums = np.array([sum(count_share(True, 1.0, 3, g) for _ in range(3)) for _ in range(20_000)])
    assert float(sums.mean()) == pytest.approx(1.5, abs=5 / math.sqrt(20_000))
    assert float(sums.std()) == pytest.approx(1.0, rel=0.03)  # three shares of 1/3 variance each
    assert count_share(False, 0.0, 3, None) == -0.5


def test_an_agent_takes_the_rounds_norm_from_its_task_only_where_adaptive_clipping_is_masked():
    from fedrl.federation.privacy import task_clip
    from fedrl.federation.runconfig import RunConfig

    masked = RunConfig(agents=3, secagg_threshold=2, dp_clip=1.0, dp_noise=1.0, dp_clip_quantile=0.5,
                       dp_count_noise=1.0)
    assert task_clip(masked, 0.37, 4) == 0.37
    # a fixed norm, or adaptive clipping in the clear (the aggregator clips): the task gives none
    assert task_clip(RunConfig(agents=3, secagg_threshold=2, dp_clip=1.0, dp_noise=1.0), 0.0, 4) is None
    assert task_clip(RunConfig(agents=3, dp_clip=1.0, dp_noise=1.0, dp_clip_quantile=0.5, dp_count_noise=1.0),
                     0.0, 4) is None
    with pytest.raises(ValueError, match="round 4's task gives no clipping norm \\(an aggregator too old"):
        task_clip(masked, 0.0, 4)
    for bad in (-1.0, math.inf, math.nan):  # an update left unclipped would break the promised privacy
        with pytest.raises(ValueError, match=f"round 4's task gives the clipping norm {bad!r}, not a positive"):
            task_clip(masked, bad, 4)


def test_a_secure_run_has_its_own_cap_on_agents():
    """Its memory grows with n masked vectors and n^2 sealed shares: 100 agents, not 10,000."""
    from fedrl.federation.runconfig import SECAGG_MAX_AGENTS

    assert parse_run_config({"agents": SECAGG_MAX_AGENTS, "secagg_threshold": 2}).agents == SECAGG_MAX_AGENTS
    with pytest.raises(ValueError, match=f"a secure run \\(secagg_threshold\\) takes at most {SECAGG_MAX_AGENTS} agents"):
        parse_run_config({"agents": SECAGG_MAX_AGENTS + 1, "secagg_threshold": 2})
    assert parse_run_config({"agents": SECAGG_MAX_AGENTS + 1}).agents == SECAGG_MAX_AGENTS + 1  # plain runs: the general cap
