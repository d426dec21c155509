"""The agent side of a round: adopt the global model, take local steps, report the update.

Used unchanged by the in-process simulator and (later) by the agent service, so both
transports compute the same numbers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedrl.algos import BCConfig, BCLearner, DRPOConfig, DRPOLearner, cql_config
from fedrl.algos.base import Batch, Learner, generator_tensor
from fedrl.algos.drpo import Noise
from fedrl.common.device import derive_seed, make_generator, subnormals_flushed, tune_allocator
from fedrl.data.buffer import TensorBuffer
from fedrl.data.d4rl import Transitions

_INIT_LOCK = threading.Lock()

# Seed streams derived from the run seed; keeping them apart keeps runs reproducible.
SEED_GLOBAL_INIT, SEED_AGENT_INIT, SEED_AGENT_RNG, SEED_EVAL, SEED_SHARDS, SEED_BATCH_RNG = range(6)
DRAWS = ("batch", "per-agent")  # where a batched trainer's members draw from (BatchedTrainer)


class RoundInterrupted(Exception):
    """A local round stopped before its last step because its caller asked it to."""


@dataclass(frozen=True)
class LocalResult:
    """What an agent returns at the end of its local round."""

    agent: int
    state: dict[str, torch.Tensor]  # prefixed CPU tensors (policy.*, optionally critic.*)
    num_samples: int  # transitions in the agent's shard
    metrics: dict[str, float]  # mean over the round's local steps
    seconds: float


def algo_config(algo: str, drpo: DRPOConfig, bc: BCConfig) -> DRPOConfig | BCConfig:
    """The hyperparameters an algorithm name implies (``fed-cql``/``cql``: lambdas forced to 0)."""
    if algo == "drpo":
        return drpo
    if algo in ("fed-cql", "cql"):
        return cql_config(drpo)
    if algo == "fed-bc":
        return bc
    raise ValueError(f"unknown algorithm {algo!r}; choose drpo, fed-cql, fed-bc or cql")


def returns_gamma(cfg: DRPOConfig | BCConfig) -> float | None:
    """The discount a learner's buffer computes returns-to-go at, if its loss reads them."""
    return cfg.gamma if getattr(cfg, "cql_calibration", "none") != "none" else None


def build_learner(cfg: DRPOConfig | BCConfig, obs_dim: int, act_dim: int,
                  device: torch.device, init_seed: int, rng_seed: int) -> Learner:
    """A learner whose initial weights come from ``init_seed`` and whose sampling uses ``rng_seed``."""
    tune_allocator()
    gen = make_generator(rng_seed, device)
    # Module initialisers draw from torch's global RNG: seed it and build under one lock, so
    # learners built concurrently (agents in threads) still get exactly their seed's weights.
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        if isinstance(cfg, BCConfig):
            return BCLearner(obs_dim, act_dim, cfg, device, gen)
        return DRPOLearner(obs_dim, act_dim, cfg, device, gen)


def initial_global_state(cfg: DRPOConfig | BCConfig, obs_dim: int, act_dim: int, seed: int,
                         obs_mean: np.ndarray, obs_std: np.ndarray,
                         federate_critic: bool) -> dict[str, torch.Tensor]:
    """Round-0 global model: a freshly initialised policy (and critics, when federated)."""
    s = derive_seed(seed, SEED_GLOBAL_INIT)
    learner = build_learner(cfg, obs_dim, act_dim, torch.device("cpu"), s, s)
    learner.policy.set_normalizer(torch.from_numpy(obs_mean), torch.from_numpy(obs_std))
    return learner.shared_state(federate_critic)


def _grad_norms_every(every: int, cfg: DRPOConfig | BCConfig) -> int:
    """A trainer's probe interval: checked, and 0 for a learner without an actor loss to probe (BC)."""
    if every < 0:
        raise ValueError(f"grad_norms_every must be >= 0, got {every}")
    return every if isinstance(cfg, DRPOConfig) else 0


class LocalTrainer:
    """One agent: its private buffer, its learner, its own RNG stream."""

    def __init__(self, agent: int, cfg: DRPOConfig | BCConfig, transitions: Transitions,
                 obs_mean: np.ndarray, obs_std: np.ndarray, seed: int, device: torch.device,
                 federate_critic: bool = False, local_normalizer: bool = False, grad_norms_every: int = 0,
                 update_clip: float = 0.0) -> None:
        """``grad_norms_every``: on every this many-th local step of a round (its first included),
        a DRPO learner also measures the actor's gradient norm from each term; a round's metrics
        hold their mean over those steps (0: never; the training is the same either way).
        ``update_clip`` > 0: the update a round returns is clipped to that L2 norm
        (:func:`fedrl.federation.privacy.clip_update`; differential privacy's first half), and
        its metrics hold ``update_norm``, the norm before, and ``clipped`` (1 when it was cut)."""
        if update_clip < 0:
            raise ValueError(f"update_clip must be >= 0, got {update_clip}")
        self.update_clip = update_clip
        self.agent, self.cfg, self.device = agent, cfg, device
        self.grad_norms_every = _grad_norms_every(grad_norms_every, cfg)
        self.federate_critic, self.local_normalizer = federate_critic, local_normalizer
        self.obs_mean, self.obs_std = obs_mean, obs_std
        self.buffer = TensorBuffer(transitions, obs_mean, obs_std, device, returns_gamma(cfg))
        obs_dim, act_dim = transitions.obs.shape[1], transitions.actions.shape[1]
        self.learner = build_learner(cfg, obs_dim, act_dim, device,
                                     derive_seed(seed, SEED_AGENT_INIT, agent),
                                     derive_seed(seed, SEED_AGENT_RNG, agent))

    def train_round(self, global_state: Mapping[str, torch.Tensor], steps: int,
                    stop: Callable[[], bool] | None = None, copy: bool = True,
                    progress: Callable[[int, int], None] | None = None, adopt: bool = False) -> LocalResult:
        """Adopt ``global_state``, run ``steps`` local updates, return the shared parameters
        (copies; with ``copy=False`` on CPU, the learner's own tensors, valid until its next round).

        ``stop`` is asked before every step; when it answers True the round is abandoned
        (:class:`RoundInterrupted`): a service asked to shut down does not finish minutes of
        local training first. ``progress(steps_done, steps)`` is called before every step (a
        Session agent reports it, rate-limited, to keep its stream alive while it trains).
        ``adopt``: ``global_state`` is handed over (decoded into a buffer of the caller's own):
        the learner takes its tensors instead of copying them (see ``load_prefixed``)."""
        t0 = time.perf_counter()
        self.learner.begin_round(global_state, adopt=adopt)
        if self.local_normalizer:
            self.learner.policy.set_normalizer(torch.from_numpy(self.obs_mean),
                                               torch.from_numpy(self.obs_std))
        logs: dict[str, list[torch.Tensor]] = {}
        with subnormals_flushed():  # a CQL critic's backward slows as Q grows, without
            for i in range(steps):
                if stop is not None and stop():
                    raise RoundInterrupted(f"local round abandoned after {i} of {steps} steps")
                if progress is not None:
                    progress(i, steps)
                probe = {"grad_norms": True} if self.grad_norms_every and i % self.grad_norms_every == 0 else {}
                batch = self.buffer.sample(self.cfg.batch_size, self.learner.gen)
                for k, v in self.learner.update(batch, **probe).items():
                    logs.setdefault(k, []).append(v)  # a probed diagnostic: its mean over the probed steps
        metrics = {k: float(torch.stack(v).double().mean()) for k, v in logs.items()}
        state = self.learner.shared_state(self.federate_critic, copy or bool(self.update_clip))
        if self.update_clip:
            from fedrl.federation.privacy import clip_update

            state, norm = clip_update(state, global_state, self.update_clip)
            metrics |= {"update_norm": norm, "clipped": float(norm > self.update_clip)}
        return LocalResult(self.agent, state, len(self.buffer), metrics, time.perf_counter() - t0)


class BatchedTrainer:
    """A run's agents as one batched model (:mod:`fedrl.algos.batched`): every agent's round of
    :class:`LocalTrainer` in one sequence of batched steps.

    Agent i starts from exactly the weights its :class:`LocalTrainer` would have (the same seeds);
    its minibatches come from its own shard and its draws from the batch's generator (seeded from
    the run seed: a batched run is reproducible from it, and is not the per-agent run's draw for
    draw). ``cfgs``: one config per agent (per-agent hyperparameters; see ``DRPO_PER_LEARNER``)."""

    def __init__(self, agents: Sequence[int], cfgs: Sequence[DRPOConfig | BCConfig], shards: Sequence[Transitions],
                 norms: Sequence[tuple[np.ndarray, np.ndarray]], seed: int | Sequence[int], device: torch.device,
                 federate_critic: bool = False, local_normalizer: bool = False, rng_stream: int = 0,
                 draws: str = "batch", grad_norms_every: int = 0) -> None:
        """``seed``: the run's seed, or one per agent (agents of several runs, e.g. a paper cell
        each: agent i's initial weights are those of agent ``agents[i]`` of a run seeded
        ``seed[i]``); the batch's own draws come from the first seed and ``rng_stream``.

        ``draws``: ``batch`` (the default) draws every member's minibatch and noise in one call
        per kind from the batch's generator. ``per-agent`` draws member i's from a generator of
        its own, seeded and used in the order of agent ``agents[i]``'s :class:`LocalTrainer`:
        the batch then computes the per-agent engine's numbers, up to float rounding (how the
        batched engine is checked against it; on a GPU it costs a few small calls per member a
        step).

        ``grad_norms_every``: as :class:`LocalTrainer`'s, for every DRPO member at once (a probed
        diagnostic is its mean over the probed steps)."""
        from fedrl.algos.batched import build_batched
        from fedrl.data.buffer import StackedBuffer

        if not (len(agents) == len(cfgs) == len(shards) == len(norms)):
            raise ValueError("one agent, config, shard and normaliser each")
        if draws not in DRAWS:
            raise ValueError(f"draws: choose {', '.join(DRAWS)}, got {draws!r}")
        self.grad_norms_every = _grad_norms_every(grad_norms_every, cfgs[0])
        self.agents, self.cfgs, self.device = list(agents), list(cfgs), device
        self.federate_critic, self.local_normalizer, self.norms = federate_critic, local_normalizer, list(norms)
        self.buffers = [TensorBuffer(tr, m, sd, device, returns_gamma(c)) for tr, (m, sd), c in zip(shards, norms, cfgs)]
        self.buffer = StackedBuffer(self.buffers)
        self.sizes = [len(tr) for tr in shards]
        obs_dim, act_dim = shards[0].obs.shape[1], shards[0].actions.shape[1]
        seeds = [seed] * len(self.agents) if isinstance(seed, int) else list(seed)
        self.gen = make_generator(derive_seed(seeds[0], SEED_BATCH_RNG, rng_stream), device)
        self.member_gens = [make_generator(derive_seed(s, SEED_AGENT_RNG, a), device)
                            for a, s in zip(self.agents, seeds)] if draws == "per-agent" else []
        self.learner = build_batched(self.cfgs, obs_dim, act_dim, device, self.gen)
        # each agent's initial weights exactly as its LocalTrainer's (built on the CPU, then stacked)
        singles = [build_learner(c, obs_dim, act_dim, torch.device("cpu"), derive_seed(s, SEED_AGENT_INIT, a),
                                 derive_seed(s, SEED_AGENT_RNG, a)) for a, c, s in zip(self.agents, self.cfgs, seeds)]
        self.learner.load_members(singles)

    def train_round(self, global_states: Sequence[Mapping[str, torch.Tensor]], steps: int,
                    progress: Callable[[int, int], None] | None = None, trace_every: int = 0) -> list[LocalResult]:
        """Every agent adopts its ``global_states[i]`` and takes ``steps`` local steps. With
        ``trace_every``, each agent's metrics also hold ``trace``: the mean of every diagnostic
        over each ``trace_every`` steps (how a round's values move, step by step)."""
        t0 = time.perf_counter()
        self.learner.begin_round(global_states)
        if self.local_normalizer:
            with torch.no_grad():
                self.learner.policy.obs_mean.copy_(torch.as_tensor(np.stack([m for m, _ in self.norms])))
                self.learner.policy.obs_std.copy_(torch.as_tensor(np.stack([s for _, s in self.norms])))
        # each diagnostic's sum and how many steps reported it (a probed one: the probed steps only)
        sums: dict[str, list] = {}
        chunk: dict[str, list] = {}
        trace: list[dict[str, list[float]]] = []
        batch = self.cfgs[0].batch_size

        def add(into: dict[str, list], k: str, v: torch.Tensor) -> None:
            if k in into:
                into[k][0] += v.detach()
                into[k][1] += 1
            else:
                into[k] = [v.detach().clone(), 1]

        def means(of: dict[str, list]) -> dict[str, list[float]]:
            return {k: (v.double() / n).cpu().tolist() for k, (v, n) in of.items()}

        with subnormals_flushed():  # as LocalTrainer's
            for i in range(steps):
                if progress is not None:
                    progress(i, steps)
                probe = {"grad_norms": True} if self.grad_norms_every and i % self.grad_norms_every == 0 else {}
                step = self.learner.update(*self._member_draws(batch), **probe) if self.member_gens else \
                    self.learner.update(self.buffer.sample(batch, self.gen), **probe)
                for k, v in step.items():
                    add(sums, k, v)
                    if trace_every:
                        add(chunk, k, v)
                if trace_every and ((i + 1) % trace_every == 0 or i + 1 == steps):
                    trace.append({"step": i + 1, **means(chunk)})
                    chunk = {}
        metrics = means(sums)
        states = self.learner.shared_states(self.federate_critic)
        secs = time.perf_counter() - t0
        out = []
        for i, (a, st, n) in enumerate(zip(self.agents, states, self.sizes)):
            m: dict = {k: float(v[i]) for k, v in metrics.items()}
            if trace:
                m["trace"] = [{k: (v if k == "step" else round(v[i], 5)) for k, v in row.items()} for row in trace]
            out.append(LocalResult(a, st, n, m, secs))
        return out

    def _member_draws(self, batch_size: int) -> tuple[Batch, Noise | None]:
        """Every member's minibatch and (DRPO) noise from its own generator, in its
        :class:`LocalTrainer`'s order (the minibatch, then the step's noise), stacked ``(L, ...)``."""
        from fedrl.algos.drpo import draw_noise

        batches, noises = [], []
        drpo = isinstance(self.cfgs[0], DRPOConfig)
        for buf, cfg, gen in zip(self.buffers, self.cfgs, self.member_gens):
            b = buf.sample(batch_size, gen)
            batches.append(b)
            if drpo:
                noises.append(draw_noise(gen, (), batch_size, b.actions.shape[-1], cfg, cfg.lambda2 > 0,
                                         b.obs.device, b.obs.dtype))
        returns = None
        if any(b.returns is not None for b in batches):  # rows of members that read none hold 0, unread
            returns = torch.stack([b.returns if b.returns is not None else torch.zeros_like(b.rewards) for b in batches])
        stacked = Batch(*(torch.stack([getattr(b, k) for b in batches]) for k in Batch._fields[:5]), returns)
        if not drpo:
            return stacked, None
        glob = None
        if self.learner.global_reg:  # a member whose lambda2 is 0 draws none; its zeros are multiplied by 0
            ref = next(n.glob for n in noises if n.glob is not None)
            glob = torch.stack([n.glob if n.glob is not None else torch.zeros_like(ref) for n in noises])
        each = {k: torch.stack([getattr(n, k) for n in noises]) for k in ("pi", "next", "cur", "rand")}
        return stacked, Noise(glob=glob, **each)

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The batched learner's :meth:`checkpoint` and, with per-agent draws, each member's generator."""
        return self.learner.checkpoint() | {f"member_rng/{i}": generator_tensor(g) for i, g in enumerate(self.member_gens)}

    def restore(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue from a :meth:`checkpoint` of a trainer with the same members and draws."""
        gens = {k: v for k, v in state.items() if k.startswith("member_rng/")}
        if len(gens) != len(self.member_gens):
            have, want = ("per-agent" if gens else "batch"), ("per-agent" if self.member_gens else "batch")
            raise ValueError(f"a checkpoint of draws={have!r} cannot continue with draws={want!r}")
        for i, g in enumerate(self.member_gens):
            g.set_state(gens[f"member_rng/{i}"])
        self.learner.restore({k: v for k, v in state.items() if not k.startswith("member_rng/")})
