"""An agent's transitions as device tensors, sampled uniformly with the agent's own RNG."""

from __future__ import annotations

import numpy as np
import torch

from fedrl.algos.base import Batch
from fedrl.data.d4rl import Transitions


class TensorBuffer:
    """Normalised transitions on one device; :meth:`sample` draws a batch with replacement."""

    def __init__(self, tr: Transitions, obs_mean: np.ndarray, obs_std: np.ndarray,
                 device: torch.device) -> None:
        if len(tr) == 0:
            raise ValueError("an agent's shard has no transitions")

        def t(x: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(x), dtype=torch.float32, device=device)

        self.obs = t((tr.obs - obs_mean) / obs_std)
        self.next_obs = t((tr.next_obs - obs_mean) / obs_std)
        self.actions = t(tr.actions)
        self.rewards = t(tr.rewards)
        self.dones = t(tr.dones)
        self.size = len(tr)
        self.device = device

    def __len__(self) -> int:
        return self.size

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        idx = torch.randint(self.size, (batch_size,), generator=generator, device=self.device)
        return Batch(self.obs[idx], self.actions[idx], self.rewards[idx], self.next_obs[idx],
                     self.dones[idx])
