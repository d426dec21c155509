"""Online SAC's settings: a module of their own, without torch, so that the command line's options
(``fedrl data train-behavior --help``) load none."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SACConfig:
    """Online SAC with automatic temperature (Haarnoja et al. 2018, "SAC: Algorithms and Applications")."""

    total_steps: int = 400_000
    """Environment steps to train for (one gradient step per environment step after ``start_steps``)."""
    start_steps: int = 5_000
    """Initial steps of uniformly random actions before the policy acts (and before updates start)."""
    hidden: tuple[int, ...] = (256, 256)
    """Hidden widths of the policy and each critic (same networks as the offline learners)."""
    lr: float = 3e-4
    """Adam learning rate of actor, critics and temperature."""
    gamma: float = 0.99
    """Discount factor."""
    tau: float = 5e-3
    """Polyak rate of the target critics."""
    batch_size: int = 256
    """Transitions per gradient step."""
    eval_every: int = 10_000
    """Steps between evaluations; each writes a checkpoint and the resume state."""
    eval_episodes: int = 5
    """Episodes per evaluation (deterministic policy, and the stochastic one data is made with)."""
    max_episode_steps: int = 1000
    """Time limit of training and evaluation episodes (D4RL's)."""
    seed: int = 0
    """Seeds network init, the environment and every sample."""

    def __post_init__(self) -> None:
        for n in ("total_steps", "batch_size", "eval_every", "eval_episodes", "max_episode_steps"):
            if getattr(self, n) <= 0:
                raise ValueError(f"{n} must be > 0, got {getattr(self, n)}")
        if not 0 <= self.start_steps <= self.total_steps:
            raise ValueError(f"start_steps must be in [0, total_steps], got {self.start_steps}")
        object.__setattr__(self, "hidden", tuple(int(h) for h in self.hidden))
