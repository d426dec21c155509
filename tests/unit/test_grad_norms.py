"""The actor's gradient norm from each term of L_pi (issue 68's "why the peak falls").

``DRPOLearner.update(..., grad_norms=True)`` reports, per term of eq. (local_updating_pi) as
weighted in L_pi, the norm of its gradient with respect to the policy's weights. Checked here
against each term rebuilt by hand with ``torch.distributions`` (not the learner's own helpers),
on the learner's state and draws of that step; and the step it probes must train exactly as an
unprobed step (a probe that leaked into the update would move every later number).
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from torch.distributions import Normal

from fedrl.algos import BCConfig, DRPOConfig, cql_config
from fedrl.algos.drpo import draw_noise
from fedrl.data.buffer import TensorBuffer
from fedrl.data.d4rl import Transitions
from fedrl.federation.round import LocalTrainer, build_learner

O, A, B = 5, 2, 64
CFG = DRPOConfig(hidden=(16, 16), batch_size=B, cql_n_actions=3, lambda1=0.7, lambda2=1.3, alpha_init=0.4,
                 cql_calibration="none")


def transitions(n: int = 300, seed: int = 0) -> Transitions:
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=(n + 1, O))
    return Transitions(obs[:-1], np.tanh(rng.normal(size=(n, A))) * 0.95, rng.uniform(0, 1, n), obs[1:],
                       (rng.uniform(size=n) < 0.05).astype(np.float64), np.arange(n) // 50)


def buffer64() -> TensorBuffer:
    buf = TensorBuffer(transitions(), np.zeros(O), np.ones(O), torch.device("cpu"))
    for k in ("obs", "next_obs", "actions", "rewards", "dones"):
        setattr(buf, k, getattr(buf, k).double())
    return buf


def by_hand(learner, batch, noise, cfg: DRPOConfig) -> dict[str, float]:
    """Each weighted term's gradient norm, from the networks and the step's draws alone."""
    policy = copy.deepcopy(learner.policy)
    params = [p for p in policy.parameters() if p.requires_grad]
    alpha = float(learner.alpha)

    def tanh_gauss_log_prob(mean, log_std, u):
        return (Normal(mean, log_std.exp()).log_prob(u) - torch.log1p(-torch.tanh(u) ** 2)).sum(-1)

    def norm(loss):
        return float(torch.sqrt(sum(g.pow(2).sum() for g in torch.autograd.grad(loss, params, retain_graph=True))))

    mean, log_std = policy(batch.obs)
    u = mean + log_std.exp() * noise.pi
    q = learner.critic(batch.obs, torch.tanh(u)).min(dim=0).values
    log_pi = tanh_gauss_log_prob(mean, log_std, u)
    a_data = batch.actions.clamp(-1 + cfg.action_clip_eps, 1 - cfg.action_clip_eps)
    with torch.no_grad():
        g_mean, g_log_std = learner.global_policy(batch.obs)
        g_a = torch.tanh(g_mean + g_log_std.exp() * noise.glob[:, 0])
    g_a = g_a.clamp(-1 + cfg.action_clip_eps, 1 - cfg.action_clip_eps)
    terms = {"grad_q": -q.mean(), "grad_entropy": alpha * log_pi.mean(),
             "grad_lambda1": cfg.lambda1 * -tanh_gauss_log_prob(mean, log_std, torch.atanh(a_data)).mean(),
             "grad_lambda2": cfg.lambda2 * -tanh_gauss_log_prob(mean, log_std, torch.atanh(g_a)).mean()}
    out = {k: norm(v) for k, v in terms.items()}
    out["grad_actor"] = norm(sum(terms.values()))
    return out


def test_each_terms_gradient_norm_is_that_terms_own(float64):
    buf = buffer64()
    learner = build_learner(CFG, O, A, torch.device("cpu"), 1, 2)
    for _ in range(5):  # away from the initial weights: the global policy differs from pi
        learner.update(buf.sample(B, learner.gen))
    learner.global_policy.load_state_dict(build_learner(CFG, O, A, torch.device("cpu"), 3, 4).policy.state_dict())
    batch = buf.sample(B, learner.gen)
    noise = draw_noise(learner.gen, (), B, A, CFG, True, batch.obs.device, batch.obs.dtype)
    want = by_hand(learner, batch, noise, CFG)
    got = {k: float(v) for k, v in learner.update(batch, noise, grad_norms=True).items() if k.startswith("grad_")}
    assert set(got) == set(want)
    for k in want:
        assert want[k] > 1e-6, (k, want[k])  # every term is on and steers the actor
        assert got[k] == pytest.approx(want[k], rel=1e-9), (k, got[k], want[k])


def test_a_term_that_is_off_has_norm_zero(float64):
    cfg = dataclasses.replace(cql_config(CFG), auto_alpha=False, alpha_init=0.0)
    buf = buffer64()
    learner = build_learner(cfg, O, A, torch.device("cpu"), 1, 2)
    got = learner.update(buf.sample(B, learner.gen), grad_norms=True)
    assert float(got["grad_lambda1"]) == float(got["grad_lambda2"]) == float(got["grad_entropy"]) == 0.0
    assert float(got["grad_q"]) > 0 and float(got["grad_actor"]) == pytest.approx(float(got["grad_q"]), rel=1e-12)


def test_probed_rounds_train_exactly_as_unprobed_ones():
    torch.set_num_threads(1)
    tr = transitions()
    runs = {}
    for every in (0, 3):
        t = LocalTrainer(0, CFG, tr, np.zeros(O), np.ones(O), seed=7, device=torch.device("cpu"), grad_norms_every=every)
        state = t.learner.shared_state(False)
        for _ in range(2):
            res = t.train_round(state, 10)
            state = res.state
        runs[every] = (res, t.learner.checkpoint())
    (plain, ck0), (probed, ck3) = runs[0], runs[3]
    for k in ck0:
        assert torch.equal(ck0[k], ck3[k]), k
    assert not any(k.startswith("grad_") for k in plain.metrics)
    assert {"grad_q", "grad_entropy", "grad_lambda1", "grad_lambda2", "grad_actor"} <= set(probed.metrics)
    assert {k: v for k, v in probed.metrics.items() if not k.startswith("grad_")} == plain.metrics


def test_probe_interval_is_checked_and_bc_is_left_alone():
    with pytest.raises(ValueError, match="grad_norms_every"):
        LocalTrainer(0, CFG, transitions(), np.zeros(O), np.ones(O), seed=0, device=torch.device("cpu"),
                     grad_norms_every=-1)
    bc = LocalTrainer(0, BCConfig(hidden=(16, 16), batch_size=B), transitions(), np.zeros(O), np.ones(O), seed=0,
                      device=torch.device("cpu"), grad_norms_every=2)
    res = bc.train_round(bc.learner.shared_state(False), 4)
    assert "bc_loss" in res.metrics and not any(k.startswith("grad_") for k in res.metrics)
