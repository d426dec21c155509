"""The verdict's cells and how one is read (its final score over 50 episodes, its last rounds'
mean, its best round), shared by the verdict (``verdict.py``) and issue 83's tables
(``footing.py``): which cells, which columns, the one-task rule for the default critic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS
from benchmarks.paper import cells as runs, presets, tables

PRESET = presets.PRESETS["verdict"]
HELDOUT = presets.PRESETS["heldout-walker2d"]  # the critic's choice checked on a task it was not made on
ORDER = ("drpo", "fed-cql", "cql", "fed-bc")  # the paper's ordering, best first
COLUMNS = ("fed-bc", "fed-cql", "cql", "drpo", "drpo-returns-gradient")
LABEL = {**presets.ALGO_LABEL, "drpo": "DRPO (paper's critic)", "drpo-returns-gradient": "DRPO, gradient stopped at G"}
NAMES = {"drpo": "DRPO", "fed-cql": "Fed-CQL", "cql": "CQL alone", "fed-bc": "Fed-BC"}  # in sentences
LAST = 5  # rounds averaged for "the last rounds" (the objective defaults are chosen by)
PAPERS = "`none`, the paper's"


def _folder(root: Path) -> Path:
    return Path(root) / f"paper-{PRESET.name}"


def cells(root: Path = RESULTS) -> list[dict[str, Any]]:
    """The verdict's cells: its columns at the preset's seeds (the added seeds and the critic's
    ablation under Fed-CQL and CQL, issue 83, are read apart)."""
    return [r for r in runs.load_results(PRESET, "table", root)
            if r.get("curve") and r["seed"] in PRESET.seeds and tables.method(r) in COLUMNS]


def per_seed(r: dict[str, Any]) -> dict[str, Any]:
    """A cell's three numbers: the final score over 50 episodes, the last rounds' mean, the best round."""
    scores = [c["score_mean"] for c in r["curve"]]
    best = max(r["curve"], key=lambda c: c["score_mean"])
    long = r.get("final_long")
    return {"seed": r["seed"], "final50": long["score_mean"] if long else None,
            "last": float(np.mean(scores[-LAST:])), "best": best["score_mean"], "best_round": best["round"]}


def summary(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {m: [] for m in COLUMNS}
    for r in results:
        out.setdefault(tables.method(r), []).append(per_seed(r))
    return {m: sorted(v, key=lambda x: x["seed"]) for m, v in out.items()}


def _ms(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{np.mean(xs):.1f} ± {np.std(xs):.1f}" if len(xs) > 1 else f"{xs[0]:.1f}"


def _seed_line(x: dict[str, Any]) -> str:
    final = "-" if x["final50"] is None else f"{x['final50']:.1f}"
    return f"s{x['seed']}: {final} / {x['last']:.1f} / {x['best']:.1f} (r{x['best_round']})"


def _complete(s: dict[str, list[dict[str, Any]]], methods) -> bool:
    return all(len(s.get(m, [])) == len(PRESET.seeds) for m in methods)


def _critic_scores(results: list[dict[str, Any]]) -> tuple[list[float], list[float]] | None:
    """Each seed's mean of the last rounds for DRPO with the paper's critic and with the gradient
    stop; None until every seed of both is in."""
    s = summary(results)
    pair = ("drpo", "drpo-returns-gradient")
    if not _complete(s, pair):
        return None
    a, b = ([x["last"] for x in s[m]] for m in pair)
    return a, b


def chosen_critic(results: list[dict[str, Any]]) -> str | None:
    """The ``cql_calibration`` DRPO's default should have, by the mean of the last rounds over
    seeds: the paper's (``"none"``) when it scores at least as well as the gradient stop (issue
    68's rule); None until every seed of both is in."""
    scores = _critic_scores(results)
    return None if scores is None else _pick(*scores)


def _pick(paper: list[float], gradient: list[float]) -> str:
    return "none" if np.mean(paper) >= np.mean(gradient) else "returns-gradient"


def heldout_cells(root: Path = RESULTS) -> list[dict[str, Any]]:
    return [r for r in runs.load_results(HELDOUT, "table", root) if r.get("curve")]


def method_table(results: list[dict[str, Any]], methods: tuple[str, ...], seeds: int) -> str:
    """Per method, the final score (50 episodes), the mean of the last rounds and the best round,
    as mean ± std over seeds and per seed (``seeds``: how many the table expects)."""
    s = summary(results)
    rows = [f"| method | final, 50 episodes | mean of the last {LAST} rounds | best round | seeds | "
            f"by seed: final / last {LAST} / best (round) |", "| --- | --- | --- | --- | --- | --- |"]
    for m in methods:
        xs = s.get(m, [])
        rows.append(f"| {LABEL[m]} | {_ms([x['final50'] for x in xs])} | {_ms([x['last'] for x in xs])} | "
                    f"{_ms([x['best'] for x in xs])} | {len(xs)} of {seeds} | "
                    f"{'<br>'.join(_seed_line(x) for x in xs) or 'not run yet'} |")
    return "\n".join(rows)
