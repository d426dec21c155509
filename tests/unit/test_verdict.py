"""The verdict's table, sentence and default-critic rule read result files as the issue defines them."""

from __future__ import annotations

import json

import pytest

from benchmarks.paper import verdict


def cell(method: str, seed: int, scores: list[float], final50: float | None = None) -> dict:
    algo = "drpo" if method.startswith("drpo") else method
    variant = {"dataset": "medium", **({"method": method} if method != algo else {})}
    r = {"algo": algo, "seed": seed, "variant": variant,
         "curve": [{"round": i + 1, "score_mean": s} for i, s in enumerate(scores)],
         "losses_per_round": {"q_data": [10.0 * (i + 1) for i in range(len(scores))],
                              "grad_q": [2.0] * len(scores), "grad_lambda1": [0.5] * len(scores),
                              "grad_lambda2": [0.5] * len(scores), "grad_entropy": [0.1] * len(scores),
                              "grad_actor": [2.2] * len(scores)}}
    if final50 is not None:
        r["final_long"] = {"episodes": 50, "score_mean": final50}
    return r


def full(levels: dict[str, float]) -> list[dict]:
    """Every cell of the preset, each method's seeds at its level +- a little; 20 rounds whose
    early rounds are a decoy peak (the last 5 rounds decide)."""
    out = []
    for m in verdict.COLUMNS:
        for s in (0, 1, 2):
            last = levels[m] + (s - 1) * 0.5
            out.append(cell(m, s, [90.0] * 3 + [last] * 17, final50=last + 1))
    return out


def test_per_seed_reads_the_final_50_episodes_the_last_five_rounds_and_the_best():
    x = verdict.per_seed(cell("drpo", 2, [10, 60, 20, 30, 40, 50, 60], final50=33.0))
    assert x == {"seed": 2, "final50": 33.0, "last": 40.0, "best": 60, "best_round": 2}


def test_the_sentence_waits_for_every_cell_of_the_ordering():
    rs = [c for c in full({"drpo": 40, "drpo-returns-gradient": 30, "fed-cql": 30, "cql": 20, "fed-bc": 10})
          if not (c["algo"] == "cql" and c["seed"] == 2)]
    assert verdict.sentence(rs).startswith("**No verdict yet**: 14 of 15 cells are in")


@pytest.mark.parametrize("levels, holds", [
    ({"drpo": 40, "fed-cql": 30, "cql": 20, "fed-bc": 10}, True),
    ({"drpo": 40, "fed-cql": 20, "cql": 30, "fed-bc": 10}, False),  # CQL above Fed-CQL: the order breaks
    ({"drpo": 25, "fed-cql": 24, "cql": 23, "fed-bc": 35}, False),
])
def test_the_sentence_says_whether_the_papers_ordering_holds_on_the_last_rounds(levels, holds):
    said = verdict.sentence(full({**levels, "drpo-returns-gradient": 0}))
    assert ("**holds**" in said) == holds and ("**does not hold**" in said) == (not holds)
    assert "5 agents here, where the paper has 10" in said
    if levels["fed-bc"] > levels["drpo"]:
        assert f"Fed-BC leads DRPO by {levels['fed-bc'] - levels['drpo']:.1f} points" in said
    else:
        assert f"DRPO leads the next best by {levels['drpo'] - max(v for k, v in levels.items() if k != 'drpo'):.1f}" in said
    assert "the seeds' spread is at most 0.4 points" in said  # (s - 1) * 0.5 over seeds 0-2: std 0.41


@pytest.mark.parametrize("paper, gradient, default", [(30, 30, "`none`"), (31, 30, "`none`"),
                                                      (29, 30, "`returns-gradient`")])
def test_the_default_critic_is_the_papers_unless_the_gradient_stop_scores_higher(paper, gradient, default):
    said = verdict.critic_choice(full({"drpo": paper, "drpo-returns-gradient": gradient, "fed-cql": 0, "cql": 0,
                                       "fed-bc": 0}))
    assert f"the default is **{default}" in said


def test_the_table_and_the_gradients_come_from_the_cells(tmp_path):
    rs = full({"drpo": 40, "drpo-returns-gradient": 30, "fed-cql": 30, "cql": 20, "fed-bc": 10})
    table = verdict.table_md(rs)
    assert "| DRPO (paper's critic) | 41.0 ± 0.4 | 40.0 ± 0.4 | 90.0 ± 0.0 | 3 of 3 |" in table
    assert "s0: 40.5 / 39.5 / 90.0 (r1)" in table
    grads = verdict.grads_md(rs)
    assert "| DRPO (paper's critic) | 20 | 200.0 | 2 | 0.1 | 0.5 | 0.5 | 2.2 | 2.0 |" in grads
    folder = tmp_path / "paper-verdict" / "table"
    folder.mkdir(parents=True)
    for i, r in enumerate(rs):
        (folder / f"c{i}.json").write_text(json.dumps(r))
    assert len(verdict.cells(tmp_path)) == 15
    assert verdict.figure(verdict.cells(tmp_path), tmp_path / "v.png", 235.0)
    assert (tmp_path / "v.png").read_bytes()[:4] == b"\x89PNG"


def test_the_preset_runs_the_issues_cells_with_every_setting_written_out():
    from benchmarks.paper import presets, tables

    p = presets.PRESETS["verdict"]
    runs = presets.plan(p, "table", p.seeds)
    assert len(runs) == 15 and {r.seed for r in runs} == {0, 1, 2}
    for r in runs:
        c = presets.sim_config(p, r)
        assert (c.agents, c.rounds, c.local_steps, c.transitions, c.eval_episodes) == (5, 20, 1000, 5000, 10)
        assert c.final_eval_episodes == 50 and c.datasets == ("hopper-medium-v2",)
        if r.algo != "fed-bc":
            want = "returns-gradient" if r.key.startswith("drpo-returns-gradient") else "none"
            assert (c.drpo.cql_calibration, c.drpo.alpha_lr, c.drpo.td_weight) == (want, 3e-4, 2.0), r.key
    assert sorted({tables.method({"algo": r.algo, "variant": r.variant}) for r in runs}) == sorted(verdict.COLUMNS)
