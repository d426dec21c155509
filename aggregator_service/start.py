"""A run's start: choosing its agents among those connected (one task, the configured env), the
checks that must hold before anything is built, the global observation normaliser, version 0
written with the participants, and the run's round machine; in a secure run with pooled
normalisation, the machine gathers the agents' moments first (round 0), and version 0 is made
from their sum.

A part of :class:`aggregator_service.coordinator.Coordinator`: it uses the agent registry and
the journal (given at construction) and the shared state; the rounds use it. Under the lock."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import numpy as np

from aggregator_service.agents import AgentRegistry
from aggregator_service.journal import Journal
from aggregator_service.records import Run, Shared, encode_version, env_mismatch, task_of
from aggregator_service.store import Store
from fedrl.data.normalize import ObsStats, global_normalizer
from fedrl.federation.machine import Plan, RoundMachine, State
from fedrl.federation.round import algo_config, initial_global_state
from fedrl.federation.runconfig import MAX_MODEL_BYTES, check_step_bytes, model_bytes
from fedrl.wire.manifest import MAX_MESSAGE_BYTES

log = logging.getLogger("fedrl.aggregator")


class RunStart:
    def __init__(self, shared: Shared, registry: AgentRegistry, journal: Journal, store: Store) -> None:
        self.s, self.registry, self.journal, self.store = shared, registry, journal, store

    def maybe_begin(self, run: Run) -> bool:
        """Make the waiting ``run``'s rounds if enough agents of one task are connected, with
        version 0 (or, in a secure run with pooled normalisation, to gather the moments it is made
        from first): True once they are ready to begin; False while it waits or when it failed.
        An agent may be chosen by several runs: it takes their tasks in turn."""
        if run.state != "waiting_for_agents" or len(self.registry.agents) < run.cfg.agents:
            return False
        now = time.time()  # a run takes agents that are connected now, never records of agents gone
        present = [a for a in self.registry.agents.values() if self.registry.connected(a, now)]
        if len(present) < run.cfg.agents:
            return False
        cfg = run.cfg
        if cfg.env is not None:  # the config names the task: only agents it can evaluate count
            problems = {a.agent_id: env_mismatch(cfg.env, {a.env_id} if a.env_id else set(), a.obs_dim, a.act_dim)
                        for a in present}
            if all(problems.values()):  # not one agent of its task: the config, not an agent, is wrong
                first = min(present, key=lambda a: (a.index, a.agent_id))
                self.journal.fail(run, problems[first.agent_id])
                return False
            present = [a for a in present if not problems[a.agent_id]]
        groups: dict[tuple[str, int, int], list] = {}
        for a in sorted(present, key=lambda a: (a.index, a.agent_id)):
            groups.setdefault(task_of(a), []).append(a)
        # the largest group that agrees on the task (ties: the group of the lowest index); agents
        # of another task are left out, and one that disagreed from the start decides nothing
        largest = max(groups.values(), key=len, default=[])
        if len(largest) < cfg.agents:
            return False  # not enough agents of one task yet: the join timeout says so if it stays so
        chosen = largest[: cfg.agents]
        envs = {a.env_id for a in chosen if a.env_id}
        obs_dim, act_dim = chosen[0].obs_dim, chosen[0].act_dim
        if cfg.env is not None:  # the evaluation env must be the agents' task
            problem = env_mismatch(cfg.env, envs, obs_dim, act_dim)
            if problem:
                self.journal.fail(run, problem)
                return False
        hp = algo_config(cfg.algo, cfg.drpo, cfg.bc)
        size = model_bytes(hp.hidden, obs_dim, act_dim, cfg.federate == "policy+critic")
        if size > MAX_MODEL_BYTES:  # before anything is built
            self.journal.fail(run, f"the global model would be {size / 2**20:.0f} MiB (hidden {list(hp.hidden)}, obs_dim "
                            f"{obs_dim}, act_dim {act_dim}); a run's model may be at most {MAX_MODEL_BYTES >> 20} MiB")
            return False
        if cfg.secagg_threshold and 8 * (size // 4 + 1) + 4096 > MAX_MESSAGE_BYTES:
            self.journal.fail(run, f"secure aggregation sends each agent's masked model in one message of 8 bytes a value: "
                            f"this model's would be {8 * (size // 4 + 1) / 2**20:.1f} MiB, over the "
                            f"{MAX_MESSAGE_BYTES >> 20} MiB a message may be")
            return False
        if problem := check_step_bytes(hp, obs_dim, act_dim):  # the agents could not take a step
            self.journal.fail(run, f"{problem} (obs_dim {obs_dim}, act_dim {act_dim})")
            return False
        run.chosen([a.agent_id for a in chosen], cfg.env or (envs.pop() if envs else ""), (obs_dim, act_dim))
        plan = Plan.of(cfg, run.selected, [a.num_samples for a in chosen], run.run_id, obs_dim)
        if plan.gather:  # the moments too go masked: round 0, whose sum makes version 0
            run.begin(RoundMachine(plan, None))
            log.info("run %s: gathering the observation moments of %d agents by secure aggregation", run.run_id,
                     len(chosen))
            return True
        if cfg.obs_norm != "none" and any(a.stats is None for a in chosen):
            private = [a.agent_id for a in chosen if a.stats is None]
            self.journal.fail(run, f"obs_norm={cfg.obs_norm} needs every agent's observation moments, and "
                            f"{', '.join(private[:5])}{' ...' if len(private) > 5 else ''} kept theirs private: "
                            f"set secagg_threshold to sum them under secure aggregation, or obs_norm=none")
            return False
        stats = [a.stats for a in chosen] if cfg.obs_norm != "none" else [ObsStats(1, np.zeros(obs_dim), np.zeros(obs_dim))]
        with np.errstate(all="ignore"):
            g_mean, g_std = global_normalizer(cfg.obs_norm, stats)
        own = {a.agent_id: a.stats.mean_std() for a in chosen} if cfg.obs_norm == "local" else {}
        state = self.version_zero(run, g_mean, g_std, own)
        if state is None:
            return False
        run.begin(RoundMachine(plan, state))
        return True

    def version_zero(self, run: Run, g_mean: np.ndarray, g_std: np.ndarray,
                     own: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> State | None:
        """Version 0 from the global normaliser, written with the participants (``run.selected``)
        and their normalisers (their ``own`` under obs_norm=local, else the global): its state, or
        None when the run failed instead, saying why."""
        cfg = run.cfg
        if not (np.isfinite(g_mean).all() and np.isfinite(g_std).all()):  # each agent's were finite; their pool overflowed
            self.journal.fail(run, "the agents' pooled observation moments are not finite")
            return None
        hp = algo_config(cfg.algo, cfg.drpo, cfg.bc)
        state = initial_global_state(hp, *run.dims, cfg.seed, g_mean, g_std, cfg.federate == "policy+critic")
        enc = encode_version(run, 0, state)
        try:
            self.store.save_version(run.run_id, 0, enc.pieces(), enc.manifest.checksum)
        except OSError as e:
            self.journal.fail(run, f"cannot write version 0 to the state directory: {e}")
            return None
        norms = {a: tuple(x.tolist() for x in own.get(a, (g_mean, g_std))) for a in run.selected}
        run.normalised(norms)
        samples = list(run.machine.plan.samples) if run.machine is not None else [
            self.registry.agents[a].num_samples for a in run.selected]
        try:
            self.store.save_participants(run.run_id, {"selected": run.selected, "norms": run.norms,
                                                      "env_id": run.env_id, "samples": samples})
        except OSError as e:
            self.journal.fail(run, f"cannot write the participants to the state directory: {e}")
            return None
        run.written(0, enc)
        return state
