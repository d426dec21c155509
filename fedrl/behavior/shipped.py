"""The behaviour checkpoints the project ships, and how they are chosen from a SAC run.

A *behaviour set* is a folder holding ``manifest.json`` and a few small policy files (float16
safetensors, ~140 KB each):

- ``expert.safetensors``: the checkpoint whose sampling policy had the highest return;
- ``medium.safetensors``: an earlier checkpoint whose sampling return is closest to a third of
  the expert's (D4RL's definition of ``medium``);
- ``replay-<step>.safetensors``: checkpoints up to ``medium`` standing in for SAC's replay
  buffer. Checkpoint ``c_i`` gets the share ``(c_i - c_{i-1}) / c_medium`` of a
  ``medium-replay`` file (``c_0`` = the end of the uniform-random warm-up, whose share the
  uniform policy gets), i.e. each checkpoint stands for the policies that collected the buffer
  between it and the one before.

Every return in the manifest was measured on the float16 weights actually shipped.
The sets for each environment live in ``fedrl/behavior/checkpoints/<env>/``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from fedrl.algos.policy_io import load_policy, save_policy
from fedrl.envs import ENVS, env_info
from fedrl.envs.rollout import NumpyPolicy, Segment, stochastic_return, uniform_policy

SHIPPED_DIR = Path(__file__).parent / "checkpoints"
MANIFEST = "manifest.json"
# The bar for an expert behaviour policy (mean sampling return), per env: Hopper's 2500 is the
# data issue's; the others are the same D4RL-normalised score (77), rounded.
EXPERT_MIN = {"hopper": 2500.0, "halfcheetah": 9300.0, "walker2d": 3550.0, "ant": 2930.0}


def shipped_envs() -> list[str]:
    """Env keys with a shipped behaviour set."""
    return sorted(p.parent.name for p in SHIPPED_DIR.glob(f"*/{MANIFEST}"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(root: Path, file: str, sha256: str) -> Path:
    """``root/file`` once its bytes are the ones the set's manifest lists."""
    path = root / file
    if not path.is_file():
        raise ValueError(f"{path}: listed in {root / MANIFEST} but missing (an incomplete install "
                         "or checkout; reinstall fedrl, or ship the set again)")
    if _sha256(path) != sha256:
        raise ValueError(f"{path}: checksum differs from {root / MANIFEST}; the file is "
                         "damaged or was replaced")
    return path


@dataclass
class BehaviorSet:
    root: Path
    manifest: dict

    @property
    def env_id(self) -> str:
        return self.manifest["env_id"]

    def entry(self, name: str) -> dict:
        if name not in ("medium", "expert"):
            raise KeyError(name)
        e = self.manifest.get(name)
        if e is None:
            raise ValueError(f"no {name} behaviour policy is shipped for {self.env_id}: "
                             f"{self.manifest.get('expert_missing_reason') or 'not in the manifest'}")
        return e

    def policy(self, name: str, stochastic: bool = True) -> NumpyPolicy:
        e = self.entry(name)
        return NumpyPolicy(load_policy(_verified(self.root, e["file"], e["sha256"]))[0], stochastic)

    def describe(self, name: str) -> dict:
        e = self.entry(name)
        return {"checkpoint": e["file"], "sha256": e["sha256"], "train_step": e["step"],
                "sampling_return_mean": e["stochastic_return_mean"], "sampling": True}

    def replay_segments(self, amount: int | None, by_episodes: bool) -> tuple[list[Segment], dict]:
        """Segments of a ``medium-replay`` dataset: uniform warm-up, then each checkpoint."""
        rp = self.manifest["medium_replay"]
        total = amount or rp["buffer_transitions"]
        shares = [rp["uniform_share"]] + [c["share"] for c in rp["checkpoints"]]
        counts = _apportion(total, shares)
        act_dim = env_info(self.env_id).act_dim
        segs = [Segment(uniform_policy(act_dim), counts[0], by_episodes)]
        for c, n in zip(rp["checkpoints"], counts[1:]):
            path = _verified(self.root, c["file"], c["sha256"])
            segs.append(Segment(NumpyPolicy(load_policy(path)[0], True), n, by_episodes))
        desc = {"recipe": "uniform warm-up then shipped SAC checkpoints up to medium, each for its "
                          "share of the replay buffer", "unit": "episodes" if by_episodes else "transitions",
                "uniform": counts[0],
                "checkpoints": [{"checkpoint": c["file"], "train_step": c["step"], "amount": n}
                                for c, n in zip(rp["checkpoints"], counts[1:])]}
        return segs, desc


def _apportion(total: int, shares: list[float]) -> list[int]:
    """Integers proportional to ``shares`` summing to ``total`` (largest remainders)."""
    s = sum(shares)
    raw = [total * x / s for x in shares]
    out = [math.floor(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1
    return out


def behavior_set(env_key: str, root: str | Path | None = None) -> BehaviorSet:
    """The behaviour set of ``env_key`` (shipped, or the folder ``root``)."""
    info = env_info(env_key)
    d = Path(root) if root is not None else SHIPPED_DIR / info.key
    mf = d / MANIFEST
    if not mf.is_file():
        have = shipped_envs()
        raise ValueError(
            f"no behaviour checkpoints for {info.gym_id} ({mf} missing); shipped: "
            f"{', '.join(have) or 'none'}. Train one with 'fedrl data train-behavior' and "
            f"'fedrl data ship-behavior', then pass --behavior-dir")
    manifest = json.loads(mf.read_text())
    if env_info(manifest["env_id"]).key != info.key:
        raise ValueError(f"{mf}: behaviour set is for {manifest['env_id']}, not {info.gym_id}")
    return BehaviorSet(d, manifest)


# -- choosing and exporting a set from a training run ----------------------------------------------

def ship(run_dir: str | Path, dest: str | Path, replay_checkpoints: int = 5, episodes: int = 10,
         candidates: int = 3, medium_fraction: float = 1 / 3, expert_min: float | None = None,
         log=print) -> dict:
    """Choose expert/medium/replay checkpoints from a ``train-behavior`` run and write a set.

    Candidates are re-measured (``episodes`` sampling episodes, float16 weights) before choosing:
    the ``candidates`` best by training-time return for expert; for medium, the ``candidates``
    earlier checkpoints closest to ``medium_fraction`` of the expert return. When the best
    checkpoint returns less than ``expert_min`` (default: ``EXPERT_MIN`` of the env, else 0) no expert is
    shipped, and medium aims at ``medium_fraction`` of D4RL's expert reference return instead.
    """
    run, dest = Path(run_dir), Path(dest)
    cfg = json.loads((run / "config.json").read_text())
    recs = [json.loads(x) for x in (run / "progress.jsonl").read_text().splitlines() if x.strip()]
    recs = list({r["step"]: r for r in recs}.values())  # a resumed run may repeat an eval
    if len(recs) < 2:
        raise ValueError(f"{run}: needs at least two evaluated checkpoints, found {len(recs)}")
    env_id = cfg["env_id"]
    info = env_info(env_id)
    if expert_min is None:
        expert_min = EXPERT_MIN.get(info.key, 0.0)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.safetensors"):
        old.unlink()

    def ckpt(step: int) -> Path:
        return run / "checkpoints" / f"step-{step:09d}.safetensors"

    def measure(step: int) -> tuple[torch.nn.Module, float, float]:
        pol = load_policy(ckpt(step))[0].half().float()  # exactly the weights that will ship
        r = stochastic_return(pol, env_id, episodes, seed=7919)
        log(f"  step {step:>8}: sampling return {r.mean:8.1f} ± {r.std:6.1f} over {episodes} episodes")
        return pol, r.mean, r.std

    log("expert candidates")
    top = sorted(recs, key=lambda r: r["stochastic_return_mean"], reverse=True)[:candidates]
    measured = {r["step"]: measure(r["step"]) for r in top}
    e_step = max(measured, key=lambda s: measured[s][1])
    e_ret = measured[e_step][1]
    has_expert = e_ret >= expert_min
    if has_expert:
        target = medium_fraction * e_ret
    else:
        target = medium_fraction * info.ref_max_score
        log(f"best sampling return {e_ret:.1f} < {expert_min:.0f}: no expert shipped; medium aims at "
            f"{medium_fraction:.2f} x D4RL's expert reference ({info.ref_max_score})")
        e_step = max(r["step"] for r in recs) + 1
    log(f"medium candidates (target {target:.1f})")
    start = cfg["sac"]["start_steps"]
    earlier = [r for r in recs if start < r["step"] < e_step]
    if not earlier:
        raise ValueError(f"{run}: no checkpoint between the random warm-up (step {start}) and the "
                         f"expert (step {e_step}) to serve as medium; train longer")
    near = sorted(earlier, key=lambda r: abs(r["stochastic_return_mean"] - target))[:candidates]
    m_measured = {r["step"]: measure(r["step"]) for r in near}
    m_step = min(m_measured, key=lambda s: abs(m_measured[s][1] - target))

    def write(name: str, pol, step: int, ret: float, std: float) -> dict:
        path = save_policy(pol, dest / f"{name}.safetensors",
                           {"env_id": env_id, "step": step, "stochastic_return_mean": ret},
                           dtype=torch.float16)
        return {"file": path.name, "sha256": _sha256(path), "step": step,
                "stochastic_return_mean": round(ret, 2), "stochastic_return_std": round(std, 2),
                "eval_episodes": episodes}

    steps_upto = sorted(r["step"] for r in recs if start < r["step"] <= m_step)
    k = min(replay_checkpoints, len(steps_upto))
    chosen = sorted({steps_upto[round(i * (len(steps_upto) - 1) / max(k - 1, 1))] for i in range(k)})
    if m_step not in chosen:
        chosen[-1] = m_step
    replay, prev = [], start
    for s in chosen:
        pol = load_policy(ckpt(s))[0].half().float()
        path = save_policy(pol, dest / f"replay-{s:09d}.safetensors", {"env_id": env_id, "step": s},
                           dtype=torch.float16)
        replay.append({"file": path.name, "sha256": _sha256(path), "step": s,
                       "share": (s - prev) / m_step})
        prev = s
    by_step = {r["step"]: r for r in recs}
    manifest = {
        "env_id": env_id,
        "expert": write("expert", *measured[e_step][:1], e_step, *measured[e_step][1:]) if has_expert else None,
        "expert_missing_reason": "" if has_expert else
            f"best checkpoint's sampling return {e_ret:.1f} is below {expert_min:.0f}; train longer",
        "medium": write("medium", *m_measured[m_step][:1], m_step, *m_measured[m_step][1:]),
        "medium_replay": {"buffer_transitions": m_step, "uniform_share": start / m_step,
                          "checkpoints": replay},
        "training": {"sac": cfg["sac"], "steps_trained": max(by_step),
                     "wall_seconds": by_step[max(by_step)]["wall_seconds"],
                     "wall_seconds_to_expert": by_step[e_step]["wall_seconds"] if has_expert else None,
                     "command": f"fedrl data train-behavior --env {env_id} --steps {cfg['sac']['total_steps']}"
                                f" --seed {cfg['sac']['seed']} --out RUN",
                     # the training's own (each progress record has it); older runs: unknown
                     "torch_threads": sorted({r["torch_threads"] for r in recs if "torch_threads" in r})
                                      or None},
        "selection": {"medium_fraction": medium_fraction, "medium_target": round(target, 1),
                      "expert_min": expert_min, "eval_episodes": episodes,
                      "candidates": candidates, "dtype": "float16"},
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"wrote {dest}: expert {f'step {e_step} ({e_ret:.1f})' if has_expert else 'none'}, medium step {m_step} "
        f"({m_measured[m_step][1]:.1f}), replay {chosen}")
    return manifest


__all__ = ["ENVS", "SHIPPED_DIR", "BehaviorSet", "behavior_set", "ship", "shipped_envs"]
