"""Loss terms against values computed by hand on tiny tensors."""

import math

import pytest
import torch

from fedrl.algos.bc import bc_mse_loss, bc_nll_loss
from fedrl.algos.cql import cql_penalty, td_loss, td_target, temperature_loss
from fedrl.algos.drpo import actor_loss
from fedrl.algos.nets import TanhGaussianPolicy


def test_td_target_masks_terminals_and_optionally_backs_up_entropy():
    r, d, q = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0]), torch.tensor([10.0, 10.0])
    assert torch.allclose(td_target(r, d, q, 0.9), torch.tensor([1 + 9.0, 2.0]))
    lp = torch.tensor([-1.0, -1.0])
    # y = r + g (1-d)(q - alpha logp) = 1 + 0.9 * (10 + 0.5)
    assert torch.allclose(td_target(r, d, q, 0.9, lp, 0.5), torch.tensor([1 + 0.9 * 10.5, 2.0]))


def test_td_loss_is_half_mse_summed_over_critics():
    q = torch.tensor([[1.0, 2.0], [3.0, 0.0]])  # (E=2, B=2)
    y = torch.tensor([0.0, 2.0])
    # critic 0: 0.5 * mean(1, 0) = 0.25; critic 1: 0.5 * mean(9, 4) = 3.25
    assert td_loss(q, y).item() == pytest.approx(3.5)


def test_cql_penalty_matches_hand_logsumexp():
    # E=1, B=1, N=1, |A|=1: log uniform density = log 0.5
    q_data = torch.tensor([[1.0]])
    q_rand, q_pi, q_next = torch.tensor([[[2.0]]]), torch.tensor([[[3.0]]]), torch.tensor([[[0.5]]])
    lp, lp_next = torch.tensor([[-1.0]]), torch.tensor([[0.2]])
    terms = [2.0 - math.log(0.5), 3.0 + 1.0, 0.5 - 0.2]
    expected = math.log(sum(math.exp(t) for t in terms)) - 1.0
    got = cql_penalty(q_data, q_rand, q_pi, lp, q_next, lp_next, act_dim=1)
    assert got.item() == pytest.approx(expected, rel=1e-6)


def test_cql_penalty_sums_over_critics_and_means_over_batch():
    q_data = torch.zeros(2, 3)
    q = torch.zeros(2, 3, 4)
    lp = torch.zeros(3, 4)
    # every term: logsumexp of 12 values [-4 log .5]*4 + [0]*8 -> same per sample
    per = math.log(4 * math.exp(-2 * math.log(0.5)) + 8)
    assert cql_penalty(q_data, q, q, lp, q, lp, act_dim=2).item() == pytest.approx(2 * per, rel=1e-6)


def test_cql_penalty_gives_no_gradient_to_proposal_log_probs():
    lp = torch.zeros(1, 1, requires_grad=True)
    q = torch.zeros(1, 1, 1, requires_grad=True)
    cql_penalty(torch.zeros(1, 1), q, q, lp, q, lp, 1).backward()
    assert lp.grad is None and q.grad is not None


def test_temperature_loss():
    la = torch.tensor(0.5, requires_grad=True)
    loss = temperature_loss(la, torch.tensor([-1.0, -3.0]), target_entropy=-3.0)
    assert loss.item() == pytest.approx(-0.5 * ((-1 - 3) + (-3 - 3)) / 2)
    loss.backward()
    assert la.grad.item() == pytest.approx(5.0)


def test_actor_loss_raw_combines_all_terms():
    q = torch.tensor([10.0, 20.0])
    lp = torch.tensor([-1.0, -2.0])
    nd, ng = torch.tensor([2.0, 4.0]), torch.tensor([1.0, 1.0])
    out = actor_loss(q, lp, 0.5, nd, ng, lambda1=0.1, lambda2=0.2)
    # -15 + 0.5 * -1.5 + 0.1 * 3 + 0.2 * 1
    assert out.total.item() == pytest.approx(-15 - 0.75 + 0.3 + 0.2)
    assert out.q_term.item() == pytest.approx(-15)
    assert out.reg_data.item() == pytest.approx(3) and out.reg_global.item() == pytest.approx(1)


def test_actor_loss_normalized_scales_q_by_detached_mean_abs():
    q = torch.tensor([100.0, -300.0], requires_grad=True)
    out = actor_loss(q, torch.zeros(2), 0.0, None, None, 0.0, 0.0, q_scale="normalized", q_norm=2.5)
    # -(2.5 / 200) * (-100) = 1.25
    assert out.q_term.item() == pytest.approx(1.25)
    out.total.backward()
    assert torch.allclose(q.grad, torch.full((2,), -2.5 / 200 / 2))  # mean|Q| treated as constant
    with pytest.raises(ValueError, match="q_scale"):
        actor_loss(q, torch.zeros(2), 0.0, None, None, 0.0, 0.0, q_scale="bogus")


def test_regularisers_off_contribute_zero():
    out = actor_loss(torch.ones(3), torch.zeros(3), 0.0, None, None, 0.1, 0.2)
    assert out.total.item() == pytest.approx(-1.0)


def test_tanh_gaussian_log_prob_matches_change_of_variables():
    mean, log_std = torch.tensor([[0.3, -0.2]]), torch.tensor([[-0.5, 0.1]])
    a = torch.tensor([[0.4, -0.7]])
    u = torch.atanh(a)
    base = torch.distributions.Normal(mean, log_std.exp()).log_prob(u).sum()
    expected = base - torch.log(1 - a.pow(2)).sum()
    assert TanhGaussianPolicy.log_prob_from(mean, log_std, a).item() == pytest.approx(expected.item(), rel=1e-5)


def test_sample_log_prob_agrees_with_log_prob_of_the_sample():
    g = torch.Generator().manual_seed(0)
    mean, log_std = torch.randn(64, 3, generator=g), torch.randn(64, 3, generator=g) * 0.3
    a, lp = TanhGaussianPolicy.sample_from(mean, log_std, g)
    inner = a.abs().max(-1).values < 0.999  # away from float32 saturation
    assert torch.allclose(lp[inner], TanhGaussianPolicy.log_prob_from(mean, log_std, a)[inner], atol=1e-3)


def test_log_prob_finite_with_gradient_at_action_bounds():
    mean = torch.zeros(4, 2, requires_grad=True)
    log_std = torch.zeros(4, 2, requires_grad=True)
    a = torch.tensor([[1.0, -1.0], [1.0, 1.0], [-1.0, -1.0], [0.0, 1.0]])
    lp = TanhGaussianPolicy.log_prob_from(mean, log_std, a)
    assert torch.isfinite(lp).all()
    lp.sum().backward()
    assert torch.isfinite(mean.grad).all() and torch.isfinite(log_std.grad).all()


def test_bc_losses():
    mean = torch.zeros(2, 1)
    acts = torch.tensor([[0.5], [-0.5]])
    assert bc_mse_loss(mean, acts).item() == pytest.approx(0.25)
    nll = bc_nll_loss(mean, torch.zeros(2, 1), acts)
    assert nll.item() == pytest.approx(-TanhGaussianPolicy.log_prob_from(mean, torch.zeros(2, 1), acts).mean().item())
