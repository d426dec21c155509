"""An agent's transitions as device tensors, sampled uniformly with the agent's own RNG."""

from __future__ import annotations

import numpy as np
import torch

from fedrl.algos.base import Batch
from fedrl.data.d4rl import Transitions


class TensorBuffer:
    """Normalised transitions on one device, in torch's default float type (the networks' own:
    float32, or float64 where a test sets it); :meth:`sample` draws a batch with replacement."""

    def __init__(self, tr: Transitions, obs_mean: np.ndarray, obs_std: np.ndarray,
                 device: torch.device, returns_gamma: float | None = None) -> None:
        """``returns_gamma``: also hold each row's discounted return-to-go at that discount, and
        put it in every batch (``Batch.returns``; Cal-QL's reference value)."""
        if len(tr) == 0:
            raise ValueError("an agent's shard has no transitions")

        dtype = torch.get_default_dtype()

        def t(x: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(x), dtype=dtype, device=device)

        self.obs = t((tr.obs - obs_mean) / obs_std)
        self.next_obs = t((tr.next_obs - obs_mean) / obs_std)
        self.actions = t(tr.actions)
        self.rewards = t(tr.rewards)
        self.dones = t(tr.dones)
        self.returns = None if returns_gamma is None else t(tr.returns_to_go(returns_gamma))
        self.size = len(tr)
        self.device = device

    def __len__(self) -> int:
        return self.size

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        idx = torch.randint(self.size, (batch_size,), generator=generator, device=self.device)
        return Batch(self.obs[idx], self.actions[idx], self.rewards[idx], self.next_obs[idx],
                     self.dones[idx], None if self.returns is None else self.returns[idx])


class StackedBuffer:
    """Several agents' shards (of any sizes) in one set of device tensors, each sampled from its
    own rows: :meth:`sample` gives a ``(L, B, ...)`` batch whose row l comes from shard l only.

    The shards are concatenated; shard l occupies rows ``[offsets[l], offsets[l] + sizes[l])``.
    One uniform draw ``(L, B)`` in float64 from the batch's generator picks every learner's rows
    at once (``floor(u * size)``; float64 keeps each of a shard's rows equally likely for any
    shard smaller than 2^40 rows)."""

    def __init__(self, buffers: list[TensorBuffer]) -> None:
        if not buffers:
            raise ValueError("a stacked buffer needs at least one shard")
        device = buffers[0].device
        self.device = device
        for name in ("obs", "next_obs", "actions", "rewards", "dones"):
            setattr(self, name, torch.cat([getattr(b, name) for b in buffers]))
        # the return-to-go where any shard's learner asks for it (the others' rows hold 0, unread)
        have = [b.returns is not None for b in buffers]
        self.returns = None if not any(have) else torch.cat(
            [b.returns if b.returns is not None else torch.zeros_like(b.rewards) for b in buffers])
        sizes = [len(b) for b in buffers]
        self.sizes = torch.tensor(sizes, device=device, dtype=torch.float64)
        self.offsets = torch.tensor(np.concatenate([[0], np.cumsum(sizes)[:-1]]), device=device, dtype=torch.int64)
        self.max_index = torch.tensor(sizes, device=device, dtype=torch.int64) - 1
        self.members = len(buffers)

    def indices(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """Rows ``(L, B)`` into the concatenated tensors, row l within shard l."""
        u = torch.rand((self.members, batch_size), generator=generator, device=self.device, dtype=torch.float64)
        local = (u * self.sizes.unsqueeze(1)).long()
        return self.offsets.unsqueeze(1) + torch.minimum(local, self.max_index.unsqueeze(1))

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        idx = self.indices(batch_size, generator)
        return Batch(self.obs[idx], self.actions[idx], self.rewards[idx], self.next_obs[idx], self.dones[idx],
                     None if self.returns is None else self.returns[idx])
