"""The learners' updates against a plain re-derivation of the paper's equations.

Each update's gradients are compared with those of an independent, deliberately unoptimised
implementation written here from the equations (one network per critic member, torch.distributions
for the log-densities, nothing shared with ``fedrl.algos`` or ``fedrl.algos.nets`` but the weights). The
reference draws its noise from a copy of the learner's generator in the learner's order. So any
one-line mis-wiring (max instead of min of the twin critics, the online critic in the TD target,
s' where s belongs, a sign, a coefficient, the actor's -Q reaching the critic's weights, pi
instead of pi_bar) changes a gradient and fails here. Gradients, not parameter steps, are
compared: Adam divides a gradient by its own scale, which would hide a wrong overall factor.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.distributions import Normal

from fedrl.algos import BCConfig, DRPOConfig, cql_config
from fedrl.algos.base import Batch
from fedrl.federation.round import build_learner

B, O, A = 24, 5, 3
CFG = DRPOConfig(hidden=(16, 16), batch_size=B, cql_n_actions=4, global_samples=2, lambda1=0.3, lambda2=0.7,
                 cql_weight=3.0, td_weight=2.0, gamma=0.9, tau=0.1, alpha_init=0.5)


def make_batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randn(B, O, generator=g), torch.rand(B, A, generator=g) * 1.8 - 0.9,
                 torch.randn(B, generator=g), torch.randn(B, O, generator=g) + 1.0,
                 (torch.rand(B, generator=g) < 0.3).float(),
                 torch.randn(B, generator=g) * 0.3)  # returns-to-go: near Q here, so max() picks both


def learner_with_state(cfg: DRPOConfig, seed: int = 0):
    """A learner whose critic, target critic and global policy all differ (so that using one in
    place of another shows), with a few steps of history."""
    ln = build_learner(cfg, O, A, torch.device("cpu"), seed, seed + 1)
    with torch.no_grad():
        for p in ln.critic_target.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
        for p in ln.global_policy.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(8)))
    return ln


def capture_grads(ln) -> dict[str, list[torch.Tensor]]:
    """Record each optimiser's gradients when it steps (what the update computed)."""
    seen: dict[str, list[torch.Tensor]] = {}
    opts = {"actor": ln.actor_opt, "critic": ln.critic_opt}
    if getattr(ln, "log_alpha", None) is not None:
        opts["alpha"] = ln.alpha_opt
    for name, opt in opts.items():
        orig = opt.step

        def step(orig=orig, opt=opt, name=name):
            seen[name] = [p.grad.clone() if p.grad is not None else None for p in opt.params]
            orig()

        opt.step = step
    return seen


# -- the reference, from the equations ----------------------------------------------------------
def policy_fn(params, obs, log_std_min, log_std_max):
    w0, b0, w1, b1, wh, bh = params
    h = torch.relu(torch.relu(obs @ w0.T + b0) @ w1.T + b1)
    out = h @ wh.T + bh
    mean, log_std = out[..., :A], out[..., A:]
    return mean, log_std.clamp(log_std_min, log_std_max)


def tanh_normal_log_prob(mean, log_std, u):
    """log density of a = tanh(u), u ~ N(mean, std): change of variables, summed over dims."""
    return (Normal(mean, log_std.exp()).log_prob(u) - torch.log(1 - torch.tanh(u) ** 2)).sum(-1)


def q_member(params, i, obs, act):
    """Critic member i as its own network: (..., O), (..., A) -> (...)."""
    w0, b0, w1, b1, wo, bo = params
    x = torch.cat([obs.expand(*act.shape[:-1], obs.shape[-1]), act], -1)
    h = torch.relu(torch.relu(x @ w0[i] + b0[i, 0]) @ w1[i] + b1[i, 0])
    return (h @ wo[i] + bo[i, 0]).squeeze(-1)


def reference_drpo_grads(ln, batch: Batch, gen: torch.Generator):
    cfg, n = ln.cfg, ln.cfg.cql_n_actions
    pp = [p.detach().clone().requires_grad_(True) for p in ln.policy.parameters()]
    cp = [p.detach().clone().requires_grad_(True) for p in ln.critic.parameters()]
    tp = [p.detach().clone() for p in ln.critic_target.parameters()]
    gp = [p.detach().clone() for p in ln.global_policy.parameters()]
    log_alpha = ln.log_alpha.detach().clone().requires_grad_(True)
    lo, hi = cfg.log_std_min, cfg.log_std_max
    obs, act, rew, nobs, done, returns = batch

    mean, log_std = policy_fn(pp, obs, lo, hi)
    u = mean + log_std.exp() * torch.randn(B, A, generator=gen)
    a_pi, log_pi = torch.tanh(u), tanh_normal_log_prob(mean, log_std, u)
    target_entropy = -float(A) if cfg.target_entropy is None else cfg.target_entropy
    alpha_loss = -(log_alpha * (log_pi.detach() + target_entropy)).mean()
    alpha = log_alpha.detach().exp()

    a_clip = act.clamp(-1 + cfg.action_clip_eps, 1 - cfg.action_clip_eps)
    nll_data = -tanh_normal_log_prob(mean, log_std, torch.atanh(a_clip))
    nll_global = torch.zeros(B)
    if cfg.lambda2 > 0:  # (the learner draws pi_bar's actions only when the term is on)
        with torch.no_grad():  # pi_bar: the frozen global policy
            gm, gls = policy_fn(gp, obs, lo, hi)
            gu = gm.unsqueeze(1) + gls.exp().unsqueeze(1) * torch.randn(B, cfg.global_samples, A, generator=gen)
        g_a = torch.tanh(gu).clamp(-1 + cfg.action_clip_eps, 1 - cfg.action_clip_eps)
        nll_global = -tanh_normal_log_prob(mean.unsqueeze(1), log_std.unsqueeze(1), torch.atanh(g_a)).mean(1)

    detached = [p.detach() for p in cp]  # the actor's Q: gradients reach the action only
    q_pi = torch.minimum(q_member(detached, 0, obs, a_pi), q_member(detached, 1, obs, a_pi))
    actor = (alpha * log_pi).mean() - q_pi.mean() + cfg.lambda1 * nll_data.mean() + cfg.lambda2 * nll_global.mean()

    with torch.no_grad():
        nm, nls = policy_fn(pp, nobs, lo, hi)
        nu = nm.unsqueeze(1) + nls.exp().unsqueeze(1) * torch.randn(B, n + 1, A, generator=gen)
        next_a, next_lp = torch.tanh(nu), tanh_normal_log_prob(nm.unsqueeze(1), nls.unsqueeze(1), nu)
        a1 = torch.tanh(nm) if cfg.target_action == "mean" else next_a[:, 0]
        q_next = torch.minimum(q_member(tp, 0, nobs, a1), q_member(tp, 1, nobs, a1))
        v = q_next - alpha * next_lp[:, 0] if cfg.backup_entropy else q_next  # the target action's own log-prob
        y = rew + cfg.gamma * (1 - done) * v
        cu = mean.detach().unsqueeze(1) + log_std.detach().exp().unsqueeze(1) * torch.randn(B, n, A, generator=gen)
        cur_a, cur_lp = torch.tanh(cu), tanh_normal_log_prob(mean.detach().unsqueeze(1), log_std.detach().unsqueeze(1), cu)
        rand_a = torch.rand(B, n, A, generator=gen) * 2 - 1
    s = obs.unsqueeze(1)
    critic = 0.0
    for i in range(2):
        q_data = q_member(cp, i, obs, act)
        td = ((q_data - y) ** 2).mean()  # the full MSE; td_weight multiplies its half
        q_cur, q_nxt = q_member(cp, i, s, cur_a), q_member(cp, i, s, next_a[:, 1:])
        if cfg.cql_calibration == "returns":  # Cal-QL: the policy's actions no lower than the data's return
            q_cur, q_nxt = torch.maximum(q_cur, returns[:, None]), torch.maximum(q_nxt, returns[:, None])
        if cfg.cql_calibration == "returns-gradient":  # own values; no push below the data's return
            below_cur, below_nxt = q_cur < returns[:, None], q_nxt < returns[:, None]
            assert below_cur.any() and (~below_cur).any(), "the batch must exercise both sides of the floor"
            q_cur = torch.where(below_cur, q_cur.detach(), q_cur)
            q_nxt = torch.where(below_nxt, q_nxt.detach(), q_nxt)
        lse = torch.logsumexp(torch.cat([q_member(cp, i, s, rand_a) - A * math.log(0.5),
                                         q_cur - cur_lp, q_nxt - next_lp[:, 1:]], 1), 1)
        critic = critic + cfg.td_weight * 0.5 * td + cfg.cql_weight * (lse - q_data).mean()
    return {"actor": torch.autograd.grad(actor, pp), "critic": torch.autograd.grad(critic, cp),
            "alpha": torch.autograd.grad(alpha_loss, [log_alpha])}


def assert_grads_close(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None, f"{what}[{i}] got no gradient"
        torch.testing.assert_close(g, w, rtol=2e-4, atol=2e-5, msg=lambda m: f"{what}[{i}]: {m}")


CONFIGS = {
    "drpo": CFG,
    "drpo-entropy-target": dataclasses.replace(CFG, target_entropy=-0.5),
    "cql": cql_config(CFG),
    "cql-mean-target": cql_config(dataclasses.replace(CFG, target_action="mean")),
    "drpo-backup-entropy": dataclasses.replace(CFG, backup_entropy=True),
    "drpo-calibrated": dataclasses.replace(CFG, cql_calibration="returns"),
    "drpo-calibrated-gradient": dataclasses.replace(CFG, cql_calibration="returns-gradient"),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_drpo_update_gradients_equal_the_equations(name):
    cfg = CONFIGS[name]
    ln = learner_with_state(cfg)
    batch = make_batch()
    for k in range(3):  # from a learner with history, so Adam state and targets are not at their start
        ln.update(make_batch(10 + k))
    gen = torch.Generator()
    gen.set_state(ln.gen.get_state())
    want = reference_drpo_grads(ln, batch, gen)
    before_target = [p.detach().clone() for p in ln.critic_target.parameters()]
    before_global = [p.detach().clone() for p in ln.global_policy.parameters()]
    seen = capture_grads(ln)
    ln.update(batch)
    for k in ("actor", "critic", "alpha"):
        assert_grads_close(seen[k], want[k], f"{name} {k} gradient")
    # Polyak: target <- (1 - tau) target + tau critic (after the critic's step)
    for t, t0, c in zip(ln.critic_target.parameters(), before_target, ln.critic.parameters()):
        torch.testing.assert_close(t.detach(), (1 - cfg.tau) * t0 + cfg.tau * c.detach(), rtol=1e-5, atol=1e-6)
    # pi_bar is frozen: no gradient, no change
    assert all(p.grad is None for p in ln.global_policy.parameters())
    assert all(torch.equal(p, q) for p, q in zip(ln.global_policy.parameters(), before_global))
    assert all(p.grad is None for p in ln.critic_target.parameters())


def test_the_reference_itself_notices_a_mis_wiring():
    """The comparison has teeth: the same reference against a learner whose TD target uses the
    online critic (a one-line mistake) disagrees."""
    ln = learner_with_state(CFG)
    batch = make_batch()
    gen = torch.Generator()
    gen.set_state(ln.gen.get_state())
    want = reference_drpo_grads(ln, batch, gen)
    ln.critic_target = ln.critic  # the mistake
    seen = capture_grads(ln)
    ln.update(batch)
    with pytest.raises(AssertionError):
        assert_grads_close(seen["critic"], want["critic"], "critic")


def test_actor_gradient_reaches_neither_critic_nor_global_policy():
    """The actor loss alone: its gradient flows into the policy only (pi's action into Q, not Q's
    weights; pi_bar's samples are constants)."""
    ln = learner_with_state(CFG)
    obs = make_batch().obs
    mean, log_std = ln.policy(obs)
    from fedrl.algos.nets import TanhGaussianPolicy

    a, _ = TanhGaussianPolicy.sample_from(mean, log_std, ln.gen)
    ln.critic.requires_grad_(False)
    q = ln.critic(obs, a).min(0).values
    ln.critic.requires_grad_(True)
    (-q.mean()).backward()
    assert all(p.grad is None for p in ln.critic.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ln.policy.parameters())


@pytest.mark.parametrize("loss", ["nll", "mse"])
def test_bc_update_gradient_equals_the_equation(loss):
    cfg = BCConfig(hidden=(16, 16), batch_size=B, loss=loss)
    ln = build_learner(cfg, O, A, torch.device("cpu"), 0, 1)
    batch = make_batch()
    pp = [p.detach().clone().requires_grad_(True) for p in ln.policy.parameters()]
    mean, log_std = policy_fn(pp, batch.obs, cfg.log_std_min, cfg.log_std_max)
    if loss == "nll":
        a = batch.actions.clamp(-1 + cfg.action_clip_eps, 1 - cfg.action_clip_eps)
        ref = -tanh_normal_log_prob(mean, log_std, torch.atanh(a)).mean()
    else:
        ref = ((torch.tanh(mean) - batch.actions) ** 2).sum(-1).mean()
    want = torch.autograd.grad(ref, pp)
    seen: dict = {}
    orig = ln.opt.step

    def step():
        seen["g"] = [p.grad.clone() for p in ln.opt.params]
        orig()

    ln.opt.step = step
    out = ln.update(batch)
    assert_grads_close(seen["g"], want, f"bc-{loss}")
    torch.testing.assert_close(out["bc_loss"], ref.detach())


def test_begin_round_sets_pi_and_pi_bar_keeps_critics_and_resets_only_the_actor_optimiser():
    ln = learner_with_state(CFG)
    for k in range(2):
        ln.update(make_batch(k))
    critic = {k: v.clone() for k, v in ln.critic.state_dict().items()}
    target = {k: v.clone() for k, v in ln.critic_target.state_dict().items()}
    critic_moments = {id(p): s["exp_avg"].clone() for p, s in ln.critic_opt.state.items()}
    other = build_learner(CFG, O, A, torch.device("cpu"), 99, 100)
    g = other.shared_state()
    assert set(g) == {f"policy.{k}" for k in other.policy.state_dict()}  # the policy only is shared
    ln.begin_round(g)
    for k, v in other.policy.state_dict().items():
        assert torch.equal(ln.policy.state_dict()[k], v) and torch.equal(ln.global_policy.state_dict()[k], v)
    assert all(torch.equal(ln.critic.state_dict()[k], v) for k, v in critic.items())
    assert all(torch.equal(ln.critic_target.state_dict()[k], v) for k, v in target.items())
    assert not ln.actor_opt.state  # fresh Adam for the new policy
    assert {id(p): s["exp_avg"] for p, s in ln.critic_opt.state.items()}.keys() == critic_moments.keys()
    assert all(torch.equal(s["exp_avg"], critic_moments[id(p)]) for p, s in ln.critic_opt.state.items())
    # and the two policies are separate tensors: a step moves pi, not pi_bar
    ln.update(make_batch(5))
    assert not torch.equal(ln.policy.head.weight, ln.global_policy.head.weight)
    assert torch.equal(ln.global_policy.head.weight, other.policy.head.weight)


def test_bc_begin_round_adopts_the_policy_and_starts_adam_over():
    cfg = BCConfig(hidden=(16, 16), batch_size=B)
    ln = build_learner(cfg, O, A, torch.device("cpu"), 0, 1)
    ln.update(make_batch())
    assert ln.opt.state
    other = build_learner(cfg, O, A, torch.device("cpu"), 5, 6)
    ln.begin_round(other.shared_state())
    assert not ln.opt.state
    assert all(torch.equal(a, b) for a, b in zip(ln.policy.state_dict().values(), other.policy.state_dict().values()))
