"""Online SAC in gymnasium MuJoCo: the behaviour policies our D4RL-style datasets are made from.

D4RL recorded its gym-mujoco datasets from SAC agents (Haarnoja et al. 2018) trained online;
this trainer does the same, checkpointing the policy (safetensors) with the returns it achieved
so that ``fedrl data make`` can pick a ``medium`` (about a third of expert return) and an
``expert`` checkpoint, and the checkpoint sequence up to ``medium`` for ``medium-replay``.

Resumable: every ``eval_every`` steps the whole trainer (networks, optimisers, temperature,
replay buffer, both random streams, counters) is written atomically to ``<out>/state``; rerunning
the same command continues from there exactly: the environment, whose state is not saved, is
replayed from the buffer's actions (MuJoCo steps deterministically; the replay is checked against
the stored rewards), so the episode in progress goes on as if never stopped. ``keep`` also writes
a compact copy (:mod:`fedrl.behavior.keep`) that a new machine resumes from.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from safetensors.numpy import load_file as load_np
from safetensors.numpy import save_file as save_np
from safetensors.torch import load_file, save_file

from fedrl.algos.base import adam, soft_update_
from fedrl.algos.config import config_to_dict
from fedrl.algos.cql import td_loss, td_target, temperature_loss
from fedrl.algos.nets import EnsembleCritic, TanhGaussianPolicy
from fedrl.algos.policy_io import save_policy
from fedrl.behavior.config import SACConfig
from fedrl.common.device import (
    make_generator,
    resolve_device,
    seed_everything,
    tune_allocator,
)
from fedrl.common.progress import Progress
from fedrl.envs import env_info, route_mujoco_warnings
from fedrl.envs.evaluation import evaluate
from fedrl.envs.rollout import stochastic_return

STATE_DIR = "state"
CKPT_DIR = "checkpoints"
PROGRESS = "progress.jsonl"


class SACAgent:
    """Policy, twin critic (one ensemble), target critic and temperature with one fused update."""

    def __init__(self, obs_dim: int, act_dim: int, cfg: SACConfig, device: torch.device,
                 gen: torch.Generator) -> None:
        self.cfg, self.device, self.gen = cfg, device, gen
        self.policy = TanhGaussianPolicy(obs_dim, act_dim, cfg.hidden).to(device)
        self.critic = EnsembleCritic(obs_dim, act_dim, cfg.hidden, ensemble=2).to(device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.log_alpha = torch.zeros((), device=device, requires_grad=True)
        self.target_entropy = -float(act_dim)
        self.opts = {"actor": adam(self.policy.parameters(), cfg.lr),
                     "critic": adam(self.critic.parameters(), cfg.lr),
                     "alpha": adam([self.log_alpha], cfg.lr)}

    def update(self, obs, act, rew, next_obs, done) -> dict[str, torch.Tensor]:
        """One SAC step. Actor, critic and temperature losses touch disjoint parameters (the
        actor sees the critic through its action only), so one backward serves all three."""
        g, alpha = self.gen, self.log_alpha.detach().exp()
        mean, log_std = self.policy(obs)
        pi_a, log_pi = TanhGaussianPolicy.sample_from(mean, log_std, g)
        with torch.no_grad():
            n_mean, n_log_std = self.policy(next_obs)
            next_a, next_log_pi = TanhGaussianPolicy.sample_from(n_mean, n_log_std, g)
            next_q = self.critic_target(next_obs, next_a).min(dim=0).values
            y = td_target(rew, done, next_q, self.cfg.gamma, next_log_pi, alpha)
        q_data = self.critic(obs, act)
        critic = td_loss(q_data, y)
        self.critic.requires_grad_(False)
        q_pi = self.critic(obs, pi_a).min(dim=0).values
        self.critic.requires_grad_(True)
        actor = (alpha * log_pi - q_pi).mean()
        temp = temperature_loss(self.log_alpha, log_pi, self.target_entropy)
        for o in self.opts.values():
            o.zero_grad(set_to_none=True)
        (critic + actor + temp).backward()
        for o in self.opts.values():
            o.step()
        soft_update_(self.critic_target, self.critic, self.cfg.tau)
        return {"critic": critic.detach(), "actor": actor.detach(), "alpha": alpha,
                "q": q_data.detach().mean()}

    # -- resume state: every tensor in one safetensors file, scalars as JSON --------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"policy.{k}": v for k, v in self.policy.state_dict().items()}
        out |= {f"critic.{k}": v for k, v in self.critic.state_dict().items()}
        out |= {f"critic_target.{k}": v for k, v in self.critic_target.state_dict().items()}
        out["log_alpha"] = self.log_alpha.detach()
        for name, opt in self.opts.items():
            for i, st in opt.state_dict()["state"].items():
                for k, v in st.items():
                    out[f"opt.{name}.{i}.{k}"] = torch.as_tensor(v)
        return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}

    def resume_tensors(self) -> dict[str, torch.Tensor]:
        """:meth:`state_tensors` and the torch generator's state: what resuming exactly needs."""
        return {**self.state_tensors(), "generator": self.gen.get_state().to("cpu").clone()}

    def load_state_tensors(self, t: dict[str, torch.Tensor]) -> None:
        def sub(p: str) -> dict[str, torch.Tensor]:
            return {k[len(p):]: v.to(self.device) for k, v in t.items() if k.startswith(p)}

        self.policy.load_state_dict(sub("policy."))
        self.critic.load_state_dict(sub("critic."))
        self.critic_target.load_state_dict(sub("critic_target."))
        with torch.no_grad():
            self.log_alpha.copy_(t["log_alpha"])
        for name, opt in self.opts.items():
            sd = opt.state_dict()
            st: dict[int, dict[str, torch.Tensor]] = {}
            for k, v in sub(f"opt.{name}.").items():
                i, key = k.split(".", 1)
                st.setdefault(int(i), {})[key] = v.cpu() if key == "step" else v
            sd["state"] = st
            opt.load_state_dict(sd)


class ReplayBuffer:
    """Fixed-capacity transitions as numpy arrays (the capacity is the whole run, as D4RL's)."""

    KEYS = ("obs", "act", "rew", "next_obs", "done")

    def __init__(self, capacity: int, obs_dim: int, act_dim: int) -> None:
        self.data = {"obs": np.zeros((capacity, obs_dim), np.float32),
                     "act": np.zeros((capacity, act_dim), np.float32),
                     "rew": np.zeros(capacity, np.float32),
                     "next_obs": np.zeros((capacity, obs_dim), np.float32),
                     "done": np.zeros(capacity, np.float32)}
        self.size = 0

    def add(self, obs, act, rew, next_obs, done) -> None:
        i = self.size
        for k, v in zip(self.KEYS, (obs, act, rew, next_obs, done)):
            self.data[k][i] = v
        self.size += 1

    def sample(self, n: int, rng: np.random.Generator, device: torch.device) -> list[torch.Tensor]:
        idx = rng.integers(0, self.size, n)
        return [torch.from_numpy(self.data[k][idx]).to(device) for k in self.KEYS]

    def save(self, path: Path) -> None:
        save_np({k: v[: self.size] for k, v in self.data.items()}, str(path))

    def load(self, path: Path) -> None:
        d = load_np(str(path))
        self.size = len(d["rew"])
        for k in self.KEYS:
            self.data[k][: self.size] = d[k]


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


@dataclass
class _Walk:
    """Where the environment stands between steps: the live episode and the episode counters."""

    obs: np.ndarray
    ep_ret: float = 0.0
    ep_len: int = 0
    episodes: int = 0
    recent: list = field(default_factory=list)

    def step(self, env, a: np.ndarray):
        """One environment step with action ``a``; returns the transition. Training and the
        replay that rebuilds a resume both step through here, so they cannot disagree."""
        obs = self.obs
        nxt, r, term, trunc, _ = env.step(a)
        self.ep_ret += float(r)
        self.ep_len += 1
        self.obs = nxt
        if term or trunc:
            self.recent = (self.recent + [self.ep_ret])[-10:]
            self.episodes += 1
            self.obs, _ = env.reset()
            self.ep_ret, self.ep_len = 0.0, 0
        return obs, a, r, nxt, float(term)


def replay(env, seed: int, resets: dict[int, int], actions: np.ndarray, rewards: np.ndarray | None = None,
           buf: ReplayBuffer | None = None) -> tuple[_Walk, int | None]:
    """Step ``env`` from ``reset(seed=seed)`` through ``actions`` (seeded resets at the steps in
    ``resets``), adding each transition to ``buf``; returns the walk at the end and the first step
    whose reward differs from ``rewards`` (``None``: the replay reproduced them all)."""
    walk = _Walk(env.reset(seed=seed)[0])
    first_diff = None
    for i, a in enumerate(actions):
        if i in resets and i > 0:
            walk.obs, _ = env.reset(seed=resets[i])
            walk.ep_ret, walk.ep_len = 0.0, 0
        tr = walk.step(env, a)
        if buf is not None:
            buf.add(*tr)
        if rewards is not None and first_diff is None and np.float32(tr[2]) != rewards[i]:
            first_diff = i
    return walk, first_diff


def _resume_streams(agent: SACAgent, meta: dict, tensors: dict, cfg: SACConfig, step: int, log):
    """The numpy stream and the torch generator as they were at ``step`` (saved since format 2)."""
    if "rng" in meta and "generator" in tensors:
        rng = np.random.default_rng(cfg.seed)
        rng.bit_generator.state = meta["rng"]
        try:
            agent.gen.set_state(tensors["generator"].to("cpu"))
            return rng, True
        except (RuntimeError, ValueError) as e:  # another device's generator
            log(f"the saved torch generator does not fit this device ({e}); reseeding it from the step")
    else:
        rng = np.random.default_rng(np.random.SeedSequence(cfg.seed, spawn_key=(step,)))
    agent.gen.manual_seed(cfg.seed + step)
    return rng, False


def train(env_name: str, cfg: SACConfig, out: str | Path, device: str = "auto",
          log: Callable[[str], None] = print, keep: str | Path | None = None,
          stop_return: float | None = None) -> list[dict]:
    """Train (or resume) SAC in ``env_name``; returns the evaluation records so far.

    ``keep``: a folder (in the repository, say) that receives the compact resume state at every
    evaluation (:mod:`fedrl.behavior.keep`); when ``out`` holds no state, training resumes from it.
    ``stop_return``: stop at the first evaluation whose stochastic return reaches it."""
    from fedrl.behavior import keep as kept

    info = env_info(env_name)
    dev = resolve_device(device)
    out = Path(out)
    (out / CKPT_DIR).mkdir(parents=True, exist_ok=True)
    (out / STATE_DIR).mkdir(exist_ok=True)
    cfg_path = out / "config.json"
    cfg_dict = {"env_id": info.gym_id, "sac": config_to_dict(cfg)}
    if cfg_path.exists():
        _same_config(json.loads(cfg_path.read_text()), cfg_dict, cfg_path)
    meta_path = out / STATE_DIR / "meta.json"
    kept_meta = kept.read_meta(keep) if keep is not None else None
    if kept_meta is not None:
        _same_config({"env_id": kept_meta["env_id"], "sac": kept_meta["sac"]}, cfg_dict, Path(keep) / "meta.json")
    _atomic_json(cfg_path, cfg_dict)

    tune_allocator()
    seed_everything(cfg.seed)
    agent = SACAgent(info.obs_dim, info.act_dim, cfg, dev, make_generator(cfg.seed, dev))
    route_mujoco_warnings()
    env = gym.make(info.gym_id, max_episode_steps=cfg.max_episode_steps, **info.gym_kwargs())  # the env's own layout
    rng = np.random.default_rng(cfg.seed)
    step, wall, records, resets = 0, 0.0, [], {0: cfg.seed}
    walk: _Walk | None = None
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        step, wall, records = meta["step"], meta["wall_seconds"], meta["evals"]
        tensors = load_file(str(out / STATE_DIR / meta["files"]["agent"]))
        agent.load_state_tensors(tensors)
        buf = ReplayBuffer(max(cfg.total_steps, step), info.obs_dim, info.act_dim)
        buf.load(out / STATE_DIR / meta["files"]["replay"])
        rng, exact = _resume_streams(agent, meta, tensors, cfg, step, log)
        resets = {int(k): v for k, v in meta.get("resets", {"0": cfg.seed}).items()}
        t0 = time.perf_counter()
        walk, diff = replay(env, cfg.seed, resets, buf.data["act"][:step], buf.data["rew"][:step])
        if diff is not None:  # a state from before the replay (or another machine): drop the episode
            log(f"replaying the environment diverged at step {diff}; starting a new episode at {step}")
            resets[step] = cfg.seed + step
            walk = _Walk(env.reset(seed=cfg.seed + step)[0], episodes=meta["episodes"])
            exact = False
        log(f"resuming {out} at step {step} ({walk.episodes} episodes, {wall / 60:.1f} min so far; "
            f"environment replayed in {time.perf_counter() - t0:.0f} s; "
            f"{'exactly' if exact else 'with reseeded random streams'})")
    elif kept_meta is not None:
        t0 = time.perf_counter()
        buf = ReplayBuffer(max(cfg.total_steps, kept_meta["step"]), info.obs_dim, info.act_dim)
        tensors, actions, rewards = kept.load(keep, kept_meta)
        step, wall, records = kept_meta["step"], kept_meta["wall_seconds"], kept_meta["evals"]
        agent.load_state_tensors(tensors)
        rng, exact = _resume_streams(agent, kept_meta, tensors, cfg, step, log)
        resets = {int(k): v for k, v in kept_meta["resets"].items()}
        walk, diff = replay(env, cfg.seed, resets, actions, rewards, buf)
        if diff is not None:
            exact = False
            log(f"WARNING: the rebuilt replay buffer differs from the kept run's from step {diff} on "
                "(this machine's MuJoCo steps differently); training goes on from the rebuilt transitions")
        log(f"resuming from the kept state {keep} at step {step} ({walk.episodes} episodes; replay buffer "
            f"rebuilt from its actions in {time.perf_counter() - t0:.0f} s; "
            f"{'exactly' if exact else 'not exactly'})")
    else:
        buf = ReplayBuffer(cfg.total_steps, info.obs_dim, info.act_dim)
        walk = _Walk(env.reset(seed=cfg.seed)[0])
    if keep is not None and step > 0 and (kept_meta is None or kept_meta["step"] < step):
        kept.export(keep, agent, buf, step, _state_meta(cfg_dict, step, walk, wall, records, resets, rng))

    reached = [r for r in records if stop_return is not None and r["stochastic_return_mean"] >= stop_return]
    if reached:
        log(f"the stochastic return reached {stop_return:g} at step {reached[0]['step']} already; nothing to train")
        env.close()
        return records
    t_seg, step_seg = time.perf_counter(), step
    bar = Progress(cfg.total_steps, f"SAC on {info.gym_id}", "steps", initial=step, every=30.0)
    losses: dict = {}
    while step < cfg.total_steps:
        if step < cfg.start_steps:
            a = rng.uniform(-1.0, 1.0, info.act_dim).astype(np.float32)
        else:
            with torch.no_grad():
                m, ls = agent.policy(torch.as_tensor(walk.obs, dtype=torch.float32, device=dev))
                a = torch.tanh(m + ls.exp() * torch.randn(m.shape, generator=agent.gen, device=dev))
                a = a.cpu().numpy()
        buf.add(*walk.step(env, a))
        step += 1
        bar.update(1)
        if step >= cfg.start_steps:
            losses = agent.update(*buf.sample(cfg.batch_size, rng, dev))
        if step % cfg.eval_every == 0 or step == cfg.total_steps:
            wall += time.perf_counter() - t_seg
            rec = _evaluate_and_checkpoint(agent, info.gym_id, cfg, out, step, walk.episodes, wall,
                                           float(np.mean(walk.recent)) if walk.recent else float("nan"),
                                           (step - step_seg) / max(time.perf_counter() - t_seg, 1e-9),
                                           {k: float(v) for k, v in losses.items()})
            records.append(rec)
            meta = _state_meta(cfg_dict, step, walk, wall, records, resets, rng)
            _save_state(agent, buf, out, meta)
            if keep is not None:
                kept.export(keep, agent, buf, step, meta)
            log(f"step {step:>8}  eval {rec['return_mean']:8.1f} (stochastic "
                f"{rec['stochastic_return_mean']:8.1f})  train-episode {rec['train_return_recent']:8.1f}"
                f"  {rec['steps_per_second']:5.0f} steps/s  {wall / 60:6.1f} min")
            t_seg, step_seg = time.perf_counter(), step
            bar.note(f"eval {rec['return_mean']:.0f}")
            if stop_return is not None and rec["stochastic_return_mean"] >= stop_return:
                log(f"stopping at step {step}: the stochastic return {rec['stochastic_return_mean']:.1f} "
                    f"reached {stop_return:g}")
                break
    bar.close()
    env.close()
    return records


def _same_config(old: dict, new: dict, where: Path) -> None:
    # total_steps may grow on resume (train longer); anything else must match.
    same = {**old, "sac": {**old.get("sac", {}), "total_steps": new["sac"]["total_steps"]}}
    if same != new:
        raise ValueError(f"{where}: holds a run with a different configuration; "
                         "use another --out or the same settings to resume")


def _state_meta(cfg_dict: dict, step: int, walk: _Walk, wall: float, records: list[dict],
                resets: dict[int, int], rng: np.random.Generator) -> dict:
    """Everything of the resume state that is not a tensor (format 2: the random streams are kept,
    and the environment is replayed from the stored actions instead of restarted)."""
    return {"format": 2, **cfg_dict, "step": step, "episodes": walk.episodes, "wall_seconds": wall,
            "evals": records, "resets": {str(k): v for k, v in sorted(resets.items())},
            "rng": rng.bit_generator.state}


def _evaluate_and_checkpoint(agent: SACAgent, gym_id: str, cfg: SACConfig, out: Path, step: int,
                             episodes: int, wall: float, train_ret: float, sps: float,
                             losses: dict) -> dict:
    pol = copy.deepcopy(agent.policy).to("cpu").eval()
    det = evaluate(pol, gym_id, cfg.eval_episodes, seed=10_000 + step)
    sto = stochastic_return(pol, gym_id, cfg.eval_episodes, seed=20_000 + step,
                            max_episode_steps=cfg.max_episode_steps)
    rec = {"step": step, "episodes": episodes, "wall_seconds": round(wall, 1),
           "return_mean": det.return_mean, "return_std": det.return_std,
           "stochastic_return_mean": sto.mean, "stochastic_return_std": sto.std,
           "train_return_recent": train_ret, "steps_per_second": round(sps, 1), "losses": losses,
           "torch_threads": torch.get_num_threads()}
    save_policy(pol, out / CKPT_DIR / f"step-{step:09d}.safetensors",
                {"env_id": gym_id, "step": step, "return_mean": det.return_mean,
                 "stochastic_return_mean": sto.mean, "seed": cfg.seed})
    with open(out / PROGRESS, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def _save_state(agent: SACAgent, buf: ReplayBuffer, out: Path, meta: dict) -> None:
    """Write step-stamped state files, then ``meta.json`` naming them (the commit point), then
    delete the previous ones: a crash at any moment leaves one complete, consistent state."""
    d, step = out / STATE_DIR, meta["step"]
    files = {"agent": f"agent-{step:09d}.safetensors", "replay": f"replay-{step:09d}.safetensors"}
    save_file(agent.resume_tensors(), str(d / files["agent"]))
    buf.save(d / files["replay"])
    _atomic_json(d / "meta.json", {**meta, "files": files})
    for f in d.glob("*.safetensors"):
        if f.name not in files.values():
            f.unlink()
