"""L learners as one batched model equal L learners run one by one.

The batched learners (``fedrl.algos.batched``) share every loss with the single ones, so what
this checks is the batching itself: stacking, the grouped critic, per-learner hyperparameters,
per-learner optimiser moments, begin_round, FedAvg and checkpoints. Both sides get the same
minibatches (each learner's from its own shard, shards of unequal size) and the same random
draws, and run in float64.

Why the tolerance (``RTOL``/``ATOL`` below, |a - b| <= 1e-14 + 1e-12 |b|): the batched step
computes the same sums as the single one in another order (a batched GEMM over learners and
members instead of one GEMM per learner, ``baddbmm`` instead of ``addmm``), so results may differ
by float64 rounding, ~1e-16 relative a step. Measured over these 50 steps: at most 4.4e-16
absolute in any parameter or moment (0.05 of the tolerance). A mutant that mixes learners moves
values by at least a learning rate's step (3e-5 and up) or a moment's share of a gradient, many
orders of magnitude above it. The assertion message gives the worst entry as a multiple of the
tolerance.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fedrl.algos import BCConfig, DRPOConfig, cql_config
from fedrl.algos.base import Batch
from fedrl.algos.batched import BatchedBC, BatchedDRPO, check_batchable
from fedrl.algos.drpo import Noise, draw_noise
from fedrl.data.buffer import StackedBuffer, TensorBuffer
from fedrl.data.d4rl import Transitions
from fedrl.federation.aggregate import aggregate
from fedrl.federation.round import build_learner, returns_gamma

O, A, B, STEPS, ROUND_AT, RESUME_AT = 6, 3, 32, 50, 25, 35
RTOL, ATOL = 1e-12, 1e-14
BASE = DRPOConfig(hidden=(16, 16), batch_size=B, cql_n_actions=3, global_samples=2)
# three learners that differ in every per-learner hyperparameter a sweep varies; the third is CQL
CFGS = [
    dataclasses.replace(BASE, lambda1=0.1, lambda2=0.2, actor_lr=3e-4, critic_lr=3e-4, alpha_lr=3e-4, cql_weight=10.0,
                        cql_calibration="returns-gradient"),
    dataclasses.replace(BASE, lambda1=0.5, lambda2=5.0, actor_lr=1e-3, critic_lr=1e-4, alpha_lr=1e-3, cql_weight=2.0,
                        alpha_init=0.5, target_entropy=-1.0, gamma=0.9, tau=0.01, target_action="mean",
                        cql_calibration="none"),
    cql_config(dataclasses.replace(BASE, actor_lr=1e-4, critic_lr=1e-3, alpha_lr=3e-5, cql_weight=5.0,
                                   td_weight=1.0, cql_calibration="returns")),
]
SIZES = (40, 97, 64)  # each learner's shard; unequal


def shards(sizes=SIZES, seed: int = 0, gammas=None) -> list[TensorBuffer]:
    out = []
    for i, n in enumerate(sizes):
        rng = np.random.default_rng(seed + i)
        obs = rng.normal(size=(n + 1, O)) + i  # learners' data differ
        tr = Transitions(obs[:-1], np.tanh(rng.normal(size=(n, A))) * 0.9, rng.uniform(0, 1, n) + i,
                         obs[1:], (rng.uniform(size=n) < 0.1).astype(np.float64), np.arange(n) // 20)
        gamma = BASE.gamma if gammas is None else gammas.get(i)  # returns-to-go for calibrated learners
        out.append(TensorBuffer(tr, np.zeros(O), np.ones(O), torch.device("cpu"), gamma))
    return out


def to64(buffers: list[TensorBuffer]) -> list[TensorBuffer]:
    for b in buffers:
        for k in ("obs", "next_obs", "actions", "rewards", "dones", "returns"):
            if getattr(b, k) is not None:
                setattr(b, k, getattr(b, k).double())
    return buffers


def fedavg(states, sizes):
    w = torch.tensor(sizes, dtype=torch.float64)
    return aggregate("fedavg", states, (w / w.sum()).tolist())


def worst(a: dict, b: dict) -> tuple[float, str]:
    """The largest |a - b| beyond the tolerance's scale, and where."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    out = (0.0, "")
    for k in a:
        d = float(((a[k].double() - b[k].double()).abs() / (ATOL + RTOL * b[k].double().abs())).max())
        out = max(out, (d, k))
    return out


def run_pair(cfgs, sizes, kind="drpo"):
    """Singles and a batch from the same start, fed the same minibatches and draws; a FedAvg round
    boundary at ROUND_AT and the batch checkpointed and restored into a new one at RESUME_AT."""
    buffers = to64(shards(sizes, gammas={i: returns_gamma(c) for i, c in enumerate(cfgs)}))
    singles = [build_learner(c, O, A, torch.device("cpu"), 10 + i, 20 + i) for i, c in enumerate(cfgs)]
    make = BatchedBC if kind == "bc" else BatchedDRPO
    batched = make(O, A, cfgs, torch.device("cpu"), torch.Generator().manual_seed(5))
    g0 = fedavg([s.shared_state() for s in singles], sizes)
    for s in singles:
        s.begin_round(g0)
    batched.begin_round([g0] * len(cfgs))
    if kind != "bc":  # critics, targets and temperatures are each learner's own from the start
        batched.load_members(singles)
    stacked = StackedBuffer(buffers)
    data_gen, noise_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    for step in range(STEPS):
        if step == ROUND_AT:  # a round boundary: FedAvg over the agents, every learner adopts it
            g1 = fedavg([s.shared_state() for s in singles], sizes)
            gb = fedavg(batched.shared_states(), sizes)
            for s in singles:
                s.begin_round(g1)
            batched.begin_round([gb] * len(cfgs))
        if step == RESUME_AT:  # a stop and a resume into a fresh batch
            ck = batched.checkpoint()
            batched = make(O, A, cfgs, torch.device("cpu"), torch.Generator().manual_seed(999))
            batched.restore(ck)
        batch = stacked.sample(B, data_gen)
        noise = None
        if kind != "bc":
            noise = draw_noise(noise_gen, (len(cfgs),), B, A, cfgs[0], True, torch.device("cpu"), torch.float64)
        for i, s in enumerate(singles):
            mine = Batch(*(None if t is None else t[i] for t in batch))
            if kind == "bc":
                s.update(mine)
            else:
                s.update(mine, Noise(*(None if t is None else t[i] for t in noise)))
        batched.update(batch, noise)
    return singles, batched


@pytest.mark.parametrize("kind", ["drpo", "bc"])
def test_batched_learners_equal_the_same_learners_one_by_one(float64, kind):
    cfgs = CFGS if kind == "drpo" else [BCConfig(hidden=(16, 16), batch_size=B, lr=lr) for lr in (3e-5, 3e-4, 1e-3)]
    singles, batched = run_pair(cfgs, SIZES, kind)
    for i, s in enumerate(singles):
        want = {k: v for k, v in s.checkpoint().items() if k != "rng"}
        got = batched.member_checkpoint(i)
        d, where = worst(got, want)
        assert d <= 1.0, f"learner {i}: {where} differs by {d:.3g} x the tolerance"
    # and the learners really differ from one another (a batch of copies would pass the above trivially)
    p = [batched.member_policy(i)["head.weight"] for i in range(len(cfgs))]
    assert not torch.allclose(p[0], p[1]) and not torch.allclose(p[1], p[2])


def test_a_batch_is_reproducible_from_its_seed_and_its_learners_draw_independently():
    """Two batches from one seed compute the same bits; two learners with the same weights, data
    and settings in one batch part after one step (their draws are their own)."""
    cfg = dataclasses.replace(BASE, lambda1=0.1, lambda2=0.2)
    buffers = shards((50, 50))
    buffers[1] = buffers[0]  # the same data for both learners

    def run():
        torch.manual_seed(0)
        b = BatchedDRPO(O, A, [cfg, cfg], torch.device("cpu"), torch.Generator().manual_seed(3))
        one = build_learner(cfg, O, A, torch.device("cpu"), 1, 2)
        b.load_members([one, one])  # identical learners
        sb, g = StackedBuffer(buffers), torch.Generator().manual_seed(4)
        idx = sb.indices(B, g)
        same = idx[0] - sb.offsets[0]
        fixed = sb.offsets.unsqueeze(1) + same  # the same rows for both learners
        for _ in range(3):
            b.update(Batch(sb.obs[fixed], sb.actions[fixed], sb.rewards[fixed], sb.next_obs[fixed], sb.dones[fixed],
                           sb.returns[fixed]))
        return b

    a, b = run(), run()
    assert all(torch.equal(x, y) for x, y in zip(a.checkpoint().values(), b.checkpoint().values()))
    p0, p1 = a.member_policy(0), a.member_policy(1)
    assert not torch.equal(p0["head.weight"], p1["head.weight"]), "learners in a batch drew the same noise"


def test_stacked_buffer_samples_each_learner_from_its_own_shard_only():
    buffers = shards((5, 300, 17))
    sb = StackedBuffer(buffers)
    g = torch.Generator().manual_seed(0)
    seen = [set() for _ in buffers]
    for _ in range(50):
        batch = sb.sample(64, g)
        for i, buf in enumerate(buffers):
            rows = {tuple(r) for r in buf.obs.tolist()}
            got = {tuple(r) for r in batch.obs[i].tolist()}
            assert got <= rows, f"learner {i} drew rows from another shard"
            seen[i] |= got
    assert len(seen[0]) == 5 and len(seen[2]) == 17  # every row of a small shard is reachable
    assert len(seen[1]) > 250


def test_a_batch_refuses_learners_that_disagree_on_structure():
    with pytest.raises(ValueError, match="cql_n_actions"):
        check_batchable([BASE, dataclasses.replace(BASE, cql_n_actions=5)], ("lambda1",))
    with pytest.raises(ValueError, match="one kind"):
        check_batchable([BASE, BCConfig()], ())
    check_batchable(CFGS, ("actor_lr", "critic_lr", "alpha_lr", "lambda1", "lambda2", "cql_weight",
                           "td_weight", "gamma", "tau", "alpha_init", "target_entropy", "target_action",
                           "cql_calibration"))
