"""The batched engine computes the per-agent engine's federation, on the path real cells take.

``tests/unit/test_batched.py`` checks batched learners against single ones with every per-learner
setting different. A preset's cells give their learners one value of each (one tau, one
calibration, one set of lambdas), so the batch takes its other branches: one float tau for every
target critic, the calibration mask all on or all off, the regularisers computed for all or for
none. Here the two engines run the same federations at such settings, 2 rounds in float64:

- ``fedrl.federation.simulate.run`` with ``engine="per-agent"`` against ``engine="batched",
  draws="per-agent"`` (each member draws its minibatches and noise as its ``LocalTrainer``): the
  global model after every round, every agent's whole learner after every round (policy, pi_bar,
  critics, target critics, temperature, optimiser moments), what every agent sends (with
  ``--federate policy+critic``: its critics and target critics), and its round metrics;
- ``fedrl.federation.cells.run_cells`` with cells of different seeds and methods in one batch
  against each cell's own per-agent simulation: the final global model (or agents' policies).

Tolerance (``RTOL``, ``ATOL``): |a - b| <= 1e-13 + 1e-10 |b|. The batch sums the same products
in another order (batched GEMMs over learners), ~1e-16 relative a step; Adam divides by the root
of its second moment, which amplifies a last-bit difference in a near-zero gradient. Measured over
every comparison here (2026-11-28, this file with the tolerance set to 1e-16 |b|): at most 2.5e-12
|b|, a fortieth of the tolerance. A mis-wired branch moves values by a learning rate's step or a
moment's share of a gradient (1e-6 and up).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fedrl.algos import BCConfig, DRPOConfig
from fedrl.federation import round as round_mod
from fedrl.federation.cells import Cell, run_cells
from fedrl.federation.simulate import SimConfig, run

RTOL, ATOL = 1e-10, 1e-13
# Structure small enough to be quick; every per-learner hyperparameter at its default
DRPO = DRPOConfig(hidden=(16, 16), batch_size=32, cql_n_actions=3)
PAPER_CRITIC = dataclasses.replace(DRPO, cql_calibration="none")  # the verdict preset's critic
BC = BCConfig(hidden=(16, 16), batch_size=32)


def worst(got: dict, want: dict) -> tuple[float, str]:
    """The largest |got - want| as a multiple of the tolerance, and where."""
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    out = (0.0, "")
    for k in want:
        a, b = got[k].double(), want[k].double()
        d = float(((a - b).abs() / (ATOL + RTOL * b.abs())).max()) if a.numel() else 0.0
        out = max(out, (d, k))
    return out


def record(monkeypatch) -> dict[str, list]:
    """Spy on both engines' rounds: each agent's whole learner and what it sent, per round."""
    seen: dict[str, list] = {"per-agent": [], "batched": []}
    local, batched = round_mod.LocalTrainer.train_round, round_mod.BatchedTrainer.train_round

    def local_round(self, *a, **kw):
        res = local(self, *a, **kw)
        seen["per-agent"].append((self.agent, {k: v.clone() for k, v in self.learner.checkpoint().items() if k != "rng"},
                                  res))
        return res

    def batched_round(self, *a, **kw):
        out = batched(self, *a, **kw)
        for i, res in enumerate(out):
            seen["batched"].append((self.agents[i], self.learner.member_checkpoint(i), res))
        return out

    monkeypatch.setattr(round_mod.LocalTrainer, "train_round", local_round)
    monkeypatch.setattr(round_mod.BatchedTrainer, "train_round", batched_round)
    return seen


CASES = {
    "drpo": dict(algo="drpo", drpo=DRPO),
    "drpo-paper-critic": dict(algo="drpo", drpo=PAPER_CRITIC),
    "fed-cql": dict(algo="fed-cql", drpo=DRPO),
    "cql-paper-critic": dict(algo="cql", drpo=PAPER_CRITIC),
    "fed-bc-local-norm": dict(algo="fed-bc", obs_norm="local"),
    "drpo-federated-critic": dict(algo="drpo", drpo=DRPO, federate="policy+critic"),
    "fed-cql-federated-critic-local-norm": dict(algo="fed-cql", drpo=PAPER_CRITIC, federate="policy+critic",
                                                obs_norm="local"),
    "drpo-fixed-alpha": dict(algo="drpo", drpo=dataclasses.replace(DRPO, auto_alpha=False, alpha_init=0.2)),
    "drpo-temperature-from-zero": dict(algo="drpo", drpo=dataclasses.replace(DRPO, alpha_init=0.0)),
    "fed-cql-actor-moments-kept": dict(algo="fed-cql", drpo=dataclasses.replace(DRPO, reset_actor_optimizer=False)),
    "fed-bc-moments-kept": dict(algo="fed-bc", bc=dataclasses.replace(BC, reset_actor_optimizer=False)),
    # the actor's gradient norm per term, probed on steps 0 and 4 of 6 (a mean over the probed
    # steps, not all six); Fed-CQL's lambda terms are 0 and Fed-BC has none
    "drpo-gradient-norms": dict(algo="drpo", drpo=PAPER_CRITIC, grad_norms_every=4),
    "fed-cql-gradient-norms": dict(algo="fed-cql", drpo=DRPO, grad_norms_every=4),
    "fed-bc-gradient-norms": dict(algo="fed-bc", grad_norms_every=4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_batched_engine_runs_the_per_agent_federation(tmp_path, random_dataset, monkeypatch, float64, case):
    kw = {"drpo": DRPO, "bc": BC, **CASES[case]}
    cfg = SimConfig(datasets=(str(random_dataset),), agents=3, trajectories=3, rounds=2, local_steps=6,
                    eval_episodes=0, seed=4, device="cpu", **kw)
    seen = record(monkeypatch)
    globals_: dict[str, list] = {}
    for engine in ("per-agent", "batched"):
        globals_[engine] = []
        run(cfg, tmp_path / engine, log=lambda m: None, engine=engine, draws="per-agent",
            on_round=lambda r, g, e=engine: globals_[e].append({k: v.clone() for k, v in g.items()}))
    per, bat = seen["per-agent"], seen["batched"]
    assert len(per) == len(bat) == 3 * 2
    for (a, want, r_want), (b, got, r_got) in zip(per, bat):
        assert a == b
        d, where = worst(got, want)
        assert d <= 1.0, f"{case}: agent {a}'s learner: {where} differs by {d:.3g} x the tolerance"
        d, where = worst(r_got.state, r_want.state)
        assert d <= 1.0, f"{case}: what agent {a} sends: {where} differs by {d:.3g} x the tolerance"
        assert r_got.num_samples == r_want.num_samples and r_got.metrics.keys() == r_want.metrics.keys()
        for k, v in r_want.metrics.items():
            assert r_got.metrics[k] == pytest.approx(v, rel=RTOL, abs=ATOL), (case, a, k)
        probed = {k for k in r_want.metrics if k.startswith("grad_")}
        assert bool(probed) == (cfg.grad_norms_every > 0 and cfg.algo != "fed-bc"), (case, sorted(probed))
    if cfg.federate == "policy+critic":
        assert any(k.startswith("critic_target.") for k in per[0][2].state)
    if cfg.algo != "cql":
        assert len(globals_["per-agent"]) == len(globals_["batched"]) == 2
        for r, (want, got) in enumerate(zip(globals_["per-agent"], globals_["batched"]), 1):
            d, where = worst(got, want)
            assert d <= 1.0, f"{case}: the global model after round {r}: {where} differs by {d:.3g} x the tolerance"
    # the agents really differ (equal copies would agree trivially) and the rounds moved them
    heads = [st["policy.head.weight"] for _, st, _ in per[-3:]]
    assert not torch.allclose(heads[0], heads[1])


@pytest.mark.parametrize("federate", ["policy", "policy+critic"])
def test_cells_of_different_seeds_in_one_batch_each_equal_their_own_simulation(tmp_path, random_dataset, monkeypatch,
                                                                               float64, federate):
    base = dict(datasets=(str(random_dataset),), agents=2, trajectories=3, rounds=2, local_steps=5, eval_episodes=0,
                device="cpu", drpo=PAPER_CRITIC, bc=BC, federate=federate,
                grad_norms_every=2 if federate == "policy+critic" else 0)
    cells = [Cell("drpo-s0", SimConfig(algo="drpo", seed=0, **base)),
             Cell("drpo-s1", SimConfig(algo="drpo", seed=1, **base)),
             Cell("fed-cql-s1", SimConfig(algo="fed-cql", seed=1, **base)),
             Cell("cql-s2", SimConfig(algo="cql", seed=2, **base))]
    if federate == "policy":  # Fed-BC has no critic to federate
        cells += [Cell("fed-bc-s0", SimConfig(algo="fed-bc", seed=0, **base)),
                  Cell("fed-bc-s1", SimConfig(algo="fed-bc", seed=1, **base))]
    together = run_cells(cells, tmp_path / "cells", log=lambda m: None, draws="per-agent")
    seen = record(monkeypatch)
    for c in cells:
        seen["per-agent"].clear()
        finals = []
        run(c.cfg, tmp_path / c.key, log=lambda m: None, engine="per-agent", on_round=lambda r, g: finals.append(g))
        got = together[c.key]
        if c.cfg.algo == "cql":  # alone: each agent's own policy is the cell's result
            want_states = [res.state for _, _, res in seen["per-agent"][-c.cfg.agents:]]
            got_states = got["agent_states"]
        else:
            want_states, got_states = [finals[-1]], [got["global_state"]]
        for want, mine in zip(want_states, got_states, strict=True):
            d, where = worst(mine, want)
            assert d <= 1.0, f"cell {c.key}: {where} differs from its own simulation by {d:.3g} x the tolerance"
        rows = [json.loads(x) for x in (tmp_path / "cells" / c.key / "rounds.jsonl").read_text().splitlines()]
        own = [json.loads(x) for x in (tmp_path / c.key / "rounds.jsonl").read_text().splitlines()]
        for r_cells, r_own in zip(rows, own, strict=True):
            for a_cells, a_own in zip(r_cells["agents"], r_own["agents"], strict=True):
                assert a_cells.keys() == a_own.keys(), (c.key, sorted(a_cells.keys() ^ a_own.keys()))
                for k in a_own:
                    if k != "seconds":
                        assert a_cells[k] == pytest.approx(a_own[k], rel=RTOL, abs=ATOL), (c.key, k)
    # cells of different seeds are different runs
    assert not torch.allclose(together["drpo-s0"]["global_state"]["policy.head.weight"],
                              together["drpo-s1"]["global_state"]["policy.head.weight"])


def test_draws_are_checked_and_a_checkpoint_keeps_its_mode(tmp_path, random_dataset):
    cfg = SimConfig(algo="fed-cql", datasets=(str(random_dataset),), agents=2, trajectories=2, rounds=2,
                    local_steps=3, eval_episodes=0, device="cpu", drpo=DRPO)
    with pytest.raises(ValueError, match="draws"):
        run(cfg, tmp_path / "bad", log=lambda m: None, engine="batched", draws="sometimes")

    class Stop(Exception):
        pass

    def stop_after_round_1(m):
        if m.startswith("round   1/2"):
            raise Stop

    with pytest.raises(Stop):
        run(cfg, tmp_path / "cut", log=stop_after_round_1, engine="batched", draws="per-agent", checkpoint=True)
    with pytest.raises(ValueError, match="draws='per-agent' cannot continue with draws='batch'"):
        run(cfg, tmp_path / "cut", log=lambda m: None, engine="batched", checkpoint=True)
    # with its own mode it continues to what an uninterrupted run computes
    whole, cont = [], []
    run(cfg, tmp_path / "whole", log=lambda m: None, engine="batched", draws="per-agent",
        on_round=lambda r, g: whole.append(g))
    run(cfg, tmp_path / "cut", log=lambda m: None, engine="batched", draws="per-agent", checkpoint=True,
        on_round=lambda r, g: cont.append(g))
    assert all(torch.equal(whole[-1][k], cont[-1][k]) for k in whole[-1])
