"""Learning-curve PNGs (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fedrl.envs.scores import normalized_score  # noqa: E402


def learning_curve(curve: list[dict], path: str | Path, title: str, env: str) -> Path:
    """Return per round with a +-std band, and the D4RL normalised score on a second axis."""
    rounds = [c["round"] for c in curve]
    mean = [c["return_mean"] for c in curve]
    std = [c["return_std"] for c in curve]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot(rounds, mean, marker="o", label="return")
    ax.fill_between(rounds, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                    alpha=0.25)
    ax.set_xlabel("round")
    ax.set_ylabel("return (raw)")
    ax2 = ax.twinx()  # the normalised score is affine in the return: same curve, second scale
    lo, hi = ax.get_ylim()
    ax2.set_ylim(normalized_score(env, lo), normalized_score(env, hi))
    ax2.set_ylabel("D4RL normalised score")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
