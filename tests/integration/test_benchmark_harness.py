"""benchmarks/paper/: rerunning the smoke preset reproduces the committed results, and
BENCHMARKS.md's tables are exactly what the committed results render to."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

import benchmarks.paper.cli  # noqa: F401 - loads the package's modules as attributes of paper
from benchmarks import paper

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "benchmarks" / "results"
NUMBERS = ("curve", "final", "losses_per_round", "config", "variant", "datasets", "algo", "seed")


def same_up_to_float_rounding(a, b, rel: float = 1e-4, abs_: float = 1e-6) -> bool:
    """Equal structure and strings/ints, floats equal to ``rel`` (or ``abs_`` near zero)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_up_to_float_rounding(a[k], b[k], rel, abs_) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_up_to_float_rounding(x, y, rel, abs_) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=rel,
                                                                                            abs_tol=abs_)
    return a == b


def test_float_rounding_comparison_still_sees_real_differences():
    assert same_up_to_float_rounding({"r": [1.0, 7.523176746306666]}, {"r": [1.0, 7.523176801545565]})
    assert not same_up_to_float_rounding({"r": [1.0, 7.52]}, {"r": [1.0, 7.53]})
    assert not same_up_to_float_rounding({"r": [1.0]}, {"r": [1.0, 2.0]})
    assert not same_up_to_float_rounding({"algo": "drpo"}, {"algo": "cql"})


@pytest.mark.slow(reason="reruns the committed smoke benchmark")
def test_smoke_rerun_matches_the_committed_results(tmp_path, hopper_medium):
    """Bit-identical on the machine that wrote them; elsewhere equal up to float rounding:
    BLAS and ATen pick kernels by CPU (AVX2, AVX-512), so another x86 machine differs in the
    8th digit (seen: 7.523176746 vs 7.523176802 after two rounds). A change to the algorithm
    moves the per-round losses by far more than the 1e-4 allowed."""
    p = paper.presets.PRESETS["smoke"]
    runs = paper.presets.plan(p, "table", p.seeds)
    assert len(runs) == 4
    for r in runs:
        committed = paper.presets.result_path(p, r, COMMITTED)
        assert committed.exists(), f"{committed} is not committed: run the smoke preset"
        fresh = paper.cells.execute(p, r, tmp_path)
        old = json.loads(committed.read_text())
        for k in NUMBERS:
            assert same_up_to_float_rounding(fresh[k], old[k]), \
                f"{r.key}: {k} differs from the committed result: {fresh[k]} vs {old[k]}"
    # ...and a second invocation resumes: nothing left to run
    a = type("A", (), {"preset": "smoke", "seeds": None, "experiment": "table", "results": str(tmp_path)})
    before = {f: f.stat().st_mtime_ns for f in tmp_path.rglob("*.json")}
    assert paper.cli.cmd_run(a) == 0
    assert {f: f.stat().st_mtime_ns for f in tmp_path.rglob("*.json")} == before
    # --only: just the named cells (unknown ones refused, naming them); what ran it is recorded
    only = tmp_path / "only"
    with pytest.raises(SystemExit, match="no cell drpo-expert-s9"):
        paper.cli.main(["run", "--preset", "smoke", "--only", "drpo-medium-s0,drpo-expert-s9", "--results", str(only)])
    assert paper.cli.main(["run", "--preset", "smoke", "--only", "fed-bc-medium-s0", "--results", str(only)]) == 0
    assert sorted(p.name for p in (only / "paper-smoke" / "table").glob("*.json")) == ["fed-bc-medium-s0.json"]
    res = json.loads((only / "paper-smoke" / "table" / "fed-bc-medium-s0.json").read_text())
    assert res["config"]["device"] == "cpu" and res["device_name"]


def test_benchmarks_md_tables_are_generated_from_the_committed_files():
    text = (ROOT / "BENCHMARKS.md").read_text()
    blocks = {k: v for name in paper.tables.MD_BLOCKS for k, v in paper.tables.md_blocks(paper.presets.PRESETS[name], COMMITTED).items()}
    assert "paper-reduced-table" in blocks and "paper-reduced-halfcheetah-table" in blocks
    studies = paper.tables.study_blocks(paper.presets.PRESETS["reduced"], COMMITTED)
    assert "paper-reduced-lambdas" in studies and not set(studies) & set(blocks)
    for doc, text, blocks_ in (("BENCHMARKS.md", text, blocks),
                               ("the studies' page", paper.tables.STUDIES_MD.read_text(), studies)):
        for name, body in blocks_.items():
            m = re.search(rf"<!-- generated:{re.escape(name)} -->\n(.*?)\n<!-- end:{re.escape(name)} -->", text, re.S)
            assert m, f"{doc} lacks the {name} block"
            assert m.group(1) == body, f"{doc}: block {name} is stale: python -m benchmarks.paper render"


def test_render_writes_tables_and_curves(tmp_path, hopper_medium):
    p = paper.presets.PRESETS["smoke"]
    for r in paper.presets.plan(p, "table", p.seeds):
        src = paper.presets.result_path(p, r, COMMITTED)
        dst = paper.presets.result_path(p, r, tmp_path)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(src.read_text())
    a = type("A", (), {"preset": "smoke", "results": str(tmp_path), "update_md": False})
    assert paper.cli.cmd_render(a) == 0
    tables = (tmp_path / "paper-smoke" / "tables.md").read_text()
    assert "| medium |" in tables and "n=1" in tables
    assert (tmp_path / "paper-smoke" / "learning_curves.png").stat().st_size > 1000
    assert not (tmp_path / "paper-smoke" / "studies.png").exists()  # no study has results


def test_q_scale_long_runs_with_its_own_rounds_and_renders_each_variant(tmp_path, hopper_medium):
    p = paper.presets.PRESETS["smoke"]
    runs = paper.presets.plan(p, "q_scale_long", p.seeds)
    agents, steps, rounds, every = p.long
    assert [r.key for r in runs] == ["drpo-raw-s0", "drpo-normalized-s0", "fed-cql-s0", "fed-bc-s0"]
    for r in runs:
        res = paper.cells.execute(p, r, tmp_path)
        assert (res["agents"], res["local_steps"], res["rounds"]) == (agents, steps, rounds)
        assert [c["round"] for c in res["curve"]] == list(range(every, rounds + 1, every))
        assert res["config"]["drpo"]["q_scale"] == (r.drpo.get("q_scale") or "raw")
    block = paper.tables.q_scale_long_md(paper.cells.load_results(p, "q_scale_long", tmp_path))
    lines = [ln for ln in block.splitlines() if ln.startswith(("| DRPO", "| Fed-CQL", "| Fed-BC"))]
    assert len(lines) == 4 and not any("not run yet" in ln for ln in lines), block


def test_study_points_equal_to_a_table_run_are_reused_and_the_rest_run_in_parallel(tmp_path, capsys, hopper_medium):
    p = paper.presets.PRESETS["smoke"]
    for r in paper.presets.plan(p, "table", p.seeds):
        dst = paper.presets.result_path(p, r, tmp_path)
        dst.parent.mkdir(parents=True, exist_ok=True)
        res = json.loads(paper.presets.result_path(p, r, COMMITTED).read_text())
        res["config"]["drpo"].pop("target_action", None)  # a file written before these options existed
        res["config"].pop("transitions", None)
        dst.write_text(json.dumps(res))
    a = type("A", (), {"preset": "smoke", "seeds": None, "experiment": "agents", "results": str(tmp_path),
                       "jobs": 2})
    assert paper.cli.cmd_run(a) == 0
    out = capsys.readouterr().out
    assert p.agents in p.agents_grid  # the study's point at the table's setting
    for algo in ("drpo", "fed-cql"):
        same = json.loads((tmp_path / "paper-smoke" / "agents" / f"{algo}-agents{p.agents}-s0.json").read_text())
        table = json.loads((tmp_path / "paper-smoke" / "table" / f"{algo}-medium-s0.json").read_text())
        assert same["reused_from"] == f"table/{algo}-medium-s0"
        assert same["final"] == table["final"] and same["variant"] == {"agents": p.agents}
        assert f"agents/{algo}-agents{p.agents}-s0" in out and "same configuration as table" in out
        other = [n for n in p.agents_grid if n != p.agents]
        for n in other:  # trained, in the worker processes
            res = json.loads((tmp_path / "paper-smoke" / "agents" / f"{algo}-agents{n}-s0.json").read_text())
            assert "reused_from" not in res and res["agents"] == n and res["final"]
            assert res["config"]["agents"] == n
    png = tmp_path / "studies.png"
    assert paper.plots.studies_png(p, tmp_path, png) and png.stat().st_size > 1000


def test_the_halfcheetah_table_plans_halfcheetah_runs_under_the_same_names():
    p = paper.presets.PRESETS["reduced-halfcheetah"]
    runs = paper.presets.plan(p, "table", (0,))
    assert len(runs) == 12 and {r.datasets[0] for r in runs} == set(p.datasets)
    assert all(d.startswith("halfcheetah-") for d in p.datasets)
    assert {r.key for r in runs} == {r.key for r in paper.presets.plan(paper.presets.PRESETS["reduced"], "table", (0,))}
    assert {r.variant["dataset"] for r in runs} == {"medium", "medium-replay", "expert"}
    assert all(r.datasets[0].startswith("halfcheetah-expert-v2") for r in paper.presets.plan(p, "lambdas", (0,)))
    assert paper.presets.result_path(p, runs[0], COMMITTED).parent == COMMITTED / "paper-reduced-halfcheetah" / "table"


def test_lambdas_are_the_papers_two_sweeps_crossing_once():
    p = paper.presets.PRESETS["reduced"]
    runs = paper.presets.plan(p, "lambdas", (0,))
    assert [r.algo for r in runs].count("fed-bc") == 1  # the reference: cloning the same agents
    runs = [r for r in runs if r.algo == "drpo"]
    pairs = [(r.drpo["lambda1"], r.drpo["lambda2"]) for r in runs]
    assert len(pairs) == len(set(pairs)) == 2 * len(p.lambda_values) - 1
    assert (0.1, 5.0) in pairs and (20.0, 1.0) in pairs and (0.1, 20.0) in pairs  # the paper's best and ends
    assert all(r.datasets == ("hopper-expert-v2:4", "hopper-medium-v2:1") for r in runs)
    res = [{"algo": "drpo", "variant": {"lambda1": a, "lambda2": b}, "final": {"score_mean": 10 * a + b}}
           for a, b in pairs] + [{"algo": "fed-bc", "variant": {"reference": "fed-bc"}, "final": {"score_mean": 7.5}}]
    lines = paper.tables.lambdas_md(res, p.lambda_fixed).splitlines()
    assert lines[0] == "| lambda1 (lambda2 = 1) | 0 | 0.1 | 1 | 5 | 20 |"
    assert lines[2] == "| DRPO score | 1.0 | 2.0 | 11.0 | 51.0 | 201.0 |"
    assert lines[3] == "| seeds | 1 | 1 | 1 | 1 | 1 |"
    assert lines[5] == "| lambda2 (lambda1 = 0.1) | 0 | 0.1 | 1 | 5 | 20 |"
    assert lines[7] == "| DRPO score | 1.0 | 1.1 | 2.0 | 6.0 | 21.0 |"
    assert lines[10] == "Fed-BC on the same agents, for reference: 7.5"
    # the claim preset sweeps lambda2 only: its (0.1, 1) cell is not shown as a one-value lambda1 sweep
    only2 = paper.tables.lambdas_md(res + [{**res[-2], "final": {"score_mean": 4.0}}], p.lambda_fixed, ("lambda2",))
    assert only2.splitlines()[0].startswith("| lambda2 (lambda1 = 0.1) |") and "lambda1 (" not in only2
    assert "| DRPO score | 1.0 | 1.1 | 2.0 | 6.0 | 12.5 ± 8.5 |" in only2 and "| seeds | 1 | 1 | 1 | 1 | 2 |" in only2
    assert "best (round)" not in only2  # runs without curves: no per-seed row
    # with curves: each seed's best score and its round, then its final score, seeds in order
    curve = lambda *xs: [{"round": i + 1, "score_mean": x} for i, x in enumerate(xs)]  # noqa: E731
    runs = [{"algo": "drpo", "variant": {"lambda1": 0.1, "lambda2": 5.0}, "seed": 1, "curve": curve(10, 40, 20),
             "final": {"score_mean": 20.0}},
            {"algo": "drpo", "variant": {"lambda1": 0.1, "lambda2": 5.0}, "seed": 0, "curve": curve(5, 6, 90),
             "final": {"score_mean": 90.0}},
            {"algo": "drpo", "variant": {"lambda1": 0.1, "lambda2": 0.0}, "seed": 0, "curve": curve(3, 2, 1),
             "final": {"score_mean": 1.0}}]
    lines = paper.tables.lambdas_md(runs, p.lambda_fixed, ("lambda2",)).splitlines()
    assert lines[0] == "| lambda2 (lambda1 = 0.1) | 0 | 5 |"
    assert lines[4] == ("| best (round) -> final, by seed | s0: 3.0 (r1) -> 1.0 | "
                        "s0: 90.0 (r3) -> 90.0<br>s1: 40.0 (r2) -> 20.0 |")


def test_a_file_without_td_weight_ran_at_the_old_default_and_is_not_reused_for_the_new(tmp_path, hopper_medium):
    p = paper.presets.PRESETS["smoke"]
    r = next(x for x in paper.presets.plan(p, "table", p.seeds) if x.algo == "drpo")  # Fed-BC reads no DRPO setting
    dst = paper.presets.result_path(p, r, tmp_path)
    dst.parent.mkdir(parents=True)
    res = json.loads(paper.presets.result_path(p, r, COMMITTED).read_text())
    assert res["config"]["drpo"]["td_weight"] == 2.0
    dst.write_text(json.dumps(res))
    assert paper.cells.find_identical(p, r, tmp_path) == dst
    res["config"]["drpo"].pop("td_weight")  # as files before the option: they ran at 1
    dst.write_text(json.dumps(res))
    assert paper.cells.find_identical(p, r, tmp_path) is None


class _Stopped(Exception):
    pass


def _stop_training_at(monkeypatch, n: int) -> list[int]:
    """Make the ``n``-th agent-round of any run raise :class:`_Stopped` as it starts, as a killed
    process would stop there; the list returned records each agent-round's agent, in order."""
    from fedrl.federation import round as round_mod

    real, calls = round_mod.LocalTrainer.train_round, []

    def train_round(self, *a, **k):
        calls.append(self.agent)
        if len(calls) == n:
            raise _Stopped
        return real(self, *a, **k)

    monkeypatch.setattr(round_mod.LocalTrainer, "train_round", train_round)
    return calls


def test_a_stopped_run_resumes_from_its_last_round_and_status_shows_it(tmp_path, monkeypatch, capsys, hopper_medium):
    """A harness run stopped as the second agent of round 2 starts keeps round 1's checkpoint and
    the first agent's round 2 in its work folder; `status` names the run with both; running again
    trains only that second agent in round 2 and finishes with what an uninterrupted run computes."""
    p = paper.presets.PRESETS["smoke"]
    r = next(x for x in paper.presets.plan(p, "table", p.seeds) if x.algo == "drpo")
    assert r.agents == 2
    clean = paper.cells.execute(p, r, tmp_path / "clean")
    calls = _stop_training_at(monkeypatch, 4)
    with pytest.raises(_Stopped):
        paper.cells.execute(p, r, tmp_path / "cut")
    work = paper.cells.work_dir(p, r, tmp_path / "cut")
    assert (work / "checkpoint.safetensors").exists() and not paper.presets.result_path(p, r, tmp_path / "cut").exists()
    assert "round   1/2" in (work / "progress.log").read_text()
    paper.cli.cmd_status(type("A", (), {"preset": "smoke", "results": str(tmp_path / "cut")}))
    said = capsys.readouterr().out
    assert f"{r.key} at round 1/2 (+1 of 2 agents of round 2), ~" in said and " min left at its last agents' pace" in said
    assert "stopped (the run command resumes it)" in said  # its process ended: the lock is free
    calls.clear()
    resumed = paper.cells.execute(p, r, tmp_path / "cut")
    assert calls == [1]  # round 2's first agent was not trained again
    assert resumed["resumed_after_round"] == 1 and "resumed_after_round" not in clean
    assert resumed["resumed_agents_kept"] == 1 and "resumed_agents_kept" not in clean
    assert resumed["curve"] == clean["curve"] and resumed["losses_per_round"] == clean["losses_per_round"]
    assert not work.exists()  # a finished run leaves its result, not its work folder


def test_a_run_stopped_in_its_first_round_records_that_it_resumed(tmp_path, monkeypatch, hopper_medium):
    """Stopped as round 1's second agent starts, no round is checkpointed but the first agent is
    kept: the finished result still says it resumed (its wall_seconds count only the second
    process), with the agents it kept."""
    p = paper.presets.PRESETS["smoke"]
    r = next(x for x in paper.presets.plan(p, "table", p.seeds) if x.algo == "fed-bc")
    _stop_training_at(monkeypatch, 2)
    with pytest.raises(_Stopped):
        paper.cells.execute(p, r, tmp_path)
    assert paper.cells.rounds_done(paper.cells.work_dir(p, r, tmp_path)) == 0
    resumed = paper.cells.execute(p, r, tmp_path)
    assert resumed["resumed_after_round"] == 0 and resumed["resumed_agents_kept"] == 1


def test_a_cell_another_process_runs_is_skipped_untouched_and_named(tmp_path, capsys):
    """Two processes training one cell would write each other's checkpoints and mix the runs: the
    second is refused before it touches the cell, the run command goes on with the others and
    exits 1, and status names the process that holds it."""
    import os

    p = paper.presets.PRESETS["smoke"]
    r = next(x for x in paper.presets.plan(p, "table", p.seeds) if x.algo == "drpo")
    work = paper.cells.work_dir(p, r, tmp_path)
    (work / "marker").parent.mkdir(parents=True)
    (work / "marker").write_text("the holder's round")
    held = paper.cells._lock(work)  # as the process running it holds it
    try:
        with pytest.raises(paper.cells.CellBusy, match=f"{r.key} is already running \\(pid {os.getpid()};"):
            paper.cells.execute(p, r, tmp_path)
        assert sorted(f.name for f in work.iterdir()) == ["marker"]
        assert paper.cells.lock_holder(work) == os.getpid()
        rc = paper.cli.main(["run", "--preset", "smoke", "--experiment", "table", "--only", r.key,
                             "--results", str(tmp_path)])
        assert rc == 1 and f"skipped: {r.key} is already running (pid {os.getpid()}" in capsys.readouterr().out
        assert not paper.presets.result_path(p, r, tmp_path).exists()
        (work / "progress.log").write_text("")
        paper.cli.cmd_status(type("A", (), {"preset": "smoke", "results": str(tmp_path)}))
        assert f"running (pid {os.getpid()})" in capsys.readouterr().out
    finally:
        held.close()
    assert paper.cells.lock_holder(work) == 0


def test_device_claim_plans_by_measured_rates():
    from benchmarks.paper import device_claim as dc

    assert dc.method_of("fed-bc-3e-4-medium-replay-s1") == "fed-bc-3e-4"
    assert dc.method_of("drpo-medium-s0") == "drpo"
    rates = {1: 100.0, 15: 1500.0}
    one = dc.estimate(["drpo-medium-s0"], rates, 0.25, 50_000)
    assert one == pytest.approx(50_000 / 100 * 1.15 + 60)  # one process alone runs at the 1-process rate
    # 15 CQL-based cells share 1500 steps/s: 750k steps / 1500; BC cells cost a quarter
    assert dc.estimate([f"drpo-medium-s{i}" for i in range(15)], rates, 0.25, 50_000) == \
        pytest.approx(750_000 / 1500 * 1.15 + 60)
    assert dc.estimate(["drpo-medium-s0", "fed-bc-medium-s0"], rates, 0.25, 50_000) == pytest.approx(one)


def test_device_claim_runs_a_named_experiment_and_unpacks_it_there(tmp_path, random_dataset):
    """``--experiment lambdas --at-once``: without MPS (none on this machine) it runs only what the
    measured time-sliced rate keeps at full speed, packs the finished cells, and unpack puts them
    in the lambdas folder, the run's record beside the table's rates rather than over them."""
    import json
    import shutil

    from benchmarks.paper import device_claim as dc
    from fedrl.data.registry import cache_dir

    (cache_dir() / "datasets").mkdir(parents=True)
    for name in ("hopper-medium-v2", "hopper-expert-v2"):  # the test's own data under the names: nothing made
        shutil.copy(random_dataset, cache_dir() / "datasets" / f"{name}.hdf5")

    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"rates_no_mps": {"1": 100.0, "6": 210.0}, "bc_steps_per_s_1proc": 400.0,
                                 "mps": False}))
    res, out = tmp_path / "res", tmp_path / "out"
    cells = "drpo-l1_0.1-l2_0.0-s0,drpo-l1_0.1-l2_1.0-s0,drpo-l1_0.0-l2_1.0-s0"
    assert dc.main(["--preset", "smoke", "--experiment", "lambdas", "--device", "cpu", "--rates", str(rates),
                    "--at-once", "3", "--cells", cells, "--budget", "240", "--out", str(out),
                    "--results", str(res)]) == 0
    info = json.loads((out / "device.json").read_text())
    assert info["experiment"] == "lambdas" and info["mps"] is False
    assert info["chosen"] == cells.split(",")[:2]  # 210 / 100 steps/s: two at full speed
    assert info["returncode"] == 0
    home = tmp_path / "home"
    assert dc.main(["--results", str(home), "unpack", str(out / "claim-device.tgz"), "--runs", str(tmp_path / "runs")]) == 0
    got = sorted(f.name for f in (home / "paper-claim" / "lambdas").iterdir())
    assert got == sorted(f"{k}.json" for k in cells.split(",")[:2])
    assert (home / "paper-claim" / "device" / "device-lambdas.json").exists()
    assert not (home / "paper-claim" / "device" / "device.json").exists()
    with pytest.raises(SystemExit, match="not cells of the smoke preset's lambdas: drpo-medium-s0"):
        dc.main(["--preset", "smoke", "--experiment", "lambdas", "--device", "cpu", "--rates", str(rates),
                 "--cells", "drpo-medium-s0", "--out", str(out), "--results", str(res)])


def test_device_claim_check_cpu_reruns_a_gpu_cells_first_rounds_beside_it(tmp_path, random_dataset, capsys):
    """check-cpu reruns a GPU cell's first rounds on the CPU with the same configuration but the
    device and writes both sides' per-round losses and scores; a CPU cell is refused."""
    import json
    import shutil

    from benchmarks import paper
    from benchmarks.paper import device_claim as dc
    from fedrl.data.registry import cache_dir

    (cache_dir() / "datasets").mkdir(parents=True)
    shutil.copy(random_dataset, cache_dir() / "datasets" / "hopper-medium-v2.hdf5")
    p = paper.presets.PRESETS["smoke"]
    r = next(x for x in paper.presets.plan(p, "table", p.seeds) if x.key == "drpo-medium-s0")
    res = paper.cells.execute(p, r, tmp_path)
    path = paper.presets.result_path(p, r, tmp_path)
    args = ["--preset", "smoke", "--results", str(tmp_path), "check-cpu", "drpo-medium-s0", "--rounds", "2"]
    with pytest.raises(SystemExit, match="ran on the CPU: nothing to check"):
        dc.main(args)
    on_gpu = dict(res, config={**res["config"], "device": "cuda"})  # as a GPU run records itself
    path.write_text(json.dumps(on_gpu))
    assert dc.main(args) == 0
    out = json.loads((tmp_path / "paper-smoke" / "device" / "cpu-check-drpo-medium-s0.json").read_text())
    assert [row["round"] for row in out["rounds"]] == [1, 2]
    for i, row in enumerate(out["rounds"]):  # this CPU rerun is the very run the result came from
        assert row["score_cpu"] == pytest.approx(res["curve"][i]["score_mean"])
        assert row["losses_cpu"] == pytest.approx({k: v[i] for k, v in res["losses_per_round"].items()})
    assert "round 2: score CPU" in capsys.readouterr().out


def test_peers_summary_medians_rates_and_skips_the_first_round():
    from benchmarks.system.peers import summarise

    runs = [{"round_seconds": [9.0, 0.1, 0.3], "cpu_ms_per_round": {"server": 10.0, "clients_total": 30.0},
             "peak_rss_mb": {"server": 100.0, "client_max": 50.0}},
            {"round_seconds": [8.0, 0.2, 0.2], "cpu_ms_per_round": {"server": 20.0, "clients_total": 50.0},
             "peak_rss_mb": {"server": 90.0, "client_max": 70.0}}]
    s = summarise(runs, model_bytes=1_000_000, clients=10, skip=1)
    assert s["rounds_measured"] == 4 and s["round_ms_median"] == pytest.approx(200.0)
    assert s["mb_per_s"] == pytest.approx(2 * 10 * 1.0 / 0.2)  # 10 downloads + 10 uploads of 1 MB
    assert s["cpu_ms_per_round"] == {"server": 15.0, "clients_total": 40.0}
    assert s["peak_rss_mb"] == {"server": 100.0, "client_max": 70.0}


def test_peers_watch_counts_a_process_trees_cpu_including_children_that_exited():
    """Flower's deployment engine runs a ClientApp per message in a child process that exits
    at once: a side's CPU must include them (through the parent's cutime), not just the roots'."""
    import subprocess
    import sys
    import time

    from benchmarks.system.peers import Watch

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    # the root sleeps; its child burns ~0.4 s of CPU and exits (reaped by the root's wait)
    script = ("import subprocess, sys, time\n"
              f"subprocess.run([sys.executable, '-c', {burn!r}])\n"
              "time.sleep(1.0)\n")
    root = subprocess.Popen([sys.executable, "-c", script])
    flat, tree = Watch([root]), Watch([root], trees=True)
    try:
        end = time.monotonic() + 30
        while root.poll() is None:
            assert time.monotonic() < end
            flat.poll()
            tree.poll()
            time.sleep(0.05)
    finally:
        root.kill()
    assert tree.cpu[root.pid] >= 0.35  # the child's seconds, counted once it exited
    assert flat.cpu[root.pid] < 0.35  # the root alone mostly slept: what the flat view would report
    assert tree.rss[root.pid] > 0


def test_peers_table_lists_each_side_measured():
    from benchmarks.system.peers import table_md

    side = {"round_ms_median": 30.0, "round_ms_p90": 40.0, "mb_per_s": 170.0, "rounds_measured": 60,
            "cpu_ms_per_round": {"server": 22.0, "clients_total": 33.0},
            "peak_rss_mb": {"server": 300.0, "client_max": 270.0}}
    slow = {**side, "round_ms_median": 75.0, "mb_per_s": 60.0, "cpu_ms_per_round": {"server": 900.0, "clients_total": 20000.0}}
    res = {"date": "2026-12-04", "clients": 10, "cores": 2, "machine_state_loadavg_at_start": [1.0, 1, 1],
           "machine_state_loadavg_at_end": [2.0, 2, 2],
           "sizes": {"hopper_policy": {"model_bytes": 282352, "ours": side, "flower": slow,
                                       "fastest_flower_over_ours_round_time": 2.5, "ours_over_flower_mb_per_s": 2.8},
                     "model_30mb": {"model_bytes": 30194776, "ours": side, "flower": slow,
                                    "flower_deployment": slow, "fastest_flower_over_ours_round_time": 2.5,
                                    "ours_over_flower_mb_per_s": 2.8, "ours_over_flower_deployment_mb_per_s": 2.8}}}
    text = table_md(res)
    rows = [line for line in text.splitlines()[2:] if line.startswith("|")]
    assert len(rows) == 5  # the deployment engine was measured for one size only
    assert rows[0].startswith("| Hopper policy (0.28 MB) | this federation | 30.0 | 40.0 | 170 | 22 / 33 | 300 / 270 | 60 |")
    assert "deployment engine" in rows[-1] and rows[-1].startswith("| 30 MB model (30.19 MB)")
    # the reading is rendered from the same numbers: 0.40x each, 2.8x the transfer; the engine's
    # 20 s of clients' CPU over 10 nodes
    assert "0.40x the time of Flower's fastest path with the Hopper policy and 0.40x with the 30 MB model" in text
    assert "is met for every size" in text and "2.0-2.0 s of CPU per node" in text
    res["sizes"]["model_30mb"]["ours_over_flower_mb_per_s"] = 1.7  # transfer under 2x: not met
    assert "not met for every size" in table_md(res)


def test_every_mutant_still_names_one_line_of_the_code():
    """``benchmarks.mutants`` edits lines by their text: each must occur exactly once in its file,
    or the audit would stop (or, worse, mutate something else) after the code moved on."""
    from benchmarks import mutants

    assert len({m.name for m in mutants.MUTANTS}) == len(mutants.MUTANTS)
    for m in mutants.MUTANTS:
        text = (ROOT / m.path).read_text()
        assert text.count(m.old) == 1, f"{m.name}: {text.count(m.old)} occurrences in {m.path}"
        assert m.old != m.new
        for t in m.tests:  # a file, or a test in one: file::name[case]
            path, _, node = t.partition("::")
            assert (ROOT / path).exists(), f"{m.name}: no test file {path}"
            name, _, case = node.partition("[")
            source = (ROOT / path).read_text() if node else ""
            if name:
                assert f"def {name}(" in source, f"{m.name}: no test {name} in {path}"
            if case:
                assert f'"{case[:-1]}"' in source, f"{m.name}: no case {case[:-1]} in {path}"


def test_lambda2_curves_draw_each_setting_and_the_reference(tmp_path, monkeypatch):
    """One bold mean line per lambda2 value (lambda1 at the sweep's), its seeds thin, the Fed-BC
    reference dashed; nothing drawn without a finished DRPO run of the sweep."""
    import matplotlib.pyplot as plt

    def curve(*xs):
        return [{"round": i + 1, "score_mean": x} for i, x in enumerate(xs)]

    def run(algo, l1, l2, seed, *xs):
        return {"algo": algo, "variant": {"lambda1": l1, "lambda2": l2}, "seed": seed, "curve": curve(*xs),
                "final": {"score_mean": xs[-1]}}

    runs = [run("drpo", 0.1, 5.0, 0, 10, 20, 60), run("drpo", 0.1, 5.0, 1, 30, 20, 40),
            run("drpo", 0.1, 0.0, 0, 5, 80, 90), run("drpo", 20.0, 1.0, 0, 1, 1, 1),  # not of this sweep
            {"algo": "fed-bc", "variant": {"reference": "fed-bc"}, "seed": 0, "curve": curve(50, 70, 88),
             "final": {"score_mean": 88.0}}]
    drawn = []
    real_savefig = plt.Figure.savefig
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), real_savefig(fig, *a, **k)))
    png = tmp_path / "l2.png"
    assert paper.plots.lambda_curves_png(runs, (0.1, 1.0), png, (0.0, 0.2, 1.0, 5.0)) and png.stat().st_size > 1000
    lines = drawn[0].axes[0].get_lines()
    bold = {ln.get_label(): ln for ln in lines if ln.get_linewidth() > 2}
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]  # a setting's colour: its place in the preset
    assert bold["DRPO, lambda2 = 5 (n=2)"].get_color() == palette[3]
    assert bold["DRPO, lambda2 = 0 (n=1)"].get_color() == palette[0]
    assert set(bold) == {"DRPO, lambda2 = 0 (n=1)", "DRPO, lambda2 = 5 (n=2)", "Fed-BC (reference) (n=1)"}
    assert list(bold["DRPO, lambda2 = 5 (n=2)"].get_ydata()) == [20.0, 20.0, 50.0]  # the mean of the two seeds
    assert bold["Fed-BC (reference) (n=1)"].get_linestyle() == "--"
    assert len(lines) == 3 + 4  # and the four runs' own curves, thin
    assert not paper.plots.lambda_curves_png(runs[-2:], (0.1, 1.0), tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_minutes_left_are_the_agents_to_train_at_the_median_of_the_last_ones(tmp_path):
    """`status`'s estimate: agents still to train x the median time of the last `agents` of them
    in progress.log (a run slowed for a while, or resumed, is read at its latest pace)."""
    (tmp_path / "progress.log").write_text(  # the first agent line is older than the last two: not counted
        "10:00:00 drpo: 2 agents ...\n"
        "10:01:00   round 1: agent 1/2 done in 600.0s\n"
        "10:02:00   round 1: agent 2/2 done in 60.0s\n"
        "10:02:01 round   1/3  return 1.0 score 2.0  [120.0s]\n"
        "10:03:00   round 2: agent 1/2 done in 180.0s\n")
    assert paper.cli.minutes_left(tmp_path, 3, 2) == pytest.approx(3 * 120 / 60)
    assert paper.cli.minutes_left(tmp_path / "none", 3, 2) is None
    (tmp_path / "progress.log").write_text("10:00:00 drpo: 2 agents ...\n")
    assert paper.cli.minutes_left(tmp_path, 3, 2) is None
    with open(tmp_path / "progress.log", "a") as f:  # short rounds log no agent lines: the round's time
        f.write("10:02:01 round   1/3  return 1.0 score 2.0  [120.0s]\n")
    assert paper.cli.minutes_left(tmp_path, 3, 2) == pytest.approx(3 * 60 / 60)


def test_the_claim_preset_runs_and_reports_its_plan_and_marks_the_rest(tmp_path, monkeypatch, capsys, hopper_medium):
    """`status` of the claim preset marks the experiments outside its plan (the paper's studies at
    10k steps, ~90 h of one core) and `run --experiment all` runs exactly its plan's cells."""
    p = paper.presets.PRESETS["claim"]
    assert p.planned == ("table", "lambdas")
    paper.cli.cmd_status(type("A", (), {"preset": "claim", "results": str(tmp_path)}))
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    for e in paper.presets.EXPERIMENTS:
        assert ("not in the claim preset's plan" in lines[e]) == (e not in p.planned), lines[e]
    # the planned experiments name the cells still to run; the others do not list theirs
    assert out.count("not started: ") == len(p.planned)
    assert f"not started: {', '.join(r.key for r in paper.presets.plan(p, 'table', p.seeds))}\n" in out
    ran = []
    monkeypatch.setattr(paper.cli, "run_one", lambda name, r, *a: (ran.append(r), (r, {"final": None}, 0.0))[1])
    monkeypatch.setattr(paper.cli, "find_identical", lambda *a: None)
    args = type("A", (), {"preset": "claim", "seeds": "", "experiment": "all", "results": str(tmp_path), "only": None})
    assert paper.cli.cmd_run(args) == 0
    want = [r.key for e in p.planned for r in paper.presets.plan(p, e, p.seeds)]
    assert [r.key for r in ran] == want and {r.experiment for r in ran} == set(p.planned)
    # the smoke preset names no plan: `--experiment all` there is every experiment
    assert paper.presets.PRESETS["smoke"].planned is None


def test_inplace_times_each_piece_inside_the_real_processes_of_both_sides(tmp_path, capsys, hopper_medium):
    """benchmarks/system/inplace.py: a short real federation whose processes time their own pieces
    (thread CPU); every agent piece is seen once a round in each agent, the aggregator's
    submission ten times a round, and nothing of the wrappers is left in this process."""
    import os

    from benchmarks.system import inplace

    out = tmp_path / "inplace.json"
    assert inplace.main(["--agents", "3", "--rounds", "12", "--skip", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    pieces = res["pieces"]
    train = pieces["agent | agent: _train (all of the above but session_update, read_task)"]
    assert train["processes"] == 3 and 0.9 <= train["calls_per_round"] <= 1.1 and train["us_per_call_median"] > 0
    assert pieces["aggregator | aggregator: _submit (one update, and the close in the last)"]["calls_per_round"] >= 2.5
    assert pieces["aggregator | aggregator: aggregate"]["processes"] == 1
    assert "agent | agent: read_task" in pieces and "agent | both: Assembler.add" in pieces
    assert "FEDRL_INPLACE_OUT" not in os.environ and "sitecustomize" not in capsys.readouterr().err


def test_device_paper_runs_the_column_as_one_batch_packs_and_unpacks_it(tmp_path, random_dataset):
    """``benchmarks.paper.device`` end to end at a tiny scale on the CPU (2 agents, 2 rounds, 5
    steps): it measures, fits every method of the seed, runs them as one batched process, packs
    the harness's result files, and unpack puts them in the paper preset's table folder. With a
    budget nothing fits in, it says so and stops before a round it could not finish."""
    import json
    import shutil
    import tarfile

    from benchmarks.paper import device as dp
    from fedrl.data.registry import cache_dir

    (cache_dir() / "datasets").mkdir(parents=True, exist_ok=True)
    shutil.copy(random_dataset, cache_dir() / "datasets" / "hopper-medium-v2.hdf5")
    out = tmp_path / "out"
    assert dp.main(["run", "--tiny", "--device", "cpu", "--out", str(out), "--seeds", "0",
                    "--measure-seconds", "0.2", "--eval-workers", "1"]) == 0
    info = json.loads((out / "device.json").read_text())
    assert info["fits"] and info["seeds_run"] == [0] and info["rates"]["drpo"]["members"] == 6
    assert sorted(info["cells"]) == ["cql-medium-s0", "drpo-medium-s0", "fed-bc-medium-s0", "fed-cql-medium-s0"]
    assert all(c["finished"] for c in info["cells"].values())
    with tarfile.open(out / "paper-device.tgz") as tar:
        names = tar.getnames()
    assert "results/paper-smoke/table/drpo-medium-s0.json" in names and "rounds/cql-medium-s0.rounds.jsonl" in names
    home = tmp_path / "home"
    assert dp.main(["unpack", str(out / "paper-device.tgz"), "--dest", str(home)]) == 0
    res = json.loads((home / "paper-smoke" / "table" / "drpo-medium-s0.json").read_text())
    assert res["key"] == "drpo-medium-s0" and [c["round"] for c in res["curve"]] == [1, 2]
    assert res["config"]["local_steps"] == 5 and res["config"]["agents"] == 2
    assert len(res["losses_per_round"]["critic_td"]) == 2
    assert (home / "paper-smoke" / "device-paper.json").exists()

    late = tmp_path / "late"
    assert dp.main(["run", "--tiny", "--device", "cpu", "--out", str(late), "--seeds", "0,1", "--budget", "1",
                    "--measure-seconds", "0.1", "--eval-workers", "1"]) == 0
    info = json.loads((late / "device.json").read_text())
    assert not info["fits"] and info["seeds_run"] == [0]
    assert all(c["rounds_done"] == 0 and not c["finished"] for c in info["cells"].values())


def test_the_harness_batches_a_presets_cells_into_one_process(tmp_path, hopper_medium):
    """``paper run --batched``: the smoke table's four cells trained as one batched model, each
    written in the harness's format (what render reads), and a second invocation has nothing to do."""
    import json

    assert paper.cli.main(["run", "--preset", "smoke", "--batched", "--results", str(tmp_path)]) == 0
    files = sorted((tmp_path / "paper-smoke" / "table").glob("*.json"))
    assert [f.stem for f in files] == ["cql-medium-s0", "drpo-medium-s0", "fed-bc-medium-s0", "fed-cql-medium-s0"]
    for f in files:
        res = json.loads(f.read_text())
        assert [c["round"] for c in res["curve"]] == [1, 2] and res["engine"].startswith("batched")
        assert res["config"]["local_steps"] == 5 and len(res["losses_per_round"]["critic_td" if res["algo"] != "fed-bc"
                                                                                 else "bc_loss"]) == 2
    before = {f: f.stat().st_mtime_ns for f in files}
    assert paper.cli.main(["run", "--preset", "smoke", "--batched", "--results", str(tmp_path)]) == 0
    assert {f: f.stat().st_mtime_ns for f in files} == before


def test_a_batched_run_leaves_out_a_cell_another_process_runs(tmp_path, hopper_medium, capsys):
    """``run --batched`` takes each member's lock as a per-cell run does: a cell another process
    trains is skipped and named (exit 1) while the rest of its group trains; the next invocation
    trains it. A group's checkpoint folder is named by its members, not by its place in a list."""
    import os

    p = paper.presets.PRESETS["smoke"]
    runs = paper.presets.plan(p, "table", p.seeds)
    r = next(x for x in runs if x.algo == "drpo")
    held = paper.cells._lock(paper.cells.work_dir(p, r, tmp_path))
    try:
        rc = paper.cli.main(["run", "--preset", "smoke", "--batched", "--results", str(tmp_path)])
        assert rc == 1 and f"skipped: {r.key} is already running (pid {os.getpid()}" in capsys.readouterr().out
        done = sorted(f.stem for f in (tmp_path / "paper-smoke" / "table").glob("*.json"))
        assert done == sorted(x.key for x in runs if x is not r)
    finally:
        held.close()
    assert paper.cli.main(["run", "--preset", "smoke", "--batched", "--results", str(tmp_path)]) == 0
    assert paper.presets.result_path(p, r, tmp_path).exists()
    a, b = runs[:2]
    assert paper.cells.group_work_dir(p, [a, b], tmp_path) == paper.cells.group_work_dir(p, [b, a], tmp_path)
    assert paper.cells.group_work_dir(p, [a], tmp_path) != paper.cells.group_work_dir(p, [a, b], tmp_path)


def test_the_harness_runs_ant(tmp_path):
    """Issue 56: the presets name Ant-v5's sets, and the table's four methods run on one of them
    (its random set, 27-dimensional observations) and finish. The set is made here at 5,000 rows
    where the registry finds it (making its 200,000 on demand is the registry's own test's)."""
    from fedrl.data.make import make_dataset
    from fedrl.data.registry import cache_dir

    make_dataset("ant", "random", 0, cache_dir() / "datasets" / "ant-random-v2.hdf5", transitions=5000,
                 progress=False)
    assert paper.presets.PRESETS["ant"].datasets == ("ant-medium-v2", "ant-medium-replay-v2", "ant-expert-v2")
    p = paper.presets.PRESETS["smoke-ant"]
    runs = paper.presets.plan(p, "table", p.seeds)
    assert sorted(r.algo for r in runs) == sorted(paper.presets.ALGO_ORDER)
    for r in runs:
        res = paper.cells.execute(p, r, tmp_path)
        assert res["datasets"] == ["ant-random-v2"] and res["final"]["round"] == p.rounds, r.key
        assert math.isfinite(res["final"]["return_mean"]) and len(res["curve"]) == p.rounds, r.key
        assert all("ant-random-v2" in sh["source"] for sh in res["shards"]), r.key


def test_a_rerun_at_new_drpo_settings_copies_fed_bc_from_the_older_preset_and_nothing_else(tmp_path):
    """claim-v2 reruns the claim at new DRPO defaults: Fed-BC reads no DRPO setting, so its runs are
    the claim's, copied; every CQL-based run, or a Fed-BC run whose own settings differ, trains."""
    import dataclasses

    old = paper.presets.PRESETS["smoke"]
    new = dataclasses.replace(old, name="smoke-v2", drpo={**old.drpo, "alpha_lr": 1e-3}, reuse_from=("smoke",))
    runs = {r.algo: r for r in paper.presets.plan(new, "table", new.seeds)}
    for r in paper.presets.plan(old, "table", old.seeds):  # the older preset's finished runs
        dst = paper.presets.result_path(old, r, tmp_path)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(json.dumps(json.loads(paper.presets.result_path(old, r, COMMITTED).read_text())))
    src = paper.presets.result_path(old, runs["fed-bc"], tmp_path)
    assert paper.cells.find_identical(new, runs["fed-bc"], tmp_path) == src
    for algo in ("drpo", "fed-cql", "cql"):
        assert paper.cells.find_identical(new, runs[algo], tmp_path) is None, algo
    assert paper.cells.reuse(new, runs["fed-bc"], src, tmp_path)["reused_from"] == "paper-smoke/table/fed-bc-medium-s0"
    # without reuse_from the older preset is not searched; with other BC settings nothing matches
    assert paper.cells.find_identical(dataclasses.replace(new, reuse_from=()), runs["fed-bc"], tmp_path) is None
    other_bc = dataclasses.replace(new, bc={**new.bc, "lr": 1e-3})
    bc_run = next(x for x in paper.presets.plan(other_bc, "table", new.seeds) if x.algo == "fed-bc")
    assert paper.cells.find_identical(other_bc, bc_run, tmp_path) is None


def test_device_paper_runs_a_presets_named_variants_and_its_own_dataset(tmp_path):
    """The verdict's and the held-out preset's columns include DRPO with the gradient stop (a named
    variant), with the variant's critic, and the dataset is the preset's unless one is named."""
    from benchmarks.paper import device as dp

    p = dp.preset(False, "heldout-walker2d")
    specs, cs = dp.plan_cells(p, "walker2d-medium-v2", (0, 1, 2), "cpu")
    assert sorted(r.key for r in specs) == sorted(f"{m}-medium-s{s}" for m in ("drpo", "drpo-returns-gradient", "fed-bc")
                                                  for s in (0, 1, 2))
    by_key = {c.key: c.cfg for c in cs}
    assert by_key["drpo-medium-s1"].drpo.cql_calibration == "none"
    assert by_key["drpo-returns-gradient-medium-s1"].drpo.cql_calibration == "returns-gradient"
    assert by_key["drpo-medium-s1"].final_eval_episodes == 50 and by_key["drpo-medium-s1"].datasets == ("walker2d-medium-v2",)
    v = dp.preset(False, "verdict")
    every, _ = dp.plan_cells(v, "hopper-medium-v2", (0, 1, 2), "cpu")
    assert len(every) == 21  # the verdict's 15 and the critic's ablation under Fed-CQL and CQL alone (issue 83)
    assert {r.key for r in every} >= {f"{m}-returns-gradient-medium-s{s}" for m in ("fed-cql", "cql") for s in (0, 1, 2)}
    for r in every[:-2]:  # all but two cells in: a GPU call runs what is left
        f = paper.presets.result_path(v, r, tmp_path)
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("{}")
    left, _ = dp.plan_cells(v, "hopper-medium-v2", (0, 1, 2), "cpu", tmp_path)
    assert [r.key for r in left] == [r.key for r in every[-2:]]
    with pytest.raises(SystemExit, match="no cells of hopper-medium-v2"):
        dp.plan_cells(p, "hopper-medium-v2", (0,), "cpu")


def test_device_paper_runs_claim_v2s_column_less_what_is_already_done(tmp_path, hopper_medium):
    """``device_paper run --preset claim-v2``: the claim-v2 cells at that preset's scale and today's
    defaults, less the cells whose result is already there (Fed-BC, copied from the claim; a cell
    finished on the CPU), so a lent GPU spends its minutes on what is missing. The results folder is
    the test's own: the committed one fills as cells finish."""
    from benchmarks.paper import device as dp

    p = dp.preset(False, "claim-v2")
    every, cells = dp.plan_cells(p, "hopper-medium-v2", (0, 1, 2), "cpu")
    assert sorted({r.algo for r in every}) == ["cql", "drpo", "fed-bc", "fed-cql"] and len(every) == 12
    c = cells[[r.key for r in every].index("drpo-medium-s0")].cfg
    assert (c.agents, c.rounds, c.local_steps, c.transitions) == (5, 10, 1000, 5000)
    assert c.drpo == paper.presets.sim_config(p, every[0]).drpo  # the harness's settings: today's defaults

    def mark_done(runs):
        for r in runs:
            f = paper.presets.result_path(p, r, tmp_path)
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text("{}")

    done = [r for r in every if r.algo == "fed-bc" or r.key == "drpo-medium-s0"]
    mark_done(done)
    left, _ = dp.plan_cells(p, "hopper-medium-v2", (0, 1, 2), "cpu", tmp_path)
    assert [r.key for r in left] == [r.key for r in every if r not in done] and len(left) == 8
    mark_done(every)
    with pytest.raises(SystemExit, match="already in"):
        dp.plan_cells(p, "hopper-medium-v2", (0, 1, 2), "cpu", tmp_path)
    with pytest.raises(SystemExit, match="no preset"):
        dp.preset(False, "claim-v3")
