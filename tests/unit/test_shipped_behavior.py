"""The behaviour checkpoints this repository ships: every quality is makeable here, in its band,
for every environment with a shipped set."""

from __future__ import annotations

import numpy as np
import pytest

from fedrl.behavior.shipped import EXPERT_MIN, behavior_set, shipped_envs
from fedrl.data.d4rl import load_d4rl, to_transitions
from fedrl.data.make import make_dataset
from fedrl.data.registry import makeable, resolve
from fedrl.envs import env_info

pytestmark = pytest.mark.slow(reason="makes every shipped quality's dataset by rolling out its behaviour policy")

# episodes per quality: sampling policies that fall now and then (Ant's medium: 1008 +- 440 over
# 50) put a 5-episode mean's ratio to the expert's outside its band by chance
EPISODES = 20
# the mixtures (medium-replay, medium-expert) are only checked for their keys and shapes here:
# their policies' returns are the ones checked in their own qualities
MIXED_EPISODES = 2


def test_hopper_is_shipped():
    assert "hopper" in shipped_envs()  # the default dataset, hopper-medium-v2, is made from it


@pytest.fixture(scope="module", params=shipped_envs())
def made(request, tmp_path_factory):
    env = request.param
    d = tmp_path_factory.mktemp(f"shipped-{env}")
    qualities = ["random", "medium", "medium-replay"]
    if behavior_set(env).manifest.get("expert"):
        qualities += ["expert", "medium-expert"]
    assert set(qualities) == set(makeable(env))  # what named datasets of this env can be made from
    gym_id = env_info(env).gym_id
    return env, {q: load_d4rl(make_dataset(gym_id, q, seed=0, out=d / f"{q}.hdf5",
                                           episodes=MIXED_EPISODES if q.startswith("medium-") else EPISODES))
                 for q in qualities}


@pytest.mark.parametrize("env", shipped_envs())
def test_shipped_manifest_is_consistent(env):
    bs = behavior_set(env)
    m = bs.manifest
    assert m["env_id"] == env_info(env).gym_id
    files = {p.name for p in bs.root.glob("*.safetensors")}
    named = {m["medium"]["file"], *(c["file"] for c in m["medium_replay"]["checkpoints"])}
    if m["expert"]:
        named.add(m["expert"]["file"])
        assert m["expert"]["stochastic_return_mean"] >= EXPERT_MIN[env]
        assert 0.2 <= m["medium"]["stochastic_return_mean"] / m["expert"]["stochastic_return_mean"] <= 0.5
    else:
        assert m["expert_missing_reason"]
    assert files == named
    assert sum(p.stat().st_size for p in bs.root.glob("*.safetensors")) < 3_000_000


def test_each_quality_has_the_keys_and_returns_in_its_band(made):
    env, made = made
    info = env_info(env)
    for q, raw in made.items():
        assert raw.observations.shape[1] == info.obs_dim and raw.actions.shape[1] == info.act_dim, q
        assert raw.metadata["quality"] == q and raw.metadata["env_id"] == info.gym_id
        assert len(to_transitions(raw)) > 0
    rand = made["random"].episode_returns().mean()
    med = made["medium"].episode_returns().mean()
    assert rand < med
    target = behavior_set(env).manifest["selection"]["medium_target"]
    assert 0.5 * target <= med <= 1.6 * target, (med, target)
    if "expert" in made:
        exp = made["expert"].episode_returns().mean()
        assert exp >= EXPERT_MIN[env] and rand < exp
        assert 0.2 <= med / exp <= 0.5, (med, exp)


def test_named_medium_dataset_is_made_from_the_shipped_policies(monkeypatch):
    import fedrl.data.registry as reg
    monkeypatch.setattr(reg, "NAMED_TRANSITIONS", 2000)
    path = resolve("hopper-medium-v2", progress=lambda m: None)
    raw = load_d4rl(path)
    assert len(raw) == 2000 and raw.metadata["quality"] == "medium"
    assert raw.metadata["behavior"]["sha256"] == behavior_set("hopper").manifest["medium"]["sha256"]
    assert np.isfinite(raw.rewards).all()
