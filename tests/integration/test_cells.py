"""Many runs (cells) trained as one batched model: each cell is its own federation."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fedrl.algos import BCConfig, DRPOConfig
from fedrl.federation.cells import Cell, check_cells, run_cells
from fedrl.federation.simulate import SimConfig

TINY_DRPO = DRPOConfig(hidden=(16, 16), batch_size=16, cql_n_actions=2)
TINY_BC = BCConfig(hidden=(16, 16), batch_size=16)


def cells(dataset, rounds=2, seeds=(0,)):
    base = dict(datasets=(str(dataset),), agents=2, trajectories=2, rounds=rounds, local_steps=3,
                eval_episodes=2, device="cpu", drpo=TINY_DRPO, bc=TINY_BC)
    out = []
    for s in seeds:
        for algo in ("drpo", "fed-cql", "cql", "fed-bc"):
            out.append(Cell(f"{algo}-s{s}", SimConfig(algo=algo, seed=s, **base)))
    out.append(Cell("drpo-l2_5-s0", SimConfig(algo="drpo", seed=0, **{**base, "drpo": dataclasses.replace(
        TINY_DRPO, lambda2=5.0)})))
    return out


class _Killed(Exception):
    pass


def test_cells_train_as_their_own_federations_and_resume_exactly(tmp_path, random_dataset, monkeypatch):
    """Every cell writes a round per line with its agents' losses and an evaluation; each cell's
    next round starts from the FedAvg of its own agents (the CQL baseline: each agent's own
    policy); a run stopped after round 1 of 2 resumes to the same bits as one never stopped."""
    from fedrl.federation import round as round_mod

    cs = cells(random_dataset, seeds=(0, 1))
    seen = []
    real = round_mod.BatchedTrainer.train_round

    def train_round(self, states, steps, progress=None, **kw):
        res = real(self, states, steps, progress, **kw)
        seen.append((self.learner.members, [dict(s) for s in states], [r.state for r in res]))
        return res

    monkeypatch.setattr(round_mod.BatchedTrainer, "train_round", train_round)
    whole = run_cells(cs, tmp_path / "whole", log=lambda m: None)
    # round 1 then round 2, each the DRPO-family batch (7 cells' 2 agents: drpo, fed-cql, cql x 2 seeds
    # + the lambda cell) then the BC batch (2 cells)
    (n_d, _, ret_d), (n_b, _, ret_b), (_, in_d, _), (_, in_b, _) = seen
    assert (n_d, n_b) == (14, 4)
    drpo_cells = [c.key for c in cs if c.cfg.algo != "fed-bc"]
    for i, key in enumerate(drpo_cells):
        a, b = ret_d[2 * i], ret_d[2 * i + 1]  # the cell's two agents' updates
        given = in_d[2 * i]
        if key.startswith("cql"):  # alone: each agent continues from its own policy
            assert torch.equal(in_d[2 * i]["policy.head.weight"], a["policy.head.weight"])
            assert torch.equal(in_d[2 * i + 1]["policy.head.weight"], b["policy.head.weight"])
        else:
            torch.testing.assert_close(given["policy.head.weight"], (a["policy.head.weight"] + b["policy.head.weight"]) / 2)
    torch.testing.assert_close(in_b[0]["policy.head.weight"], (ret_b[0]["policy.head.weight"] + ret_b[1]["policy.head.weight"]) / 2)
    for c in cs:
        rows = [json.loads(x) for x in (tmp_path / "whole" / c.key / "rounds.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [1, 2] and len(rows[0]["agents"]) == 2
        assert all("eval" in r for r in rows) and whole[c.key]["finished"]
        assert ("critic_td" in rows[0]["agents"][0]) == (c.cfg.algo != "fed-bc")
        assert (rows[0]["eval"]["spread_over"] == "agents") == (c.cfg.algo == "cql")
    monkeypatch.setattr(round_mod.BatchedTrainer, "train_round", real)

    def stop_after_round_1(m):
        if m.startswith("round   1/2"):
            raise _Killed

    with pytest.raises(_Killed):
        run_cells(cs, tmp_path / "cut", log=stop_after_round_1)
    logs = []
    resumed = run_cells(cs, tmp_path / "cut", log=logs.append)
    assert any(m.startswith("resuming 9 cells after round 1") for m in logs), logs
    for c in cs:
        assert resumed[c.key]["curve"] == whole[c.key]["curve"]
        a, b = whole[c.key]["global_state"], resumed[c.key]["global_state"]
        assert all(torch.equal(a[k], b[k]) for k in a)
        ra = (tmp_path / "whole" / c.key / "rounds.jsonl").read_text().splitlines()
        rb = (tmp_path / "cut" / c.key / "rounds.jsonl").read_text().splitlines()
        def losses(line):
            return [{k: v for k, v in ag.items() if k != "seconds"} for ag in json.loads(line)["agents"]]

        assert [losses(x) for x in ra] == [losses(x) for x in rb]


def test_a_batch_refuses_to_resume_on_data_other_than_it_started_on(tmp_path, random_dataset):
    import shutil

    import h5py

    data = tmp_path / "data.hdf5"
    shutil.copy(random_dataset, data)
    cs = cells(data)[:2]

    def stop_after_round_1(m):
        if m.startswith("round   1/2"):
            raise _Killed

    with pytest.raises(_Killed):
        run_cells(cs, tmp_path / "cut", log=stop_after_round_1)
    with h5py.File(data, "r+") as f:
        f["rewards"][...] = f["rewards"][...] * 2.0
    with pytest.raises(ValueError, match=r"cell drpo-s0: this run started on other data \(agent\(s\) 0, 1:"):
        run_cells(cs, tmp_path / "cut", log=lambda m: None)
    shutil.copy(random_dataset, data)
    assert all(r["finished"] for r in run_cells(cs, tmp_path / "cut", log=lambda m: None).values())


def test_a_finished_cell_evaluates_its_final_policy_again_over_its_own_episodes(tmp_path, random_dataset):
    """``final_eval_episodes``: the final policy (a ``cql`` cell's every agent's) over that many
    episodes from ``fedrl simulate``'s seed of its own, evaluated here by the plain evaluator."""
    from fedrl.algos.base import POLICY, load_prefixed
    from fedrl.algos.nets import TanhGaussianPolicy
    from fedrl.common.device import derive_seed
    from fedrl.envs.evaluation import evaluate
    from fedrl.federation.round import SEED_EVAL

    cs = [Cell(c.key, dataclasses.replace(c.cfg, final_eval_episodes=3 if c.key != "fed-bc-s0" else 0))
          for c in cells(random_dataset) if c.key in ("drpo-s0", "cql-s0", "fed-bc-s0")]
    out = run_cells(cs, tmp_path, log=lambda m: None)
    assert "final_long" not in out["fed-bc-s0"]
    for key in ("drpo-s0", "cql-s0"):
        long = out[key]["final_long"]
        states = out[key]["agent_states"] if key.startswith("cql") else [out[key]["global_state"]]
        seed = derive_seed(0, SEED_EVAL, 1) % 2**31
        returns = []
        for st in states:
            pol = TanhGaussianPolicy(11, 3, TINY_DRPO.hidden, TINY_DRPO.log_std_min, TINY_DRPO.log_std_max)
            load_prefixed(pol, st, POLICY)
            returns.append(evaluate(pol, "Hopper-v5", 3, seed).as_dict()["return_mean"])
        assert long["episodes"] == 3 and long["round"] == 2
        assert long["return_mean"] == pytest.approx(sum(returns) / len(returns), rel=1e-9), key
        assert long["return_mean"] != pytest.approx(out[key]["final"]["return_mean"], rel=1e-9)  # not the round's


def test_a_deadline_stops_before_a_round_that_would_not_fit(tmp_path, random_dataset):
    import time

    logs = []
    out = run_cells(cells(random_dataset, rounds=3)[:2], tmp_path, log=logs.append,
                    deadline=time.time() + 1e-3, round_seconds_hint=60.0)
    assert all(r["rounds_done"] == 0 and not r["finished"] for r in out.values())
    assert any("stopping before round 1" in m for m in logs)


def test_cells_that_cannot_share_a_batch_are_refused_by_name(random_dataset):
    cs = cells(random_dataset)
    with pytest.raises(ValueError, match="local_steps"):
        check_cells([cs[0], Cell("other", dataclasses.replace(cs[1].cfg, local_steps=7))])
    with pytest.raises(ValueError, match="repeat"):
        check_cells([cs[0], cs[0]])
