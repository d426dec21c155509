"""One-line mis-wirings of the learning code, each of which the test suite must notice.

    python -m benchmarks.mutants [--only NAME,...] [--list] [--tests FILE,...] [--drop FILE,...]

Each mutant is a single edit of one line of ``fedrl/`` (the kind of slip a reviewer would miss:
max for min, the online critic for the target, s' for s, a sign, a coefficient, a gradient
that leaks, a state that is not reset). For each, a clean copy of the committed tree at HEAD
gets the edit and the learner tests run there; a mutant that every test passes *survived* and
is a hole in the suite. Nothing in the working tree is touched. Prints one line per mutant and
a summary; exit status 1 if any survived. About 15-60 s a mutant on one core here.

The list is ours; the issue's reviewers keep their own. A mutant that changes nothing a
program could observe (an equivalent mutant) does not belong here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ("tests/unit/test_update_wiring.py", "tests/unit/test_learning_closed_form.py",
         "tests/unit/test_losses.py", "tests/unit/test_learners.py", "tests/unit/test_aggregate.py",
         "tests/unit/test_optim.py")


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...] = ()  # run instead of the default learner tests (the round logic's own)


D, C, N, B, A, BASE = ("fedrl/algos/drpo.py", "fedrl/algos/cql.py", "fedrl/algos/nets.py", "fedrl/algos/bc.py",
                       "fedrl/federation/aggregate.py", "fedrl/algos/base.py")
BAT, BUF = "fedrl/algos/batched.py", "fedrl/data/buffer.py"
BATCHED_TESTS = ("tests/unit/test_batched.py",)
# the batched engine against the per-agent one at a preset's settings (one tau, one calibration, ...)
ENGINE_TESTS = ("tests/unit/test_batched.py", "tests/integration/test_engines_agree.py", "tests/integration/test_cells.py")
RND, CELLS = "fedrl/federation/round.py", "fedrl/federation/cells.py"
SIM, COORD = "fedrl/federation/simulate.py", "aggregator_service/rounds.py"
SUBS, TICK = "aggregator_service/submissions.py", "aggregator_service/ticker.py"
CKPT = "fedrl/federation/checkpoint.py"
MACHINE, MACHINE_TESTS = "fedrl/federation/machine.py", ("tests/unit/test_machine.py",)
PRIV, PRIV_TESTS = "fedrl/federation/privacy.py", ("tests/unit/test_privacy.py",)
PRIV_SIM_TESTS = ("tests/integration/test_simulate.py",)
SIM_TESTS = ("tests/integration/test_simulate.py",)
GRAD_TESTS = tuple(f"tests/integration/test_engines_agree.py::test_the_batched_engine_runs_the_per_agent_federation[{c}]"
                   for c in ("drpo-gradient-norms", "fed-cql-gradient-norms"))
SERVICE_TESTS = ("tests/service/test_federation.py",)
HARDENING_TESTS = ("tests/service/test_hardening.py",)
UPKEEP_TEST = "tests/service/test_faults.py::test_the_clocks_upkeep_raising_stops_neither_the_clock_nor_its_runs"
UNEXPECTED_TEST = "tests/service/test_evaluator_and_reconnect.py::test_an_unexpected_error_does_not_end_the_follower"
SEVERAL_RUNS_TESTS = ("tests/service/test_several_runs.py",)
SA, SA_TESTS = "fedrl/federation/secagg.py", ("tests/unit/test_secagg.py",)
SA_SUMS, SA_SIM_TESTS = "fedrl/federation/secagg_sums.py", ("tests/integration/test_secure_simulate.py",)
# the services' halves of secure aggregation and DP, and the hardening of private rounds (issue 84)
SR, PRIVATE_TESTS = "fedrl/federation/secure_steps.py", ("tests/service/test_private_rounds.py",)
SECURE_MACHINE_TESTS = ("tests/unit/test_machine_secure.py",)
OPTIONS = "fedrl/federation/options.py"
MUTANTS = (
    # DRPO / CQL update (drpo.py)
    Mutant("actor-max-of-twins", D, "q_pi = q(obs, pi_a).min(dim=twin_dim)", "q_pi = q(obs, pi_a).max(dim=twin_dim)"),
    Mutant("actor-q-reaches-critic", D, "    critic.requires_grad_(False)\n", "    pass\n"),
    Mutant("target-uses-online-critic", D, "next_q = q_target(next_obs, a_next)", "next_q = q(next_obs, a_next)"),
    Mutant("target-max-of-twins", D, "next_q = q_target(next_obs, a_next).min(dim=twin_dim)",
           "next_q = q_target(next_obs, a_next).max(dim=twin_dim)"),
    Mutant("target-policy-at-s", D, "n_mean, n_log_std = policy(next_obs)", "n_mean, n_log_std = policy(obs)"),
    Mutant("target-critic-at-s", D, "next_q = q_target(next_obs, a_next)", "next_q = q_target(obs, a_next)"),
    Mutant("pibar-is-pi", D, "g_mean, g_log_std = global_policy(obs)", "g_mean, g_log_std = policy(obs)"),
    Mutant("pibar-at-s-prime", D, "g_mean, g_log_std = global_policy(obs)", "g_mean, g_log_std = global_policy(next_obs)"),
    Mutant("cql-at-s-prime", D, "q_all = q(obs.unsqueeze(-2), all_a)", "q_all = q(next_obs.unsqueeze(-2), all_a)"),
    Mutant("cql-proposals-swapped", D, "[act.unsqueeze(-2), noise.rand, cur_a, next_a[..., 1:, :]]",
           "[act.unsqueeze(-2), noise.rand, next_a[..., 1:, :], cur_a]"),
    Mutant("td-weight-dropped", D, "coefs.td_weight * c_td + coefs.cql_weight * c_cql", "c_td + coefs.cql_weight * c_cql"),
    Mutant("cql-weight-dropped", D, "coefs.td_weight * c_td + coefs.cql_weight * c_cql", "coefs.td_weight * c_td + c_cql"),
    Mutant("polyak-inverted", D, "soft_update_(self.critic_target, self.critic, cfg.tau)",
           "soft_update_(self.critic_target, self.critic, 1 - cfg.tau)"),
    Mutant("polyak-skipped", D, "        soft_update_(self.critic_target, self.critic, cfg.tau)\n", "        pass\n"),
    Mutant("uniform-proposals-shifted", D, ".mul_(2.0).sub_(1.0)", ".mul_(2.0).sub_(0.5)"),
    Mutant("pibar-not-reset", D, "load_prefixed((self.policy, self.global_policy), state, POLICY)",
           "load_prefixed((self.policy,), state, POLICY)"),
    Mutant("actor-adam-not-reset", D, "            self.actor_opt.state.clear()", "            pass"),
    Mutant("alpha-gets-actor-gradient", D, "return self.log_alpha.detach().exp()", "return self.log_alpha.exp()"),
    Mutant("entropy-backup-wrong-sample", D, "next_log_pi[..., 0] if cfg.backup_entropy", "next_log_pi[..., 1] if cfg.backup_entropy"),
    Mutant("actor-sample-detached", D, "pi_a, log_pi = sample(mean, log_std, noise.pi)",
           "pi_a, log_pi = sample(mean.detach(), log_std, noise.pi)"),
    Mutant("nll-global-from-pibar", D, "mean.unsqueeze(-2), log_std.unsqueeze(-2), g_a, cfg.action_clip_eps",
           "g_mean.unsqueeze(-2), g_log_std.unsqueeze(-2), g_a, cfg.action_clip_eps"),
    Mutant("entropy-sign", D, "entropy_term = (per_sample(alpha) * log_pi).mean(dim=-1)", "entropy_term = -(per_sample(alpha) * log_pi).mean(dim=-1)"),
    Mutant("lambdas-swapped", D, "lambda1 * reg_data + lambda2 * reg_global", "lambda2 * reg_data + lambda1 * reg_global"),
    Mutant("q-term-sign", D, "        q_term = -q_mean\n", "        q_term = q_mean\n"),
    # CQL losses (cql.py)
    Mutant("td-ignores-done", C, "return rewards + per_sample(gamma) * (1.0 - dones) * v", "return rewards + per_sample(gamma) * v"),
    Mutant("td-done-inverted", C, "return rewards + per_sample(gamma) * (1.0 - dones) * v", "return rewards + per_sample(gamma) * dones * v"),
    Mutant("td-entropy-sign", C, "next_q - per_sample(alpha) * next_log_prob", "next_q + per_sample(alpha) * next_log_prob"),
    Mutant("td-loss-factor", C, "return 0.5 * (q_data - target.detach()", "return 1.0 * (q_data - target.detach()"),
    Mutant("cql-uniform-density-sign", C, "q_rand - log_uniform", "q_rand + log_uniform"),
    Mutant("cql-mean-over-twins", C, "- q_data).mean(dim=-1).sum(dim=-1)", "- q_data).mean(dim=(-2, -1))"),
    Mutant("cql-data-term-sign", C, "(torch.logsumexp(cat, dim=-1) - q_data)", "(torch.logsumexp(cat, dim=-1) + q_data)"),
    Mutant("calibration-on-data-term", C, "q_pi, q_pi_next = torch.maximum(q_pi, f), torch.maximum(q_pi_next, f)",
           "q_pi, q_pi_next, q_data = torch.maximum(q_pi, f), torch.maximum(q_pi_next, f), torch.maximum(q_data, f)"),
    Mutant("calibration-misses-s-prime-proposals", C, "torch.maximum(q_pi_next, f)", "q_pi_next"),
    Mutant("gradient-calibration-lifts-values", C, "if isinstance(gradient_only, torch.Tensor) or gradient_only:",
           "if False:"),
    Mutant("gradient-calibration-stops-above-the-floor", C, "torch.where(raw_pi < f, raw_pi.detach(), raw_pi)",
           "torch.where(raw_pi > f, raw_pi.detach(), raw_pi)"),
    Mutant("batched-calibration-mask-of-another-learner", C, "m = gradient_only.reshape(-1, *[1] * (q_pi.ndim - 1))",
           "m = gradient_only.flip(0).reshape(-1, *[1] * (q_pi.ndim - 1))", BATCHED_TESTS),
    Mutant("calibration-floor-of-another-state", BUF, "self.dones[idx], None if self.returns is None else self.returns[idx])",
           "self.dones[idx], None if self.returns is None else self.returns[idx.roll(1)])",
           ("tests/unit/test_critic_values.py",)),
    Mutant("calibration-stacked-floor-of-another-shard", BUF, "\n                     None if self.returns is None else self.returns[idx])",
           "\n                     None if self.returns is None else self.returns[idx.roll(1, 0)])", ("tests/unit/test_critic_values.py",)),
    Mutant("temperature-target-sign", C, "log_prob.detach() + per_sample(target_entropy)", "log_prob.detach() - per_sample(target_entropy)"),
    # policy densities (nets.py)
    Mutant("sample-jacobian-sign", N, "eps.pow(2) - log_std - 0.5 * LOG_2PI - tanh_log_det_jacobian(u)",
           "eps.pow(2) - log_std - 0.5 * LOG_2PI + tanh_log_det_jacobian(u)"),
    Mutant("logprob-scale-inverted", N, "z = (u - mean) * torch.exp(-log_std)", "z = (u - mean) * torch.exp(log_std)"),
    Mutant("logprob-no-jacobian", N, "return (-0.5 * z.pow(2) - log_std - 0.5 * LOG_2PI - tanh_log_det_jacobian(u)).sum(-1)",
           "return (-0.5 * z.pow(2) - log_std - 0.5 * LOG_2PI).sum(-1)"),
    # BC (bc.py)
    Mutant("bc-mse-mean-over-dims", B, "(torch.tanh(mean) - actions).pow(2).sum(-1).mean(dim=-1)",
           "(torch.tanh(mean) - actions).pow(2).mean(dim=(-2, -1))"),
    Mutant("bc-adam-not-reset", B, "            self.opt.state.clear()", "            pass"),
    # Adam (base.py)
    Mutant("adam-no-bias-correction1", BASE, "(self.lr / (1 - self.beta1 ** float(s[\"step\"]))) * -1", "self.lr * -1"),
    Mutant("adam-betas-swapped", BASE, "torch._foreach_lerp_(exp_avgs, grads, 1 - b1)", "torch._foreach_lerp_(exp_avgs, grads, 1 - b2)"),
    # the batched learners (batched.py, buffer.py): learner i reads learner j's data, random
    # stream, moments, lambda or learning rate
    Mutant("batched-reads-another-shard", BUF, "return self.offsets.unsqueeze(1) + torch.minimum(",
           "return self.offsets.roll(1).unsqueeze(1) + torch.minimum(", BATCHED_TESTS),
    Mutant("batched-one-random-stream", BAT, "noise = draw_noise(self.gen, (self.members,), batch.obs.shape[1]",
           "noise = draw_noise(self.gen, (1,), batch.obs.shape[1]", BATCHED_TESTS),
    Mutant("batched-moments-of-another", BASE, "ratio = torch._foreach_div(exp_avgs, denom)",
           "ratio = torch._foreach_div([m.roll(1, 0) for m in exp_avgs], denom)", BATCHED_TESTS),
    Mutant("batched-lambda2-of-another", BAT, 'v("lambda1"), v("lambda2"), v("cql_weight")',
           'v("lambda1"), v("lambda2").roll(1), v("cql_weight")', BATCHED_TESTS),
    Mutant("batched-critic-lr-of-another", BAT, 'col(v("critic_lr").repeat_interleave(2), p)', 'col(v("critic_lr").repeat(2), p)',
           BATCHED_TESTS),
    Mutant("batched-critic-members-mixed", N, "x = x.expand(groups, k, *x.shape[2:]).reshape(self.ensemble, *x.shape[2:])",
           "x = x.expand(groups, k, *x.shape[2:]).transpose(0, 1).reshape(self.ensemble, *x.shape[2:])", BATCHED_TESTS),
    Mutant("batched-temperature-of-another", BAT, "self.log_alpha.copy_(torch.stack([ln.log_alpha.detach() for ln in learners]))",
           "self.log_alpha.copy_(torch.stack([ln.log_alpha.detach() for ln in learners]).roll(1, 0))", BATCHED_TESTS),
    # ...and the branches a batch takes when its learners agree (a preset's cells: one tau, one
    # calibration, one set of lambdas), which only the engines' agreement at such settings sees
    Mutant("batched-polyak-shared-tau-inverted", BAT, "torch._foreach_lerp_(targets, sources, self.tau)",
           "torch._foreach_lerp_(targets, sources, 1 - self.tau)", ENGINE_TESTS),
    Mutant("batched-sends-online-critic-as-target", BAT,
           'st |= {f"{CRITIC_TARGET}.{k}": v for k, v in self.member_critic(m, self.critic_target).items()}',
           'st |= {f"{CRITIC_TARGET}.{k}": v for k, v in self.member_critic(m).items()}', ENGINE_TESTS),
    Mutant("batched-target-critic-from-global-critic", BAT,
           "        for prefix, module in ((CRITIC, self.critic), (CRITIC_TARGET, self.critic_target)):",
           "        for prefix, module in ((CRITIC, self.critic), (CRITIC, self.critic_target)):", ENGINE_TESTS),
    Mutant("batched-fixed-alpha-as-log", BAT, 'self._fixed_alpha = v("alpha_init")',
           'self._fixed_alpha = v("alpha_init").exp()', ENGINE_TESTS),
    Mutant("batched-actor-moments-always-reset", BAT,
           "        if self.cfg.reset_actor_optimizer:\n            self.actor_opt.state.clear()",
           "        if True:\n            self.actor_opt.state.clear()", ENGINE_TESTS),
    Mutant("batched-off-term-reported", BAT,
           'diag["reg_data"] = torch.where(self.coefs.lambda1 > 0, diag["reg_data"], 0.0)',
           'diag["reg_data"] = diag["reg_data"]', ENGINE_TESTS),
    Mutant("batched-local-normalizer-of-another", RND, "np.stack([m for m, _ in self.norms])",
           "np.stack([m for m, _ in self.norms[::-1]])", ENGINE_TESTS),
    Mutant("batched-member-draws-of-first-seed", RND, "make_generator(derive_seed(s, SEED_AGENT_RNG, a), device)",
           "make_generator(derive_seed(seeds[0], SEED_AGENT_RNG, a), device)", ENGINE_TESTS),
    Mutant("batched-cells-never-federate-critics", CELLS, 'federate_critic = first.federate == "policy+critic"',
           "federate_critic = False", ENGINE_TESTS),
    # aggregation (aggregate.py)
    Mutant("fedavg-not-normalised", A, "return [wi / total for wi in w]", "return [wi for wi in w]"),
    Mutant("samples-weighting-ignored", A, "return [float(n) for n in num_samples]", "return [1.0] * len(num_samples)"),
    Mutant("fedavg-first-agent-twice", A, "for x, alpha in zip(xs, alphas):", "for x, alpha in zip([xs[0]] + list(xs[1:-1]) + [xs[0]], alphas):"),
    # the round logic: the simulation and the aggregator service
    Mutant("agents-alone-restart-from-global", SIM, "res = trainers[i].train_round(machine.agent_states[i],",
           "res = trainers[i].train_round(machine.global_state,", SIM_TESTS),
    # the rounds' state machine (machine.py), which the simulation, the cells and the service drive
    Mutant("round-ignores-sample-counts", MACHINE, "w = agent_weights(p.weighting, [u.num_samples for u in ups])",
           "w = agent_weights(p.weighting, [1 for u in ups])", MACHINE_TESTS),
    Mutant("round-global-is-first-agent", MACHINE,
           "new = aggregate(p.aggregation, [u.state for u in ups], w, p.trim_fraction, [u.flat for u in ups], alloc)",
           "new = ups[0].state", MACHINE_TESTS),
    Mutant("round-quorum-ignored", MACHINE, "and len(self.taken) >= self.plan.quorum)", ")", MACHINE_TESTS),
    Mutant("round-dp-unclipped", MACHINE, "done = [clip_update(u.state, self.global_state, self.clip) for u in ups]",
           "done = [(u.state, 0.0) for u in ups]", MACHINE_TESTS),
    # adaptive clipping (Andrew et al. 2021)
    Mutant("adaptive-clip-moves-the-wrong-way", PRIV, "step = math.log(clip) - lr * (unclipped_fraction - quantile)",
           "step = math.log(clip) + lr * (unclipped_fraction - quantile)", PRIV_TESTS),
    Mutant("adaptive-count-not-centred", PRIV, "centred = sum((1.0 if x <= clip else 0.0) - 0.5 for x in norms)",
           "centred = sum((1.0 if x <= clip else 0.0) for x in norms)", PRIV_TESTS),
    Mutant("adaptive-count-without-noise", PRIV, "        centred += count_noise * float(",
           "        centred += 0 * float(", PRIV_TESTS),
    Mutant("adaptive-update-noise-not-raised", MACHINE,
           "new = noisy_average(new, len(ups), self.clip, update_noise(p.dp_noise, p.dp_count_noise), noise)",
           "new = noisy_average(new, len(ups), self.clip, p.dp_noise, noise)", PRIV_TESTS),
    Mutant("adaptive-norm-never-moves", MACHINE, "            self.clip = closed.next_clip\n", "            pass\n",
           PRIV_TESTS),
    Mutant("adaptive-resume-restarts-the-norm", MACHINE, "self.clip = plan.dp_clip if clip is None else clip",
           "self.clip = plan.dp_clip", PRIV_TESTS),
    Mutant("adaptive-agents-clip-themselves", PRIV, "return 0.0 if cfg.dp_clip_quantile and not cfg.secagg_threshold else cfg.dp_clip",
           "return cfg.dp_clip", PRIV_SIM_TESTS),
    Mutant("adaptive-secure-bit-inverted", PRIV, "return [count_share(metrics[\"clipped\"] == 0.0,",
           "return [count_share(metrics[\"clipped\"] != 0.0,", SA_SIM_TESTS),
    Mutant("adaptive-secure-share-not-centred", PRIV, "share = 0.5 if within else -0.5", "share = 1.0 if within else 0.0",
           SA_SIM_TESTS),
    Mutant("adaptive-accountant-unadjusted", PRIV,
           "one = dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(update_noise(noise, count_noise)),",
           "one = dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(noise),", PRIV_TESTS),
    Mutant("round-budget-ignored", MACHINE,
           "if p.dp_epsilon_budget and (e := epsilon(p.dp_noise, r, p.dp_delta, p.dp_count_noise)) > p.dp_epsilon_budget:",
           "if False:", MACHINE_TESTS),
    Mutant("round-duplicate-taken", MACHINE, "        if agent in self.taken:\n", "        if False:\n", MACHINE_TESTS),
    Mutant("round-close-draws-noise-again", MACHINE, "        if self._pending is not None:\n",
           "        if False:\n", MACHINE_TESTS),
    Mutant("service-skips-the-rounds-check", SUBS, "            run.machine.check(agent_id, m.round, m.base_version, samples=m.num_samples)\n",
           "            pass\n", SERVICE_TESTS),
    # secure aggregation (secagg.py): the masks that must cancel, the shares handed out
    Mutant("secagg-pairwise-signs-agree", SA, "return m if me < peer else (np.uint64(0) - m)", "return m",
           SA_TESTS),
    Mutant("secagg-self-mask-left-in", SA, "total -= prg(self_seeds[a], size)", "pass", SA_TESTS),
    Mutant("secagg-dropped-masks-added-twice", SA,
           "total += pairwise_mask(sk, self.roster[u].mask_key, v, u, self.params, size)",
           "total -= pairwise_mask(sk, self.roster[u].mask_key, v, u, self.params, size)", SA_TESTS),
    Mutant("secagg-shares-swapped", SA, "self._held[a][1] if a in u3 else self._held[a][0]",
           "self._held[a][0] if a in u3 else self._held[a][1]", SA_TESTS),
    Mutant("secagg-second-answer-allowed", SA, "        if self._answered:\n", "        if False:\n", SA_TESTS),
    # the observation moments of round 0: each agent's weighted by its share of the samples,
    # the sum over the survivors' summed weight
    Mutant("secagg-moments-unweighted", SA_SUMS, "flat = np.concatenate([mean, sq, [1.0]]) * alpha",
           "flat = np.concatenate([mean, sq, [1.0]])", SA_SIM_TESTS),
    Mutant("secagg-moments-not-over-weight", SA_SUMS,
           "return ObsStats(1, s[:obs_dim] / weight, s[obs_dim:2 * obs_dim] / weight).mean_std()",
           "return ObsStats(1, s[:obs_dim], s[obs_dim:2 * obs_dim]).mean_std()", SA_SIM_TESTS),
    # private rounds under a hostile agent or operator: each protection of issue 84 removed
    Mutant("clock-unsupervised", TICK, 'with self.rounds.failing(run, "the aggregator\'s clock"):', "if True:", PRIVATE_TESTS),
    Mutant("close-unsupervised", COORD, "with self.failing(run, f\"round {run.round}'s close\"):", "if True:",
           PRIVATE_TESTS),
    Mutant("average-not-checked-finite", MACHINE, "if v.is_floating_point() and not bool(torch.isfinite(v).all()):",
           "if False:", MACHINE_TESTS),
    Mutant("adaptive-norm-unbounded", PRIV, "return math.exp(min(max(step, math.log(low)), math.log(high)))",
           "return math.exp(step)", MACHINE_TESTS),
    Mutant("dp-settings-unbounded", OPTIONS, "if v and not low <= v <= high:", "if False:", PRIV_TESTS),
    Mutant("secagg-small-order-key-taken", SA, "            if not usable_key(k):\n", "            if False:\n",
           PRIVATE_TESTS),
    Mutant("secagg-repeated-key-taken", SA,
           "if keys.share_key == keys.mask_key or {keys.share_key, keys.mask_key} & taken:", "if False:", PRIVATE_TESTS),
    Mutant("secagg-sealed-length-unchecked", SR, "if any(len(b) != SEALED_BYTES for b in msg.sealed.values()):",
           "if False:", PRIVATE_TESTS),
    Mutant("secagg-answer-point-unchecked", SR, "if any(p != point for p, _ in msg.shares.values()):", "if False:",
           PRIVATE_TESTS),
    Mutant("secure-step-never-closes-at-its-deadline", SR, "if have != self.expected and now < self.deadline:",
           "if have != self.expected:", SECURE_MACHINE_TESTS),
    Mutant("secure-step-takes-a-late-agent", SR, "if k < self.step or agent not in self.expected:", "if k < self.step:",
           SECURE_MACHINE_TESTS),
    Mutant("secure-step-below-threshold-closes", SR, "        if len(have) < t:\n", "        if False:\n",
           SECURE_MACHINE_TESTS),
    Mutant("round-zero-weighted-uniformly", MACHINE,
           "return dict(zip(self.agents, map(float, self.samples or [1] * len(self.agents))))",
           "return dict.fromkeys(self.agents, 1.0)", SECURE_MACHINE_TESTS),
    Mutant("secure-round-weights-ignore-samples", MACHINE,
           "counts = list(self.samples) if self.samples else [1] * len(self.agents)",
           "counts = [1] * len(self.agents)", SECURE_MACHINE_TESTS),
    Mutant("secure-round-context-not-the-round", MACHINE, 'context=f"{p.context}/{r}".encode()',
           'context=f"{p.context}".encode()', SECURE_MACHINE_TESTS),
    Mutant("round-deadline-not-from-its-opening", MACHINE,
           'return now + self.plan.round_timeout if self.plan.round_timeout else float("inf")',
           'return self.plan.round_timeout if self.plan.round_timeout else float("inf")', MACHINE_TESTS),
    Mutant("secagg-weight-unchecked", SR,
           "return abs(float(dequantize(np.array([last]), self.params)[0]) - want) <= bound", "return True",
           PRIVATE_TESTS),
    Mutant("secagg-no-answer-left-out", SA,
           "tries = [[]] + ([[a] for a in names] if len(answers) > self.params.threshold else [])", "tries = [[]]",
           PRIVATE_TESTS),
    Mutant("secagg-replay-taken", SR, "        if digest in self.seen:\n", "        if False:\n", PRIVATE_TESTS),
    Mutant("secagg-agent-dies-on-refusal", "agent_service/secure.py",
           'raise SecAggError(f"the aggregator refused the {next(iter(step))} step: {e.details()}") from None',
           "raise", PRIVATE_TESTS),
    Mutant("secagg-unopened-sender-kept", SA, "            excluded |= more\n", "            break\n",
           SA_TESTS + PRIVATE_TESTS),
    Mutant("secagg-excluded-mask-sign", SA, "            total -= _signed(prg(seed, size), u, v)",
           "            total += _signed(prg(seed, size), u, v)", SA_TESTS),
    Mutant("secagg-excluded-share-given", SA, "for a in u3 | d if a in self._held}", "for a in u3 | d | e if a in self._held}",
           SA_TESTS),
    Mutant("secagg-agent-stops-at-unopened", SA, "            except SecAggError:\n                bad.append(sender)\n",
           "            except SecAggError:\n                raise\n", SA_TESTS + PRIVATE_TESTS),
    Mutant("secagg-unopened-not-reported", "agent_service/secure.py", "        masked.unopened.extend(unopened)\n",
           "\n", ("tests/service/test_private_rounds.py::"
                  "test_a_sender_whose_sealed_shares_do_not_open_is_left_out_and_the_sum_is_the_others",)),
    Mutant("store-missing-checksum-accepted", "aggregator_service/store.py", "            if self.format(run_id) >= 2:\n",
           "            if False:\n", ("tests/service/test_faults.py",)),
    Mutant("secure-run-uncapped", "fedrl/federation/runconfig.py",
           "if self.secagg_threshold and self.agents > SECAGG_MAX_AGENTS:", "if False:", PRIV_TESTS),
    Mutant("stopped-watch-ends-at-once", "aggregator_service/lifecycle.py",
           "if run.cfg.eval_episodes == 0 or not self.registry.evaluators_following():", "if True:",
           ("tests/service/test_ctl_and_stubs.py",)),
    Mutant("pool-count-uncapped", "fedrl/data/normalize.py",
           "weights = np.minimum(counts, COUNT_CAP * np.median(counts))", "weights = counts", ("tests/unit/test_data.py",)),
    Mutant("pool-mean-unclipped", "fedrl/data/normalize.py",
           "m = np.clip(means, med_mean - MEAN_CLIP * med_std, med_mean + MEAN_CLIP * med_std)", "m = means",
           ("tests/unit/test_data.py",)),
    Mutant("epsilon-not-warmed", TICK, "                warm_epsilon(run.cfg, max(run.round, 1))\n",
           "                pass\n", PRIVATE_TESTS),
    # a run resumed on data other than it started on (a dataset remade on another machine)
    Mutant("resume-ignores-the-contents", CKPT,
           'or old.get("sha256", new.get("sha256")) != new.get("sha256")]', "]", SIM_TESTS),
    Mutant("digest-skips-the-observations", "fedrl/data/d4rl.py", "        for f in _TRANSITION_FIELDS:\n            a = np",
           "        for f in _TRANSITION_FIELDS[1:]:\n            a = np", ("tests/unit/test_data.py",)),
    Mutant("batch-resumes-on-other-data", CELLS, "            same_data(recorded, st.shards)\n",
           "            pass\n", ("tests/integration/test_cells.py",)),
    # the batched engine's gradient norms per term: measured, and averaged over the probed steps only
    Mutant("batched-gradient-norms-not-measured", "fedrl/algos/batched.py",
           "if p.requires_grad] if grad_norms else None)", "if p.requires_grad] if False else None)", GRAD_TESTS),
    Mutant("batched-gradient-norms-over-every-step", "fedrl/federation/round.py",
           "(v.double() / n).cpu().tolist() for k, (v, n) in of.items()",
           "(v.double() / steps).cpu().tolist() for k, (v, n) in of.items()", GRAD_TESTS),
    # several runs on one federation: each run's own tasks, learners, updates, stops and resume
    Mutant("tasks-ignore-busy-runs", "aggregator_service/tasks.py", "and r.run_id not in busy\n", "\n",
           SEVERAL_RUNS_TESTS),
    Mutant("tasks-newest-round-first", "aggregator_service/tasks.py",
           "run = min(waiting, key=lambda r: r.round_opened)", "run = max(waiting, key=lambda r: r.round_opened)",
           SEVERAL_RUNS_TESTS),
    Mutant("stop-given-at-every-call", "aggregator_service/tasks.py",
           "                    a.stops_sent.add(run.run_id)\n",
           "                    pass\n", SEVERAL_RUNS_TESTS),
    Mutant("agent-one-learner-for-every-run", "agent_service/client.py", "lr = self.learners.get(task.run_id)",
           "lr = next(iter(self.learners.values()), None)", SEVERAL_RUNS_TESTS),
    Mutant("lanes-name-no-busy-run", "agent_service/client.py", "req.busy_runs.extend(busy)", "busy = []",
           SEVERAL_RUNS_TESTS),
    Mutant("update-taken-by-the-newest-run", SUBS, "run = self.s.runs.get(run_id)\n        if run is None:\n",
           "run = self.s.run\n        if run is None:\n", SEVERAL_RUNS_TESTS),
    Mutant("resume-only-the-newest-run", "aggregator_service/lifecycle.py",
           "for run_id in self.store.run_ids()[-self.max_runs:]:", "for run_id in self.store.run_ids()[-1:]:",
           SEVERAL_RUNS_TESTS),
    Mutant("run-cap-not-enforced", "aggregator_service/lifecycle.py", "if len(active) >= self.max_runs:",
           "if False:", SERVICE_TESTS),
    Mutant("stop-without-a-run-takes-the-first", "aggregator_service/lifecycle.py",
           "if not run_id and len(active) > 1:", "if False:", SERVICE_TESTS),
    Mutant("secure-rounds-not-counted", COORD, "(rec.accepted.get(run.run_id, (0, 0))[0] + 1, closed.round)",
           "(rec.accepted.get(run.run_id, (0, 0))[0], closed.round)", SEVERAL_RUNS_TESTS),
    Mutant("a-sat-out-round-offered-again", "aggregator_service/tasks.py",
           "                   and (r.run_id, r.round) not in a.declined]", "                   ]", SEVERAL_RUNS_TESTS),
    Mutant("a-sat-out-round-asked-for-again", "agent_service/client.py",
           "            self._skip_run = task.run_id\n", "            self._stop.wait(self.cfg.task_wait)\n",
           SEVERAL_RUNS_TESTS),
    Mutant("full-fleet-takes-any-env", "aggregator_service/lifecycle.py",
           "if cfg.env is None or len(live) < self.registry.max_agents:", "if True:", SEVERAL_RUNS_TESTS),
    # what one hostile caller sends that the services keep or build from
    Mutant("update-weighs-what-it-counts", MACHINE, "            if samples != joined:\n", "            if False:\n",
           MACHINE_TESTS),
    Mutant("update-metrics-unbounded", SUBS, "    if len(metrics) > MAX_UPDATE_METRICS:\n", "    if False:\n",
           HARDENING_TESTS),
    Mutant("update-metrics-may-be-privacys", SUBS, "    own = sorted(RESERVED_METRICS & set(metrics))\n",
           "    own = []\n", HARDENING_TESTS),
    Mutant("evaluation-reports-unchecked", "aggregator_service/lifecycle.py",
           "        if problem := report_problem(report):\n", "        if False:\n", HARDENING_TESTS),
    Mutant("evaluation-report-replaced", "aggregator_service/lifecycle.py",
           "            if v in run.evaluations or v in run.not_evaluated:\n                return\n", "", HARDENING_TESTS),
    Mutant("session-wait-nan-passes", "aggregator_service/servicer.py", "SESSION_MIN_WAIT if math.isnan(asked) else ",
           "", ("tests/service/test_stream_guard.py",)),
    Mutant("any-agent-fetches-any-run", "aggregator_service/versions.py",
           "                if agent is not None and agent not in run.selected:\n", "                if False:\n",
           ("tests/service/test_security.py",)),
    Mutant("refusals-echo-long-strings-whole", "fedrl/wire/rpc.py", "    if len(message) <= STATUS_DETAILS_MAX:\n",
           "    if True:\n", HARDENING_TESTS),
    Mutant("policy-built-before-its-shapes-are-checked", "fedrl/algos/policy_io.py", "    if given != want:\n",
           "    if False:\n", ("tests/service/test_evaluator_and_reconnect.py",)),
    Mutant("evaluator-sizes-buffers-as-declared", "evaluator_service/servicer.py",
           "Assembler(manifest, grow=True)", "Assembler(manifest, grow=False)",
           ("tests/service/test_hardening.py::test_the_evaluators_memory_follows_the_bytes_received_not_those_declared",)),
    Mutant("evaluation-steps-non-finite-actions", "fedrl/envs/evaluation.py", "                if not np.isfinite(act).all():\n",
           "                if False:\n", ("tests/service/test_evaluator_and_reconnect.py",)),
    Mutant("follower-retries-a-version-it-cannot-evaluate", "evaluator_service/follower.py",
           "                        if e.code() not in VERSION_FAILURES:\n", "                        if True:\n",
           ("tests/service/test_evaluator_and_reconnect.py",)),
    Mutant("watch-waits-for-versions-not-evaluable", "aggregator_service/lifecycle.py",
           " and v not in run.not_evaluated]", "]", ("tests/service/test_evaluator_and_reconnect.py",)),
    Mutant("not-evaluated-report-keeps-returns", "aggregator_service/lifecycle.py",
           "        if n:\n            return f\"{n} returns with not_evaluated", "        if False:\n            return f\"{n} returns with not_evaluated",
           HARDENING_TESTS),
    Mutant("idle-watch-ends-on-one-calls-error", "fedrl/wire/streams.py",
           "                except Exception:  # noqa: BLE001 - the watch must go on",
           "                except ZeroDivisionError:  # noqa: BLE001 - the watch must go on",
           ("tests/unit/test_idle_watch.py",)),
    Mutant("clock-ends-on-an-upkeep-error", "aggregator_service/ticker.py",
           "            except Exception:  # noqa: BLE001 - memory kept or freed later",
           "            except ZeroDivisionError:  # noqa: BLE001 - memory kept or freed later", (UPKEEP_TEST,)),
    Mutant("accountant-warm-up-fails-every-tick", "aggregator_service/ticker.py",
           "                    self._cold.add(run.run_id)\n", "                    raise\n", (UPKEEP_TEST,)),
    Mutant("follower-ends-on-an-unexpected-error", "evaluator_service/follower.py",
           "            except Exception:  # the follower thread must not end",
           "            except ZeroDivisionError:  # the follower thread must not end", (UNEXPECTED_TEST,)),
    Mutant("follower-retries-an-unexpected-error-forever", "evaluator_service/follower.py",
           "                        if tries < UNEXPECTED_TRIES:\n", "                        if True:\n", (UNEXPECTED_TEST,)),
    Mutant("follower-watch-ends-on-an-unreadable-event", "evaluator_service/follower.py",
           "            except Exception as e:  # the stream's end", "            except grpc.RpcError as e:  # the stream's end",
           (UNEXPECTED_TEST,)),
    Mutant("streams-may-take-every-worker", "fedrl/wire/streams.py", "RESERVED_WORKERS = 8\n", "RESERVED_WORKERS = 0\n",
           ("tests/service/test_stream_guard.py::test_a_flood_of_idle_streams_is_refused_and_the_server_keeps_answering",
            "tests/service/test_stream_guard.py::test_a_flood_of_long_polls_is_capped_and_health_status_and_join_still_answer")),
    Mutant("model-size-checked-after-building", "aggregator_service/start.py",
           "        if size > MAX_MODEL_BYTES:  # before anything is built", "        if False:  # before anything is built",
           ("tests/service/test_hardening.py::test_a_global_model_larger_than_the_limit_is_refused_before_it_is_built",)),
    Mutant("local-round-trains-subnormals", "fedrl/federation/round.py",
           "        with subnormals_flushed():  # a CQL", "        if True:  # a CQL", ("tests/unit/test_subnormals.py",)),
    Mutant("batched-round-trains-subnormals", "fedrl/federation/round.py",
           "        with subnormals_flushed():  # as LocalTrainer's", "        if True:  # as LocalTrainer's",
           ("tests/unit/test_subnormals.py",)),
    Mutant("flush-skips-torchs-workers", "fedrl/common/device.py",
           "    if n > 1 and (omp := _openmp()) is not None:", "    if False and (omp := _openmp()) is not None:",
           ("tests/unit/test_subnormals.py",)),
    Mutant("flush-outlives-training-in-workers", "fedrl/common/device.py",
           "GOMP_parallel(_ON_WORKERS[on], ", "GOMP_parallel(_ON_WORKERS[True], ", ("tests/unit/test_subnormals.py",)),
    Mutant("flush-outlives-training", "fedrl/common/device.py", "            _set_flush(False)",
           "            pass", ("tests/unit/test_subnormals.py",)),
)


def _pytest(tree: Path, tests: tuple[str, ...]) -> tuple[int, str]:
    """Run ``tests`` in ``tree``: (pytest's exit status, the first failure's line or the last line)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", *tests],
                       cwd=tree, env=env, capture_output=True, text=True, timeout=900, check=False)
    out = (p.stdout + p.stderr).strip().splitlines()
    # pytest's own FAILED/ERROR lines name a test; a captured log line ("ERROR    fedrl...") does not
    return p.returncode, next((ln for ln in out if ln.startswith(("FAILED tests/", "ERROR tests/"))),
                              out[-1] if out else "")[:160]


_CLEAN: set[tuple[str, ...]] = set()  # test sets seen to pass on the unmutated tree


def run_mutant(m: Mutant, tree: Path, tests: tuple[str, ...]) -> tuple[bool, float, str]:
    """Apply ``m`` to ``tree``, run ``tests`` there, restore the file. (killed, seconds, detail).
    The tests must pass on the unmutated tree first (checked once per set): a failure that is not
    the mutant's (a missing package, a broken test) would otherwise count as a kill."""
    f = tree / m.path
    text = f.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutant {m.name}: its line occurs {text.count(m.old)} times in {m.path} "
                         "(the code changed: update the mutant)")
    if tests not in _CLEAN:
        rc, line = _pytest(tree, tests)
        if rc != 0:
            raise SystemExit(f"the tests of mutant {m.name} fail without it (pytest exit {rc}): {line}")
        _CLEAN.add(tests)
    f.write_text(text.replace(m.old, m.new))
    t0 = time.monotonic()
    try:
        rc, failed = _pytest(tree, tests)
    finally:
        f.write_text(text)
    return rc != 0, time.monotonic() - t0, failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mutants", description=__doc__.split("\n\n")[1])
    p.add_argument("--only", default="", help="comma-separated mutant names, or groups: a name's first word "
                   "('batched' is every batched-* mutant) (default: all)")
    p.add_argument("--drop", default="", help="comma-separated test files left out of every mutant's tests: "
                   "which mutants survive without them (each such test's reason to exist)")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--tests", default=",".join(TESTS), help="comma-separated test files run against each mutant")
    a = p.parse_args(argv)
    only = set(filter(None, a.only.split(",")))
    chosen = [m for m in MUTANTS if not only or m.name in only or m.name.split("-")[0] in only]
    unknown = only - {m.name for m in MUTANTS} - {m.name.split("-")[0] for m in MUTANTS}
    if unknown:
        raise SystemExit(f"unknown mutants: {', '.join(sorted(unknown))} (see --list)")
    if a.list:
        for m in chosen:
            print(f"{m.name:30s} {m.path}")
        return 0
    tests = tuple(a.tests.split(","))
    drop = set(filter(None, a.drop.split(",")))
    with tempfile.TemporaryDirectory(prefix="fedrl-mutants-") as d:
        tree = Path(d) / "tree"
        # the committed tree, not the working one: a mutant must be judged against the tests that land
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), "HEAD"], check=True,
                       capture_output=True)
        try:
            survived = []
            for m in chosen:
                mine = tuple(t for t in (m.tests or tests) if t not in drop)
                if not mine:
                    print(f"-        {m.name:30s} no test left once {', '.join(sorted(drop))} are dropped", flush=True)
                    survived.append(m.name)
                    continue
                killed, secs, detail = run_mutant(m, tree, mine)
                print(f"{'killed  ' if killed else 'SURVIVED'} {m.name:30s} {secs:5.0f}s  {detail}", flush=True)
                if not killed:
                    survived.append(m.name)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True,
                           check=False)
            shutil.rmtree(tree, ignore_errors=True)
    print(f"{len(chosen) - len(survived)} of {len(chosen)} mutants killed"
          + (f"; survived: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
