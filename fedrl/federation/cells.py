"""Many runs (the paper's cells) trained as one batched model on one device.

A paper table is cells (method x dataset x seed, or a study's values) of the same shapes. Here
every agent of every cell is one member of a batched learner (:class:`BatchedTrainer`): the
DRPO family (DRPO, Fed-CQL, CQL alone: CQL is DRPO with lambdas 0) in one batch, Fed-BC in
another. Each round, each cell averages its own agents (FedAvg over the cell's members; the
``cql`` baseline keeps each agent's own policy), and every cell's policies are evaluated in one
vectorised pass (:func:`fedrl.envs.evaluation.evaluate_many`, with the seeds
:func:`fedrl.federation.simulate.run` uses, so scores stay comparable with every committed
result). Each cell writes its ``rounds.jsonl`` as :func:`~fedrl.federation.simulate.run` does;
every round is checkpointed and a stopped run continues after its last round, bit for bit.

What is not the per-agent simulation's: each member's random draws come from its batch's
generator (so a cell's numbers are not the per-agent engine's draw for draw), and the cells
share the batch's rounds and local steps (a ValueError names a cell that does not).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedrl.algos import BCConfig
from fedrl.algos.base import POLICY
from fedrl.common.device import derive_seed, resolve_device
from fedrl.common.lifetime import child_pool
from fedrl.data.normalize import ObsStats, agent_normalizer, global_normalizer
from fedrl.envs.evaluation import evaluate_many
from fedrl.federation.round import (
    SEED_EVAL,
    BatchedTrainer,
    algo_config,
    initial_global_state,
)
from fedrl.federation.machine import Open, Plan, RoundMachine, Update
from fedrl.federation.checkpoint import atomic_save, recorded_settings, same_data, settings
from fedrl.federation.simconfig import SimConfig
from fedrl.federation.shards import load_shards
from fedrl.federation.simulate import curve_point, round_evaluation, round_record

CHECKPOINT = "cells-checkpoint.safetensors"
SHARED = ("rounds", "local_steps", "eval_every", "eval_episodes", "federate", "obs_norm", "device", "grad_norms_every")


@dataclass(frozen=True)
class Cell:
    """One run of a table: its name and its simulation settings."""

    key: str
    cfg: SimConfig


@dataclass
class _CellState:
    cell: Cell
    hp: Any
    agents: int
    sizes: list[int]
    machine: RoundMachine  # the cell's rounds, as simulate and the services make them
    eval_seed: int
    curve: list[dict[str, Any]]
    shards: list[dict[str, Any]]
    data_return: float

    @property
    def global_state(self) -> dict[str, torch.Tensor]:
        return self.machine.global_state

    @property
    def agent_states(self) -> list[dict[str, torch.Tensor]]:
        return list(self.machine.agent_states)


def check_cells(cells: Sequence[Cell]) -> None:
    """Cells batch together when they share rounds, local steps, evaluation and the federation's
    shape; keys must be unique."""
    if not cells:
        raise ValueError("no cells to run")
    private = [c.key for c in cells if c.cfg.dp_clip]
    if private:
        raise ValueError(f"cells {', '.join(private)}: differential privacy clips each agent's update in the "
                         "per-agent engine (fedrl.federation.simulate), not in a batch")
    secure = [c.key for c in cells if c.cfg.secagg_threshold]
    if secure:
        raise ValueError(f"cells {', '.join(secure)}: secure aggregation runs in the per-agent engine "
                         "(fedrl.federation.simulate), not in a batch")
    keys = [c.key for c in cells]
    if len(set(keys)) != len(keys):
        raise ValueError(f"cell keys repeat: {sorted(k for k in set(keys) if keys.count(k) > 1)}")
    first = cells[0].cfg
    for c in cells[1:]:
        for name in SHARED:
            if getattr(c.cfg, name) != getattr(first, name):
                raise ValueError(f"cell {c.key}: {name} {getattr(c.cfg, name)!r} differs from cell {cells[0].key}'s "
                                 f"{getattr(first, name)!r}; cells of one batch share {', '.join(SHARED)}")


def run_cells(cells: Sequence[Cell], work: str | Path, log: Callable[[str], None] | None = None,
              deadline: float | None = None, round_seconds_hint: float | None = None,
              eval_workers: int = 1, trace_every: int = 0, draws: str = "batch") -> dict[str, dict[str, Any]]:
    """Train ``cells`` together under ``work`` (``work/<key>/rounds.jsonl`` for each, one checkpoint
    for all). ``deadline`` (``time.time()``): no round starts that would end after it (a round's
    time is the last one's, or ``round_seconds_hint`` before the first). ``eval_workers`` > 1
    splits each round's evaluation over that many processes (a GPU machine's idle cores).
    ``trace_every``: each agent's round record also holds its diagnostics' means over every
    that many local steps (``trace``). ``draws="per-agent"``: each agent draws its minibatches and
    noise as its cell's per-agent simulation does (:class:`BatchedTrainer`), so every cell computes
    its own ``fedrl simulate`` run up to float rounding (the check of this module).
    Returns per cell ``{"curve", "final", "best", "rounds_done", "finished", ...}``, and once the
    last round is done, ``"final_long"`` for a cell whose ``final_eval_episodes`` asks for it."""
    check_cells(cells)
    log = log or print
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    first = cells[0].cfg
    device = resolve_device(first.device)
    federate_critic = first.federate == "policy+critic"
    states: list[_CellState] = []
    groups: dict[str, list[tuple[int, int]]] = {"drpo": [], "bc": []}  # (cell, agent) members
    group_data: dict[str, tuple[list, list, list, list, list]] = {"drpo": ([], [], [], [], []),
                                                                    "bc": ([], [], [], [], [])}
    env = None
    for ci, c in enumerate(cells):
        cfg = c.cfg
        shards, e = load_shards(cfg.datasets, cfg.agents, cfg.trajectories, cfg.seed, cfg.env, lambda m: None,
                                cfg.transitions)
        if env is not None and e.key != env.key:
            raise ValueError(f"cell {c.key} is on {e.gym_id}, others on {env.gym_id}: one environment per batch")
        env = e
        stats = [ObsStats.of(s.transitions.obs) for s in shards]
        g_norm = global_normalizer(cfg.obs_norm, stats)
        norms = [agent_normalizer(cfg.obs_norm, st, g_norm) for st in stats]
        hp = algo_config(cfg.algo, cfg.drpo, cfg.bc)
        obs_dim, act_dim = shards[0].transitions.obs.shape[1], shards[0].transitions.actions.shape[1]
        g0 = initial_global_state(hp, obs_dim, act_dim, cfg.seed, *g_norm, federate_critic)
        from fedrl.ops.plotting import episode_return_mean

        machine = RoundMachine(Plan.of(cfg, [s.agent for s in shards]), g0)
        states.append(_CellState(c, hp, len(shards), [len(s.transitions) for s in shards], machine,
                                 derive_seed(cfg.seed, SEED_EVAL) % 2**31, [],
                                 [s.record() for s in shards],
                                 float(np.mean([episode_return_mean(s.transitions.rewards, s.transitions.episode)
                                                for s in shards]))))
        g = "bc" if isinstance(hp, BCConfig) else "drpo"
        for s, nm in zip(shards, norms):
            groups[g].append((ci, s.agent))
            agents, cfgs, trs, ns, seeds = group_data[g]
            agents.append(s.agent), cfgs.append(hp), trs.append(s.transitions), ns.append(nm), seeds.append(cfg.seed)
    trainers = {g: BatchedTrainer(*group_data[g][:4], group_data[g][4], device, federate_critic,
                                  local_normalizer=first.obs_norm == "local", rng_stream=k, draws=draws,
                                  grad_norms_every=first.grad_norms_every)
                for k, g in enumerate(("drpo", "bc")) if groups[g]}
    done = 0
    ck = work / CHECKPOINT
    if ck.exists():
        done = _resume(ck, cells, states, trainers)
        log(f"resuming {len(cells)} cells after round {done} of {first.rounds}")
    for st in states:
        folder = work / st.cell.key
        folder.mkdir(exist_ok=True)
        lines = (folder / "rounds.jsonl").read_text().splitlines()[:done] if done and (folder / "rounds.jsonl").exists() else []
        (folder / "rounds.jsonl").write_text("".join(x + "\n" for x in lines))
    log(f"{len(cells)} cells on {env.gym_id}: " + ", ".join(f"{g} batch of {len(m)}" for g, m in groups.items() if m)
        + f", {first.rounds} rounds x {first.local_steps} local steps, device {device}")
    last_round_s = round_seconds_hint
    pool = None
    if eval_workers > 1:
        pool = child_pool(eval_workers)
    try:
        done = _rounds(states, trainers, groups, cells, work, ck, env, done, deadline, last_round_s, pool, log,
                       trace_every)
        long = _final_long(states, env.gym_id, done, pool) if done == first.rounds else {}
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    out = {}
    for st in states:
        curve = st.curve
        out[st.cell.key] = {"curve": curve, "final": curve[-1] if curve and done == first.rounds else None,
                            "best": max(curve, key=lambda c: c["return_mean"]) if curve else None,
                            "rounds_done": done, "finished": done == first.rounds, "shards": st.shards,
                            "data_return": st.data_return, "global_state": st.global_state,
                            "agent_states": st.agent_states,
                            **({"final_long": long[st.cell.key]} if st.cell.key in long else {})}
    return out


def _rounds(states, trainers, groups, cells, work: Path, ck: Path, env, done: int, deadline, last_round_s,
            pool, log, trace_every: int = 0) -> int:
    """The rounds after ``done``, until the last or the deadline; the last round finished."""
    first = cells[0].cfg
    actions = [st.machine.begin() for st in states]
    while all(isinstance(a, Open) for a in actions):  # the cells' machines open their rounds together
        r = actions[0].round
        if any(a.round != r for a in actions):
            raise RuntimeError(f"the cells' machines opened rounds {[a.round for a in actions]}: one batch trains one round")
        if deadline is not None and last_round_s is not None and time.time() + last_round_s > deadline:
            log(f"stopping before round {r}: the deadline leaves less than a round ({last_round_s:.0f}s)")
            break
        t0 = time.perf_counter()
        results: dict[tuple[int, int], Any] = {}
        for g, tr in trainers.items():
            inputs = [states[ci].agent_states[a] if states[ci].cell.cfg.own_policies else states[ci].global_state
                      for ci, a in groups[g]]
            for (ci, a), res in zip(groups[g], tr.train_round(inputs, first.local_steps, trace_every=trace_every)):
                results[(ci, a)] = res
        train_s = time.perf_counter() - t0
        recs, actions = [], []
        for ci, st in enumerate(states):
            mine = [results[(ci, a)] for a in range(st.agents)]
            for res in mine:
                st.machine.take(res.agent, r, st.machine.version, Update(res.state, res.num_samples))
            closed = st.machine.close()
            actions.append(st.machine.commit(closed))
            recs.append(round_record(st.cell.cfg, closed, mine, train_s))
        if first.eval_episodes and (r % first.eval_every == 0 or r == first.rounds):
            _evaluate(states, recs, env.gym_id, first.eval_episodes, pool)
        for st, rec in zip(states, recs):
            rec["seconds"] = time.perf_counter() - t0
            with open(work / st.cell.key / "rounds.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
        _checkpoint(ck, r, cells, states, trainers)
        last_round_s = time.perf_counter() - t0
        scores = [st.curve[-1]["score_mean"] for st in states if st.curve and st.curve[-1]["round"] == r]
        log(f"round {r:3d}/{first.rounds}: {len(cells)} cells in {last_round_s:.1f}s (training {train_s:.1f}s)"
            + (f", scores {min(scores):.1f}-{max(scores):.1f}" if scores else ""))
        done = r
    return done


def _evaluations(states: list[_CellState], env_id: str, episodes: int, seed_of, pool=None) -> list[dict[str, Any]]:
    """Every given cell's policy (a ``cql`` cell's every agent's) over ``episodes`` from seed
    ``seed_of(state)``, in one vectorised pass (or one per worker of ``pool``, the policies dealt
    out in contiguous chunks): each cell's round evaluation, in order."""
    policies, seeds, owner = [], [], []
    for ci, st in enumerate(states):
        mine = st.agent_states if st.cell.cfg.own_policies else [st.global_state]
        for s in mine:
            policies.append({k[len(POLICY) + 1:]: v for k, v in s.items() if k.startswith(POLICY + ".")})
            seeds.append(seed_of(st))
            owner.append(ci)
    if pool is None:
        results = evaluate_many(policies, env_id, episodes, seeds)
    else:
        k = -(-len(policies) // pool._max_workers)
        futures = [pool.submit(evaluate_many, policies[i:i + k], env_id, episodes, seeds[i:i + k])
                   for i in range(0, len(policies), k)]
        results = [x for f in futures for x in f.result()]
    return [round_evaluation(st.cell.cfg.own_policies, [res.as_dict() for res, o in zip(results, owner) if o == ci])
            for ci, st in enumerate(states)]


def _evaluate(states: list[_CellState], recs: list[dict], env_id: str, episodes: int, pool=None) -> None:
    """Each cell's round evaluation, on the episodes ``fedrl simulate`` evaluates that round on."""
    for st, rec, ev in zip(states, recs, _evaluations(states, env_id, episodes, lambda st: st.eval_seed, pool)):
        rec["eval"] = ev
        st.curve.append(curve_point(rec["round"], rec["eval"]))


def _final_long(states: list[_CellState], env_id: str, rounds: int, pool=None) -> dict[str, dict[str, Any]]:
    """Per cell with ``final_eval_episodes``, its final policy again over that many episodes of
    their own (``fedrl simulate``'s ``final_long``: the same seed, so the same episodes)."""
    out: dict[str, dict[str, Any]] = {}
    for n in sorted({st.cell.cfg.final_eval_episodes for st in states} - {0}):
        mine = [st for st in states if st.cell.cfg.final_eval_episodes == n]
        evs = _evaluations(mine, env_id, n, lambda st: derive_seed(st.cell.cfg.seed, SEED_EVAL, 1) % 2**31, pool)
        out |= {st.cell.key: {"episodes": n, **curve_point(rounds, ev)} for st, ev in zip(mine, evs)}
    return out


def _checkpoint(path: Path, r: int, cells: Sequence[Cell], states: list[_CellState], trainers: dict) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for ci, st in enumerate(states):
        tensors |= {f"global/{ci}/{k}": v for k, v in st.global_state.items()}
        if st.cell.cfg.own_policies:
            tensors |= {f"agent_state/{ci}/{i}/{k}": v for i, s in enumerate(st.agent_states) for k, v in s.items()}
    for g, tr in trainers.items():
        tensors |= {f"group/{g}/{k}": v for k, v in tr.checkpoint().items()}
    meta = {"round": r, "cells": [{"key": c.key, "sim": settings(c.cfg)} for c in cells],
            "curves": [st.curve for st in states], "shards": [st.shards for st in states]}
    atomic_save(tensors, meta, path)


def _resume(path: Path, cells: Sequence[Cell], states: list[_CellState], trainers: dict) -> int:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["fedrl_checkpoint"])
    want = [{"key": c.key, "sim": settings(c.cfg)} for c in cells]
    if [{"key": c["key"], "sim": recorded_settings(c["sim"])} for c in meta["cells"]] != want:
        raise ValueError(f"{path} is a checkpoint of other cells or settings; pass another work folder")
    for c, recorded, st in zip(cells, meta.get("shards", []), states):  # none in older checkpoints
        try:
            same_data(recorded, st.shards)
        except ValueError as e:
            raise ValueError(f"cell {c.key}: {e}") from None
    tensors = load_file(str(path))

    def part(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

    done = int(meta["round"])
    for ci, st in enumerate(states):
        g = part(f"global/{ci}/")
        own = [part(f"agent_state/{ci}/{i}/") for i in range(st.agents)] if st.cell.cfg.own_policies else None
        st.machine = RoundMachine(st.machine.plan, g, done, done, own)
        st.curve = list(meta["curves"][ci])
    for g, tr in trainers.items():
        tr.restore(part(f"group/{g}/"))
    return done
