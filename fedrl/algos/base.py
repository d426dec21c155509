"""What every learner shares: the batch type, parameter helpers and the learner interface."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

import torch
from torch import nn

POLICY = "policy"
CRITIC = "critic"
CRITIC_TARGET = "critic_target"


class Batch(NamedTuple):
    """A minibatch of transitions, all on the learner's device."""

    obs: torch.Tensor  # (B, O), normalised
    actions: torch.Tensor  # (B, A) in [-1, 1]
    rewards: torch.Tensor  # (B,)
    next_obs: torch.Tensor  # (B, O), normalised
    dones: torch.Tensor  # (B,) 1.0 where the episode terminated (not on a timeout)
    returns: torch.Tensor | None = None  # (B,) the data's discounted return-to-go from s, when asked for


class Learner(Protocol):
    """One agent's local learner: set from the global model, then take gradient steps."""

    policy: nn.Module

    def begin_round(self, global_state: Mapping[str, torch.Tensor]) -> None:
        """Adopt the global model (prefixed keys, see :func:`prefixed_state`) for a new round."""

    def update(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One gradient step; returns detached scalar diagnostics (no ``.item()`` here)."""

    def shared_state(self, federate_critic: bool, copy: bool = True) -> dict[str, torch.Tensor]:
        """The parameters this learner sends to the server (detached CPU copies; with
        ``copy=False`` the tensors themselves when they live on the CPU)."""

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """Everything the next step depends on (weights, optimiser moments, temperature, RNG) as
        flat CPU tensors: :meth:`restore` of it continues bit-identically."""

    def restore(self, state: Mapping[str, torch.Tensor]) -> None:
        """Adopt a :meth:`checkpoint`."""


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict(keep_vars=True)``, looked up once per module: an agent adopts and
    sends its modules' tensors every round, and walking the module tree each time costs more
    than the copies. Valid because these modules keep their parameter and buffer objects for
    life (steps, loads and ``.to`` change them in place; nothing registers new ones later)."""
    own = module.__dict__.get("_fedrl_tensors")
    if own is None:
        own = module.__dict__["_fedrl_tensors"] = module.state_dict(keep_vars=True)
    return own


def prefixed_state(prefix: str, module: nn.Module, copy: bool = True) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` as detached CPU tensors under ``prefix.`` (copies unless ``copy``
    is False and they are on the CPU already)."""
    return {f"{prefix}.{k}": v.detach().to("cpu", copy=copy) for k, v in module_tensors(module).items()}


def on_device(state: Mapping[str, torch.Tensor], device: torch.device) -> Mapping[str, torch.Tensor]:
    """``state`` moved to ``device``; as it is for the CPU, where the tensors a learner adopts
    come from (decoded from the wire, averaged): no call per tensor every round."""
    if device.type == "cpu":
        return state
    return {k: v.to(device) for k, v in state.items()}


@torch.no_grad()
def load_prefixed(module: nn.Module | Sequence[nn.Module], state: Mapping[str, torch.Tensor], prefix: str,
                  adopt: bool = False) -> bool:
    """Load the ``prefix.*`` entries of ``state`` into ``module`` (or into each of several
    modules of one architecture) (strict); False if none exist.

    Strict as ``load_state_dict``: exactly the module's names, each with its shape. The copy is
    one fused call for all the modules (this runs every round, for every agent).

    ``adopt`` (one module): its tensors become the entries themselves (their memory; no copy)
    wherever dtype and device allow. Only for entries the caller hands over: the module then
    writes into them as it trains, and holds their memory until its next load."""
    head = prefix + "."
    n = len(head)
    sub = {k[n:]: v for k, v in state.items() if k.startswith(head)}
    if not sub:
        return False
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    modules = (module,) if isinstance(module, nn.Module) else module
    for m in modules:
        _pair_up(m, sub, dst, src)
    if adopt:
        if len(modules) != 1:
            raise ValueError("adopt loads one module: two cannot share the same memory")
        rest = [(d, s) for d, s in zip(dst, src) if not _adopt(d, s)]
        dst, src = [d for d, _ in rest], [s for _, s in rest]
    if dst:
        torch._foreach_copy_(dst, src)
    return True


def _adopt(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Make ``dst`` (a parameter or buffer) a tensor over ``src``'s memory, where it can be one."""
    if src.dtype != dst.dtype or src.device != dst.device or src.requires_grad or not src.is_contiguous():
        return False
    dst.set_(src)
    return True


def _pair_up(module: nn.Module, state: Mapping[str, torch.Tensor], dst: list, src: list) -> None:
    """Append ``module``'s tensors to ``dst`` and their new values from ``state`` to ``src``,
    after checking ``state`` has exactly the module's names, each with its shape."""
    own = module_tensors(module)
    if own.keys() != state.keys():
        missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        raise RuntimeError(f"state does not match {type(module).__name__}: missing {missing}, "
                           f"unexpected {unexpected}")
    for k, t in own.items():
        v = state[k]
        if v.shape != t.shape:
            raise RuntimeError(f"{k}: shape {list(v.shape)} does not match the module's {list(t.shape)}")
        dst.append(t)
        src.append(v)


@torch.no_grad()
def soft_update_(target: nn.Module, source: nn.Module, tau: float) -> None:
    """Polyak averaging ``target <- (1 - tau) target + tau source`` in one fused call."""
    torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), tau)


class Adam:
    """Adam over a fixed list of tensors, in torch's multi-tensor (``_foreach``) ops.

    The arithmetic of ``torch.optim.Adam(params, lr, foreach=True)`` with its other defaults
    (betas (0.9, 0.999), eps 1e-8, no weight decay, no AMSGrad), op for op: parameters and
    moments come out bit-identical (tested against torch.optim). Parameters whose ``grad`` is
    None are skipped, as torch does. ``state`` maps a parameter to its ``step``, ``exp_avg`` and
    ``exp_avg_sq``; ``state.clear()`` starts the moments over.

    Why not torch.optim itself: building the first torch.optim optimizer in a process imports
    torch._dynamo (its methods are wrapped to keep the compiler out): 1.2-1.8 s of CPU and ~75 MB
    of memory that every agent process paid at start, for nothing it uses.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("Adam got an empty parameter list")
        self.lr, (self.beta1, self.beta2), self.eps = float(lr), betas, eps
        self.state: dict[torch.Tensor, dict] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        params = [p for p in self.params if p.grad is not None]
        if not params:
            return
        states, exp_avgs, denom = self._advance(params)
        step_size = [(self.lr / (1 - self.beta1 ** float(s["step"]))) * -1 for s in states]
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)

    def _advance(self, params: list[torch.Tensor]) -> tuple[list[dict], list[torch.Tensor], list[torch.Tensor]]:
        """One step's moments of ``params`` (updated in place) and the denominators
        ``sqrt(v / (1 - b2^t)) + eps``: what every Adam here shares but the learning rate."""
        for p in params:
            if p not in self.state:
                self.state[p] = {"step": 0, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                 "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        b1, b2 = self.beta1, self.beta2
        for s in states:
            s["step"] += 1
        torch._foreach_lerp_(exp_avgs, grads, 1 - b1)
        torch._foreach_mul_(exp_avg_sqs, b2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - b2)
        bias_correction2_sqrt = [(1 - b2 ** float(s["step"])) ** 0.5 for s in states]
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, self.eps)
        return states, exp_avgs, denom

    def state_dict(self) -> dict:
        """torch.optim's layout: ``{"state": {index: {"step", "exp_avg", "exp_avg_sq"}}}``, the
        index being the parameter's position, ``step`` a float32 scalar tensor."""
        return {"state": {i: {"step": torch.tensor(float(s["step"])), "exp_avg": s["exp_avg"],
                              "exp_avg_sq": s["exp_avg_sq"]}
                          for i, p in enumerate(self.params) if (s := self.state.get(p)) is not None}}

    def load_state_dict(self, sd: Mapping) -> None:
        """Replace the state with ``sd`` (as :meth:`state_dict` or torch.optim's writes it)."""
        state = {}
        for i, st in sd["state"].items():
            p = self.params[int(i)]
            state[p] = {"step": int(st["step"]),
                        **{k: torch.as_tensor(st[k]).to(device=p.device, dtype=p.dtype).clone()
                           for k in ("exp_avg", "exp_avg_sq")}}
            if state[p]["exp_avg"].shape != p.shape:
                raise ValueError(f"optimizer state {i} has shape {list(state[p]['exp_avg'].shape)}, "
                                 f"the parameter {list(p.shape)}")
        self.state = state


def optimizer_tensors(name: str, opt: Adam) -> dict[str, torch.Tensor]:
    """``opt``'s moments and step counts as flat tensors ``opt.<name>.<index>.<field>`` (a
    checkpoint holds tensors only: safetensors, no pickle)."""
    return {f"opt.{name}.{i}.{k}": v.detach().to("cpu").reshape(-1) if k == "step" else v.detach().to("cpu")
            for i, st in opt.state_dict()["state"].items() for k, v in st.items()}


def load_optimizer_tensors(name: str, opt: Adam, state: Mapping[str, torch.Tensor]) -> None:
    """Restore what :func:`optimizer_tensors` wrote (an optimizer that had taken no step has none)."""
    head = f"opt.{name}."
    per: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in state.items():
        if k.startswith(head):
            i, field = k[len(head):].split(".")
            per.setdefault(int(i), {})[field] = v.reshape(()) if field == "step" else v
    opt.load_state_dict({"state": per})


def generator_tensor(gen: torch.Generator) -> torch.Tensor:
    """The RNG's state as a tensor (restored by ``gen.set_state``)."""
    return gen.get_state().clone()


def adam(params, lr: float) -> Adam:
    """The learners' optimizer: :class:`Adam` (torch.optim.Adam's multi-tensor arithmetic)."""
    return Adam(params, lr)


class StackedAdam(Adam):
    """:class:`Adam` over stacked tensors whose leading axis holds independent learners, each with
    its own learning rate: ``lrs[i]`` broadcasts against ``params[i]`` (``(L, 1, ...)``; a number
    for all). Adam is elementwise, so each learner's moments are its own; every learner takes a
    step together (one step count per tensor). The arithmetic is :class:`Adam`'s, op for op, but
    for the learning rate, which multiplies as a tensor (``addcdiv`` takes only a number)."""

    def __init__(self, params, lrs) -> None:
        super().__init__(params, 1.0)
        self.lrs = list(lrs)
        if len(self.lrs) != len(self.params):
            raise ValueError(f"{len(self.lrs)} learning rates for {len(self.params)} tensors")

    @torch.no_grad()
    def step(self) -> None:
        live = [(p, lr) for p, lr in zip(self.params, self.lrs) if p.grad is not None]
        if not live:
            return
        states, exp_avgs, denom = self._advance([p for p, _ in live])
        ratio = torch._foreach_div(exp_avgs, denom)
        for r, (_, lr), s in zip(ratio, live, states):
            r.mul_(lr * (-1.0 / (1 - self.beta1 ** float(s["step"]))))
        torch._foreach_add_([p for p, _ in live], ratio)
