"""A training step's time with and without subnormal floats flushed, late in a paper cell and at
its start (why the learners train inside ``fedrl.common.device.subnormals_flushed``).

    python -m benchmarks.system.subnormals [--preset heldout-walker2d] [--key drpo-medium-s1]
        [--experiment table] [--work DIR] [--steps 100] [--repeats 2] [--out PATH]

It reads the checkpoint a ``python -m benchmarks.paper run`` cell keeps in progress (under
``runs/paper-PRESET/EXPERIMENT/KEY/``, or ``--work``; a cell past round ~8 shows the effect), restores agent
0's learner from it, builds the same agent's learner afresh (round 1), and times each learner's
DRPO step (a minibatch draw and ``update``) on one torch thread, with and without the flush,
alternated ``--repeats`` times so that the machine's load falls on all four alike. Writes
benchmarks/results/subnormals.json unless ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, code_revision, device_name


def _step_ms(trainer, steps: int, flushed: bool) -> float:
    """Mean milliseconds of ``steps`` of the trainer's own steps (its learner keeps training)."""
    from fedrl.common.device import subnormals_flushed

    with subnormals_flushed() if flushed else contextlib.nullcontext():
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.learner.update(trainer.buffer.sample(trainer.cfg.batch_size, trainer.learner.gen))
        return 1000 * (time.perf_counter() - t0) / steps


def subnormal_share(trainer) -> dict[str, int]:
    """How many of the learner's checkpointed floats are subnormal, of how many."""
    import torch

    tiny = torch.finfo(torch.float32).tiny
    ck = {k: v for k, v in trainer.learner.checkpoint().items() if torch.is_tensor(v) and v.is_floating_point()}
    return {"subnormal": int(sum(((v.abs() < tiny) & (v != 0)).sum() for v in ck.values())),
            "floats": int(sum(v.numel() for v in ck.values()))}


def measure(preset: str, experiment: str, key: str, steps: int, repeats: int, work: str = "") -> dict:
    import torch

    from benchmarks.paper.cells import rounds_done, work_dir
    from benchmarks.paper.presets import PRESETS, planned, sim_config
    from fedrl.federation import simulate as sim

    torch.set_num_threads(1)
    p = PRESETS[preset]
    spec = next((r for r in planned(p, experiment) if r.key == key), None)
    if spec is None:
        raise SystemExit(f"no cell {key} in {preset}/{experiment}")
    work = Path(work) if work else work_dir(p, spec)
    done = rounds_done(work)
    if not done:
        raise SystemExit(f"{work} holds no checkpoint: run the cell past a few rounds first "
                         f"(python -m benchmarks.paper run --preset {preset} --only {key})")
    cfg = sim_config(p, spec, "cpu")
    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        late_dir, fresh_dir = Path(tmp, "late"), Path(tmp, "fresh")
        late_dir.mkdir()
        fresh_dir.mkdir()
        for f in ("checkpoint.safetensors", "config.json", "rounds.jsonl"):
            shutil.copy(work / f, late_dir / f)
        late = sim._set_up(cfg, late_dir, lambda m: None, True, "per-agent", "batch", cpu)
        fresh = sim._set_up(cfg, fresh_dir, lambda m: None, False, "per-agent", "batch", cpu)
    learners = {"late": late.trainers[0], "fresh": fresh.trainers[0]}
    for name, fed in (("late", late), ("fresh", fresh)):
        learners[name].learner.begin_round(fed.global_state)
    share = {name: subnormal_share(t) for name, t in learners.items()}
    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, t in learners.items():
            for flushed in (False, True):
                times.setdefault(f"{name}_{'flushed' if flushed else 'plain'}", []).append(_step_ms(t, steps, flushed))
    ms = {k: round(statistics.median(v), 2) for k, v in times.items()}
    return {"date": datetime.date.today().isoformat(), "cell": f"{preset}/{experiment}/{key}", "rounds_done": done,
            "steps": steps, "repeats": repeats, "ms_per_step": ms, "all_ms": times, "checkpoint_floats": share,
            "late_slowdown_plain": round(ms["late_plain"] / ms["fresh_plain"], 2),
            "late_slowdown_flushed": round(ms["late_flushed"] / ms["fresh_flushed"], 2),
            "code_revision": code_revision(), "device_name": device_name("cpu"), "torch": torch.__version__,
            "machine": platform.machine()}


def table_md(path: Path) -> str:
    """The committed measurement as a table (docs/performance.md)."""
    if not path.exists():
        return "Not measured yet: `python -m benchmarks.system.subnormals`."
    t = json.loads(path.read_text())
    ms = t["ms_per_step"]
    return (f"{t['device_name']}, one torch thread, torch {t['torch']}, {t['date']}: agent 0 of the cell "
            f"`{t['cell']}` after round {t['rounds_done']}, against the same agent's learner at round 1 "
            f"(`{path.relative_to(ROOT)}`, medians of {t['repeats']} x {t['steps']} steps):\n\n"
            "| learner | ms per DRPO step | with the flush | without / with |\n| --- | --- | --- | --- |\n"
            f"| round 1 | {ms['fresh_plain']:.1f} | {ms['fresh_flushed']:.1f} | "
            f"{ms['fresh_plain'] / ms['fresh_flushed']:.2f}x |\n"
            f"| after round {t['rounds_done']} | {ms['late_plain']:.1f} | {ms['late_flushed']:.1f} | "
            f"{ms['late_plain'] / ms['late_flushed']:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.system.subnormals", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="heldout-walker2d")
    ap.add_argument("--experiment", default="table")
    ap.add_argument("--key", default="drpo-medium-s1")
    ap.add_argument("--work", default="", help="the cell's folder in progress, if not under this checkout's runs/")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "subnormals.json"))
    a = ap.parse_args(argv)
    res = measure(a.preset, a.experiment, a.key, a.steps, a.repeats, a.work)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res["ms_per_step"]), f"late/fresh: {res['late_slowdown_plain']}x plain, "
          f"{res['late_slowdown_flushed']}x flushed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
