"""DRPO's lead on equal footing and on a second task (issue 83), read from result files only.

    python -m benchmarks.paper run --preset verdict --only fed-cql-returns-gradient-medium-s0,...
    python -m benchmarks.paper run --preset verdict --only drpo-returns-gradient-medium-s3,...
    python -m benchmarks.paper run --preset heldout-walker2d
    python -m benchmarks.paper.verdict render            (renders these tables with the verdict's)

- **Equal footing** (hopper-medium, the verdict's cells, seeds 0-2): every CQL-based method under
  both critics, the paper's (``none``) and the gradient stop (``returns-gradient``). The paper's
  ablation is DRPO against Fed-CQL (DRPO without its two regularisers) under the same critic: its
  sentence gives DRPO - Fed-CQL under each critic, by seed.
- **More seeds** where the spread is large: DRPO with the gradient stop and Fed-BC at seeds 0-4.
- **The second task** (Walker2d-v5 medium, ``heldout-walker2d``): DRPO under both critics and
  Fed-BC, seeds 0-2, with the verdict's protocol.
- **The default critic by both tasks**: each task's mean over seeds of DRPO's last-5-round score
  under each critic, the two tasks weighted equally; the paper's critic unless the gradient stop's
  two-task mean is higher. Until the second task is in, the verdict's one-task rule stands.

Every number is a cell's mean D4RL score over its last ``verdict.LAST`` rounds; until a table's
cells are all in, it says how many are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import RESULTS
from benchmarks.paper import cells as runs, presets, readings as verdict, tables

CQL_METHODS = ("drpo", "fed-cql", "cql")
GRADIENT = "-returns-gradient"
CRITICS = (("", "the paper's critic (`none`)"), (GRADIENT, "the gradient stop (`returns-gradient`)"))
NAMES = {"drpo": "DRPO", "fed-cql": "Fed-CQL", "cql": "CQL alone", "fed-bc": "Fed-BC"}
SEEDS = verdict.PRESET.seeds  # the verdict's (0, 1, 2)
# the spread's added seeds (3, 4): DRPO with the gradient stop, and Fed-BC (the preset plans them)
SPREAD_METHODS = tuple(m for m, _ in verdict.PRESET.more_seeds)
ADDED_SEEDS = dict(verdict.PRESET.more_seeds)[SPREAD_METHODS[0]]
HELD_METHODS = ("fed-bc", "drpo", "drpo" + GRADIENT)


def hopper(root: Path = RESULTS) -> list[dict[str, Any]]:
    """Every finished cell of the verdict preset, at any seed and method."""
    return [r for r in runs.load_results(verdict.PRESET, "table", root) if r.get("curve")]


def walker(root: Path = RESULTS) -> list[dict[str, Any]]:
    return verdict.heldout_cells(root)


def last_by_seed(results: list[dict[str, Any]], method: str, seeds: tuple[int, ...]) -> dict[int, float]:
    """``method``'s mean score over its last rounds, by seed, for the ``seeds`` that are in."""
    return {r["seed"]: verdict.per_seed(r)["last"] for r in results
            if tables.method(r) == method and r["seed"] in seeds}


def _cell(xs: dict[int, float], want: int) -> str:
    return f"{verdict._ms(list(xs.values()))} ({len(xs)} of {want})"


def _diff(a: dict[int, float], b: dict[int, float]) -> list[float]:
    return [a[s] - b[s] for s in sorted(a) if s in b]


def batched_note(results: list[dict[str, Any]]) -> str:
    """The cells among ``results`` that ran as one batched model on a device (a lent GPU), named:
    the same losses, agents' data and evaluation episodes as the per-agent cells of their seed,
    with the batch's own random draws (so not the per-agent run's numbers draw for draw)."""
    batched = [r for r in results if r.get("engine") == runs.BATCHED_ENGINE]
    if not batched:
        return ""
    keys = sorted((r["key"] for r in batched), key=lambda k: (int(k.rsplit("-s", 1)[1]), k))
    devices = sorted({str(r.get("device_name") or "a device") for r in batched})
    return (f" Ran on {', '.join(devices)} as one batched model (`python -m benchmarks.paper.device`; the same "
            f"losses and agents' data, the batch's own random draws): {', '.join(f'`{k}`' for k in keys)}.")


def footing_md(results: list[dict[str, Any]]) -> str:
    """The CQL-based methods under both critics, and the paper's ablation on that footing."""
    rows = ["| method | " + " | ".join(name for _, name in CRITICS) + " | gradient stop - paper's, by seed |",
            "| --- | --- | --- | --- |"]
    last = {m + c: last_by_seed(results, m + c, SEEDS) for m in CQL_METHODS for c, _ in CRITICS}
    for m in CQL_METHODS:
        d = _diff(last[m + GRADIENT], last[m])
        rows.append(f"| {NAMES[m]} | " + " | ".join(_cell(last[m + c], len(SEEDS)) for c, _ in CRITICS)
                    + f" | {', '.join(f'{x:+.1f}' for x in d) or '-'} |")
    said = footing_sentence(last)
    shown = [r for r in results if tables.method(r) in last and r["seed"] in SEEDS]
    return "\n".join(rows) + "\n\n" + said + ("" if "not in yet" in said else batched_note(shown))


def footing_sentence(last: dict[str, dict[int, float]]) -> str:
    if any(len(v) < len(SEEDS) for v in last.values()):
        added = [m + GRADIENT for m in CQL_METHODS[1:]]  # the cells issue 83 adds: the gradient stop under those two
        n = sum(len(last[m]) for m in added)
        return (f"**The paper's ablation on equal footing**: not in yet, {n} of {len(added) * len(SEEDS)} cells "
                f"of Fed-CQL and CQL alone with the gradient stop "
                f"(`python -m benchmarks.paper status --preset {verdict.PRESET.name}`).")
    parts, leads = [], []
    for c, name in CRITICS:
        d = _diff(last["drpo" + c], last["fed-cql" + c])
        leads.append(float(np.mean(d)) > 0)
        parts.append(f"under {name} {float(np.mean(d)):+.1f} ± {float(np.std(d)):.1f} (by seed "
                     + ", ".join(f"{x:+.1f}" for x in d) + f"; DRPO ahead in {sum(x > 0 for x in d)} of {len(d)})")
    where = ("under both critics" if all(leads) else "under neither critic" if not any(leads)
             else f"only under {CRITICS[leads.index(True)][1]}")
    critic = {m: float(np.mean(_diff(last[m + GRADIENT], last[m]))) for m in CQL_METHODS}
    return (f"**The paper's ablation on equal footing** (DRPO against Fed-CQL, which is DRPO without its two "
            f"regularisers, under the same critic), DRPO - Fed-CQL over the last {verdict.LAST} rounds: "
            + "; ".join(parts) + f". The dual regularisation leads {where}. The critic alone moves each method by "
            + ", ".join(f"{NAMES[m]} {critic[m]:+.1f}" for m in CQL_METHODS) + " (gradient stop - paper's).")


def spread_md(results: list[dict[str, Any]]) -> str:
    """DRPO with the gradient stop and Fed-BC over five seeds: the spread's own table."""
    seeds = (*SEEDS, *ADDED_SEEDS)
    rows = ["| method | mean of the last rounds | " + " | ".join(f"s{s}" for s in seeds) + " |",
            "| --- | --- | " + " | ".join("---" for _ in seeds) + " |"]
    last = {m: last_by_seed(results, m, seeds) for m in SPREAD_METHODS}
    for m in SPREAD_METHODS:
        rows.append(f"| {verdict.LABEL[m]} | {_cell(last[m], len(seeds))} | "
                    + " | ".join(f"{last[m][s]:.1f}" if s in last[m] else "-" for s in seeds) + " |")
    added = sum(s in last[m] for m in SPREAD_METHODS for s in ADDED_SEEDS)
    if added < len(SPREAD_METHODS) * len(ADDED_SEEDS):
        missing = [r.key for r in presets.planned(verdict.PRESET, "table")
                   if r.seed in ADDED_SEEDS and r.seed not in last[r.method]]
        said = (f"**Five seeds**: not in yet, {added} of {len(SPREAD_METHODS) * len(ADDED_SEEDS)} added cells "
                f"(`python -m benchmarks.paper run --preset {verdict.PRESET.name} --only {','.join(missing)}`).")
    else:
        a, b = last[SPREAD_METHODS[0]], last[SPREAD_METHODS[1]]
        d = _diff(a, b)
        said = (f"**Five seeds**: DRPO with the gradient stop {verdict._ms(list(a.values()))}, Fed-BC "
                f"{verdict._ms(list(b.values()))}; DRPO above Fed-BC in {sum(x > 0 for x in d)} of {len(d)} seeds "
                f"(by {', '.join(f'{x:+.1f}' for x in d)})."
                + batched_note([r for r in results if tables.method(r) in SPREAD_METHODS and r["seed"] in seeds]))
    return "\n".join(rows) + "\n\n" + said


DATA_QUALITY = "data_quality.json"
AT = ("alpha", "entropy", "reg_data", "q_data")  # the diagnostics read at the last round
# the other CQL-based methods under the gradient stop: on a seed they hold the same agents' data
PEERS = tuple(m + GRADIENT for m in CQL_METHODS[1:])
DIAGNOSTICS = {"alpha": "alpha", "entropy": "entropy", "reg_data": "NLL of the data actions",
               "q_data": "Q on the data", "share": "Q term / regularisers (actor gradient)"}


def data_quality(root: Path = RESULTS) -> dict[str, dict[str, float]]:
    """Per seed, what its agents' episodes hold: their number, mean return and D4RL score (from the
    dataset and each seed's shards, as a cell recorded them), kept in the results folder (render
    reads the file). ``python -m benchmarks.paper.verdict data-quality``."""
    import json

    from fedrl.data.d4rl import to_transitions
    from fedrl.data.registry import load
    from fedrl.envs.scores import normalized_score

    tr = to_transitions(load(verdict.PRESET.datasets[0]))
    out: dict[str, dict[str, float]] = {}
    for r in hopper(root):
        if str(r["seed"]) in out:
            continue
        rets = [float(tr.rewards[tr.episode == e].sum()) for sh in r["shards"] for e in sh["episodes"]]
        out[str(r["seed"])] = {"episodes": len(rets), "return": round(float(np.mean(rets)), 1),
                               "score": round(float(np.mean([normalized_score("Hopper-v5", x) for x in rets])), 2)}
    path = Path(root) / f"paper-{verdict.PRESET.name}" / DATA_QUALITY
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return out


def _at_last(r: dict[str, Any], key: str) -> float | None:
    v = r.get("losses_per_round", {}).get(key)
    return float(v[-1]) if v else None


def seed_reading(results: list[dict[str, Any]], quality: dict[str, dict[str, float]],
                 method: str = "drpo" + GRADIENT) -> dict[int, dict[str, float]]:
    """Per seed of ``method``: its last rounds' score, the last round's diagnostics (:data:`AT`, the
    Q term's share of the actor's gradient), its data's score, and Fed-BC's and the other
    gradient-stop methods' (:data:`PEERS`) scores on that seed: the same agents' data."""
    seeds = (*SEEDS, *ADDED_SEEDS)
    bc = last_by_seed(results, "fed-bc", seeds)
    peers = {m: last_by_seed(results, m, seeds) for m in PEERS}
    out = {}
    for r in results:
        if tables.method(r) != method or r["seed"] not in seeds:
            continue
        x = {"last": verdict.per_seed(r)["last"], **{k: _at_last(r, k) for k in AT}}
        gq, l1, l2 = (_at_last(r, k) for k in ("grad_q", "grad_lambda1", "grad_lambda2"))
        x["share"] = gq / (l1 + l2) if gq is not None and l1 and l2 else None
        q = quality.get(str(r["seed"]))
        x["data_score"] = q["score"] if q else None
        x["fed_bc"] = bc.get(r["seed"])
        x |= {m: peers[m].get(r["seed"]) for m in PEERS}
        out[r["seed"]] = x
    return dict(sorted(out.items()))


def seed_md(results: list[dict[str, Any]], quality: dict[str, dict[str, float]]) -> str:
    """What sets the seed that never lifts apart (issue 83, item 2): the diagnostics at the last
    round side by side with its data's score and Fed-BC's, and one sentence from them. The seed
    that never lifts is the one with the lowest last-rounds score; a diagnostic "sets it apart"
    when its value lies outside the others' range by more than 5% of their spread's scale."""
    rd = seed_reading(results, quality)
    if len(rd) < len(SEEDS):
        return f"**The seed that never lifts**: not in yet, {len(rd)} of {len(SEEDS)} seeds."
    cols = ("last", *PEERS, "data_score", "fed_bc", *AT, "share")
    head = {"last": f"DRPO, last {verdict.LAST} rounds", "data_score": "the agents' data (D4RL score)",
            "fed_bc": "Fed-BC, same seed", **{m: f"{NAMES[m.removesuffix(GRADIENT)]}, gradient stop, same seed"
                                              for m in PEERS},
            **{k: f"{DIAGNOSTICS[k]} at the last round" for k in (*AT, "share")}}
    rows = ["| seed | " + " | ".join(head[c] for c in cols) + " |", "| --- | " + " | ".join("---" for _ in cols) + " |"]
    for seed, x in rd.items():
        rows.append(f"| s{seed} | " + " | ".join("-" if x[c] is None else f"{x[c]:.3g}" for c in cols) + " |")
    low = min(rd, key=lambda k: rd[k]["last"])
    others = [x for k, x in rd.items() if k != low]
    apart = []
    for c in (*AT, "share", "data_score", "fed_bc"):
        mine, rest = rd[low][c], [x[c] for x in others if x[c] is not None]
        if mine is None or not rest:
            continue
        scale = max(abs(v) for v in (*rest, mine)) or 1.0
        if mine < min(rest) - 0.05 * scale or mine > max(rest) + 0.05 * scale:
            apart.append(head[c] if c not in AT and c != "share" else DIAGNOSTICS[c])
    same = [DIAGNOSTICS[c] for c in (*AT, "share") if DIAGNOSTICS[c] not in apart]
    said = (f"**The seed that never lifts** is s{low} (DRPO with the gradient stop, {rd[low]['last']:.1f} over its last "
            f"{verdict.LAST} rounds). At the last round its " + ", ".join(same)
            + (" lie within 5% of the other seeds' range" if same else "")
            + ("; what sets it apart: " + ", ".join(apart) if apart else "; nothing logged sets it apart")
            + ". " + _peers_said(rd, low)
            + "Seeds whose data scores lower than the others' are the test of that reading.")
    return "\n".join(rows) + "\n\n" + said


def _peers_said(rd: dict[int, dict[str, Any]], low: int) -> str:
    """Whether the other methods under the gradient stop, on the same agents' data, also lag on
    the seed DRPO lags on (the seed's data and draws, not DRPO's regularisers), as far as they are in."""
    out = []
    for m in PEERS:
        xs = {k: x[m] for k, x in rd.items() if x[m] is not None}
        name = f"{NAMES[m.removesuffix(GRADIENT)]} with the gradient stop"
        if low not in xs or len(xs) < 2:
            out.append(f"{name}: not in yet on s{low} and another seed")
            continue
        lowest = xs[low] < min(v for k, v in xs.items() if k != low)
        out.append(f"{name} {'also scores lowest' if lowest else 'does not score lowest'} "
                   f"on s{low} ({xs[low]:.1f}, against {', '.join(f'{xs[k]:.1f}' for k in sorted(xs) if k != low)})")
    return "On the same agents' data, " + "; ".join(out) + ". "


def walker_md(held: list[dict[str, Any]]) -> str:
    """The second task's table (as the verdict's) and its sentence."""
    s = verdict.summary(held)
    rows = [verdict.method_table(held, HELD_METHODS, len(verdict.HELDOUT.seeds))]
    n, want = sum(len(s.get(m, [])) for m in HELD_METHODS), len(HELD_METHODS) * len(verdict.HELDOUT.seeds)
    if n < want:
        said = (f"**The second task** (Walker2d-v5 medium, the verdict's protocol): not in yet, {n} of {want} cells "
                f"(`python -m benchmarks.paper status --preset {verdict.HELDOUT.name}`).")
    else:
        m = {k: float(np.mean([x["last"] for x in s[k]])) for k in HELD_METHODS}
        ranked = sorted(HELD_METHODS, key=lambda k: -m[k])
        said = (f"**The second task** (Walker2d-v5 medium, the verdict's protocol), mean of the last {verdict.LAST} "
                f"rounds over {len(verdict.HELDOUT.seeds)} seeds: "
                + ", ".join(f"{verdict.LABEL[k]} {m[k]:.1f} ± {float(np.std([x['last'] for x in s[k]])):.1f}"
                            for k in ranked) + " (ranked)." + batched_note(held))
    return "\n".join(rows) + "\n\n" + said


def task_critics(results: list[dict[str, Any]], seeds: tuple[int, ...]) -> tuple[float, float] | None:
    """One task's DRPO mean over seeds under the paper's critic and the gradient stop (None until
    every seed of both is in)."""
    a, b = (last_by_seed(results, "drpo" + c, seeds) for c, _ in CRITICS)
    if len(a) < len(seeds) or len(b) < len(seeds):
        return None
    return float(np.mean(list(a.values()))), float(np.mean(list(b.values())))


def two_task_choice(hop: list[dict[str, Any]], held: list[dict[str, Any]]) -> tuple[str | None, str]:
    """(the default critic by both tasks, its sentence); (None, why) until both tasks are in."""
    h, w = task_critics(hop, SEEDS), task_critics(held, verdict.HELDOUT.seeds)
    if h is None or w is None:
        missing = "hopper-medium" if h is None else "walker2d-medium"
        return None, (f"**By both tasks**: not decided yet, {missing}'s DRPO cells are not all in; until they are, "
                      "the default is hopper-medium's choice above.")
    paper, gradient = (h[0] + w[0]) / 2, (h[1] + w[1]) / 2
    chosen = "none" if paper >= gradient else "returns-gradient"
    prefer = ["none" if x[0] >= x[1] else "returns-gradient" for x in (h, w)]
    agree = ("both tasks prefer the same critic" if prefer[0] == prefer[1] else
             f"the two tasks disagree: hopper-medium prefers `{prefer[0]}`, walker2d-medium `{prefer[1]}`")
    spread = {}  # a task's margin beside its seeds' spread (the larger of the two critics' std)
    for name, res, seeds, x in (("hopper-medium", hop, SEEDS, h), ("walker2d-medium", held, verdict.HELDOUT.seeds, w)):
        sd = max(float(np.std(list(last_by_seed(res, "drpo" + c, seeds).values()))) for c, _ in CRITICS)
        if abs(x[1] - x[0]) < sd:
            spread[name] = (abs(x[1] - x[0]), sd)
    if spread:
        agree += " (" + "; ".join(f"{k}'s margin, {m:.1f}, is within its seeds' spread, ±{sd:.1f}"
                                  for k, (m, sd) in spread.items()) + ")"
    return chosen, (f"**By both tasks** (DRPO's mean of the last {verdict.LAST} rounds over seeds, each task "
                    f"weighted equally): hopper-medium, the paper's critic {h[0]:.1f}, the gradient stop {h[1]:.1f}; "
                    f"walker2d-medium {w[0]:.1f} and {w[1]:.1f}; the mean over both tasks {paper:.1f} and "
                    f"{gradient:.1f}. {agree[0].upper() + agree[1:]}, and the default is "
                    f"**{verdict.PAPERS if chosen == 'none' else '`returns-gradient`'}**.")


def default_critic(root: Path = RESULTS) -> str | None:
    """The ``cql_calibration`` the committed cells choose: by both tasks once both are in, else
    the verdict's hopper-medium rule (None until that is in)."""
    chosen, _ = two_task_choice(hopper(root), walker(root))
    return chosen if chosen is not None else verdict.chosen_critic(verdict.cells(root))


def readme_md(hop: list[dict[str, Any]], held: list[dict[str, Any]]) -> str:
    """README's part: each table with its sentence once all its cells are in, else one line on
    where it stands (BENCHMARKS.md shows the cells that are in)."""
    out = []
    for md in (footing_md(hop), walker_md(held)):
        table, said = md.rsplit("\n\n", 1)
        out.append(f"- {said} BENCHMARKS.md shows the cells that are in." if "not in yet" in said else md)
    return "\n\n".join(out)


def _quality(root: Path) -> dict[str, dict[str, float]]:
    import json

    path = Path(root) / f"paper-{verdict.PRESET.name}" / DATA_QUALITY
    return json.loads(path.read_text()) if path.exists() else {}


def blocks(root: Path = RESULTS) -> dict[str, str]:
    hop, held = hopper(root), walker(root)
    return {"footing-table": footing_md(hop), "footing-spread": spread_md(hop) + "\n\n" + seed_md(hop, _quality(root)),
            "heldout-table": walker_md(held),
            "critic-two-tasks": two_task_choice(hop, held)[1], "readme-footing": readme_md(hop, held)}


