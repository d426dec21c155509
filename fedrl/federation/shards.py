"""An agent's data: every source loaded and checked against the task, and its trajectories
dealt to the agents (seeded), the same way wherever a federation runs: ``fedrl simulate``, the
cells, the agent service (which keeps only its own shard) and ``fedrl up``'s checks before any
process starts. So a service run and an in-process run with the same settings train on identical
data."""

from __future__ import annotations

from collections.abc import Callable

from fedrl.common.device import derive_seed
from fedrl.data.d4rl import check_env_dims, to_transitions
from fedrl.data.errors import DatasetError
from fedrl.data.partition import Shard, ShardSource, partition
from fedrl.data.registry import check_one_env, infer_env, load
from fedrl.envs import EnvInfo
from fedrl.federation.round import SEED_SHARDS


def parse_source(spec: str, default_agents: int) -> tuple[str, int]:
    """``PATH`` or ``PATH:N`` -> (path, agents)."""
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isdigit() and head:
        return head, int(tail)
    return spec, default_agents


def load_shards(datasets: tuple[str, ...] | list[str], default_agents: int, trajectories: int,
                seed: int, env_name: str | None, log: Callable[[str], None],
                transitions: int = 0) -> tuple[list[Shard], EnvInfo]:
    """Load every source, check it against the env, deal trajectories to agents (seeded).

    The agent service calls this too and keeps only its own shard.
    """
    sources, env = [], None
    check_one_env([parse_source(spec, default_agents)[0] for spec in datasets])
    for spec in datasets:
        path, n_agents = parse_source(spec, default_agents)
        raw = load(path, progress=log)
        e = infer_env(raw, path, env_name)
        env = env or e
        if e.key != env.key:
            raise ValueError(f"datasets mix environments: {env.gym_id} and {e.gym_id} ({path})")
        try:  # the evaluator must be able to produce this observation layout
            env.gym_kwargs(raw.obs_dim)
        except ValueError as e:
            raise DatasetError(raw.source, f"observations have {raw.obs_dim} dims: {e}") from None
        check_env_dims(raw, raw.obs_dim, env.act_dim, env.gym_id)
        sources.append(ShardSource(raw.source, to_transitions(raw), n_agents))
    return partition(sources, trajectories, derive_seed(seed, SEED_SHARDS), transitions=transitions), env
