"""Issue 83's tables read result files as the issue defines them: the paper's ablation on equal
footing, five seeds, the second task, and the default critic by both tasks."""

from __future__ import annotations

import pytest

from benchmarks.paper import cells as runs, footing, verdict
from tests.unit.test_verdict import cell


def cells(levels: dict[str, float], seeds=(0, 1, 2), spread: float = 0.5) -> list[dict]:
    """A cell per method and seed, its last rounds at the method's level +- ``spread`` by seed."""
    return [cell(m, s, [90.0] * 3 + [levels[m] + (s - 1) * spread] * 17, final50=levels[m]) for m in levels for s in seeds]


FOOTING = {"drpo": 31.0, "fed-cql": 28.0, "cql": 31.5, "drpo-returns-gradient": 54.0,
           "fed-cql-returns-gradient": 50.0, "cql-returns-gradient": 40.0}


def test_the_ablation_waits_for_the_added_cells_and_says_how_many():
    partial = [r for r in cells(FOOTING) if not (tables_method(r) == "cql-returns-gradient" and r["seed"] == 2)]
    said = footing.footing_md(partial)
    assert "not in yet, 5 of 6 cells of Fed-CQL and CQL alone with the gradient stop" in said
    assert "| CQL alone | 31.5 ± 0.4 (3 of 3) | 39.8 ± 0.2 (2 of 3) |" in said


def tables_method(r):
    from benchmarks.paper import tables

    return tables.method(r)


@pytest.mark.parametrize("gradient_drpo, where", [(54.0, "under both critics"),
                                                  (49.0, "only under the paper's critic (`none`)"),
                                                  (27.0, "only under the paper's critic (`none`)")])
def test_the_ablation_gives_drpo_minus_fed_cql_under_each_critic(gradient_drpo, where):
    said = footing.footing_md(cells({**FOOTING, "drpo-returns-gradient": gradient_drpo}))
    d = gradient_drpo - 50.0
    assert f"under the gradient stop (`returns-gradient`) {d:+.1f} ± 0.0" in said
    assert "under the paper's critic (`none`) +3.0 ± 0.0 (by seed +3.0, +3.0, +3.0; DRPO ahead in 3 of 3)" in said
    assert f"The dual regularisation leads {where}." in said
    assert "Fed-CQL +22.0" in said  # the critic alone, gradient stop - paper's


def test_neither_critic_when_fed_cql_leads_under_both():
    said = footing.footing_md(cells({**FOOTING, "fed-cql": 40.0, "fed-cql-returns-gradient": 60.0}))
    assert "The dual regularisation leads under neither critic." in said


def test_five_seeds_wait_for_the_added_cells_then_count_the_seeds_drpo_leads():
    five = (0, 1, 2, 3, 4)
    rs = cells({"drpo-returns-gradient": 50.0, "fed-bc": 30.0}, seeds=five, spread=12.0)
    said = footing.spread_md(rs[:-1])  # the command it gives runs just the missing cell
    assert "not in yet, 3 of 4 added cells" in said and "--preset verdict --only fed-bc-medium-s4`" in said
    said = footing.spread_md(rs)
    assert "DRPO above Fed-BC in 5 of 5 seeds" in said and "| 38.0 | 50.0 | 62.0 | 74.0 | 86.0 |" in said


@pytest.mark.parametrize("hop, walk, chosen, agree", [
    ((31.0, 54.0), (40.0, 30.0), "returns-gradient", "disagree"),  # means 35.5 vs 42.0
    ((31.0, 54.0), (60.0, 30.0), "none", "disagree"),  # 45.5 vs 42.0
    ((31.0, 54.0), (30.0, 40.0), "returns-gradient", "same"),
    ((40.0, 40.0), (30.0, 30.0), "none", "same"),  # a tie keeps the paper's critic
])
def test_the_default_critic_is_chosen_by_the_mean_over_both_tasks(hop, walk, chosen, agree):
    h = cells({"drpo": hop[0], "drpo-returns-gradient": hop[1]})
    w = cells({"drpo": walk[0], "drpo-returns-gradient": walk[1], "fed-bc": 20.0})
    got, said = footing.two_task_choice(h, w)
    assert got == chosen
    assert ("the two tasks disagree" if agree == "disagree" else "both tasks prefer the same critic") in said.lower()
    assert footing.two_task_choice(h, w[1:])[0] is None  # until both tasks are in (a DRPO cell missing)


def test_the_readme_shows_a_table_only_once_its_cells_are_all_in():
    w = cells({"drpo": 40.0, "drpo-returns-gradient": 30.0, "fed-bc": 35.0})
    md = footing.readme_md(cells(FOOTING)[:-1], w)
    assert md.startswith("- **The paper's ablation on equal footing**: not in yet") and "| Fed-BC |" in md
    assert "DRPO (paper's critic) 40.0 ± 0.4, Fed-BC 35.0 ± 0.4, DRPO, gradient stopped at G 30.0 ± 0.4 (ranked)" in md


def test_drpos_default_critic_is_the_one_the_committed_cells_choose_by_the_rule_in_force():
    from fedrl.algos import DRPOConfig

    assert DRPOConfig().cql_calibration == (footing.default_critic() or "returns-gradient")
    assert verdict.chosen_critic(verdict.cells()) is not None


def test_the_seed_that_never_lifts_is_read_against_its_data_and_its_diagnostics():
    """The lowest seed's diagnostics at the last round against the others' range: equal ones are
    said to be within it, its data's score and Fed-BC's on the same seed set it apart."""
    rs = [*cells({"drpo-returns-gradient": 60.0}), *cells({"fed-bc": 30.0}, spread=4.0)]
    for r in rs:
        if r["seed"] == 1 and r["variant"].get("method") == "drpo-returns-gradient":
            r["curve"][-5:] = [{"round": 16 + i, "score_mean": 31.0} for i in range(5)]
    quality = {"0": {"score": 30.0}, "1": {"score": 28.2}, "2": {"score": 30.2}}
    said = footing.seed_md(rs, quality)
    assert "**The seed that never lifts** is s1 (DRPO with the gradient stop, 31.0" in said
    assert "alpha, entropy, NLL of the data actions, Q on the data, Q term / regularisers (actor gradient) lie within" in said
    assert "what sets it apart: the agents' data (D4RL score)." in said  # Fed-BC's s1 is the middle of its three
    assert "| s1 | 31 | - | - | 28.2 | 30 |" in said  # the other gradient-stop methods not in yet
    assert "Fed-CQL with the gradient stop: not in yet on s1 and another seed" in said
    assert "not in yet, 2 of 3 seeds" in footing.seed_md([r for r in rs if r["seed"] != 2], quality)


@pytest.mark.parametrize("fed_cql_s1, said_of_it", [
    (15.0, "Fed-CQL with the gradient stop also scores lowest on s1 (15.0, against 19.5, 20.5)"),
    (19.5, "Fed-CQL with the gradient stop does not score lowest on s1 (19.5, against 19.5, 20.5)"),  # a tie
    (60.0, "Fed-CQL with the gradient stop does not score lowest on s1 (60.0, against 19.5, 20.5)")])
def test_the_seed_is_read_against_the_other_gradient_stop_methods_on_the_same_data(fed_cql_s1, said_of_it):
    """Fed-CQL and CQL alone under the gradient stop hold the same agents' data on a seed: whether
    they lag on DRPO's lowest seed too tells the seed's data and draws from DRPO's regularisers."""
    rs = cells({"drpo-returns-gradient": 60.0, "fed-bc": 30.0, "fed-cql-returns-gradient": 20.0})
    for r in rs:
        if r["seed"] == 1 and r["variant"].get("method") == "drpo-returns-gradient":
            r["curve"][-5:] = [{"round": 16 + i, "score_mean": 31.0} for i in range(5)]
        if r["seed"] == 1 and tables_method(r) == "fed-cql-returns-gradient":
            r["curve"][-5:] = [{"round": 16 + i, "score_mean": fed_cql_s1} for i in range(5)]
    said = footing.seed_md(rs, {})
    assert said_of_it in said
    assert "CQL alone with the gradient stop: not in yet on s1 and another seed" in said


def test_the_verdict_plans_the_added_seeds_for_the_spread_methods_only():
    """``run --preset verdict`` (no --seeds) and ``status`` include seeds 3 and 4 of DRPO with the
    gradient stop and Fed-BC, and no other method's."""
    from benchmarks.paper import presets

    p = presets.PRESETS["verdict"]
    keys = [r.key for r in presets.planned(p, "table")]
    assert keys[:len(p.methods) * 3] == [r.key for r in presets.plan(p, "table", p.seeds)]
    assert keys[len(p.methods) * 3:] == ["drpo-returns-gradient-medium-s3", "drpo-returns-gradient-medium-s4",
                                         "fed-bc-medium-s3", "fed-bc-medium-s4"]
    assert footing.ADDED_SEEDS == (3, 4) and footing.SPREAD_METHODS == ("drpo-returns-gradient", "fed-bc")


def test_a_margin_within_the_seeds_spread_is_said_to_be():
    h = cells({"drpo": 31.0, "drpo-returns-gradient": 54.0})
    w = cells({"drpo": 27.0, "drpo-returns-gradient": 26.8}, spread=4.0)  # std 3.3 by seed
    said = footing.two_task_choice(h, w)[1]
    assert "(walker2d-medium's margin, 0.2, is within its seeds' spread, ±3.3)" in said
    assert "hopper-medium's margin" not in said  # 23.0 against a spread of 0.4


def test_cells_run_as_one_batched_model_are_named_where_their_numbers_are_shown():
    rs = cells(FOOTING)
    assert "batched model" not in footing.footing_md(rs)
    for r in rs:
        if tables_method(r) == "cql-returns-gradient" and r["seed"] == 2:
            r.update(key="cql-returns-gradient-medium-s2", engine=runs.BATCHED_ENGINE,
                     device_name="NVIDIA H200")
    said = footing.footing_md(rs)
    assert said.endswith("Ran on NVIDIA H200 as one batched model (`python -m benchmarks.paper.device`; the same "
                         "losses and agents' data, the batch's own random draws): `cql-returns-gradient-medium-s2`.")
