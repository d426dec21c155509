"""A SAC run's compact resume state, small enough to commit, from which a new machine continues.

A behaviour policy's SAC run takes longer than a machine lives here (Ant-v5: hours of one core),
and its run folder (``runs/``) does not survive the machine. ``fedrl data train-behavior --keep
DIR`` writes, at every evaluation, what continuing needs and nothing the simulator can recompute:

- ``agent-<step>.safetensors``: policy, critics, target critics, temperature, every Adam moment
  and the torch generator's state (float32, as trained: about 3.5 MB at 2 x 256);
- ``steps-<from>-<to>.npz``: the actions taken (float32) and the rewards received, in chunks of
  ``CHUNK`` steps; a full chunk is never rewritten, so a repository stores each step once
  (36 bytes a step for Ant-v5);
- ``meta.json``: the step, the counters, the evaluations so far, the numpy stream's state, the
  seeded resets, and each chunk's SHA-256.

The replay buffer, the environment's state and the episode in progress are not stored: resuming
replays the actions through the environment from the run's seeded reset, which rebuilds every
transition, and checks each reward against the stored one. MuJoCo is deterministic, so on the same
MuJoCo build the rebuilt state is the run's own and training continues exactly as if uninterrupted
(tested). Where another build steps differently, the log names the first step that differs and
training goes on from the rebuilt transitions: genuine transitions of the same actions, and the
same networks, optimiser moments and random streams.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from safetensors.torch import load_file, save_file

CHUNK = 50_000
META = "meta.json"


def read_meta(keep: str | Path) -> dict | None:
    """The kept state's ``meta.json``, or ``None`` when ``keep`` holds none yet."""
    p = Path(keep) / META
    return json.loads(p.read_text()) if p.exists() else None


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _chunk_name(lo: int, hi: int) -> str:
    return f"steps-{lo:09d}-{hi:09d}.npz"


def export(keep: str | Path, agent, buf, step: int, meta: dict) -> None:
    """Write the state at ``step`` into ``keep``: the new agent file and the chunks since the last
    export, then ``meta.json`` (the commit point), then delete what it no longer names."""
    keep = Path(keep)
    keep.mkdir(parents=True, exist_ok=True)
    old = read_meta(keep) or {"chunks": []}
    chunks = [c for c in old["chunks"] if c["to"] - c["from"] == CHUNK and c["to"] <= step]
    lo = chunks[-1]["to"] if chunks else 0
    while lo < step:
        hi = min(step, (lo // CHUNK + 1) * CHUNK)
        name = _chunk_name(lo, hi)
        tmp = keep / (name + ".tmp.npz")
        np.savez_compressed(tmp, act=buf.data["act"][lo:hi], rew=buf.data["rew"][lo:hi])
        os.replace(tmp, keep / name)
        chunks.append({"file": name, "from": lo, "to": hi, "sha256": _sha(keep / name)})
        lo = hi
    agent_file = f"agent-{step:09d}.safetensors"
    save_file(agent.resume_tensors(), str(keep / agent_file))
    doc = {**{k: v for k, v in meta.items() if k != "files"}, "agent": agent_file,
           "agent_sha256": _sha(keep / agent_file), "chunks": chunks}
    tmp = keep / (META + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, keep / META)
    named = {agent_file, META} | {c["file"] for c in chunks}
    for f in keep.iterdir():
        if f.is_file() and f.name not in named:
            f.unlink()


def load(keep: str | Path, meta: dict):
    """The kept agent tensors, and every step's action and reward, each file checked against the
    SHA-256 ``meta.json`` gives (a damaged or missing file is named)."""
    keep = Path(keep)

    def checked(name: str, sha: str) -> Path:
        p = keep / name
        if not p.exists():
            raise FileNotFoundError(f"{keep}: the kept state names {name}, which is missing")
        if _sha(p) != sha:
            raise ValueError(f"{p}: its SHA-256 differs from the one {META} records (damaged or replaced)")
        return p

    tensors = load_file(str(checked(meta["agent"], meta["agent_sha256"])))
    acts, rews, at = [], [], 0
    for c in meta["chunks"]:
        if c["from"] != at:
            raise ValueError(f"{keep}: the kept steps jump from {at} to {c['from']}")
        with np.load(checked(c["file"], c["sha256"]), allow_pickle=False) as z:
            acts.append(z["act"])
            rews.append(z["rew"])
        at = c["to"]
    if at != meta["step"]:
        raise ValueError(f"{keep}: the kept steps end at {at}, the state is at step {meta['step']}")
    actions = np.concatenate(acts) if acts else np.zeros((0, 1), np.float32)
    rewards = np.concatenate(rews) if rews else np.zeros(0, np.float32)
    return tensors, actions, rewards
