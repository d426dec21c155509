"""The reference study's worker: one chunk of one run's training, in this project's environment
for our learners and in d3rlpy's own virtual environment for d3rlpy's, ending with a checkpoint
(``benchmarks.studies.reference`` drives it; its docstring says what is compared and how). Also the
study's settings and its data, prepared once in the project's environment."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "reference"
WORK = ROOT / "runs" / "reference"
VENV = ROOT / "benchmarks" / ".venv-d3rlpy"
D3RLPY_PIN = "d3rlpy==2.8.1"
DATASET = "hopper-medium-v2"
GAMMA = 0.99
Q_ROWS = 10_000  # Q on the data and NLL over at most this many transitions (a fixed subset)
EVAL_EPISODES = 10

# learner -> (algorithm, implementation, settings that differ from the shared ones)
LEARNERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "cql-ours": ("cql", "ours", {}),
    "cql-ours-td1": ("cql", "ours", {"td_weight": 1.0}),
    "cql-ours-mean-target": ("cql", "ours", {"target_action": "mean"}),
    "cql-ours-orthogonal": ("cql", "ours", {"init": "orthogonal"}),
    "cql-d3rlpy": ("cql", "d3rlpy", {}),
    # the temperature's learning rate (issue 53): 3e-5 is the default above (CORL's actor rate),
    # 1e-4 d3rlpy's own CQL default, 3e-4 SAC's paper's rate for every optimiser
    "cql-ours-alr1e-4": ("cql", "ours", {"alpha_lr": 1e-4}),
    "cql-ours-alr3e-4": ("cql", "ours", {"alpha_lr": 3e-4}),
    "cql-d3rlpy-alr1e-4": ("cql", "d3rlpy", {"alpha_lr": 1e-4}),
    "bc-ours": ("bc", "ours", {}),
    "bc-ours-mse": ("bc", "ours", {"loss": "mse"}),
    "bc-d3rlpy": ("bc", "d3rlpy", {}),
}
# data -> trajectories (0: the whole file), picked once with seed 0 (the same for every seed);
# ``5traj_scaled``: the same 5 trajectories with CORL's reward normalisation for hopper (rewards x
# 1000 / (max - min episode return of the data), its ``normalize_reward: true`` config)
DATA = {"5traj": 5, "all": 0, "5traj_scaled": 5}
DEFAULT_RUNS = ("cql-ours-5traj", "cql-d3rlpy-5traj", "bc-ours-5traj", "bc-ours-mse-5traj", "bc-d3rlpy-5traj",
                "cql-ours-td1-5traj", "cql-ours-all", "cql-d3rlpy-all", "bc-ours-all", "bc-d3rlpy-all")
LABEL = {"cql-ours": "CQL, fedrl", "cql-ours-td1": "CQL, fedrl, td_weight 1 (earlier default)",
         "cql-ours-mean-target": "CQL, fedrl, TD target at the mean action (d3rlpy's)",
         "cql-ours-orthogonal": "CQL, fedrl, CORL's orthogonal initialisation",
         "cql-d3rlpy": "CQL, d3rlpy 2.8.1", "cql-ours-alr1e-4": "CQL, fedrl, temperature lr 1e-4",
         "cql-ours-alr3e-4": "CQL, fedrl, temperature lr 3e-4",
         "cql-d3rlpy-alr1e-4": "CQL, d3rlpy 2.8.1, temperature lr 1e-4 (its default)", "bc-ours": "BC, fedrl (NLL)", "bc-ours-mse": "BC, fedrl (MSE)",
         "bc-d3rlpy": "BC, d3rlpy 2.8.1 (MSE)"}


def split_run(run: str) -> tuple[str, str]:
    """``cql-ours-td1-5traj`` -> (``cql-ours-td1``, ``5traj``)."""
    learner, _, data = run.rpartition("-")
    if learner not in LEARNERS or data not in DATA:
        raise SystemExit(f"unknown run {run!r}: <learner>-<data>, learner one of {', '.join(LEARNERS)}, "
                         f"data one of {', '.join(DATA)}")
    return learner, data


def shared_settings() -> dict[str, Any]:
    """The hyperparameters both implementations run with: the project's defaults."""
    from fedrl.algos import BCConfig, DRPOConfig

    d, b = DRPOConfig(), BCConfig()
    return {"actor_lr": d.actor_lr, "critic_lr": d.critic_lr, "alpha_lr": d.alpha_lr, "batch_size": d.batch_size,
            "hidden": list(d.hidden), "gamma": d.gamma, "tau": d.tau, "cql_weight": d.cql_weight,
            "td_weight": d.td_weight, "cql_n_actions": d.cql_n_actions, "alpha_init": d.alpha_init,
            "bc_lr": b.lr, "bc_loss": b.loss}


# -- data (project environment) --------------------------------------------------------------
def prepare_data(data: str, work: Path = WORK) -> Path:
    """Write the run's data once as an .npz the workers read (numpy only)."""
    path = work / f"data-{data}.npz"
    if path.exists():
        return path
    from fedrl.data.d4rl import to_transitions
    from fedrl.data.normalize import ObsStats
    from fedrl.data.partition import ShardSource, partition
    from fedrl.data.registry import load

    raw = load(DATASET)
    tr = to_transitions(raw)
    if DATA[data]:
        tr = partition([ShardSource(raw.source, tr, 1)], DATA[data], 0)[0].transitions
    rewards = tr.rewards.astype(np.float64)
    if data.endswith("_scaled"):
        returns = np.bincount(np.unique(tr.episode, return_inverse=True)[1], weights=rewards)
        rewards = rewards * 1000.0 / (returns.max() - returns.min())
    mean, std = ObsStats.of(tr.obs).mean_std()
    rows = np.random.default_rng(0).permutation(len(tr))[:Q_ROWS] if len(tr) > Q_ROWS else np.arange(len(tr))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, obs=((tr.obs - mean) / std).astype(np.float32), next_obs=((tr.next_obs - mean) / std).astype(np.float32),
             actions=tr.actions.astype(np.float32), rewards=rewards.astype(np.float32),
             dones=tr.dones.astype(np.float32), obs_mean=mean, obs_std=std, probe=rows,
             mc_return=np.float64(mc_return(rewards, tr.dones, tr.episode, GAMMA)),
             episodes=np.int64(len(np.unique(tr.episode))))
    tmp.replace(path)
    return path


def mc_return(rewards: np.ndarray, dones: np.ndarray, episode: np.ndarray, gamma: float) -> float:
    """Mean over transitions of the discounted return-to-go within each episode (a row's episode
    ends where its episode id changes or ``done`` is set)."""
    g, out = 0.0, np.zeros(len(rewards))
    for i in range(len(rewards) - 1, -1, -1):
        if i == len(rewards) - 1 or episode[i + 1] != episode[i] or dones[i]:
            g = 0.0
        g = rewards[i] + gamma * g
        out[i] = g
    return float(out.mean())


# -- the worker: one chunk of training (project env for ours, the d3rlpy venv for d3rlpy) ----
class _Ours:
    def __init__(self, algo: str, over: dict[str, Any], s: dict[str, Any], obs_dim: int, act_dim: int, seed: int):
        import dataclasses

        import torch

        from fedrl.algos import BCConfig, DRPOConfig, cql_config
        from fedrl.federation.round import build_learner

        over = dict(over)
        init = over.pop("init", "default")
        hidden, batch = tuple(s["hidden"]), s["batch_size"]
        if algo == "cql":  # the run's recorded settings, so a resumed run keeps them whatever today's defaults
            cfg = cql_config(DRPOConfig(
                hidden=hidden, batch_size=batch, actor_lr=s["actor_lr"], critic_lr=s["critic_lr"],
                alpha_lr=s["alpha_lr"], gamma=s["gamma"], tau=s["tau"], cql_weight=s["cql_weight"],
                td_weight=s["td_weight"], cql_n_actions=s["cql_n_actions"], alpha_init=s["alpha_init"],
                cql_calibration="none"))  # CQL(H) as d3rlpy computes it: the comparison's common ground
        else:
            cfg = BCConfig(hidden=hidden, batch_size=batch, lr=s["bc_lr"], loss=s["bc_loss"])
        cfg = dataclasses.replace(cfg, **over)
        self.learner = build_learner(cfg, obs_dim, act_dim, torch.device("cpu"), seed, seed + 1)
        if init == "orthogonal":
            corl_init(self.learner, seed)
        self.algo = algo

    def update(self, batch) -> None:
        from fedrl.algos.base import Batch

        self.learner.update(Batch(*batch))

    def state(self) -> dict:
        return self.learner.checkpoint()

    def load(self, st: dict) -> None:
        self.learner.restore(st)

    def policy_tensors(self):
        p = self.learner.policy
        return p, p.log_std_min

    def q_mean(self, obs, act):
        return self.learner.critic(obs, act).mean(0)

    def temperature(self) -> float:
        return float(self.learner.alpha) if self.algo == "cql" else float("nan")


def corl_init(learner, seed: int) -> None:
    """CORL cql.py's initialisation (``orthogonal_init: true``): critic hidden layers orthogonal
    with gain sqrt(2), its output layer orthogonal with gain 1e-2, biases 0; the policy's output
    layer Xavier-uniform with gain 1e-2, bias 0 (its trunk keeps torch's default)."""
    import torch
    from torch import nn

    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = [*learner.critic.hidden, learner.critic.out]
        for layer in layers:
            gain = 1e-2 if layer is learner.critic.out else np.sqrt(2)
            for w in layer.weight:  # (in, out) per member; torch's layout is (out, in)
                w.copy_(nn.init.orthogonal_(torch.empty(w.shape[1], w.shape[0]), gain=gain).T)
            layer.bias.zero_()
        learner.critic_target.load_state_dict(learner.critic.state_dict())
        nn.init.xavier_uniform_(learner.policy.head.weight, gain=1e-2)
        learner.policy.head.bias.zero_()


class _D3rlpy:
    def __init__(self, algo: str, over: dict[str, Any], s: dict[str, Any], obs_dim: int, act_dim: int, seed: int):
        import d3rlpy
        import torch
        from d3rlpy.models.encoders import VectorEncoderFactory

        d3rlpy.seed(seed)
        enc = VectorEncoderFactory(list(s["hidden"]))
        if algo == "cql":
            cfg = d3rlpy.algos.CQLConfig(
                actor_learning_rate=s["actor_lr"], critic_learning_rate=s["critic_lr"],
                temp_learning_rate=over.get("alpha_lr", s["alpha_lr"]), alpha_learning_rate=0.0, initial_alpha=1.0,
                conservative_weight=s["cql_weight"], n_action_samples=s["cql_n_actions"],
                batch_size=s["batch_size"], gamma=s["gamma"], tau=s["tau"], n_critics=2,
                initial_temperature=s["alpha_init"], actor_encoder_factory=enc, critic_encoder_factory=enc)
        else:
            cfg = d3rlpy.algos.BCConfig(learning_rate=s["bc_lr"], batch_size=s["batch_size"],
                                        policy_type="deterministic", encoder_factory=enc)
        self.algo_obj = cfg.create(device="cpu:0")
        self.algo_obj.create_impl((obs_dim,), act_dim)
        self.impl, self.algo, self.step = self.algo_obj.impl, algo, 0
        self.torch = torch

    def update(self, batch) -> None:
        from d3rlpy.torch_utility import TorchMiniBatch

        obs, act, rew, nobs, done = batch
        ones = self.torch.ones_like(rew)[:, None]
        b = TorchMiniBatch(observations=obs, actions=act, rewards=rew[:, None], next_observations=nobs,
                           next_actions=act, returns_to_go=self.torch.zeros_like(ones), terminals=done[:, None],
                           intervals=ones, device="cpu:0")
        self.impl.update(b, self.step)
        self.step += 1

    def policy_tensors(self):
        """The d3rlpy policy as our TanhGaussianPolicy (same trunk, mean and log-std rows of one head)."""
        import torch

        from fedrl.algos.nets import TanhGaussianPolicy

        m = self.impl.modules
        pol = m.policy if self.algo == "cql" else m.imitator
        lin = [x for x in pol._encoder._layers if isinstance(x, torch.nn.Linear)]
        out = pol._mu if self.algo == "cql" else pol._fc
        act_dim, hidden = out.out_features, [x.out_features for x in lin]
        ours = TanhGaussianPolicy(lin[0].in_features, act_dim, hidden, log_std_min=-20.0, log_std_max=2.0)
        with torch.no_grad():
            for dst, src in zip([x for x in ours.trunk if isinstance(x, torch.nn.Linear)], lin):
                dst.weight.copy_(src.weight)
                dst.bias.copy_(src.bias)
            ours.head.weight[:act_dim].copy_(out.weight)
            ours.head.bias[:act_dim].copy_(out.bias)
            if self.algo == "cql":
                ours.head.weight[act_dim:].copy_(pol._logstd.weight)
                ours.head.bias[act_dim:].copy_(pol._logstd.bias)
            else:  # deterministic: no log-std (NLL is not defined)
                ours.head.weight[act_dim:].zero_()
                ours.head.bias[act_dim:].zero_()
        return ours, (-20.0 if self.algo == "cql" else None)

    def q_mean(self, obs, act):
        return self.impl._q_func_forwarder.compute_expected_q(obs, act, "mean").reshape(-1)

    def temperature(self) -> float:
        from d3rlpy.models.torch import get_parameter

        return float(get_parameter(self.impl.modules.log_temp).exp().reshape(())) if self.algo == "cql" else float("nan")


def worker(run: str, seed: int, until: int, settings: dict[str, Any], work: Path = WORK) -> dict[str, Any]:
    """Train ``run`` from its checkpoint to step ``until``; save checkpoint + policy; return metrics."""
    import torch

    from fedrl.algos.nets import TanhGaussianPolicy

    torch.set_num_threads(1)
    learner, data = split_run(run)
    algo, impl, over = LEARNERS[learner]
    d = np.load(work / f"data-{data}.npz")
    t = {k: torch.from_numpy(d[k]) for k in ("obs", "actions", "rewards", "next_obs", "dones")}
    n, obs_dim, act_dim = len(t["rewards"]), t["obs"].shape[1], t["actions"].shape[1]
    home = work / f"{run}-s{seed}"
    home.mkdir(parents=True, exist_ok=True)
    ck = home / "checkpoint.pt"
    gen = torch.Generator().manual_seed(1000 + seed)  # the minibatch indices, shared by both implementations
    model = (_Ours if impl == "ours" else _D3rlpy)(algo, over, settings, obs_dim, act_dim, seed)
    step = 0
    if ck.exists():  # a local file this benchmark wrote, never network input
        st = torch.load(ck, weights_only=False)
        step = st["step"]
        gen.set_state(st["gen"])
        torch.set_rng_state(st["torch_rng"])
        if impl == "ours":
            model.load(st["model"])
        else:
            model.impl.modules.create_checkpointer("cpu:0").load(_bytes_io(st["model"]))
            model.step = step
    t0 = time.perf_counter()
    while step < until:
        idx = torch.randint(n, (settings["batch_size"],), generator=gen)
        model.update(tuple(t[k][idx] for k in ("obs", "actions", "rewards", "next_obs", "dones")))
        step += 1
    secs = time.perf_counter() - t0
    if impl == "ours":
        model_state = model.state()
    else:
        buf = _bytes_io()
        model.impl.modules.create_checkpointer("cpu:0").save(buf)
        model_state = buf.getvalue()
    tmp = ck.with_suffix(".tmp")
    torch.save({"step": step, "gen": gen.get_state(), "torch_rng": torch.get_rng_state(), "model": model_state}, tmp)
    tmp.replace(ck)
    # metrics on the data, with our code for both
    probe = torch.from_numpy(d["probe"])
    obs, act = t["obs"][probe], t["actions"][probe]
    pol, _ = model.policy_tensors()
    with torch.no_grad():
        q = float(model.q_mean(obs, act).mean()) if algo == "cql" else float("nan")
        mean, log_std = pol(obs)
        nll = float(-TanhGaussianPolicy.log_prob_from(mean, log_std, act).mean())
    if impl == "d3rlpy" and algo == "bc":
        nll = float("nan")
    pol.set_normalizer(torch.from_numpy(d["obs_mean"]), torch.from_numpy(d["obs_std"]))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in pol.state_dict().items()}, str(home / "policy.safetensors"),
              {"log_std_min": str(pol.log_std_min), "hidden": json.dumps([m.out_features for m in pol.trunk
                                                                          if isinstance(m, torch.nn.Linear)])})
    return {"step": step, "q_data": q, "nll_data": nll, "temperature": model.temperature(),
            "train_seconds": round(secs, 2)}


def _bytes_io(b: bytes = b""):
    import io

    return io.BytesIO(b)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.studies.reference_worker",
                                 description="(internal) one chunk of one run of benchmarks.studies.reference")
    ap.add_argument("--run", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--until", type=int, required=True)
    ap.add_argument("--settings", required=True)
    ap.add_argument("--work", default=str(WORK))
    a = ap.parse_args(argv)
    print(json.dumps(worker(a.run, a.seed, a.until, json.loads(a.settings), Path(a.work))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
