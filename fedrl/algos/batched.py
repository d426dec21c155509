"""``L`` independent learners updated by one batched step: the paper's cells as one model.

Every learner of a batch has the same shapes, so their networks are stacked: the policy is an
``L``-member :class:`EnsemblePolicy`, the twin critic an ``L x 2``-member :class:`EnsembleCritic`
(learner l owns members ``2l`` and ``2l + 1``), the temperature an ``(L,)`` tensor, and Adam runs
over the stacked tensors (:class:`StackedAdam`: elementwise, so each learner keeps its own
moments). One step computes every learner's losses with the single learner's own functions
(:func:`fedrl.algos.drpo.drpo_losses`, :mod:`fedrl.algos.cql`, :mod:`fedrl.algos.bc`), one value
per learner, and backpropagates their sum: the learners' parameters are disjoint, so each gets
exactly its own gradient.

Each learner has its own minibatch (from its own shard), its own random draws (drawn for all
learners in one call from the batch's generator, independent across learners), and its own
value of every hyperparameter a sweep varies (:data:`DRPO_PER_LEARNER`, :data:`BC_PER_LEARNER`);
the rest must agree (a ValueError names the field). CQL is DRPO with lambda1 = lambda2 = 0, so
DRPO, Fed-CQL and CQL learners share one batch. A batch of single learners' states
(:meth:`BatchedDRPO.load_members`) gives, step for step, what those learners compute alone on the
same minibatches and draws, up to float rounding (``tests/unit/test_batched.py``).

Layer 1 (``fedrl.algos``): may import ``fedrl.common``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from fedrl.algos.base import (
    CRITIC,
    CRITIC_TARGET,
    POLICY,
    Batch,
    StackedAdam,
    generator_tensor,
)
from fedrl.algos.bc import bc_loss
from fedrl.algos.config import BCConfig, DRPOConfig
from fedrl.algos.drpo import Coefs, Noise, draw_noise, drpo_losses
from fedrl.algos.nets import (
    EnsembleCritic,
    EnsemblePolicy,
    members_to_policy,
    policy_to_members,
)

# Hyperparameters each learner of a batch may set for itself (a sweep's axes); every other field
# is structure (shapes, sample counts, which terms exist) and must be the same across the batch.
DRPO_PER_LEARNER = ("actor_lr", "critic_lr", "alpha_lr", "lambda1", "lambda2", "cql_weight", "td_weight",
                    "gamma", "tau", "alpha_init", "target_entropy", "q_norm", "target_action", "cql_calibration")
BC_PER_LEARNER = ("lr",)


def check_batchable(cfgs: Sequence, per_learner: Sequence[str]):
    """The batch's shared structure (``cfgs[0]``), after checking every config agrees on it."""
    if not cfgs:
        raise ValueError("a batch needs at least one learner")
    kinds = {type(c) for c in cfgs}
    if len(kinds) != 1:
        raise ValueError(f"a batch holds one kind of learner, got {sorted(k.__name__ for k in kinds)}")
    first = cfgs[0]
    for f in dataclasses.fields(first):
        if f.name in per_learner:
            continue
        vals = {repr(getattr(c, f.name)) for c in cfgs}
        if len(vals) > 1:
            raise ValueError(f"learners of one batch must agree on {f.name} (got {', '.join(sorted(vals))}); "
                             f"per learner only: {', '.join(per_learner)}")
    return first


def _values(cfgs: Sequence, name: str, device: torch.device) -> torch.Tensor:
    """Every learner's ``name`` as an ``(L,)`` tensor (torch's default dtype, as the networks')."""
    return torch.tensor([float(getattr(c, name)) for c in cfgs], device=device)


def _policy_state(learner) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in learner.policy.state_dict().items()}


class _Stacked:
    """What both batched learners share: the stacked policy, conversions to and from members."""

    policy: EnsemblePolicy
    members: int
    hidden: tuple[int, ...]

    def _policy_from_states(self, module: EnsemblePolicy, states: Sequence[Mapping[str, torch.Tensor]],
                            prefix: str = POLICY) -> None:
        head = prefix + "."
        per = [policy_to_members({k[len(head):]: v for k, v in st.items() if k.startswith(head)}, self.hidden)
               for st in states]
        if any(not p for p in per):
            raise KeyError(f"a state has no '{prefix}.*' tensors")
        with torch.no_grad():
            for name, t in module.state_dict(keep_vars=True).items():
                t.copy_(torch.cat([p[name] for p in per]).to(t.device, t.dtype))

    def member_policy(self, member: int, module: EnsemblePolicy | None = None) -> dict[str, torch.Tensor]:
        """Learner ``member``'s policy as a :class:`TanhGaussianPolicy` state dict (CPU copies)."""
        sd = {k: v.detach().to("cpu") for k, v in (module or self.policy).state_dict().items()}
        return members_to_policy(sd, member, self.hidden)

    @staticmethod
    def _policy_moment(t: torch.Tensor, member: int) -> torch.Tensor:
        """A stacked policy tensor's member as nn.Linear holds it: weights transposed, biases flat."""
        return t[member].T.contiguous() if t.shape[1] != 1 else t[member, 0].clone()

    def _load_policy_moments(self, opt: StackedAdam, singles: Sequence) -> None:
        """Each single optimiser's moments over its policy into ``opt``'s stacked ones."""
        if not all(s.state for s in singles):
            if any(s.state for s in singles):
                raise ValueError("some learners' policy optimisers have stepped and some have not")
            opt.state.clear()
            return
        steps = {s.state[s.params[0]]["step"] for s in singles}
        if len(steps) != 1:
            raise ValueError(f"learners at different optimiser steps ({sorted(steps)}) cannot share a batch")
        step = steps.pop()

        def stack(i: int, p: torch.Tensor, key: str) -> torch.Tensor:
            parts = [s.state[s.params[i]][key] for s in singles]
            if p.shape[1] == 1:  # a bias (L, 1, out); nn.Linear's is (out,)
                return torch.stack(parts).unsqueeze(1).to(p.device, p.dtype)
            return torch.stack([x.T for x in parts]).to(p.device, p.dtype)  # nn.Linear's weight is (out, in)

        opt.state = {p: {"step": step, "exp_avg": stack(i, p, "exp_avg"), "exp_avg_sq": stack(i, p, "exp_avg_sq")}
                     for i, p in enumerate(opt.params)}


class BatchedDRPO(_Stacked):
    """``L`` DRPO (or CQL: lambdas 0) learners as one model; see the module docstring."""

    def __init__(self, obs_dim: int, act_dim: int, cfgs: Sequence[DRPOConfig], device: torch.device,
                 generator: torch.Generator) -> None:
        cfg = check_batchable(cfgs, DRPO_PER_LEARNER)
        self.cfgs, self.cfg, self.device, self.gen = list(cfgs), cfg, device, generator
        L = self.members = len(cfgs)
        self.act_dim, self.hidden = act_dim, tuple(cfg.hidden)
        self.policy = EnsemblePolicy(obs_dim, act_dim, cfg.hidden, L, cfg.log_std_min, cfg.log_std_max).to(device)
        self.global_policy = copy.deepcopy(self.policy).requires_grad_(False)
        self.critic = EnsembleCritic(obs_dim, act_dim, cfg.hidden, ensemble=2 * L).to(device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        v = lambda name: _values(cfgs, name, device)
        target_entropy = torch.tensor([-float(act_dim) if c.target_entropy is None else float(c.target_entropy)
                                       for c in cfgs], device=device)
        self.coefs = Coefs(v("lambda1"), v("lambda2"), v("cql_weight"), v("td_weight"), v("gamma"), target_entropy,
                           v("q_norm"), torch.tensor([c.target_action == "mean" for c in cfgs], device=device),
                           torch.tensor([c.cql_calibration != "none" for c in cfgs], device=device),
                           torch.tensor([c.cql_calibration == "returns-gradient" for c in cfgs], device=device))
        self.data_reg = any(c.lambda1 > 0 for c in cfgs)
        self.global_reg = any(c.lambda2 > 0 for c in cfgs)
        taus = {c.tau for c in cfgs}
        self.tau: float | list[torch.Tensor] = taus.pop() if len(taus) == 1 else \
            [v("tau").repeat_interleave(2).reshape(-1, *[1] * (p.ndim - 1)) for p in self.critic.parameters()]
        self.log_alpha: torch.Tensor | None = None
        if cfg.auto_alpha:
            self.log_alpha = torch.tensor([math.log(c.alpha_init) if c.alpha_init > 0 else -math.inf for c in cfgs],
                                          device=device, requires_grad=True)
            self.alpha_opt = StackedAdam([self.log_alpha], [v("alpha_lr")])
        else:
            self._fixed_alpha = v("alpha_init")
        col = lambda t, p: t.reshape(-1, *[1] * (p.ndim - 1))
        self.actor_opt = StackedAdam(self.policy.parameters(), [col(v("actor_lr"), p) for p in self.policy.parameters()])
        self.critic_opt = StackedAdam(self.critic.parameters(),
                                      [col(v("critic_lr").repeat_interleave(2), p) for p in self.critic.parameters()])

    @property
    def alpha(self) -> torch.Tensor:
        """Every learner's temperature ``(L,)``."""
        return self._fixed_alpha if self.log_alpha is None else self.log_alpha.detach().exp()

    def _optimizers(self) -> dict[str, StackedAdam]:
        opts = {"actor": self.actor_opt, "critic": self.critic_opt}
        if self.log_alpha is not None:
            opts["alpha"] = self.alpha_opt
        return opts

    # -- members in, members out (FedAvg, evaluation, the equality tests) --------------------
    def begin_round(self, global_states: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Learner l sets pi and pi_bar to ``global_states[l]``'s policy (and its critics if they
        are federated), as :meth:`DRPOLearner.begin_round` does; the actors' Adam starts over."""
        if len(global_states) != self.members:
            raise ValueError(f"{len(global_states)} global states for {self.members} learners")
        self._policy_from_states(self.policy, global_states)
        self._policy_from_states(self.global_policy, global_states)
        for prefix, module in ((CRITIC, self.critic), (CRITIC_TARGET, self.critic_target)):
            if any(k.startswith(prefix + ".") for k in global_states[0]):
                self._critic_from_states(module, [{k[len(prefix) + 1:]: v for k, v in st.items()
                                                   if k.startswith(prefix + ".")} for st in global_states])
        if self.cfg.reset_actor_optimizer:
            self.actor_opt.state.clear()

    def _critic_from_states(self, module: EnsembleCritic, states: Sequence[Mapping[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, t in module.state_dict(keep_vars=True).items():
                t.copy_(torch.cat([st[name] for st in states]).to(t.device, t.dtype))

    def member_critic(self, member: int, module: EnsembleCritic | None = None) -> dict[str, torch.Tensor]:
        return {k: v.detach()[2 * member:2 * member + 2].to("cpu").clone()
                for k, v in (module or self.critic).state_dict().items()}

    def shared_states(self, federate_critic: bool = False) -> list[dict[str, torch.Tensor]]:
        """Each learner's update, as :meth:`DRPOLearner.shared_state` gives it (CPU copies)."""
        out = []
        for m in range(self.members):
            st = {f"{POLICY}.{k}": v for k, v in self.member_policy(m).items()}
            if federate_critic:
                st |= {f"{CRITIC}.{k}": v for k, v in self.member_critic(m).items()}
                st |= {f"{CRITIC_TARGET}.{k}": v for k, v in self.member_critic(m, self.critic_target).items()}
            out.append(st)
        return out

    def load_members(self, learners: Sequence) -> None:
        """Take every :class:`DRPOLearner`'s whole state (weights, pi_bar, critics, targets,
        temperature, optimiser moments; not its RNG): learner l becomes member l."""
        if len(learners) != self.members:
            raise ValueError(f"{len(learners)} learners for a batch of {self.members}")
        self._policy_from_states(self.policy, [{f"{POLICY}.{k}": v for k, v in _policy_state(ln).items()} for ln in learners])
        self._policy_from_states(self.global_policy, [{f"{POLICY}.{k}": v.detach() for k, v in
                                                       ln.global_policy.state_dict().items()} for ln in learners])
        self._critic_from_states(self.critic, [ln.critic.state_dict() for ln in learners])
        self._critic_from_states(self.critic_target, [ln.critic_target.state_dict() for ln in learners])
        with torch.no_grad():
            if self.log_alpha is not None:
                self.log_alpha.copy_(torch.stack([ln.log_alpha.detach() for ln in learners]))
        self._load_policy_moments(self.actor_opt, [ln.actor_opt for ln in learners])
        self._load_stacked_moments(self.critic_opt, [ln.critic_opt for ln in learners])
        if self.log_alpha is not None:
            self._load_stacked_moments(self.alpha_opt, [ln.alpha_opt for ln in learners], stack=True)

    @staticmethod
    def _load_stacked_moments(opt: StackedAdam, singles: Sequence, stack: bool = False) -> None:
        if not any(s.state for s in singles):
            opt.state.clear()
            return
        steps = {s.state[s.params[0]]["step"] for s in singles if s.state}
        if len(steps) != 1 or not all(s.state for s in singles):
            raise ValueError("learners at different optimiser steps cannot share a batch")
        step = steps.pop()
        join = torch.stack if stack else torch.cat
        opt.state = {p: {"step": step, **{k: join([s.state[s.params[i]][k] for s in singles]).to(p.device, p.dtype)
                                          for k in ("exp_avg", "exp_avg_sq")}}
                     for i, p in enumerate(opt.params)}

    def member_checkpoint(self, member: int) -> dict[str, torch.Tensor]:
        """Learner ``member``'s state in :meth:`DRPOLearner.checkpoint`'s layout and names (without
        ``rng``: the batch draws from one generator)."""
        out = {f"{POLICY}.{k}": v for k, v in self.member_policy(member).items()}
        out |= {f"global_policy.{k}": v for k, v in self.member_policy(member, self.global_policy).items()}
        out |= {f"{CRITIC}.{k}": v for k, v in self.member_critic(member).items()}
        out |= {f"{CRITIC_TARGET}.{k}": v for k, v in self.member_critic(member, self.critic_target).items()}
        if self.log_alpha is not None:
            out["log_alpha"] = self.log_alpha.detach()[member].to("cpu").clone()
        for name, opt in self._optimizers().items():
            for i, p in enumerate(opt.params):
                st = opt.state.get(p)
                if st is None:
                    continue
                if name == "actor":
                    mom = {k: self._policy_moment(st[k], member).to("cpu") for k in ("exp_avg", "exp_avg_sq")}
                elif name == "critic":
                    mom = {k: st[k][2 * member:2 * member + 2].to("cpu").clone() for k in ("exp_avg", "exp_avg_sq")}
                else:
                    mom = {k: st[k][member].to("cpu").clone() for k in ("exp_avg", "exp_avg_sq")}
                out |= {f"opt.{name}.{i}.step": torch.tensor([float(st["step"])]),
                        **{f"opt.{name}.{i}.{k}": v for k, v in mom.items()}}
        return out

    # -- the whole batch's checkpoint ---------------------------------------------------------
    def checkpoint(self) -> dict[str, torch.Tensor]:
        """Every stacked tensor, the optimisers' moments and the generator: :meth:`restore`
        continues bit-identically."""
        out = {}
        for prefix, module in ((POLICY, self.policy), ("global_policy", self.global_policy),
                               (CRITIC, self.critic), (CRITIC_TARGET, self.critic_target)):
            out |= {f"{prefix}.{k}": v.detach().to("cpu").clone() for k, v in module.state_dict().items()}
        if self.log_alpha is not None:
            out["log_alpha"] = self.log_alpha.detach().to("cpu").clone()
        return out | _optimizers_and_rng(self)

    @torch.no_grad()
    def restore(self, state: Mapping[str, torch.Tensor]) -> None:
        _restore(self, state, ((POLICY, self.policy), ("global_policy", self.global_policy),
                               (CRITIC, self.critic), (CRITIC_TARGET, self.critic_target)))
        if self.log_alpha is not None:
            self.log_alpha.copy_(state["log_alpha"])

    # -- one step for every learner ---------------------------------------------------------
    def update(self, batch: Batch, noise: Noise | None = None, grad_norms: bool = False) -> dict[str, torch.Tensor]:
        """One DRPO step of every learner: ``batch`` holds learner l's minibatch at index l
        (``(L, B, ...)``); returns each diagnostic per learner ``(L,)``. ``grad_norms``: also each
        learner's actor gradient norm from each term (:func:`fedrl.algos.drpo.actor_grad_norms`,
        as :meth:`DRPOLearner.update` reports it); the step is the same."""
        cfg = self.cfg
        if noise is None:
            noise = draw_noise(self.gen, (self.members,), batch.obs.shape[1], self.act_dim, cfg, self.global_reg,
                               batch.obs.device, batch.obs.dtype)
        losses, diag = drpo_losses(self.policy, self.global_policy, self.critic, self.critic_target,
                                   batch, noise, cfg, self.coefs, self.log_alpha, self.alpha, self.act_dim, 1,
                                   self.data_reg, self.global_reg,
                                   [p for p in self.policy.parameters() if p.requires_grad] if grad_norms else None)
        # a member whose lambda is 0 reports its term as a single learner does, as 0 (the batch
        # computed it for the members whose lambda is not)
        diag["reg_data"] = torch.where(self.coefs.lambda1 > 0, diag["reg_data"], 0.0)
        diag["reg_global"] = torch.where(self.coefs.lambda2 > 0, diag["reg_global"], 0.0)
        opts = list(self._optimizers().values())
        for o in opts:
            o.zero_grad(set_to_none=True)
        torch.stack(losses).sum().backward()
        for o in opts:
            o.step()
        with torch.no_grad():
            targets, sources = list(self.critic_target.parameters()), list(self.critic.parameters())
            if isinstance(self.tau, float):
                torch._foreach_lerp_(targets, sources, self.tau)
            else:
                for t, s, w in zip(targets, sources, self.tau):
                    t.lerp_(s, w)
        return diag


def _optimizers_and_rng(obj) -> dict[str, torch.Tensor]:
    """A batched learner's optimiser moments (stacked, as they are) and its generator."""
    out = {}
    for name, opt in obj._optimizers().items():
        for i, p in enumerate(opt.params):
            if (st := opt.state.get(p)) is not None:
                out |= {f"opt.{name}.{i}.step": torch.tensor([float(st["step"])]),
                        f"opt.{name}.{i}.exp_avg": st["exp_avg"].detach().to("cpu").clone(),
                        f"opt.{name}.{i}.exp_avg_sq": st["exp_avg_sq"].detach().to("cpu").clone()}
    out["rng"] = generator_tensor(obj.gen)
    return out


def _restore(obj, state: Mapping[str, torch.Tensor], modules) -> None:
    state = dict(state)
    obj.gen.set_state(state.pop("rng"))
    for prefix, module in modules:
        head = prefix + "."
        sub = {k[len(head):]: v for k, v in state.items() if k.startswith(head)}
        if not sub:
            raise KeyError(f"checkpoint has no '{prefix}.*' tensors")
        module.load_state_dict({k: v.to(obj.device) for k, v in sub.items()})
    for name, opt in obj._optimizers().items():
        opt.state = {}
        for i, p in enumerate(opt.params):
            if f"opt.{name}.{i}.step" in state:
                opt.state[p] = {"step": int(state[f"opt.{name}.{i}.step"].reshape(())),
                                "exp_avg": state[f"opt.{name}.{i}.exp_avg"].to(p.device, p.dtype).clone(),
                                "exp_avg_sq": state[f"opt.{name}.{i}.exp_avg_sq"].to(p.device, p.dtype).clone()}


class BatchedBC(_Stacked):
    """``L`` behaviour-cloning learners as one model (the Fed-BC baseline's cells)."""

    def __init__(self, obs_dim: int, act_dim: int, cfgs: Sequence[BCConfig], device: torch.device,
                 generator: torch.Generator) -> None:
        cfg = check_batchable(cfgs, BC_PER_LEARNER)
        self.cfgs, self.cfg, self.device, self.gen = list(cfgs), cfg, device, generator
        self.members, self.act_dim, self.hidden = len(cfgs), act_dim, tuple(cfg.hidden)
        self.policy = EnsemblePolicy(obs_dim, act_dim, cfg.hidden, len(cfgs), cfg.log_std_min,
                                     cfg.log_std_max).to(device)
        lr = _values(cfgs, "lr", device)
        self.opt = StackedAdam(self.policy.parameters(),
                               [lr.reshape(-1, *[1] * (p.ndim - 1)) for p in self.policy.parameters()])

    def _optimizers(self) -> dict[str, StackedAdam]:
        return {"actor": self.opt}

    def begin_round(self, global_states: Sequence[Mapping[str, torch.Tensor]]) -> None:
        if len(global_states) != self.members:
            raise ValueError(f"{len(global_states)} global states for {self.members} learners")
        self._policy_from_states(self.policy, global_states)
        if self.cfg.reset_actor_optimizer:
            self.opt.state.clear()

    def shared_states(self, federate_critic: bool = False) -> list[dict[str, torch.Tensor]]:
        return [{f"{POLICY}.{k}": v for k, v in self.member_policy(m).items()} for m in range(self.members)]

    def load_members(self, learners: Sequence) -> None:
        self._policy_from_states(self.policy, [{f"{POLICY}.{k}": v for k, v in _policy_state(ln).items()} for ln in learners])
        self._load_policy_moments(self.opt, [ln.opt for ln in learners])

    def member_checkpoint(self, member: int) -> dict[str, torch.Tensor]:
        out = {f"{POLICY}.{k}": v for k, v in self.member_policy(member).items()}
        for i, p in enumerate(self.opt.params):
            if (st := self.opt.state.get(p)) is not None:
                out |= {f"opt.actor.{i}.step": torch.tensor([float(st["step"])]),
                        **{f"opt.actor.{i}.{k}": self._policy_moment(st[k], member).to("cpu")
                           for k in ("exp_avg", "exp_avg_sq")}}
        return out

    def checkpoint(self) -> dict[str, torch.Tensor]:
        out = {f"{POLICY}.{k}": v.detach().to("cpu").clone() for k, v in self.policy.state_dict().items()}
        return out | _optimizers_and_rng(self)

    @torch.no_grad()
    def restore(self, state: Mapping[str, torch.Tensor]) -> None:
        _restore(self, state, ((POLICY, self.policy),))

    def update(self, batch: Batch, noise: Noise | None = None) -> dict[str, torch.Tensor]:
        """One BC step of every learner (``batch``: ``(L, B, ...)``); the loss per learner ``(L,)``."""
        mean, log_std = self.policy(batch.obs)
        loss = bc_loss(self.cfg, mean, log_std, batch.actions)
        self.opt.zero_grad(set_to_none=True)
        loss.sum().backward()
        self.opt.step()
        return {"bc_loss": loss.detach()}


def build_batched(cfgs: Sequence[DRPOConfig | BCConfig], obs_dim: int, act_dim: int, device: torch.device,
                  generator: torch.Generator) -> BatchedDRPO | BatchedBC:
    """The batched learner for ``cfgs`` (all DRPO-family or all BC)."""
    if isinstance(cfgs[0], BCConfig):
        return BatchedBC(obs_dim, act_dim, cfgs, device, generator)
    return BatchedDRPO(obs_dim, act_dim, cfgs, device, generator)
