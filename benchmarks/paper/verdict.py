"""DRPO's verdict at the paper's per-agent budget (the ``verdict`` preset of ``benchmarks.paper``).

    python -m benchmarks.paper run --preset verdict --experiment table [--only KEY]   (the cells)
    python -m benchmarks.paper.verdict data-returns      (the data's discounted return, per seed; once)
    python -m benchmarks.paper.verdict data-quality      (each seed's agents' data: its D4RL score; once)
    python -m benchmarks.paper.verdict render            (table, figure, sentence -> README, BENCHMARKS.md)

Hopper-medium, 5 agents x 20 rounds x 1,000 local steps (20,000 actor steps per agent, the
paper's), each agent ~5,000 transitions, seeds 0-2; Fed-BC, Fed-CQL, CQL alone and DRPO with the
critic as the paper writes it (CQL(H), ``cql_calibration="none"``), and DRPO at the default
critic (``returns-gradient``, which these cells chose) as a named variant. Every round is evaluated (10
episodes) and the final policy again over 50. ``render`` reads the result files only, and renders
nothing while cells of one seed trained on different shards (a machine's remade dataset that came
out different): it names them.

- the table: per method, the final score (50 episodes), the mean of the last 5 rounds' scores and
  the best round, as mean ± std over seeds and per seed;
- ``verdict.png``: every method's score by round (mean ± std over seeds) and beneath it, by round,
  Q on the data against the data's discounted return, the NLL of the data's actions, the
  policy's entropy, the temperature, and DRPO's actor gradient from each term of L_pi;
- why the early peak falls (``verdict_why``): per cell, the peak and what follows it, when Q on the
  data reaches the data's return, the critic's health and the Q term's share of the actor's
  gradient, and three sentences read from them;
- the sentence: whether the paper's ordering DRPO > Fed-CQL > CQL > Fed-BC holds on the mean of
  the last 5 rounds, by how much, and the seeds' spread; then the same with DRPO at the default
  critic in DRPO's place, and in how many seeds it is above every other method of its seed (a
  reading on the cells that chose that critic, and said to be); until all 15 cells are in it
  says how many are.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import BENCHMARKS_MD, RESULTS, ROOT, replace_blocks
from benchmarks.paper import cells as runs, presets, tables, verdict_why

from benchmarks.paper.readings import (  # noqa: F401 - the verdict's names, kept where its users find them
    PRESET,
    HELDOUT,
    ORDER,
    COLUMNS,
    LABEL,
    NAMES,
    LAST,
    PAPERS,
    _folder,
    cells,
    per_seed,
    summary,
    _ms,
    _seed_line,
    _complete,
    _critic_scores,
    chosen_critic,
    _pick,
    heldout_cells,
    method_table,
)

DATA_RETURNS = "data_returns.json"


def table_md(results: list[dict[str, Any]]) -> str:
    return method_table(results, COLUMNS, len(PRESET.seeds))


def _data_of(r: dict[str, Any]) -> tuple[tuple, tuple | None]:
    """What a cell trained on: each agent's episodes and transitions (not the file's path, which
    is the machine's), and the shards' digests where its record has them (None where not)."""
    shards = r.get("shards", [])
    digests = tuple(sh.get("sha256") for sh in shards)
    return (tuple((sh["agent"], tuple(sh["episodes"]), sh["transitions"]) for sh in shards),
            digests if digests and all(digests) else None)


def unlike_data(results: list[dict[str, Any]]) -> list[str]:
    """A line per seed whose cells did not all train on the same shards (data made again on
    another machine and come out different, or a changed split): their scores would not compare,
    and the seed's discounted return (read from one cell's shards) would not be theirs. Cells
    agree on the same episodes, and on the same digests where both have them."""
    by_seed: dict[int, list[list]] = {}  # per seed: [episodes, digests or None, keys]
    for r in sorted(results, key=lambda r: _data_of(r)[1] is None):  # cells with digests first
        episodes, digests = _data_of(r)
        groups = by_seed.setdefault(r["seed"], [])
        for g in groups:
            if g[0] == episodes and (digests is None or g[1] in (None, digests)):
                g[1] = g[1] or digests
                g[2].append(r.get("key", tables.method(r)))
                break
        else:
            groups.append([episodes, digests, [r.get("key", tables.method(r))]])
    return [f"seed {seed}: " + "; ".join(", ".join(sorted(g[2])) for g in groups)
            for seed, groups in sorted(by_seed.items()) if len(groups) > 1]


def sentence(results: list[dict[str, Any]]) -> str:
    """The verdict in one sentence, from the mean of the last rounds over seeds (none until every
    cell of the ordering is in)."""
    s = summary(results)
    n, want = len(results), len(COLUMNS) * len(PRESET.seeds)
    if not _complete(s, ORDER):
        return (f"**No verdict yet**: {n} of {want} cells are in (`python -m benchmarks.paper status --preset "
                f"{PRESET.name}`).")
    m = {a: float(np.mean([x["last"] for x in s[a]])) for a in ORDER}
    sd = {a: float(np.std([x["last"] for x in s[a]])) for a in ORDER}
    holds = all(m[a] > m[b] for a, b in zip(ORDER, ORDER[1:]))
    ranked = sorted(ORDER, key=lambda a: -m[a])
    gap = m["drpo"] - max(m[a] for a in ORDER[1:])
    lead = (f"DRPO leads the next best by {gap:.1f} points" if gap > 0 else
            f"{NAMES[ranked[0]]} leads DRPO by {m[ranked[0]] - m['drpo']:.1f} points")
    said = (f"**At the paper's per-agent budget** (20 rounds x 1,000 local steps; 5 agents here, where the paper "
            f"has 10), the paper's ordering DRPO > Fed-CQL > CQL > Fed-BC **{'holds' if holds else 'does not hold'}** "
            f"on the mean score of the last {LAST} rounds over {len(PRESET.seeds)} seeds: "
            + ", ".join(f"{NAMES[a]} {m[a]:.1f} ± {sd[a]:.1f}" for a in ranked)
            + f" (ranked); {lead}; the seeds' spread is at most {max(sd.values()):.1f} points.")
    return said + (" " + _with_default_critic(s, m) if _complete(s, ("drpo-returns-gradient",)) else "")


def _with_default_critic(s: dict[str, list[dict[str, Any]]], m: dict[str, float]) -> str:
    """The ordering again with DRPO at the project's default critic (the gradient stop) in DRPO's
    place: by the mean over seeds, and seed by seed against the other methods of the same seed."""
    mine = [x["last"] for x in s["drpo-returns-gradient"]]
    mean, others = float(np.mean(mine)), ORDER[1:]
    holds = mean > m["fed-cql"] > m["cql"] > m["fed-bc"]
    best_other = max(others, key=lambda a: m[a])
    lead = (f"ahead of the next best ({NAMES[best_other]}) by {mean - m[best_other]:.1f} points" if mean > m[best_other]
            else f"{NAMES[best_other]} ahead of it by {m[best_other] - mean:.1f} points")
    last = {a: {x["seed"]: x["last"] for x in s[a]} for a in others}
    wins = sum(x["last"] > max(last[a][x["seed"]] for a in others) for x in s["drpo-returns-gradient"])
    first = " (DRPO is first; the other three are out of the paper's order)" if mean > m[best_other] and not holds else ""
    return (f"With DRPO's default critic (the penalty's gradient stopped at the data's return-to-go) in its place, "
            f"the ordering **{'holds' if holds else 'does not hold'}**{first}: DRPO {mean:.1f} ± {float(np.std(mine)):.1f}, "
            f"{lead}, and above every other method of the same seed in {wins} of {len(mine)} seeds. That critic "
            f"was chosen on these same cells, so this second reading is not a held-out one.")


def critic_choice(results: list[dict[str, Any]]) -> str:
    """The sentence that gives :func:`chosen_critic` and its numbers."""
    scores = _critic_scores(results)
    if scores is None:
        s = summary(results)
        return (f"Not decided yet: {sum(len(s.get(m, [])) for m in ('drpo', 'drpo-returns-gradient'))} of "
                f"{2 * len(PRESET.seeds)} DRPO cells are in.")
    a, b = scores
    return (f"DRPO's mean score over the last {LAST} rounds, over {len(a)} seeds: the paper's critic (`none`) "
            f"{_ms(a)}, the gradient stop (`returns-gradient`) {_ms(b)}: the default is "
            f"**{PAPERS if _pick(a, b) == 'none' else '`returns-gradient`'}**.")


def heldout_reading(chosen: str | None, held: list[dict[str, Any]]) -> str:
    """The two critics on the held-out task, and whether that task would choose as the verdict did."""
    where = (f"Held out, on Walker2d-v5 medium with the verdict's protocol and settings (`python -m benchmarks.paper "
             f"run --preset {HELDOUT.name} --experiment table`)")
    scores = _critic_scores(held)
    if scores is None:
        n = sum(tables.method(r) in ("drpo", "drpo-returns-gradient") for r in held)
        return f"{where}: not in yet, {n} of {2 * len(HELDOUT.seeds)} DRPO cells."
    a, b = scores
    there = _pick(a, b)
    said = (f"{where}: DRPO's mean score over the last {LAST} rounds, over {len(a)} seeds, the paper's critic "
            f"{_ms(a)}, the gradient stop {_ms(b)}: ")
    if chosen is None:
        return said + "the verdict has not chosen yet."
    if there == chosen:
        return said + "this task chooses as hopper-medium did."
    return said + ("this task chooses the other critic: the two tasks disagree, and the rule over both tasks "
                   "(below) decides.")


GRADS = (("grad_q", "Q term"), ("grad_entropy", "alpha log pi"), ("grad_lambda1", "lambda1 D(pi, pi_b)"),
         ("grad_lambda2", "lambda2 D(pi, pi_bar)"), ("grad_actor", "all of L_pi"))


def _by_round(rs: list[dict[str, Any]], key: str) -> np.ndarray | None:
    """``key``'s per-round values (agents' mean) of each run, ``(runs, rounds)``, or None."""
    rows = [r["losses_per_round"][key] for r in rs if key in r.get("losses_per_round", {})]
    n = min((len(x) for x in rows), default=0)
    return np.array([x[:n] for x in rows]) if rows and n else None


def grads_md(results: list[dict[str, Any]], rounds: tuple[int, ...] = (1, 2, 3, 5, 10, 15, 20)) -> str:
    """DRPO's actor gradient norm from each term of L_pi by round (mean over agents, probed steps and
    seeds): whether the Q term's growth drowns the regularisers."""
    rows = []
    for m in ("drpo", "drpo-returns-gradient"):
        rs = [r for r in results if tables.method(r) == m]
        cols = {k: _by_round(rs, k) for k, _ in GRADS}
        q = _by_round(rs, "q_data")
        if cols["grad_q"] is None:
            continue
        if not rows:
            rows = ["| method | round | Q on the data | " + " | ".join(n for _, n in GRADS) +
                    " | Q term / regularisers |", "| --- | --- | --- | " + " | ".join("---" for _ in GRADS) + " | --- |"]
        for r in rounds:
            if r > cols["grad_q"].shape[1]:
                continue
            v = {k: float(c[:, r - 1].mean()) for k, c in cols.items() if c is not None}
            reg = v.get("grad_lambda1", 0.0) + v.get("grad_lambda2", 0.0)
            ratio = f"{v['grad_q'] / reg:.1f}" if reg else "-"
            q_here = f"{float(q[:, r - 1].mean()):.1f}" if q is not None else "-"
            rows.append(f"| {LABEL[m]} | {r} | {q_here} | " + " | ".join(f"{v[k]:.3g}" if k in v else "-" for k, _ in GRADS)
                        + f" | {ratio} |")
    return "\n".join(rows) if rows else "not run yet"


def data_returns(root: Path = RESULTS) -> dict[str, float]:
    """The data's discounted return (gamma 0.99; mean over the agents' transitions of the return-to-go
    from each), per seed: what Q on the data estimates. Computed from the dataset and each seed's
    shards, then kept in the results folder (render reads the file)."""
    from fedrl.data.d4rl import to_transitions
    from fedrl.data.registry import load

    tr = to_transitions(load(PRESET.datasets[0]))
    out = {}
    for r in cells(root):
        if str(r["seed"]) in out:
            continue
        rtg = np.concatenate([tr.of_episodes(sh["episodes"]).returns_to_go(0.99) for sh in r["shards"]])
        out[str(r["seed"])] = round(float(rtg.mean()), 2)
    path = _folder(root) / DATA_RETURNS
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **out}, indent=1, sort_keys=True) + "\n")
    return {**old, **out}


def figure(results: list[dict[str, Any]], path: Path, data_return: float | None) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not results:  # the page shows the figure from the start: say what it waits for
        fig, ax = plt.subplots(figsize=(8, 2))
        ax.axis("off")
        ax.text(0.5, 0.5, f"no verdict cell has finished yet (0 of {len(COLUMNS) * len(PRESET.seeds)})",
                ha="center", va="center", fontsize=12)
        fig.savefig(path, dpi=80)
        plt.close(fig)
        return True
    fig = plt.figure(figsize=(13, 8.5))
    grid = fig.add_gridspec(3, 3, height_ratios=(1.4, 1, 1))
    top = fig.add_subplot(grid[0, :])
    panels = [fig.add_subplot(grid[1 + i // 3, i % 3]) for i in range(6)]
    colours = dict(zip(COLUMNS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for m in COLUMNS:
        rs = [r for r in results if tables.method(r) == m]
        if not rs:
            continue
        n = min(len(r["curve"]) for r in rs)
        rounds = [c["round"] for c in rs[0]["curve"][:n]]
        ys = np.array([[c["score_mean"] for c in r["curve"][:n]] for r in rs])
        top.plot(rounds, ys.mean(0), color=colours[m], label=f"{LABEL[m]} (n={len(rs)})")
        if len(rs) > 1:
            top.fill_between(rounds, ys.mean(0) - ys.std(0), ys.mean(0) + ys.std(0), color=colours[m], alpha=0.15)
        for ax, key, title in zip(panels, ("q_data", "critic_td", "reg_data", "entropy", "alpha"),
                                  ("Q on the data", "TD error (critic)", "NLL of the data's actions (DRPO)",
                                   "policy entropy", "temperature alpha")):
            v = _by_round(rs, key)
            if v is None or (key == "reg_data" and not np.any(v)):
                continue
            x = np.arange(1, v.shape[1] + 1)
            ax.plot(x, v.mean(0), color=colours[m])
            ax.set_title(title, fontsize=9)
    if data_return is not None:
        panels[0].axhline(data_return, color="k", ls=":", label=f"data's discounted return ({data_return:.0f})")
        panels[0].legend(fontsize=7)
    drpo = [r for r in results if tables.method(r) == "drpo"]
    ax = panels[5]
    for (k, name), style in zip(GRADS[:4], ("-", "--", "-.", ":")):
        v = _by_round(drpo, k)
        if v is not None:
            ax.plot(np.arange(1, v.shape[1] + 1), v.mean(0), style, color="k", label=name)
    if ax.lines:
        ax.set_yscale("log")
        ax.legend(fontsize=6)
    ax.set_title("DRPO (paper's critic): actor gradient norm by term", fontsize=9)
    top.set_ylabel("D4RL score")
    top.set_title("hopper-medium, 5 agents x 1,000 local steps a round: mean ± std over seeds", fontsize=10)
    top.legend(fontsize=8, ncol=3)
    for a in (top, *panels):
        a.grid(alpha=0.3)
        a.set_xlabel("round", fontsize=8)
        a.xaxis.set_major_locator(MaxNLocator(integer=True, steps=(1, 5, 10)))  # whole rounds: 5, 10, ...; no 2.5
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _data_returns(root: Path) -> dict[str, float]:
    path = _folder(root) / DATA_RETURNS
    return json.loads(path.read_text()) if path.exists() else {}


def blocks(root: Path = RESULTS) -> dict[str, str]:
    results = cells(root)
    table, said = table_md(results), sentence(results)
    return {"verdict-table": table + "\n\n" + said, "verdict-grads": grads_md(results),
            "verdict-why": verdict_why.why_md(results, _data_returns(root), LABEL),
            "verdict-critic": critic_choice(results),
            "verdict-critic-heldout": heldout_reading(chosen_critic(results), heldout_cells(root)),
            "readme-verdict": table + "\n\n" + said}


README_MD = ROOT / "README.md"
CHOICES_MD = ROOT / "docs" / "explanation" / "choices.md"


def cmd_render(a) -> int:
    root = Path(a.results)
    out = _folder(root)
    out.mkdir(parents=True, exist_ok=True)
    drs = _data_returns(root)
    results = cells(root)
    if bad := unlike_data(results):
        print("not rendered: these cells of one seed trained on different data (each group its own; "
              "rerun the odd ones on the others' data):\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    if figure(results, out / "verdict.png", float(np.mean(list(drs.values()))) if drs else None):
        print(f"wrote {out / 'verdict.png'}")
    b = blocks(root)
    from benchmarks.paper import footing

    b |= footing.blocks(root)  # issue 83: equal footing, five seeds, the second task, both tasks' critic
    (out / "verdict.md").write_text("\n\n".join(f"### {k}\n\n{v}" for k, v in b.items()) + "\n")
    if a.update_md:
        for path, names in ((BENCHMARKS_MD, ("verdict-table", "verdict-grads", "verdict-why", "footing-table",
                                             "footing-spread", "heldout-table")),
                            (README_MD, ("readme-verdict", "readme-footing")),
                            (CHOICES_MD, ("verdict-critic", "verdict-critic-heldout", "critic-two-tasks"))):
            path.write_text(replace_blocks(path.read_text(), {k: b[k] for k in names}))
            print(f"updated {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.paper.verdict", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data-returns", help="the data's discounted return per seed, kept beside the results")
    d.add_argument("--results", default=str(RESULTS))
    d.set_defaults(func=lambda a: print(json.dumps(data_returns(Path(a.results)))) or 0)
    q = sub.add_parser("data-quality", help="each seed's agents' data: episodes, mean return, D4RL score (issue 83)")
    q.add_argument("--results", default=str(RESULTS))

    def quality(a) -> int:
        from benchmarks.paper.footing import data_quality

        print(json.dumps(data_quality(Path(a.results))))
        return 0

    q.set_defaults(func=quality)
    r = sub.add_parser("render", help="table, figure and sentence; README, BENCHMARKS.md and choices.md blocks")
    r.add_argument("--results", default=str(RESULTS))
    r.add_argument("--no-update-md", dest="update_md", action="store_false")
    r.set_defaults(func=cmd_render)
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
