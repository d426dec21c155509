"""Training flushes subnormal floats (a CQL critic's backward is ~3x slower with them late in a
run, docs/performance.md): both engines' rounds train inside ``subnormals_flushed``, and the
thread's setting is back off after, so nothing outside training (an accountant's float64, an
evaluation) computes otherwise. Each check runs in a thread of its own: a failure leaves the
test process's own setting alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from fedrl.algos import DRPOConfig
from fedrl.common.device import subnormals_flushed
from fedrl.federation.round import BatchedTrainer, LocalTrainer
from tests.unit.test_grad_norms import O, transitions  # small random data and its observation size

TINY = 1e-39  # a float32 subnormal: below torch.finfo(torch.float32).tiny
CFG = DRPOConfig(hidden=(16, 16), batch_size=32, cql_n_actions=3)


def flushing() -> bool:
    """Whether this thread's arithmetic flushes subnormals now."""
    return float(torch.tensor([TINY]) * 1.0) == 0.0


def in_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(timeout=600)
    assert not t.is_alive() and out, "the check's thread did not finish"
    return out[0]


def test_the_flush_holds_within_nests_and_ends_with_the_outermost():
    def check():
        seen = [flushing()]
        with subnormals_flushed():
            seen.append(flushing())
            with subnormals_flushed():
                seen.append(flushing())
            seen.append(flushing())  # the inner exit leaves it to the outer
        seen.append(flushing())
        return seen

    assert in_thread(check) == [False, True, True, True, False]


def test_the_flush_is_the_threads_own():
    entered, leave = threading.Event(), threading.Event()

    def hold():
        with subnormals_flushed():
            entered.set()
            leave.wait(timeout=600)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert entered.wait(timeout=600)
        assert in_thread(flushing) is False  # another thread computes as before
    finally:
        leave.set()
        t.join(timeout=600)


def test_a_local_round_trains_flushed_and_leaves_the_thread_as_it_was():
    def check():
        tr = LocalTrainer(0, CFG, transitions(), np.zeros(O), np.ones(O), seed=3, device=torch.device("cpu"))
        during: list[bool] = []
        tr.train_round(tr.learner.shared_state(False), 3, progress=lambda i, n: during.append(flushing()))
        return during, flushing()

    during, after = in_thread(check)
    assert during == [True] * 3 and after is False


def test_a_batched_round_trains_flushed_and_leaves_the_thread_as_it_was():
    def check():
        tr = BatchedTrainer([0, 1], [CFG] * 2, [transitions()] * 2, [(np.zeros(O), np.ones(O))] * 2, seed=3,
                            device=torch.device("cpu"))
        singles = [LocalTrainer(a, CFG, transitions(), np.zeros(O), np.ones(O), seed=3, device=torch.device("cpu"))
                   for a in (0, 1)]
        during: list[bool] = []
        tr.train_round([s.learner.shared_state(False) for s in singles], 3,
                       progress=lambda i, n: during.append(flushing()))
        return during, flushing()

    during, after = in_thread(check)
    assert during == [True] * 3 and after is False


def test_the_flush_reaches_torchs_worker_threads_and_leaves_them_as_it_found_them():
    """With several torch threads a parallel op's chunks are computed by OpenMP workers, each with
    its own flag: setting the calling thread's alone left half of a two-thread op unflushed."""
    from fedrl.common.device import _openmp

    if _openmp() is None:
        pytest.skip("no libgomp beside this torch: only the calling thread can be set")
    x = torch.full((4_000_000,), TINY)  # large enough that two threads share the op

    def subnormal_left() -> int:
        return int(((x * 1.0) != 0).sum())

    def check():
        with subnormals_flushed():
            inside = subnormal_left()
        return inside, subnormal_left()

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert in_thread(check) == (0, x.numel())
    finally:
        torch.set_num_threads(threads)
