"""A simulated run's checkpoints: after every round, everything the next round starts from (the
global model, every agent's learner with its critics, optimiser moments and RNG, the curve so
far) in one safetensors file written atomically, and each agent that finished its local round in
the round a run was stopped in; reading them back, refusing those of another configuration."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from fedrl.federation.round import LocalResult, LocalTrainer
from fedrl.federation.simconfig import SimConfig

CHECKPOINT = "checkpoint.safetensors"
# Agents that finished their local round in the round a run was stopped in, one file each: a
# resumed run takes them as they are and trains only the others (a DRPO agent's 1,000 local steps
# at the paper's sizes are minutes on one core; a stop mid-round loses at most one agent's).
AGENTS_IN_ROUND = "agents-in-round"


def has_checkpoint(out: str | Path) -> bool:
    """Whether ``out`` holds a stopped run's state to continue from: a round's checkpoint, or
    agents already trained in its first round."""
    out = Path(out)
    return (out / CHECKPOINT).exists() or any((out / AGENTS_IN_ROUND).glob("agent-*.safetensors"))


def same_data(recorded: list[dict[str, Any]], shards: list[dict[str, Any]]) -> None:
    """Refuse to continue a run on data other than it started on (ValueError naming the agents):
    the dataset is made again on each machine, and a stopped run may be resumed on another.
    ``recorded`` is the run's ``config.json`` shards; a record without a digest (older runs) is
    held to its episodes and row count only."""
    keys = ("agent", "episodes", "transitions")
    bad = [str(new["agent"]) for old, new in zip(recorded, shards)
           if any(old.get(k) != new.get(k) for k in keys) or old.get("sha256", new.get("sha256")) != new.get("sha256")]
    if len(recorded) != len(shards) or bad:
        which = f"agent(s) {', '.join(bad)}" if bad else f"{len(recorded)} agents then, {len(shards)} now"
        raise ValueError(f"this run started on other data ({which}: other episodes or contents than the dataset "
                         "gives now); remake the dataset as it was, or start the run again in another folder (--out)")


def write_checkpoint(out: Path, cfg: SimConfig, r: int, curve: list, global_state: dict[str, torch.Tensor],
                     agent_states: list[dict[str, torch.Tensor]], learners: dict[str, Any], engine: str) -> None:
    """Everything round ``r + 1`` starts from, in one safetensors file written atomically
    (``learners``: prefix -> a learner, each agent's or the whole batch's)."""
    tensors = {f"global/{k}": v for k, v in global_state.items()}
    if cfg.own_policies:
        tensors |= {f"agent_state/{i}/{k}": v for i, st in enumerate(agent_states) for k, v in st.items()}
    for prefix, learner in learners.items():
        tensors |= {f"{prefix}{k}": v for k, v in learner.checkpoint().items()}
    meta = {"round": r, "curve": curve, "sim": settings(cfg), "engine": engine}
    atomic_save(tensors, meta, out / CHECKPOINT)


def settings(cfg: SimConfig) -> dict[str, Any]:
    """``cfg`` as a checkpoint records it (JSON types), to compare with the settings of a resume."""
    return json.loads(json.dumps(cfg.as_dict()))


def recorded_settings(have: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's recorded settings with the options added since it was written at their
    defaults (each new option's default leaves runs as they were: a run checkpointed before it
    existed ran that way), so a stopped run resumes under a newer code's settings."""
    from fedrl.algos import BCConfig, DRPOConfig

    defaults = settings(SimConfig(drpo=DRPOConfig(), bc=BCConfig()))
    out = {**defaults, **have}
    for k in ("drpo", "bc"):
        if isinstance(have.get(k), dict):
            out[k] = {**defaults[k], **have[k]}
    return out


def atomic_save(tensors: dict[str, torch.Tensor], meta: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp),
              {"fedrl_checkpoint": json.dumps(meta)})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)


def write_agent_checkpoint(out: Path, cfg: SimConfig, r: int, res: LocalResult, trainer: LocalTrainer) -> None:
    """Agent ``res.agent``'s finished local round ``r``: its learner (to continue from) and what
    it returned (its update and metrics), in one file written atomically."""
    folder = out / AGENTS_IN_ROUND
    folder.mkdir(exist_ok=True)
    tensors = {f"learner/{k}": v for k, v in trainer.learner.checkpoint().items()}
    tensors |= {f"state/{k}": v for k, v in res.state.items()}
    meta = {"round": r, "agent": res.agent, "num_samples": res.num_samples, "metrics": res.metrics,
            "seconds": res.seconds, "sim": settings(cfg)}
    atomic_save(tensors, meta, folder / f"agent-{res.agent}.safetensors")


def clear_agent_checkpoints(out: Path) -> None:
    folder = out / AGENTS_IN_ROUND
    if folder.is_dir():
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()


def resume_agents(out: Path, cfg: SimConfig, r: int, trainers: list[LocalTrainer]) -> dict[int, LocalResult]:
    """The agents whose local round ``r`` finished before the run stopped: each one's learner
    restored into ``trainers`` and its result, by agent. Files of another round (left by a stop
    between a round's checkpoint and their removal) are ignored; one of other settings is refused."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    want = settings(cfg)
    done: dict[int, LocalResult] = {}
    by_agent = {tr.agent: tr for tr in trainers}
    for path in sorted((out / AGENTS_IN_ROUND).glob("agent-*.safetensors")):
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["fedrl_checkpoint"])
        if recorded_settings(meta["sim"]) != want:
            raise ValueError(f"{path} is a checkpoint of another configuration (differs in "
                             f"{', '.join(differences(recorded_settings(meta['sim']), want))}); "
                             "pass another --out or the same settings")
        if meta["round"] != r or meta["agent"] not in by_agent:
            continue
        tensors = load_file(str(path))
        learner = {k.removeprefix("learner/"): v for k, v in tensors.items() if k.startswith("learner/")}
        state = {k.removeprefix("state/"): v for k, v in tensors.items() if k.startswith("state/")}
        by_agent[meta["agent"]].learner.restore(learner)
        done[meta["agent"]] = LocalResult(meta["agent"], state, meta["num_samples"], meta["metrics"], meta["seconds"])
    return done


def resume(out: Path, cfg: SimConfig, learners: dict[str, Any], n_agents: int,
           engine: str) -> tuple[int, list, dict, list]:
    """Read ``out``'s checkpoint into ``learners``; (rounds done, curve, global state, agent states)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = out / CHECKPOINT
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["fedrl_checkpoint"])
    want = settings(cfg)
    if recorded_settings(meta["sim"]) != want:
        diff = differences(recorded_settings(meta["sim"]), want)
        raise ValueError(f"{path} is a checkpoint of another configuration (differs in {', '.join(diff)}); "
                         "pass another --out or the same settings")
    if meta.get("engine", "per-agent") != engine:
        raise ValueError(f"{path} is a checkpoint of the {meta.get('engine', 'per-agent')} engine; this run uses the "
                         f"{engine} engine: pass --engine {meta.get('engine', 'per-agent')} to continue it")
    tensors = load_file(str(path))

    def part(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

    global_state = part("global/")
    agent_states = ([part(f"agent_state/{i}/") for i in range(n_agents)] if cfg.own_policies
                    else [global_state] * n_agents)
    for prefix, learner in learners.items():
        learner.restore(part(prefix))
    return int(meta["round"]), list(meta["curve"]), global_state, agent_states


def differences(have: dict, want: dict) -> list[str]:
    """The settings that differ, nested ones as ``drpo.lambda2``."""
    out = []
    for k in sorted(set(have) | set(want)):
        a, b = have.get(k), want.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{k}.{f}" for f in sorted(set(a) | set(b)) if a.get(f) != b.get(f)]
        elif a != b:
            out.append(k)
    return out
