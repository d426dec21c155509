"""The paper's tables, rendered as Markdown from the result files only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, ROOT
from benchmarks.paper.cells import load_results
from benchmarks.paper.presets import ALGO_LABEL, ALGO_ORDER, Preset, short


# -- rendering -------------------------------------------------------------------------------
def _ms(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{np.mean(xs):.1f} ± {np.std(xs):.1f}" if len(xs) > 1 else f"{xs[0]:.1f}"


def columns(p: Preset) -> tuple[str, ...]:
    """The preset's methods in the paper's column order, named variants beside their method."""
    order = ("fed-bc", "fed-bc-3e-4", "fed-cql", "cql", "drpo", "drpo-returns-gradient")
    return tuple(m for m in order if m in p.methods)


def method(r: dict[str, Any]) -> str:
    """A result's table column: its algorithm, or the named variant it ran (``fed-bc-3e-4``)."""
    return r["variant"].get("method", r["algo"])


def table_md(results: list[dict[str, Any]], datasets: tuple[str, ...], methods: tuple[str, ...] = ALGO_ORDER) -> str:
    rows = ["| dataset | " + " | ".join(ALGO_LABEL[a] for a in methods) + " |",
            "| --- | " + " | ".join("---" for _ in methods) + " |"]
    for d in datasets:
        cells = []
        for a in methods:
            rs = [r for r in results if method(r) == a and r["variant"]["dataset"] == short(d) and r["final"]]
            if not rs:
                cells.append("not run yet")
                continue
            sc = [r["final"]["score_mean"] for r in rs]
            ret = [r["final"]["return_mean"] for r in rs]
            gpu = sum(r["config"].get("device", "cpu") != "cpu" for r in rs)
            cells.append(f"{_ms(sc)} ({_ms(ret)}) n={len(rs)}" + (f", {gpu} on GPU" if gpu else ""))
        rows.append(f"| {short(d)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _best_then_final(r: dict[str, Any]) -> str:
    """A run's best evaluated score (its round) and its final one: ``51.6 (r7) -> 28.4``."""
    best = max(r["curve"], key=lambda c: c["score_mean"])
    return f"{best['score_mean']:.1f} (r{best['round']}) -> {r['curve'][-1]['score_mean']:.1f}"


def best_md(results: list[dict[str, Any]], datasets: tuple[str, ...], methods: tuple[str, ...] = ALGO_ORDER) -> str:
    """Per cell: the best evaluated score of each run's curve (its round) and how far the final
    score is below it, per seed: whether a method got there and then lost it."""
    rows = ["| dataset | " + " | ".join(ALGO_LABEL[a] for a in methods) + " |",
            "| --- | " + " | ".join("---" for _ in methods) + " |"]
    for d in datasets:
        cells = []
        for a in methods:
            rs = sorted((r for r in results if method(r) == a and r["variant"]["dataset"] == short(d) and r["curve"]),
                        key=lambda r: r["seed"])
            parts = [_best_then_final(r) for r in rs]
            cells.append("<br>".join(parts) if parts else "not run yet")
        rows.append(f"| {short(d)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def study_md(results: list[dict[str, Any]], key: str) -> str:
    if not results:
        return "not run yet"
    algos = sorted({r["algo"] for r in results}, key=ALGO_ORDER.index)
    values = sorted({r["variant"][key] for r in results})
    rows = [f"| {key} | " + " | ".join(ALGO_LABEL[a] for a in algos) + " |",
            "| --- | " + " | ".join("---" for _ in algos) + " |"]
    for v in values:
        cells = [_ms([r["final"]["score_mean"] for r in results if r["algo"] == a and r["variant"][key] == v
                      and r["final"]]) for a in algos]
        rows.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def lambda_sweeps(results: list[dict[str, Any]], fixed: tuple[float, float],
                  sweeps: tuple[str, ...]) -> list[tuple[str, str, float, dict[float, list[dict[str, Any]]]]]:
    """Each sweep in ``sweeps`` that has finished DRPO runs: (varied lambda, held lambda, its
    value, {varied value: its finished runs, by seed}), values ascending; the table and the plot
    read this."""
    fix1, fix2 = fixed
    out = []
    for vary, hold, hold_value in (("lambda1", "lambda2", fix2), ("lambda2", "lambda1", fix1)):
        rs = [r for r in results if r["algo"] == "drpo" and r["final"] and r["variant"][hold] == hold_value]
        values = sorted({r["variant"][vary] for r in rs})
        if vary in sweeps and values:
            out.append((vary, hold, hold_value,
                        {v: sorted((r for r in rs if r["variant"][vary] == v), key=lambda r: r.get("seed", 0))
                         for v in values}))
    return out


def lambdas_md(results: list[dict[str, Any]], fixed: tuple[float, float] = (0.1, 1.0),
               sweeps: tuple[str, ...] = ("lambda1", "lambda2")) -> str:
    """The paper's Figure 4(c) sweeps that ``sweeps`` names: lambda1 with lambda2 fixed, lambda2
    with lambda1 fixed; each value's final score over its seeds, how many seeds ran, and each
    seed's best score (its round) and final score (whether a setting got there and lost it)."""
    refs = [r for r in results if r["algo"] != "drpo" and r["final"]]
    results = [r for r in results if r["algo"] == "drpo"]
    if not results:
        return "not run yet"
    out = []
    for vary, hold, hold_value, per in lambda_sweeps(results, fixed, sweeps):
        values = list(per)
        out += [f"| {vary} ({hold} = {hold_value:g}) | " + " | ".join(f"{v:g}" for v in values) + " |",
                "| --- | " + " | ".join("---" for _ in values) + " |",
                "| DRPO score | " + " | ".join(_ms([r["final"]["score_mean"] for r in per[v]]) for v in values) + " |",
                "| seeds | " + " | ".join(str(len(per[v])) for v in values) + " |"]
        if any(r.get("curve") for v in values for r in per[v]):
            out.append("| best (round) -> final, by seed | " + " | ".join(
                "<br>".join(f"s{r['seed']}: {_best_then_final(r)}" for r in per[v] if r.get("curve"))
                for v in values) + " |")
        out.append("")
    for a in sorted({r["algo"] for r in refs}):
        out.append(f"{ALGO_LABEL[a]} on the same agents, for reference: "
                   f"{_ms([r['final']['score_mean'] for r in refs if r['algo'] == a])}")
        out.append("")
    return "\n".join(out[:-1])


def q_scale_md(table: list[dict[str, Any]], normalized: list[dict[str, Any]], datasets: tuple[str, ...]) -> str:
    rows = ["| dataset | DRPO, raw Q term (default) | DRPO, normalised Q term |", "| --- | --- | --- |"]
    for d in datasets:
        raw = [r["final"]["score_mean"] for r in table if r["algo"] == "drpo" and r["variant"]["dataset"] == short(d)
               and r["final"]]
        nor = [r["final"]["score_mean"] for r in normalized if r["variant"]["dataset"] == short(d) and r["final"]]
        rows.append(f"| {short(d)} | {_ms(raw) if raw else 'not run yet'} (n={len(raw)}) | "
                    f"{_ms(nor) if nor else 'not run yet'} (n={len(nor)}) |")
    return "\n".join(rows)


def q_scale_long_md(results: list[dict[str, Any]]) -> str:
    """Final score, best score and, at the last round, mean Q on the data and the policy's NLL of
    the data actions (what lambda1 pulls down), per Q-term variant, mean ± std over seeds."""
    if not results:
        return "not run yet"
    order = ("raw", "normalized", "none (no regularisers)", "none (behaviour cloning)")
    label = {"raw": "DRPO, raw Q term (default)", "normalized": "DRPO, normalised Q term",
             "none (no regularisers)": "Fed-CQL (no regularisers)",
             "none (behaviour cloning)": "Fed-BC (the same budget, for reference)"}
    r0 = results[0]
    rows = [f"{r0['agents']} agents x {r0['trajectories']} trajectories of {short(r0['datasets'][0])}, "
            f"{r0['rounds']} rounds x {r0['local_steps']} local steps (normalised score; return in brackets)", "",
            "| variant | final score | best score | mean Q on data (last round) | NLL of data actions (last round) |",
            "| --- | --- | --- | --- | --- |"]
    for v in order:
        rs = [r for r in results if r["variant"]["q_scale"] == v and r["final"]]
        if not rs:
            rows.append(f"| {label[v]} | not run yet | | | |")
            continue
        last = lambda k: [r["losses_per_round"][k][-1] for r in rs if k in r["losses_per_round"]]  # noqa: E731
        best = [max(c["score_mean"] for c in r["curve"]) for r in rs]
        rows.append(f"| {label[v]} | {_ms([r['final']['score_mean'] for r in rs])} "
                    f"({_ms([r['final']['return_mean'] for r in rs])}) n={len(rs)} | {_ms(best)} | "
                    f"{_ms(last('q_data')) if rs[0]['algo'] != 'fed-bc' else 'no critic'} | "
                    f"{_ms(last('reg_data')) if rs[0]['algo'] == 'drpo' else 'not computed'} |")
    return "\n".join(rows)


# The presets BENCHMARKS.md shows, and which of their blocks (None: all of them)
MD_BLOCKS: dict[str, tuple[str, ...] | None] = {"reduced": ("table", "best"), "reduced-halfcheetah": ("table", "best"),
                                                 "claim": ("table", "best", "lambdas"), "claim-v2": ("table", "best")}
# The studies' page: the reduced preset's studies
STUDIES_MD = ROOT / "docs" / "explanation" / "reduced-studies.md"
STUDY_BLOCKS: dict[str, tuple[str, ...]] = {"reduced": ("agents", "trajectories", "local_steps", "lambdas", "q_scale",
                                                        "q_scale_long")}


def _kept(p: Preset, blocks: dict[str, str], keep: tuple[str, ...] | None) -> dict[str, str]:
    return {k: v for k, v in blocks.items() if keep is None or k.removeprefix(f"paper-{p.name}-") in keep}


def md_blocks(p: Preset, root: Path = RESULTS, blocks: dict[str, str] | None = None) -> dict[str, str]:
    """The blocks of ``p`` that BENCHMARKS.md holds (none for a preset it does not show);
    ``blocks``: :func:`render_blocks`' of ``p``, where the caller has them already."""
    if p.name not in MD_BLOCKS:
        return {}
    return _kept(p, render_blocks(p, root) if blocks is None else blocks, MD_BLOCKS[p.name])


def study_blocks(p: Preset, root: Path = RESULTS, blocks: dict[str, str] | None = None) -> dict[str, str]:
    """The blocks of ``p`` that the studies' page holds (none for a preset it does not show)."""
    if p.name not in STUDY_BLOCKS:
        return {}
    return _kept(p, render_blocks(p, root) if blocks is None else blocks, STUDY_BLOCKS[p.name])


def render_blocks(p: Preset, root: Path = RESULTS) -> dict[str, str]:
    """Markdown blocks, keyed by marker name, generated from the result files only."""
    table = load_results(p, "table", root)
    blocks = {
        f"paper-{p.name}-table": table_md(table, p.datasets, columns(p)),
        f"paper-{p.name}-best": best_md(table, p.datasets, columns(p)),
        f"paper-{p.name}-agents": study_md(load_results(p, "agents", root), "agents"),
        f"paper-{p.name}-trajectories": study_md(load_results(p, "trajectories", root), "trajectories"),
        f"paper-{p.name}-local_steps": study_md(load_results(p, "local_steps", root), "local_steps"),
        f"paper-{p.name}-lambdas": lambdas_md(load_results(p, "lambdas", root), p.lambda_fixed,
                                                        p.lambda_sweeps),
        f"paper-{p.name}-q_scale": q_scale_md(table, load_results(p, "q_scale", root), p.datasets),
        f"paper-{p.name}-q_scale_long": q_scale_long_md(load_results(p, "q_scale_long", root)),
    }
    return blocks
