"""What every learner shares: the batch type, parameter helpers and the learner interface."""

from __future__ import annotations

from collections.abc import Mapping
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


class Learner(Protocol):
    """One agent's local learner: set from the global model, then take gradient steps."""

    policy: nn.Module

    def begin_round(self, global_state: Mapping[str, torch.Tensor]) -> None:
        """Adopt the global model (prefixed keys, see :func:`prefixed_state`) for a new round."""

    def update(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One gradient step; returns detached scalar diagnostics (no ``.item()`` here)."""

    def shared_state(self, federate_critic: bool) -> dict[str, torch.Tensor]:
        """The parameters this learner sends to the server (detached CPU copies)."""


def prefixed_state(prefix: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` as detached CPU tensors under ``prefix.``."""
    return {f"{prefix}.{k}": v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def load_prefixed(module: nn.Module, state: Mapping[str, torch.Tensor], prefix: str) -> bool:
    """Load the ``prefix.*`` entries of ``state`` into ``module`` (strict); False if none exist.

    Strict as ``load_state_dict``: exactly the module's names, each with its shape. The copy is
    one fused call (this runs every round, for every agent)."""
    head = prefix + "."
    sub = {k[len(head):]: v for k, v in state.items() if k.startswith(head)}
    if not sub:
        return False
    copy_state_(module, sub)
    return True


@torch.no_grad()
def copy_state_(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """``module``'s parameters and buffers <- ``state`` (same names and shapes, checked)."""
    own = module.state_dict(keep_vars=True)
    if own.keys() != state.keys():
        missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        raise RuntimeError(f"state does not match {type(module).__name__}: missing {missing}, "
                           f"unexpected {unexpected}")
    dst, src = [], []
    for k, t in own.items():
        v = state[k]
        if v.shape != t.shape:
            raise RuntimeError(f"{k}: shape {list(v.shape)} does not match the module's {list(t.shape)}")
        dst.append(t)
        src.append(v)
    torch._foreach_copy_(dst, src)


@torch.no_grad()
def soft_update_(target: nn.Module, source: nn.Module, tau: float) -> None:
    """Polyak averaging ``target <- (1 - tau) target + tau source`` in one fused call."""
    torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), tau)


def adam(params, lr: float) -> torch.optim.Adam:
    """Adam with the multi-tensor implementation (fewer kernel launches on CPU and GPU)."""
    return torch.optim.Adam(params, lr=lr, foreach=True)
