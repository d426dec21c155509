"""Networks: MLP trunks, the tanh-Gaussian policy and the twin critic as one batched ensemble."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

LOG_2PI = math.log(2.0 * math.pi)
LOG_2 = math.log(2.0)


def mlp(in_dim: int, hidden: Sequence[int]) -> nn.Sequential:
    """Linear+ReLU layers: ``in_dim -> hidden[0] -> ... -> hidden[-1]`` (ReLU after each)."""
    layers: list[nn.Module] = []
    d = in_dim
    for h in hidden:
        layers += [nn.Linear(d, h), nn.ReLU()]
        d = h
    return nn.Sequential(*layers)


def tanh_log_det_jacobian(u: torch.Tensor) -> torch.Tensor:
    """``log(1 - tanh(u)^2)`` computed stably as ``2 (log 2 - u - softplus(-2u))``."""
    return 2.0 * (LOG_2 - u - F.softplus(-2.0 * u))


class TanhGaussianPolicy(nn.Module):
    """pi(a|s) = tanh(N(mu(s), sigma(s))), actions in [-1, 1]^act_dim.

    The policy is fed *normalised* observations in training. ``obs_mean`` / ``obs_std`` are
    buffers (part of the state dict, so they travel with the weights) that :meth:`act` applies
    to raw environment observations, making a saved policy self-contained for evaluation.
    """

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        hidden: Sequence[int] = (256, 256),
        log_std_min: float = -5.0,
        log_std_max: float = 2.0,
    ) -> None:
        super().__init__()
        self.obs_dim, self.act_dim = obs_dim, act_dim
        self.log_std_min, self.log_std_max = log_std_min, log_std_max
        self.trunk = mlp(obs_dim, hidden)
        self.head = nn.Linear(hidden[-1], 2 * act_dim)
        self.register_buffer("obs_mean", torch.zeros(obs_dim))
        self.register_buffer("obs_std", torch.ones(obs_dim))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-tanh Gaussian parameters ``(mean, log_std)``, each ``(..., act_dim)``."""
        mean, log_std = self.head(self.trunk(obs)).chunk(2, dim=-1)
        return mean, log_std.clamp(self.log_std_min, self.log_std_max)

    @staticmethod
    def sample_from(
        mean: torch.Tensor,
        log_std: torch.Tensor,
        generator: torch.Generator | None,
        n: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised sample and its log-prob from given parameters.

        ``n=None``: one action per state, shapes ``(B, A)`` and ``(B,)``.
        ``n=k``: k actions per state, shapes ``(B, k, A)`` and ``(B, k)``.
        """
        shape = mean.shape if n is None else (*mean.shape[:-1], n, mean.shape[-1])
        eps = torch.randn(shape, generator=generator, device=mean.device, dtype=mean.dtype)
        return TanhGaussianPolicy.sample_with(mean, log_std, eps)

    @staticmethod
    def sample_with(mean: torch.Tensor, log_std: torch.Tensor, eps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reparameterised sample ``tanh(mean + std * eps)`` and its log-prob for given
        standard-normal noise: ``eps`` of ``mean``'s shape ``(..., A)`` (one action per state) or
        ``(..., k, A)`` (k actions per state). The learners draw their noise up front
        (:func:`fedrl.algos.drpo.draw_noise`), so a batched learner and single ones can be fed
        the same draws."""
        if eps.ndim == mean.ndim + 1:
            mean, log_std = mean.unsqueeze(-2), log_std.unsqueeze(-2)
        u = mean + log_std.exp() * eps
        log_prob = (-0.5 * eps.pow(2) - log_std - 0.5 * LOG_2PI - tanh_log_det_jacobian(u)).sum(-1)
        return torch.tanh(u), log_prob

    @staticmethod
    def log_prob_from(
        mean: torch.Tensor, log_std: torch.Tensor, actions: torch.Tensor, eps: float = 1e-6
    ) -> torch.Tensor:
        """log pi(a|s) of given actions (e.g. the dataset's): ``(..., A) -> (...)``.

        Actions are clipped to ``[-1+eps, 1-eps]`` before ``atanh`` so that actions exactly at
        the bounds (common in D4RL files) give a finite log-probability.
        """
        a = actions.clamp(-1.0 + eps, 1.0 - eps)
        u = torch.atanh(a)
        z = (u - mean) * torch.exp(-log_std)
        return (-0.5 * z.pow(2) - log_std - 0.5 * LOG_2PI - tanh_log_det_jacobian(u)).sum(-1)

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """log pi(a|s) for normalised observations."""
        mean, log_std = self(obs)
        return self.log_prob_from(mean, log_std, actions)

    @torch.inference_mode()
    def act(self, raw_obs: torch.Tensor) -> torch.Tensor:
        """Deterministic evaluation action ``tanh(mu(s))`` for *raw* observations.

        Only the mean half of the head is computed (the log-std is not needed here)."""
        h = self.trunk((raw_obs - self.obs_mean) / self.obs_std)
        mean = torch.nn.functional.linear(h, self.head.weight[: self.act_dim], self.head.bias[: self.act_dim])
        return torch.tanh(mean)

    def set_normalizer(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Install the observation statistics :meth:`act` applies."""
        self.obs_mean.copy_(torch.as_tensor(mean, dtype=self.obs_mean.dtype))
        self.obs_std.copy_(torch.as_tensor(std, dtype=self.obs_std.dtype))


class VectorizedLinear(nn.Module):
    """``E`` independent linear layers applied as one batched matmul: ``(E, N, in) -> (E, N, out)``."""

    def __init__(self, in_features: int, out_features: int, ensemble: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(ensemble, in_features, out_features))
        self.bias = nn.Parameter(torch.empty(ensemble, 1, out_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Same distribution as nn.Linear's default init, per member.
        bound = 1.0 / math.sqrt(self.weight.shape[1])
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ensemble_linear(self.bias, x, self.weight)


def ensemble_linear(b: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``b + x @ w`` for ``x (E, N, in)``, ``w (E, in, out)``, ``b (E, 1, out)``.

    A single output (a Q head) is computed as ``(w^T x^T)^T``: CPU BLAS runs a one-column
    batched GEMM several times slower than the one-row product (2.2 ms vs 0.55 ms for the CQL
    critic's 2 x 7936 x 256 head here). The result is a transposed view of the same values.
    """
    if w.shape[-1] == 1:
        return torch.baddbmm(b, w.transpose(1, 2), x.transpose(1, 2)).transpose(1, 2)
    return torch.baddbmm(b, x, w)


# On CPU, rows of an ensemble MLP's input run through all its layers in blocks of this many:
# the CQL critic's 7,936-row batch as eight blocks instead of one. The (E, 1024, 256) GEMMs ran
# 20-35% faster than the (E, 7936, 256) ones on 2 threads here (~8% on one) and a block's
# activations stay in cache between its layers: the DRPO update 1.13-1.24x faster on 1 and 2
# threads (docs/performance.md). On a GPU the whole batch is one block (one launch per layer).
ROW_BLOCK = 1024


def _row_blocks(n: int, device: torch.device) -> range:
    """Start rows of the blocks an ``n``-row batch is processed in (one block for an empty one)."""
    return range(0, max(n, 1), ROW_BLOCK if device.type == "cpu" else max(n, 1))


class _EnsembleReluMLP(torch.autograd.Function):
    """An ensemble ReLU MLP ``x (E, N, in) -> (E, N, out)`` as one autograd node.

    On CPU, rows are processed in blocks of :data:`ROW_BLOCK` (each block through every layer,
    forward and backward). Up to one block, these are the same GEMMs in the same order as the
    layer-by-layer modules (results bit-identical, tested); with more, the weight and bias
    gradients are summed block by block (the same values up to float rounding, tested). The
    backward pass owns its gradient buffers: the ReLU backward runs in place on them instead of
    allocating a new tensor per layer, and no per-layer autograd nodes are built. ``params``
    are ``w0, b0, w1, b1, ...`` (``w: (E, in, out)``, ``b: (E, 1, out)``), ReLU after every
    layer but the last.
    """

    @staticmethod
    def forward(ctx, x, *params):
        ws, bs = params[0::2], params[1::2]
        outs, saved = [], []
        starts = _row_blocks(x.shape[1], x.device)
        for start in starts:
            h = x[:, start:start + starts.step]
            saved.append(h)
            for w, b in zip(ws[:-1], bs[:-1]):
                h = ensemble_linear(b, h, w).relu_()
                saved.append(h)
            outs.append(ensemble_linear(bs[-1], h, ws[-1]))
        ctx.save_for_backward(*ws, *saved)
        ctx.starts = starts
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_out):
        saved = ctx.saved_tensors
        n = len(ctx.needs_input_grad) // 2  # layers: each block saved its input and n-1 activations
        ws, blocks = saved[:n], saved[n:]
        grads: list[torch.Tensor | None] = [None] * (2 * n)
        gxs = []
        starts = ctx.starts
        for k, start in enumerate(starts):
            acts, g = blocks[k * n:(k + 1) * n], g_out[:, start:start + starts.step]
            for i in reversed(range(n)):
                single = ws[i].shape[-1] == 1  # a one-column layer: products, not one-column GEMMs
                # summed over blocks ((E, out, in) for a one-column layer, else (E, in, out));
                # out of place, so FLOP counters (benchmarks.system.throughput) see every product
                if ctx.needs_input_grad[1 + 2 * i]:
                    a, b_ = (g.transpose(1, 2), acts[i]) if single else (acts[i].transpose(1, 2), g)
                    grads[2 * i] = torch.bmm(a, b_) if k == 0 else torch.baddbmm(grads[2 * i], a, b_)
                if ctx.needs_input_grad[2 + 2 * i]:
                    gb = g.sum(1, keepdim=True)
                    grads[2 * i + 1] = gb if k == 0 else grads[2 * i + 1].add_(gb)
                if i > 0 or ctx.needs_input_grad[0]:
                    # g @ w^T; a fresh buffer either way, so the ReLU mask can be applied in place
                    g = g * ws[i].transpose(1, 2) if single else torch.bmm(g, ws[i].transpose(1, 2))
                    if i > 0:
                        torch.ops.aten.threshold_backward.grad_input(g, acts[i], 0.0, grad_input=g)
                    else:
                        gxs.append(g)
        for i in range(n):
            if grads[2 * i] is not None and ws[i].shape[-1] == 1:
                grads[2 * i] = grads[2 * i].transpose(1, 2)
        gx = None if not gxs else gxs[0] if len(gxs) == 1 else torch.cat(gxs, 1)
        return (gx, *grads)


class EnsembleCritic(nn.Module):
    """``E`` Q-networks (twin: E=2) evaluated as one batched ensemble.

    ``forward(obs (..., O), act (..., A)) -> (E, ...)``; every member sees the same inputs.
    """

    def __init__(
        self, obs_dim: int, act_dim: int, hidden: Sequence[int] = (256, 256), ensemble: int = 2
    ) -> None:
        super().__init__()
        self.ensemble = ensemble
        dims = [obs_dim + act_dim, *hidden]
        self.hidden = nn.ModuleList(
            VectorizedLinear(i, o, ensemble) for i, o in zip(dims[:-1], dims[1:])
        )
        self.out = VectorizedLinear(dims[-1], 1, ensemble)

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        batch_shape = act.shape[:-1]
        if obs.shape[:-1] != batch_shape:
            obs = obs.expand(*batch_shape, obs.shape[-1])
        x = torch.cat([obs, act], dim=-1).reshape(1, -1, obs.shape[-1] + act.shape[-1])
        x = x.expand(self.ensemble, -1, -1)
        params = [t for layer in (*self.hidden, self.out) for t in (layer.weight, layer.bias)]
        return _EnsembleReluMLP.apply(x, *params).reshape(self.ensemble, *batch_shape)

    def grouped(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        """``G`` learners' critics in one call: ``obs (G, ..., O)``, ``act (G, ..., A)`` ->
        ``(G, E/G, ...)``. Members ``[g*k, (g+1)*k)`` (``k = E/G``, a twin: 2) see group g's
        inputs only, so learner g's twin critic is exactly its own two members."""
        groups, batch_shape = act.shape[0], act.shape[1:-1]
        k = self.ensemble // groups
        if k * groups != self.ensemble:
            raise ValueError(f"{self.ensemble} members do not split into {groups} groups")
        if obs.shape[:-1] != act.shape[:-1]:
            obs = obs.expand(*act.shape[:-1], obs.shape[-1])
        x = torch.cat([obs, act], dim=-1).reshape(groups, 1, -1, obs.shape[-1] + act.shape[-1])
        x = x.expand(groups, k, *x.shape[2:]).reshape(self.ensemble, *x.shape[2:])
        params = [t for layer in (*self.hidden, self.out) for t in (layer.weight, layer.bias)]
        return _EnsembleReluMLP.apply(x, *params).reshape(groups, k, *batch_shape)


class EnsemblePolicy(nn.Module):
    """``L`` tanh-Gaussian policies (:class:`TanhGaussianPolicy`'s network, one per learner) as one
    batched ensemble: ``forward(obs (L, ..., O)) -> (mean, log_std)``, each ``(L, ..., A)``.

    Layer ``i``'s weights are stacked ``(L, in, out)`` (the transpose of ``nn.Linear``'s; see
    :func:`policy_to_members` / :func:`members_to_policy`); ``obs_mean`` / ``obs_std`` are ``(L, O)``.
    """

    def __init__(self, obs_dim: int, act_dim: int, hidden: Sequence[int], members: int,
                 log_std_min: float = -5.0, log_std_max: float = 2.0) -> None:
        super().__init__()
        self.obs_dim, self.act_dim, self.members = obs_dim, act_dim, members
        self.log_std_min, self.log_std_max = log_std_min, log_std_max
        dims = [obs_dim, *hidden, 2 * act_dim]
        self.layers = nn.ModuleList(VectorizedLinear(i, o, members) for i, o in zip(dims[:-1], dims[1:]))
        self.register_buffer("obs_mean", torch.zeros(members, obs_dim))
        self.register_buffer("obs_std", torch.ones(members, obs_dim))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lead = obs.shape[:-1]
        x = obs.reshape(self.members, -1, self.obs_dim)
        params = [t for layer in self.layers for t in (layer.weight, layer.bias)]
        out = _EnsembleReluMLP.apply(x, *params).reshape(*lead, 2 * self.act_dim)
        mean, log_std = out.chunk(2, dim=-1)
        return mean, log_std.clamp(self.log_std_min, self.log_std_max)

    @torch.inference_mode()
    def act(self, raw_obs: torch.Tensor) -> torch.Tensor:
        """Deterministic actions ``tanh(mu(s))`` of every member for raw observations ``(L, N, O)``."""
        mean, _ = self((raw_obs - self.obs_mean.unsqueeze(1)) / self.obs_std.unsqueeze(1))
        return torch.tanh(mean)


def policy_to_members(state: dict[str, torch.Tensor], hidden: Sequence[int]) -> dict[str, torch.Tensor]:
    """One :class:`TanhGaussianPolicy` state dict as member tensors of an :class:`EnsemblePolicy`
    (each with a leading axis of 1; ``torch.cat`` of several such makes the ensemble's)."""
    names = [f"trunk.{2 * i}" for i in range(len(hidden))] + ["head"]
    out = {}
    for i, name in enumerate(names):
        out[f"layers.{i}.weight"] = state[f"{name}.weight"].T.unsqueeze(0)
        out[f"layers.{i}.bias"] = state[f"{name}.bias"].reshape(1, 1, -1)
    out["obs_mean"], out["obs_std"] = state["obs_mean"].unsqueeze(0), state["obs_std"].unsqueeze(0)
    return out


def members_to_policy(state: dict[str, torch.Tensor], member: int, hidden: Sequence[int]) -> dict[str, torch.Tensor]:
    """Member ``member`` of an :class:`EnsemblePolicy` state dict as a :class:`TanhGaussianPolicy`
    state dict (contiguous copies)."""
    names = [f"trunk.{2 * i}" for i in range(len(hidden))] + ["head"]
    out = {}
    for i, name in enumerate(names):
        out[f"{name}.weight"] = state[f"layers.{i}.weight"][member].T.contiguous()
        out[f"{name}.bias"] = state[f"layers.{i}.bias"][member, 0].clone()
    out["obs_mean"], out["obs_std"] = state["obs_mean"][member].clone(), state["obs_std"][member].clone()
    return out
