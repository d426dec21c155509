"""The behaviour checkpoints this repository ships: every quality is makeable here, in its band."""

from __future__ import annotations

import numpy as np
import pytest

from fedrl.behavior.shipped import behavior_set, shipped_envs
from fedrl.data.d4rl import load_d4rl, to_transitions
from fedrl.data.make import make_dataset
from fedrl.data.registry import resolve

pytestmark = pytest.mark.skipif("hopper" not in shipped_envs(), reason="no Hopper behaviour set shipped")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("shipped")
    qualities = ["random", "medium", "medium-replay"]
    if behavior_set("hopper").manifest.get("expert"):
        qualities += ["expert", "medium-expert"]
    return {q: load_d4rl(make_dataset("Hopper-v5", q, seed=0, out=d / f"{q}.hdf5", episodes=5))
            for q in qualities}


def _complete_returns(raw):
    return raw.episode_returns()


def test_shipped_manifest_is_consistent():
    bs = behavior_set("hopper")
    m = bs.manifest
    assert m["env_id"] == "Hopper-v5"
    files = {p.name for p in bs.root.glob("*.safetensors")}
    named = {m["medium"]["file"], *(c["file"] for c in m["medium_replay"]["checkpoints"])}
    if m["expert"]:
        named.add(m["expert"]["file"])
        assert m["expert"]["stochastic_return_mean"] >= 2500
        assert 0.2 <= m["medium"]["stochastic_return_mean"] / m["expert"]["stochastic_return_mean"] <= 0.5
    assert files == named
    assert sum(p.stat().st_size for p in bs.root.glob("*.safetensors")) < 3_000_000


def test_each_quality_has_the_keys_and_returns_in_its_band(made):
    for q, raw in made.items():
        assert raw.observations.shape[1] == 11 and raw.actions.shape[1] == 3, q
        assert raw.metadata["quality"] == q and raw.metadata["env_id"] == "Hopper-v5"
        assert len(to_transitions(raw)) > 0
    rand = _complete_returns(made["random"]).mean()
    med = _complete_returns(made["medium"]).mean()
    assert rand < med
    target = behavior_set("hopper").manifest["selection"]["medium_target"]
    assert 0.5 * target <= med <= 1.6 * target, (med, target)
    if "expert" in made:
        exp = _complete_returns(made["expert"]).mean()
        assert exp >= 2500 and rand < exp
        assert 0.2 <= med / exp <= 0.5, (med, exp)


def test_named_medium_dataset_is_made_from_the_shipped_policies(monkeypatch):
    import fedrl.data.registry as reg
    monkeypatch.setattr(reg, "NAMED_TRANSITIONS", 2000)
    path = resolve("hopper-medium-v2", progress=lambda m: None)
    raw = load_d4rl(path)
    assert len(raw) == 2000 and raw.metadata["quality"] == "medium"
    assert raw.metadata["behavior"]["sha256"] == behavior_set("hopper").manifest["medium"]["sha256"]
    assert np.isfinite(raw.rewards).all()
