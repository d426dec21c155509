"""Learning-curve PNGs (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from fedrl.envs import env_info  # noqa: E402
from fedrl.envs.scores import normalized_score  # noqa: E402


def learning_curve(curve: list[dict], path: str | Path, title: str, env: str,
                   data_return: float | None = None) -> Path:
    """Return per round with a +-std band, and the D4RL normalised score on a second axis.

    Horizontal references a reader can judge the policy by: the mean episode return of the
    federation's own data (``data_return``, when given) and D4RL's random and expert returns for
    the task (scores 0 and 100). Rounds are integers on the x axis."""
    rounds = [c["round"] for c in curve]
    mean = [c["return_mean"] for c in curve]
    std = [c["return_std"] for c in curve]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    ax.plot(rounds, mean, marker="o", label="global policy (mean ± std over episodes)")
    ax.fill_between(rounds, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                    alpha=0.25)
    e = env_info(env)
    if data_return is not None:
        ax.axhline(data_return, color="tab:green", ls="--", lw=1, label=f"the agents' data ({data_return:.0f})")
    # The axis spans the run and its data's level (early rounds stay readable whatever the
    # references' scale): a reference outside it is noted at the edge it lies beyond.
    lo, hi = y_range([m - s for m, s in zip(mean, std)] + ([data_return] if data_return is not None else []),
                     [m + s for m, s in zip(mean, std)] + ([data_return] if data_return is not None else []))
    ax.set_ylim(lo, hi)
    for value, name, ls in ((e.ref_max_score, "D4RL expert", ":"), (e.ref_min_score, "D4RL random", "-.")):
        if lo <= value <= hi:
            ax.axhline(value, color="tab:gray", ls=ls, lw=1, label=f"{name} ({value:.0f})")
        else:
            above = value > hi
            ax.annotate(f"{name} {value:.0f} {'above' if above else 'below'}, off scale",
                        xy=(0.99, 0.98 if above else 0.02), xycoords="axes fraction", ha="right",
                        va="top" if above else "bottom", fontsize=7, color="tab:gray")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("return (raw)")
    ax2 = ax.twinx()  # the normalised score is affine in the return: same curve, second scale
    lo, hi = ax.get_ylim()
    ax2.set_ylim(normalized_score(env, lo), normalized_score(env, hi))
    ax2.set_ylabel("D4RL normalised score")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return Path(path)


def y_range(lows: list[float], highs: list[float]) -> tuple[float, float]:
    """The return axis: from the lowest to the highest value shown, with a margin of a tenth of
    the span (at least 1), never narrower than 10 return units."""
    lo, hi = min(lows), max(highs)
    pad = max(0.1 * (hi - lo), 1.0)
    lo, hi = lo - pad, hi + pad
    if hi - lo < 10.0:
        mid = (hi + lo) / 2
        lo, hi = mid - 5.0, mid + 5.0
    return lo, hi


def episode_return_mean(rewards, episode) -> float:
    """Mean over episodes of the summed rewards of each (``episode``: each row's episode id)."""
    import numpy as np

    _, inverse = np.unique(episode, return_inverse=True)
    return float(np.bincount(inverse, weights=np.asarray(rewards, dtype=np.float64)).mean())
