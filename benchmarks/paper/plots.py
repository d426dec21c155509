"""The paper's figures (learning curves, the studies, the lambda sweeps), drawn from the result files only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from benchmarks.paper.cells import load_results
from benchmarks.paper.presets import ALGO_LABEL, ALGO_ORDER, Preset, short
from benchmarks.paper.tables import lambda_sweeps, method


def _save(fig, path: Path) -> None:
    """Lay out, write (no software tag: the same results draw the same bytes) and close a figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def curves_png(results: list[dict[str, Any]], datasets: tuple[str, ...], path: Path,
               methods: tuple[str, ...] = ALGO_ORDER) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [d for d in datasets if any(r["variant"]["dataset"] == short(d) for r in results)]
    if not present:
        return False
    fig, axes = plt.subplots(1, len(present), figsize=(5 * len(present), 3.6), squeeze=False)
    for ax, d in zip(axes[0], present):
        for a in methods:
            rs = [r for r in results if method(r) == a and r["variant"]["dataset"] == short(d) and r["curve"]]
            if not rs:
                continue
            rounds = [c["round"] for c in rs[0]["curve"]]
            ys = np.array([[c["score_mean"] for c in r["curve"]] for r in rs if len(r["curve"]) == len(rounds)])
            m = ys.mean(0)
            ax.plot(rounds, m, label=f"{ALGO_LABEL[a]} (n={len(ys)})")
            if len(ys) > 1:
                ax.fill_between(rounds, m - ys.std(0), m + ys.std(0), alpha=0.2)
        ax.set_title(short(d))
        ax.set_xlabel("round")
        ax.set_ylabel("normalised score")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    _save(fig, path)
    return True


def studies_png(p: Preset, root: Path, path: Path) -> bool:
    """Final score against each study's variable (the paper's Figures 3-4): one panel per study run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []  # (title, x label, log x, {label: [(x, scores)]})
    for e in ("agents", "trajectories", "local_steps"):
        rs = [r for r in load_results(p, e, root) if r["final"]]
        if rs:
            series = {}
            for a in ALGO_ORDER:
                xs = sorted({r["variant"][e] for r in rs if r["algo"] == a})
                if xs:
                    series[ALGO_LABEL[a]] = [(x, [r["final"]["score_mean"] for r in rs
                                                  if r["algo"] == a and r["variant"][e] == x]) for x in xs]
            panels.append((e.replace("_", " "), e.replace("_", " "), series))
    lam = [r for r in load_results(p, "lambdas", root) if r["final"] and r["algo"] == "drpo"]
    if lam:
        series = {f"{vary} ({hold} = {v0:g})": [(v, [r["final"]["score_mean"] for r in rs]) for v, rs in per.items()]
                  for vary, hold, v0, per in lambda_sweeps(lam, p.lambda_fixed, p.lambda_sweeps)}
        panels.append(("lambdas, 4 expert + 1 medium agents", "lambda (0 drawn at the left edge)", series))
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (title, xlabel, series) in zip(axes[0], panels):
        for label, pts in series.items():
            xs = _lambda_x(pts) if title.startswith("lambdas") else np.array([x for x, _ in pts], float)
            m = np.array([np.mean(y) for _, y in pts])
            sd = np.array([np.std(y) for _, y in pts])
            ax.errorbar(xs, m, yerr=sd, marker="o", capsize=3, label=f"{label} (n={max(len(y) for _, y in pts)})")
        ax.set_xscale("log")
        if title.startswith("lambdas"):  # ticks at the values run, 0 named as itself
            ticks = sorted({(x, v) for pts in series.values() for (v, _), x in zip(pts, _lambda_x(pts))})
            ax.set_xticks([x for x, _ in ticks], [f"{v:g}" for _, v in ticks])
            ax.minorticks_off()
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("normalised score")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, path)
    return True


def _lambda_x(pts: list[tuple[float, Any]]) -> np.ndarray:
    """Where a lambda sweep's values go on a log axis: 0 one decade left of the smallest positive."""
    xs = np.array([x for x, _ in pts], float)
    pos = xs[xs > 0]
    return np.where(xs > 0, xs, (pos.min() / 10) if len(pos) else 1.0)


def lambda_curves_png(results: list[dict[str, Any]], fixed: tuple[float, float], path: Path,
                      values: tuple[float, ...] = ()) -> bool:
    """Score by round of the lambda2 sweep (lambda1 held at ``fixed[0]``): each seed thin, the
    mean over seeds bold, one colour per lambda2 (its place in ``values``, the preset's, so a
    setting keeps its colour as others arrive); the Fed-BC reference's mean dashed, in black.
    Shows what a final score hides: a setting still rising at the last round, or one that peaked
    and fell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results if r["final"] and r.get("curve")]
    drpo = [r for r in runs if r["algo"] == "drpo" and r["variant"]["lambda1"] == fixed[0]]
    if not drpo:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    present = sorted({r["variant"]["lambda2"] for r in drpo})
    order = [*values, *(v for v in present if v not in values)]
    groups = [(f"DRPO, lambda2 = {v:g}", [r for r in drpo if r["variant"]["lambda2"] == v], "-",
               palette[order.index(v) % len(palette)]) for v in present]
    refs = [r for r in runs if r["algo"] != "drpo"]
    if refs:
        groups.append(("Fed-BC (reference)", refs, "--", "black"))
    for label, rs, style, colour in groups:
        for r in rs:
            ax.plot([c["round"] for c in r["curve"]], [c["score_mean"] for c in r["curve"]], style,
                    color=colour, alpha=0.35, linewidth=0.9)
        rounds = [c["round"] for c in rs[0]["curve"]]
        full = np.array([[c["score_mean"] for c in r["curve"]] for r in rs if len(r["curve"]) == len(rounds)])
        ax.plot(rounds, full.mean(0), style, color=colour, linewidth=2.2, label=f"{label} (n={len(full)})")
    ax.set_xlabel("round")
    ax.set_ylabel("normalised score")
    ax.set_title(f"4 expert + 1 medium agents, lambda1 = {fixed[0]:g}: each seed thin, their mean bold", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)
    return True
