"""In-process federation: the same round logic as the services, without a network.

``fedrl simulate`` runs this. Each round: every agent adopts the global policy, trains locally,
returns its parameters; the server averages them (``cql``: no server, each agent alone).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedrl.algos.base import POLICY, load_prefixed
from fedrl.algos.config import config_to_dict
from fedrl.algos.nets import TanhGaussianPolicy
from fedrl.algos.policy_io import save_policy
from fedrl.common.device import derive_seed, resolve_device, seed_everything
from fedrl.common.progress import Progress
from fedrl.data.normalize import ObsStats, agent_normalizer, global_normalizer
from fedrl.envs.evaluation import evaluate
from fedrl.federation.checkpoint import (
    CHECKPOINT,
    clear_agent_checkpoints,
    has_checkpoint,
    resume,
    resume_agents,
    same_data,
    write_agent_checkpoint,
    write_checkpoint,
)
from fedrl.federation.round import (
    DRAWS,
    SEED_EVAL,
    BatchedTrainer,
    LocalResult,
    LocalTrainer,
    algo_config,
    initial_global_state,
)
from fedrl.federation.machine import (
    Closed,
    Failed,
    Gathered,
    Open,
    Plan,
    RoundMachine,
    Stopped,
    Update,
    mean_metrics,
    resumed_clip,
)
from fedrl.federation.privacy import ADAPTIVE_RECORD, agent_clip, task_clip
from fedrl.federation.shards import load_shards, parse_source  # noqa: F401 - re-exported for the simulator's users
from fedrl.federation.simconfig import ENGINES, SimConfig  # noqa: F401 - ENGINES re-exported



def resolve_engine(engine: str, device: torch.device) -> str:
    """``auto``: the batched model on a GPU, where one learner leaves the device idle (1.4% of an
    H200's FP32 rate) and a batch fills it; one learner at a time on the CPU, where batching does
    not pay (``python -m benchmarks.system.throughput batched``: BENCHMARKS.md)."""
    if engine not in ENGINES:
        raise ValueError(f"--engine: choose {', '.join(ENGINES)}, got {engine!r}")
    if engine == "auto":
        return "batched" if device.type == "cuda" else "per-agent"
    return engine

def refuse_a_used_folder(out: str | Path, markers: tuple[str, ...]) -> None:
    """Raise (naming them) if ``out`` holds any of ``markers``: a run's results are never written
    over by another's."""
    held = [n for n in markers if (Path(out) / n).exists()]
    if held:
        raise ValueError(f"{out} already holds a run ({', '.join(held)}): pass another --out or remove it")


def run(cfg: SimConfig, out: str | Path, log: Callable[[str], None] | None = None,
        on_round: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
        checkpoint: bool = False, parallel_agents: int = 1, progress: bool = False,
        engine: str = "auto", draws: str = "batch", secure_drops: Mapping[int, Collection] | None = None
        ) -> dict[str, Any]:
    """Run the federation; write ``config.json``, ``rounds.jsonl``, ``summary.json``,
    ``learning_curve.png`` and the final ``global_policy.safetensors`` under ``out``.
    ``on_round(r, global_state)`` sees every new global model (the equivalence tests use it).

    With ``checkpoint``, the whole state (global model, every agent's learner with its critics,
    optimiser moments and RNG, the curve so far) is written to ``out/checkpoint.safetensors``
    after every round, and a run whose folder holds one continues after its last finished round,
    computing exactly what the uninterrupted run would have (tested).

    ``parallel_agents`` trains that many agents at once, one thread each (with one torch thread
    per process, as the benchmarks run, the agents' computations are independent: the results are
    bit-identical to one agent at a time, tested); two on two cores take ~0.56 of the time.

    ``engine``: ``per-agent`` trains each agent's own learner (the services' path, and the
    reference); ``batched`` trains every agent as one batched model (:class:`BatchedTrainer`: the
    same losses, each agent's own data and hyperparameters, its draws from the batch's generator);
    ``auto`` picks :func:`resolve_engine`'s. ``draws`` (batched engine): ``per-agent`` draws each
    agent's minibatches and noise as the per-agent engine does (:class:`BatchedTrainer`), so the
    two engines compute the same run up to float rounding.

    ``secure_drops`` (secure aggregation; the tests' dropouts): by round, the agents that leave
    after sharing their keys, so that its masked step closes at its deadline, as the services'
    clock closes it for an agent that stopped.

    Three parts: :func:`_set_up` (the agents' data and learners, the round machine's plan, where
    a checkpoint resumes), :func:`_rounds` (the machine's rounds, each written as
    :func:`round_record`'s row), :func:`_finish` (the final policy, its long evaluation, the summary)."""
    if parallel_agents < 1:
        raise ValueError(f"parallel agents must be >= 1, got {parallel_agents}")
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    engine = resolve_engine(engine, device)
    if engine == "batched" and parallel_agents > 1:
        raise ValueError("--parallel-agents runs the per-agent engine's agents in threads; the batched engine "
                         "trains them all in one model (pass --engine per-agent, or leave --parallel-agents out)")
    if draws not in DRAWS:
        raise ValueError(f"draws: choose {', '.join(DRAWS)}, got {draws!r}")
    if cfg.secagg_threshold:
        n_total = sum(parse_source(spec, cfg.agents)[1] for spec in cfg.datasets)
        if cfg.secagg_threshold > n_total:
            raise ValueError(f"--secagg-threshold {cfg.secagg_threshold}: more than the run's {n_total} agents")
    if engine == "batched" and cfg.dp_clip:
        raise ValueError("--set dp_clip: differential privacy clips each agent's update in the per-agent engine "
                         "(pass --engine per-agent)")
    seed_everything(cfg.seed)
    t_start = time.perf_counter()
    fed = _set_up(cfg, out, log, checkpoint, engine, draws, device)
    rounds_run, stopped = _rounds(fed, cfg, out, log, on_round, checkpoint, parallel_agents, progress, secure_drops)
    return _finish(fed, cfg, out, log, rounds_run, stopped, t_start)


@dataclass
class _Federation:
    """What a simulated run sets up once, and what its rounds carry on: the agents' data and
    learners, the round machine (made in :func:`_rounds`, or in :func:`_set_up` for round 0), the
    global state and the curve, from a checkpoint's round on."""

    shards: list
    env: Any
    hp: Any
    engine: str
    plan: Plan
    machine: RoundMachine | None
    trainers: list[LocalTrainer]
    batched: BatchedTrainer | None
    learners: dict[str, Any]
    global_state: dict[str, torch.Tensor]
    agent_states: list[dict[str, torch.Tensor]]
    curve: list[dict[str, Any]]
    done_rounds: int
    in_round: dict[int, LocalResult]  # agents of round done_rounds + 1 already trained
    lines: list[str]  # rounds.jsonl's rows of the rounds done
    eval_policy: TanhGaussianPolicy
    eval_seed: int

    @property
    def n_agents(self) -> int:
        return len(self.shards)

    def evaluate(self, state: dict[str, torch.Tensor], episodes: int, seed: int) -> dict[str, Any]:
        load_prefixed(self.eval_policy, state, POLICY)
        return evaluate(self.eval_policy, self.env.gym_id, episodes, seed).as_dict()


def _set_up(cfg: SimConfig, out: Path, log: Callable[[str], None], checkpoint: bool, engine: str, draws: str,
            device: torch.device) -> _Federation:
    """The agents' shards and learners, the round machine's plan (round 0's gathered moments in a
    secure pooled run), version 0 or a checkpoint's state, and ``config.json``."""
    shards, env = load_shards(cfg.datasets, cfg.agents, cfg.trajectories, cfg.seed, cfg.env, log, cfg.transitions)
    stats = [ObsStats.of(s.transitions.obs) for s in shards]
    obs_dim, act_dim = shards[0].transitions.obs.shape[1], shards[0].transitions.actions.shape[1]
    # the clock is notional: every round opens at 0 and a deadline (1) passes only for a dropout
    plan = replace(Plan.of(cfg, [agent_name(s.agent) for s in shards], samples=[len(s.transitions) for s in shards],
                           context=f"simulate/{cfg.seed}", obs_dim=obs_dim), round_timeout=1.0)
    machine: RoundMachine | None = None
    if plan.gather:  # round 0: the moments summed by the protocol, as the services gather them
        machine = RoundMachine(plan, None)
        g_norm, moments_rec = gather_moments(machine, stats)
    else:
        g_norm, moments_rec = global_normalizer(cfg.obs_norm, stats), None
    norms = [agent_normalizer(cfg.obs_norm, st, g_norm) for st in stats]
    hp = algo_config(cfg.algo, cfg.drpo, cfg.bc)
    federate_critic = cfg.federate == "policy+critic"
    batched: BatchedTrainer | None = None
    trainers: list[LocalTrainer] = []
    if engine == "batched":
        batched = BatchedTrainer([s.agent for s in shards], [hp] * len(shards), [s.transitions for s in shards],
                                 norms, cfg.seed, device, federate_critic, local_normalizer=cfg.obs_norm == "local",
                                 draws=draws, grad_norms_every=cfg.grad_norms_every)
        learners = {"batched/": batched}
    else:
        trainers = [
            LocalTrainer(s.agent, hp, s.transitions, m, sd, cfg.seed, device, federate_critic,
                         local_normalizer=cfg.obs_norm == "local", grad_norms_every=cfg.grad_norms_every,
                         update_clip=agent_clip(cfg))
            for s, (m, sd) in zip(shards, norms)
        ]
        learners = {f"learner/{i}/": tr.learner for i, tr in enumerate(trainers)}
    n_agents = len(shards)
    global_state = initial_global_state(hp, obs_dim, act_dim, cfg.seed, *g_norm, federate_critic)
    agent_states = [global_state] * n_agents  # the independent 'cql' baseline's own policies
    curve: list[dict[str, Any]] = []
    done_rounds = 0
    in_round: dict[int, LocalResult] = {}
    records = [s.record() for s in shards]  # each shard's digest, once
    if checkpoint and has_checkpoint(out):
        if (out / "summary.json").exists():
            raise ValueError(f"{out} holds a finished run (summary.json): nothing to resume")
        if (out / CHECKPOINT).exists():
            done_rounds, curve, global_state, agent_states = resume(out, cfg, learners, n_agents, engine)
        if engine == "per-agent":
            in_round = resume_agents(out, cfg, done_rounds + 1, trainers)
        if (out / "config.json").exists():
            same_data(json.loads((out / "config.json").read_text())["shards"], records)
        trained = f"; agents {', '.join(str(i + 1) for i in sorted(in_round))} of round {done_rounds + 1} " \
                  "already trained" if in_round else ""
        log(f"resuming {out} after round {done_rounds} of {cfg.rounds}{trained}")

    (out / "config.json").write_text(json.dumps({
        "sim": cfg.as_dict(), "algorithm_hparams": config_to_dict(hp), "env_id": env.gym_id,
        "device": str(device), "engine": engine,
        **({"secure_moments": moments_rec} if moments_rec else {}),
        "shards": records,
    }, indent=2))
    log(f"{cfg.algo}: {n_agents} agents x {cfg.trajectories} trajectories"
        f"{f' (at least {cfg.transitions} transitions each)' if cfg.transitions else ''} "
        f"({sum(len(s.transitions) for s in shards)} transitions) on {env.gym_id}, "
        f"{cfg.rounds} rounds x {cfg.local_steps} local steps, device {device}, {engine} engine")
    lines = (out / "rounds.jsonl").read_text().splitlines()[:done_rounds] if done_rounds else []
    return _Federation(shards, env, hp, engine, plan, machine, trainers, batched, learners, global_state, agent_states,
                       curve, done_rounds, in_round, lines,
                       TanhGaussianPolicy(obs_dim, act_dim, hp.hidden, hp.log_std_min, hp.log_std_max),
                       derive_seed(cfg.seed, SEED_EVAL) % 2**31)


def _rounds(fed: _Federation, cfg: SimConfig, out: Path, log: Callable[[str], None],
            on_round: Callable[[int, dict[str, torch.Tensor]], None] | None, checkpoint: bool, parallel_agents: int,
            progress: bool, secure_drops: Mapping[int, Collection] | None) -> tuple[int, str]:
    """The machine's rounds from ``fed``'s on, each trained, closed, committed, evaluated when due,
    written as a row of ``rounds.jsonl`` (and a checkpoint): the last round run, and why the run
    stopped early ("" when it did not)."""
    n_agents, trainers, in_round = fed.n_agents, fed.trainers, fed.in_round
    per_round = n_agents * cfg.local_steps
    bar = Progress(cfg.rounds * per_round, f"{cfg.algo}", "steps", initial=fed.done_rounds * per_round,
                   enabled=progress)

    def step_done(_i: int, _n: int) -> None:
        bar.update(1)

    noise_gen = None
    if cfg.dp_clip and cfg.dp_noise:
        from fedrl.federation.privacy import noise_generator

        noise_gen = noise_generator()
    machine = fed.machine
    if machine is not None and not fed.done_rounds:  # version 0 from round 0's moments
        action = machine.found(fed.global_state)
    else:
        machine = fed.machine = RoundMachine(fed.plan, fed.global_state, fed.done_rounds, fed.done_rounds,
                                             fed.agent_states, resumed_clip(fed.plan, last_metrics(fed.lines)))
        action = machine.begin()
    rounds_run = fed.done_rounds
    with bar, open(out / "rounds.jsonl", "w") as jl:
        jl.writelines(x + "\n" for x in fed.lines)  # a round after the checkpoint's is done again
        while isinstance(action, Open):
            r = action.round
            t0 = time.perf_counter()
            if (clip := task_clip(cfg, machine.clip, r)) is not None:  # the agents clip, to this round's norm
                for tr in trainers:
                    tr.update_clip = clip

            def train(i: int):
                if i in in_round:  # trained before the run was stopped: its learner is restored
                    if progress:
                        bar.update(cfg.local_steps)
                    return in_round.pop(i)
                res = trainers[i].train_round(machine.agent_states[i], cfg.local_steps,
                                              **({"progress": step_done} if progress else {}))
                if checkpoint:
                    write_agent_checkpoint(out, cfg, r, res, trainers[i])
                if cfg.local_steps >= 200:
                    log(f"  round {r}: agent {i + 1}/{len(trainers)} done in {res.seconds:.1f}s")
                return res

            if fed.batched is not None:
                results = fed.batched.train_round(list(machine.agent_states), cfg.local_steps,
                                                  progress=(lambda _i, _n: bar.update(n_agents)) if progress else None)
            elif parallel_agents > 1:
                with ThreadPoolExecutor(parallel_agents, thread_name_prefix="agent") as pool:
                    results = list(pool.map(train, range(n_agents)))
            else:
                results = [train(i) for i in range(n_agents)]
            if cfg.secagg_threshold:
                drops = [agent_name(i) for i in (secure_drops or {}).get(r, ())]
                closed, sa_rec = secure_round(machine, cfg, results, noise_gen, drops)
            else:
                for res in results:
                    machine.take(agent_name(res.agent), r, action.version, Update(res.state, res.num_samples))
                closed = machine.close(noise_gen)
            action = machine.commit(closed)
            fed.global_state, fed.agent_states = machine.global_state, list(machine.agent_states)
            if on_round is not None and not cfg.own_policies:
                on_round(r, fed.global_state)
            rec = round_record(cfg, closed, results, time.perf_counter() - t0,
                               sa_rec if cfg.secagg_threshold else None)
            rounds_run = r
            if cfg.eval_episodes and (r % cfg.eval_every == 0 or r == cfg.rounds):
                states = fed.agent_states if cfg.own_policies else [fed.global_state]
                rec["eval"] = round_evaluation(cfg.own_policies, [fed.evaluate(st, cfg.eval_episodes, fed.eval_seed)
                                                                  for st in states])
                fed.curve.append(curve_point(r, rec["eval"]))
            rec["seconds"] = time.perf_counter() - t0
            jl.write(json.dumps(rec) + "\n")
            jl.flush()
            if checkpoint:
                write_checkpoint(out, cfg, r, fed.curve, fed.global_state, fed.agent_states, fed.learners, fed.engine)
                clear_agent_checkpoints(out)  # round r is in the checkpoint: its agents' files are spent
            log(_round_line(r, cfg.rounds, rec))
            bar.note(f"round {r}/{cfg.rounds}" + (f", score {fed.curve[-1]['score_mean']:.1f}" if fed.curve else ""))
    stopped = action.message if isinstance(action, Stopped) else ""
    if stopped:
        log(stopped)
    return rounds_run, stopped


def _finish(fed: _Federation, cfg: SimConfig, out: Path, log: Callable[[str], None], rounds_run: int, stopped: str,
            t_start: float) -> dict[str, Any]:
    """The final policy saved, its long evaluation, ``summary.json`` and the learning curve."""
    curve, env, hp = fed.curve, fed.env, fed.hp
    final_states = fed.agent_states if cfg.own_policies else [fed.global_state]
    load_prefixed(fed.eval_policy, final_states[0], POLICY)
    save_policy(fed.eval_policy, out / "global_policy.safetensors",
                {"algo": cfg.algo, "env_id": env.gym_id, "hparams": config_to_dict(hp),
                 "note": "agent 0's policy (no global policy in 'cql')" if cfg.own_policies else "global"})
    summary = {
        "algo": cfg.algo, "env_id": env.gym_id, "agents": fed.n_agents, "rounds": cfg.rounds, "engine": fed.engine,
        "wall_seconds": time.perf_counter() - t_start,
        "final": curve[-1] if curve else None,
        "best": max(curve, key=lambda c: c["return_mean"]) if curve else None,
        "curve": curve,
    }
    if stopped:
        summary["stopped"] = stopped
    if cfg.dp_clip:
        summary["privacy"] = privacy_record(cfg, rounds_run, [])
    if cfg.final_eval_episodes:
        long_seed = derive_seed(cfg.seed, SEED_EVAL, 1) % 2**31  # episodes of their own, not the rounds'
        long = round_evaluation(cfg.own_policies, [fed.evaluate(st, cfg.final_eval_episodes, long_seed)
                                                   for st in final_states])
        summary["final_long"] = {"episodes": cfg.final_eval_episodes, **curve_point(rounds_run, long)}
        log(f"final policy over {cfg.final_eval_episodes} episodes: return {long['return_mean']:.1f} "
            f"± {long['return_std']:.1f}, score {long['score_mean']:.1f}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / CHECKPOINT).unlink(missing_ok=True)  # the run is complete: its results are the record
    clear_agent_checkpoints(out)
    if curve:
        from fedrl.ops.plotting import episode_return_mean, learning_curve

        data_return = float(np.mean([episode_return_mean(s.transitions.rewards, s.transitions.episode)
                                     for s in fed.shards]))
        learning_curve(curve, out / "learning_curve.png",
                       f"{cfg.algo} on {', '.join(Path(parse_source(d, cfg.agents)[0]).name for d in cfg.datasets)}: "
                       f"{fed.n_agents} agents x {cfg.local_steps} local steps", env.key, data_return)
    best, final = summary["best"], summary["final"]
    scores = (f"; best score {best['score_mean']:.1f} (round {best['round']}), final {final['score_mean']:.1f}"
              if curve else "")
    log(f"done in {summary['wall_seconds']:.1f}s{scores}; results in {out}")
    return summary


def round_record(cfg: SimConfig, closed: Closed, results: list[LocalResult], train_seconds: float,
                 secure: dict[str, Any] | None = None) -> dict[str, Any]:
    """Round ``closed.round``'s record in rounds.jsonl (``fedrl simulate``'s and the cells'): its
    version, training time, each agent's sample count, time and metrics, their means, what
    differential privacy has spent, and ``secure``, the secure aggregation's record. A secure run
    records what its aggregator would learn: no agent's metrics (statistics of its data)."""
    shown = [{} if secure is not None else res.metrics for res in results]
    rec: dict[str, Any] = {"round": closed.round, "version": closed.version, "train_seconds": train_seconds,
                           "agents": [{"agent": res.agent, "num_samples": res.num_samples, "seconds": res.seconds,
                                       **m} for res, m in zip(results, shown)],
                           "metrics": mean_metrics([m for m in shown if m])}
    if cfg.dp_clip:
        rec["privacy"] = privacy_record(cfg, closed.round, [m for m in shown if m])
        rec["privacy"] |= {ADAPTIVE_RECORD[k]: v for k, v in closed.metrics.items() if k in ADAPTIVE_RECORD}
    if secure is not None:
        rec["secure_aggregation"] = secure
    return rec


def agent_name(i: int) -> str:
    """Agent ``i``'s name in the round machine (and in secure aggregation's protocol), as the
    services name theirs."""
    return f"agent-{i}"


def secure_round(machine: RoundMachine, cfg: SimConfig, results: list[LocalResult], noise_gen,
                 drop: Collection = ()) -> tuple[Closed, dict]:
    """The open round's version by the machine's secure aggregation, every agent's side run here
    (``secagg_sums.agents_here``), and its record. With DP noise, each agent adds its share: std
    sigma * C / sqrt(t) (C: the round's norm), so that any t or more survivors' sum carries at
    least the central mechanism's N(0, (sigma * C)^2). Under adaptive clipping each agent also
    sums its noisy share of the count (from its metrics' ``clipped``) with its model."""
    from fedrl.federation.privacy import count_extra, noise_share_std
    from fedrl.federation.secagg_sums import agent_vector, agents_here

    t0 = time.perf_counter()
    sec = machine.secure
    std = noise_share_std(cfg, machine.clip) if noise_gen is not None else 0.0
    vectors = {agent_name(res.agent): (lambda alpha, res=res: agent_vector(res.state, alpha, sec.params, std, noise_gen,
                                                               count_extra(cfg, res.metrics, noise_gen)))
               for res in results}
    closed = agents_here(machine, vectors, drop)
    if not isinstance(closed, Closed):
        raise RuntimeError(closed.message if isinstance(closed, Failed) else f"round {machine.round}: {closed}")
    return closed, secure_record(sec, time.perf_counter() - t0)


def secure_record(sec, seconds: float) -> dict[str, Any]:
    """What a secure aggregation's record says: its threshold, who took part, survived and
    dropped, how far its average can be from the exact one, and its time."""
    from fedrl.federation.secagg_sums import average_bound

    return {"threshold": sec.params.threshold, "agents": len(sec.weights), "survivors": len(sec.survivors),
            "dropped": len(sec.dropped), "bound": average_bound(sec.sum, len(sec.survivors), sec.params),
            "seconds": seconds}


def gather_moments(machine: RoundMachine, stats: list[ObsStats]) -> tuple[tuple[np.ndarray, np.ndarray], dict]:
    """Round 0 of ``machine`` (a plan that gathers): pooled normalisation of ``stats`` (one per
    agent, in the plan's order) by the protocol, every agent's side here, as the services gather
    them (MOMENTS tasks): ((mean, std), its record)."""
    from fedrl.federation.secagg_sums import agents_here, moments_vector

    t0 = time.perf_counter()
    machine.begin()
    sec = machine.secure
    vectors = {a: (lambda alpha, st=st: moments_vector(st.count, st.total, st.total_sq, alpha, sec.params))
               for a, st in zip(machine.plan.agents, stats)}
    got = agents_here(machine, vectors)
    if not isinstance(got, Gathered):
        raise RuntimeError(got.message if isinstance(got, Failed) else f"round 0: {got}")
    return (got.mean, got.std), secure_record(sec, time.perf_counter() - t0)


def secure_normalizer(cfg: SimConfig, stats: list[ObsStats]) -> tuple[tuple[np.ndarray, np.ndarray], dict]:
    """Pooled normalisation under secure aggregation as ``fedrl simulate`` makes it (round 0 of
    a machine for ``cfg``'s agents, each of ``stats``' count of samples)."""
    agents = [agent_name(i) for i in range(len(stats))]
    plan = Plan.of(cfg, agents, samples=[st.count for st in stats], context=f"simulate/{cfg.seed}",
                   obs_dim=len(stats[0].total))
    return gather_moments(RoundMachine(plan, None), stats)


# adaptive clipping's round metrics (the machine's) -> their names in a round's privacy record


def last_metrics(lines: list[str]) -> dict[str, float] | None:
    """The machine's metrics of the last round of ``lines`` (the rounds.jsonl records a resume
    keeps) that a resume reads: adaptive clipping's, from the round's privacy record."""
    if not lines:
        return None
    privacy = json.loads(lines[-1]).get("privacy") or {}
    return {k: float(privacy[v]) for k, v in ADAPTIVE_RECORD.items() if v in privacy}


def privacy_record(cfg: SimConfig, rounds: int, metrics: list[dict[str, float]]) -> dict[str, Any]:
    """What differential privacy has spent after ``rounds`` rounds, and this round's clipping."""
    from fedrl.federation.privacy import privacy_spent

    rec: dict[str, Any] = privacy_spent(cfg, rounds)
    if metrics and all("clipped" in m for m in metrics):  # the agents clipped (fixed clipping, in the clear)
        rec["clipped_fraction"] = float(np.mean([m.get("clipped", 0.0) for m in metrics]))
        rec["update_norm_median"] = float(np.median([m.get("update_norm", 0.0) for m in metrics]))
    return rec


def round_evaluation(own_policies: bool, evaluations: list[dict[str, Any]]) -> dict[str, Any]:
    """A round's evaluation record: the global policy's (spread over its episodes), or for the
    ``cql`` baseline the mean and spread over its agents' own policies."""
    if not own_policies:
        return {**evaluations[0], "spread_over": "episodes"}
    means = np.array([e["return_mean"] for e in evaluations])
    scores = np.array([e["score_mean"] for e in evaluations])
    return {"return_mean": float(means.mean()), "return_std": float(means.std()),
            "score_mean": float(scores.mean()), "score_std": float(scores.std()),
            "spread_over": "agents", "per_agent": evaluations}


def curve_point(r: int, evaluation: dict[str, Any]) -> dict[str, Any]:
    return {"round": r, **{k: evaluation[k] for k in ("return_mean", "return_std", "score_mean", "score_std")}}


def _round_line(r: int, rounds: int, rec: dict[str, Any]) -> str:
    ag = rec["agents"]
    keys = [k for k in ("critic_td", "cql_penalty", "reg_data", "bc_loss") if k in ag[0]]
    losses = " ".join(f"{k}={np.mean([a[k] for a in ag]):.3g}" for k in keys)
    ev = rec.get("eval")
    score = (f"return {ev['return_mean']:8.1f} ± {ev['return_std']:6.1f}  score {ev['score_mean']:6.1f}"
             if ev else "(not evaluated)")
    dp = rec.get("privacy")
    spent = f"  epsilon {dp['epsilon']:.3g} (delta {dp['delta']:g})" if dp else ""
    return f"round {r:3d}/{rounds}  {score}  {losses}{spent}  [{rec['seconds']:.1f}s]"
