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
    said = verdict.sentence(full({**levels, "drpo-returns-gradient": 0})).split(" With DRPO's default critic")[0]
    assert ("**holds**" in said) == holds and ("**does not hold**" in said) == (not holds)
    assert "5 agents here, where the paper has 10" in said
    if levels["fed-bc"] > levels["drpo"]:
        assert f"Fed-BC leads DRPO by {levels['fed-bc'] - levels['drpo']:.1f} points" in said
    else:
        assert f"DRPO leads the next best by {levels['drpo'] - max(v for k, v in levels.items() if k != 'drpo'):.1f}" in said
    assert "the seeds' spread is at most 0.4 points" in said  # (s - 1) * 0.5 over seeds 0-2: std 0.41


@pytest.mark.parametrize("gradient, holds, lead, wins", [
    (50, False, "ahead of the next best (Fed-BC) by 15.0 points", 3),  # first, but the rest out of order
    (20, False, "Fed-BC ahead of it by 15.0 points", 0),
])
def test_the_sentence_reads_the_ordering_again_with_the_default_critic(gradient, holds, lead, wins):
    said = verdict.sentence(full({"drpo": 25, "drpo-returns-gradient": gradient, "fed-cql": 24, "cql": 23,
                                  "fed-bc": 35}))
    first, second = said.split(" With DRPO's default critic")
    assert "**does not hold**" in first and "Fed-BC leads DRPO by 10.0 points" in first
    assert f"**{'holds' if holds else 'does not hold'}**" in second
    assert ("DRPO is first" in second) == (gradient > 35.5) and lead in second
    assert f"DRPO {gradient:.1f} ± 0.4" in second and f"same seed in {wins} of 3 seeds" in second
    assert "not a held-out one" in second


def test_the_default_critics_seeds_are_each_held_to_the_other_methods_of_their_seed():
    rs = full({"drpo": 25, "drpo-returns-gradient": 50, "fed-cql": 24, "cql": 23, "fed-bc": 35})
    low = next(r for r in rs if r["variant"].get("method") == "drpo-returns-gradient" and r["seed"] == 1)
    low["curve"] = [{"round": i + 1, "score_mean": 10.0} for i in range(20)]  # below every method of seed 1
    second = verdict.sentence(rs).split(" With DRPO's default critic")[1]
    assert "DRPO 36.7 ± 18.9, ahead of the next best (Fed-BC) by 1.7 points" in second
    assert "same seed in 2 of 3 seeds" in second


def test_the_ordering_with_the_default_critic_holds_when_it_leads_an_ordered_rest():
    said = verdict.sentence(full({"drpo": 10, "drpo-returns-gradient": 50, "fed-cql": 40, "cql": 30, "fed-bc": 20}))
    assert "**does not hold**" in said.split(" With")[0]
    second = said.split(" With DRPO's default critic")[1]
    assert "**holds**: DRPO 50.0" in second and "by 10.0 points" in second and "in 3 of 3 seeds" in second


@pytest.mark.parametrize("paper, gradient, default", [(30, 30, "`none`"), (31, 30, "`none`"),
                                                      (29, 30, "`returns-gradient`")])
def test_the_default_critic_is_the_papers_unless_the_gradient_stop_scores_higher(paper, gradient, default):
    said = verdict.critic_choice(full({"drpo": paper, "drpo-returns-gradient": gradient, "fed-cql": 0, "cql": 0,
                                       "fed-bc": 0}))
    assert f"the default is **{default}" in said


def test_drpos_default_critic_is_the_one_the_committed_cells_choose():
    """A rendered choice and the code agree: once both critics' cells are in, the default is the
    one they choose; until then it is the gradient stop, as choices.md says."""
    from fedrl.algos import DRPOConfig

    chosen = verdict.chosen_critic(verdict.cells())
    assert DRPOConfig().cql_calibration == (chosen or "returns-gradient")


def shards(*episodes) -> list[dict]:
    return [{"agent": i, "source": f"/machine-{i}/hopper-medium-v2.hdf5", "episodes": list(e), "transitions": 100 * len(e)}
            for i, e in enumerate(episodes)]


def test_the_committed_cells_of_a_seed_trained_on_the_same_data():
    """Cells run on several machines, each making the dataset again: a seed's cells must share
    their agents' episodes, or the table compares runs on different data."""
    rs = verdict.cells()
    assert len({r["seed"] for r in rs}) == 3
    assert verdict.unlike_data(rs) == []


def test_render_refuses_cells_of_one_seed_on_different_data_and_names_them(tmp_path, capsys):
    folder = tmp_path / "paper-verdict" / "table"
    folder.mkdir(parents=True)
    for key, method, seed, data in (("a-s0", "fed-bc", 0, ([1, 2], [3])), ("b-s0", "cql", 0, ([1, 2], [3])),
                                    ("c-s0", "drpo", 0, ([1, 2], [4])), ("d-s1", "drpo", 1, ([5], [6]))):
        r = {**cell(method, seed, [10.0] * 20, 10.0), "key": key, "shards": shards(*data)}
        (folder / f"{key}.json").write_text(json.dumps(r))
    rs = verdict.cells(tmp_path)
    same = [r for r in rs if r["key"] != "c-s0"]
    for r in same:  # the machine's path is not the data
        r["shards"][0]["source"] = "/elsewhere/hopper-medium-v2.hdf5"
    assert verdict.unlike_data(same) == []
    assert verdict.unlike_data(rs) == ["seed 0: a-s0, b-s0; c-s0"]
    assert verdict.main(["render", "--results", str(tmp_path), "--no-update-md"]) == 1
    assert "seed 0: a-s0, b-s0; c-s0" in capsys.readouterr().err
    assert not (tmp_path / "paper-verdict" / "verdict.md").exists()
    digested = [json.loads(json.dumps(r)) for r in same]
    for r in digested:  # records with digests: the same episodes with other contents differ
        for sh in r["shards"]:
            sh["sha256"] = "b" * 64 if r["key"] == "b-s0" else "a" * 64
    assert verdict.unlike_data(digested) == ["seed 0: a-s0; b-s0"]
    digested[1]["shards"][0].pop("sha256")  # a record without them agrees with either
    assert verdict.unlike_data(digested[:2] + same[2:]) == []
    (folder / "c-s0.json").unlink()
    assert verdict.main(["render", "--results", str(tmp_path), "--no-update-md"]) == 0
    assert (tmp_path / "paper-verdict" / "verdict.md").exists()


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
    assert len(runs) == 21 and {r.seed for r in runs} == {0, 1, 2}
    for r in runs:
        c = presets.sim_config(p, r)
        assert (c.agents, c.rounds, c.local_steps, c.transitions, c.eval_episodes) == (5, 20, 1000, 5000, 10)
        assert c.final_eval_episodes == 50 and c.datasets == ("hopper-medium-v2",)
        if r.algo != "fed-bc":
            want = "returns-gradient" if "-returns-gradient-" in r.key else "none"
            assert (c.drpo.cql_calibration, c.drpo.alpha_lr, c.drpo.td_weight) == (want, 3e-4, 2.0), r.key
    footing = {"fed-cql-returns-gradient", "cql-returns-gradient"}  # the paper's ablation, the default critic
    assert sorted({tables.method({"algo": r.algo, "variant": r.variant}) for r in runs}) == sorted({*verdict.COLUMNS, *footing})
    for m in footing:  # the same method as its column under the paper's critic, but for the critic
        a, b = ({r.seed: presets.sim_config(p, r).as_dict() for r in runs
                 if tables.method({"algo": r.algo, "variant": r.variant}) == k} for k in (m, m.split("-returns")[0]))
        for s in (0, 1, 2):
            assert a[s]["drpo"].pop("cql_calibration") == "returns-gradient" and b[s]["drpo"].pop("cql_calibration") == "none"
            assert a[s] == b[s], (m, s)


def test_the_heldout_preset_is_the_verdicts_drpo_cells_on_walker2d():
    from benchmarks.paper import presets

    v, h = presets.PRESETS["verdict"], presets.PRESETS["heldout-walker2d"]
    held = presets.plan(h, "table", h.seeds)
    assert sorted(r.key for r in held) == sorted(f"{m}-medium-s{s}" for m in ("drpo", "drpo-returns-gradient", "fed-bc")
                                                 for s in (0, 1, 2))
    mine = {r.key: r for r in presets.plan(v, "table", v.seeds)}
    for r in held:
        a, b = presets.sim_config(h, r).as_dict(), presets.sim_config(v, mine[r.key]).as_dict()
        assert a.pop("datasets") == ["walker2d-medium-v2"] and b.pop("datasets") == ["hopper-medium-v2"]
        assert a == b, r.key  # every other setting, the critic's included, is the verdict's


@pytest.mark.parametrize("paper, gradient, chosen, said", [
    (40, 30, "none", "this task chooses as hopper-medium did"),
    (40, 30, "returns-gradient", "this task chooses the other critic"),
    (30, 40, "returns-gradient", "this task chooses as hopper-medium did"),
    (30, 40, None, "the verdict has not chosen yet"),
])
def test_the_heldout_task_says_whether_it_chooses_the_same_critic(paper, gradient, chosen, said):
    held = [c for c in full({"drpo": paper, "drpo-returns-gradient": gradient, "fed-cql": 0, "cql": 0, "fed-bc": 0})
            if c["algo"] == "drpo"]
    text = verdict.heldout_reading(chosen, held)
    assert said in text and f"the paper's critic {paper:.1f} ± 0.4, the gradient stop {gradient:.1f} ± 0.4" in text
    assert verdict.heldout_reading(chosen, held[:5]).endswith("not in yet, 5 of 6 DRPO cells.")


def why_cell(method: str, seed: int, scores, q, td, grad_q=None, reg=None) -> dict:
    r = cell(method, seed, scores)
    n = len(scores)
    r["losses_per_round"] = {"q_data": q, "critic_td": td, "grad_q": grad_q or [1.0] * n,
                             "grad_lambda1": [x / 2 for x in reg] if reg else [0.0] * n,
                             "grad_lambda2": [x / 2 for x in reg] if reg else [0.0] * n}
    return r


def test_the_reading_finds_the_peak_the_round_q_reaches_g_and_whether_the_curve_recovers():
    from benchmarks.paper import verdict_why as w

    # peak 50 at round 2, a trough of 10, Q crosses 95% of G=100 at round 6 (95.0), then 60s
    scores = [20, 50, 30, 10, 20, 60, 62, 64, 66, 68]
    q = [10, 30, 50, 70, 90, 95, 99, 100, 100, 100]
    x = w.cell_reading(why_cell("drpo", 0, scores, q, [1.0] * 10, [4.0] * 10, [2.0] + [1.0] * 9), 100.0)
    assert (x["peak"], x["peak_round"], x["trough"], x["trough_round"]) == (50, 2, 10, 4)
    assert x["reach_round"] == 6 and x["before"] == pytest.approx(20.0) and x["from"] == pytest.approx(64.0)
    assert x["last"] == pytest.approx(64.0) and not x["diverged"]
    # the Q term's share: 4 / 1 at the peak (round 2), 4 / 1 at the end: not above it
    assert (x["share_peak"], x["share_last"]) == (4.0, 4.0)
    said = w.why_md([why_cell("drpo", 0, scores, q, [1.0] * 10, [4.0] * 10, [2.0] + [1.0] * 9)], {"0": 100.0},
                    verdict.LABEL)
    assert "recovers in 1 of the 1 seed(s) whose Q reached it (r6: 20.0 -> 64.0)" in said
    worse = why_cell("drpo", 1, [20, 50, 30, 30, 30, 20, 20, 20, 20, 20], q, [1.0] * 10)  # falls once Q is there
    assert "recovers in 1 of the 2 seed(s) whose Q reached it (r6: 20.0 -> 64.0, r6: 30.0 -> 20.0)" in w.why_md(
        [why_cell("drpo", 0, scores, q, [1.0] * 10), worse], {"0": 100.0, "1": 100.0}, verdict.LABEL)
    assert "in 0 of 1 seed the Q term's share at the last round is above" in said
    assert "| DRPO (paper's critic), s0 | 50.0 (r2) -> 10.0 (r4) -> 64.0 | r6 | 20.0 -> 64.0 |" in said


def test_the_reading_says_when_q_never_reaches_g_and_when_the_q_term_drowns_the_regularisers():
    from benchmarks.paper import verdict_why as w

    r = why_cell("drpo", 1, [30, 20, 25, 26], [10, 20, 30, 94.9], [1.0] * 4, [1.0, 2.0, 4.0, 8.0], [1.0] * 4)
    x = w.cell_reading(r, 100.0)
    assert x["reach_round"] is None and "before" not in x
    assert x["share_last"] > x["share_peak"]
    said = w.why_md([r], {"1": 100.0}, verdict.LABEL)
    assert "not by r4 (95% of G)" in said and "Q has not reached it by the last round in 1 of 1 seed" in said
    assert "in 1 of 1 seed the Q term's share at the last round is above its share at the early peak (1.0 -> 8.0)" in said


@pytest.mark.parametrize("q, td, diverged", [
    ([10, 50, 100, 149], [1, 2, 4, 9.9], False),  # Q climbs to G; TD error grows with its scale
    ([10, 50, 100, 151], [1, 2, 2, 2], True),  # past 1.5 G
    ([10, -5, 10, 20], [1, 2, 2, 2], True),  # below 0
    ([10, 50, 60, 70], [1, 2, 4, 10.1], True),  # TD error past 5x round 2's
])
def test_a_critic_diverges_by_the_stated_rule(q, td, diverged):
    from benchmarks.paper import verdict_why as w

    r = why_cell("fed-cql", 0, [1, 2, 3, 4], q, td)
    assert w.cell_reading(r, 100.0)["diverged"] is diverged
    assert "share_peak" not in w.cell_reading(r, 100.0)  # CQL's actor has no regulariser to share with
    said = w.why_md([r, why_cell("cql", 0, [5, 5, 5, 5], [10, 20, 30, 40], [1, 1, 1, 1])], {"0": 100.0}, verdict.LABEL)
    assert f"Fed-CQL in {int(diverged)} of 1 seed" in said
    assert ("The diverged cells' mean of the last 5 rounds is 2.5, the others' 5.0" in said) == diverged


def test_the_reading_waits_for_a_cql_cell_and_its_seeds_data_return():
    from benchmarks.paper import verdict_why as w

    bc = cell("fed-bc", 0, [1, 2, 3])
    bc["losses_per_round"] = {}
    assert w.why_md([bc], {"0": 100.0}, verdict.LABEL) == "not run yet"
    r = why_cell("cql", 0, [1, 2], [1, 2], [1, 1])
    assert w.why_md([r], {"1": 100.0}, verdict.LABEL) == "not run yet"
