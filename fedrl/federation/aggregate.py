"""Aggregation: pure functions from agents' parameters to the next global parameters."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from fedrl.wire.codec import Flat
from fedrl.wire.tensorfile import all_finite

from fedrl.federation.choices import AGGREGATIONS, FEDERATE_CHOICES, WEIGHTINGS  # noqa: F401 - importers read them here


class AggregationError(ValueError):
    """Updates that cannot be combined (mismatched tensors, bad weights, non-finite values)."""


def check_compatible(states: Sequence[Mapping[str, torch.Tensor]], finite: bool = True) -> None:
    """All states have the same tensor names, shapes and dtypes as the first (and, with
    ``finite``, hold no NaN or Inf)."""
    if not states:
        raise AggregationError("no updates to aggregate")
    ref = states[0]
    for i, s in enumerate(states):
        if s.keys() != ref.keys():
            diff = sorted(set(s) ^ set(ref))
            raise AggregationError(f"update {i} has different tensor names: {', '.join(diff[:5])}")
        for k, v in s.items():
            r = ref[k]
            if v.shape != r.shape or v.dtype != r.dtype:
                raise AggregationError(f"update {i}: '{k}' is {v.dtype}{list(v.shape)}, "
                                       f"expected {r.dtype}{list(r.shape)}")
            if finite and not all_finite(v):
                raise AggregationError(f"update {i}: '{k}' contains NaN or Inf")


def agent_weights(weighting: str, num_samples: Sequence[int]) -> list[float]:
    """Per-agent weights: ``uniform`` (the paper's 1/n) or proportional to ``samples``."""
    if weighting == "uniform":
        return [1.0] * len(num_samples)
    if weighting == "samples":
        if any(n <= 0 for n in num_samples):
            raise AggregationError(f"sample-count weighting needs positive counts, got {list(num_samples)}")
        return [float(n) for n in num_samples]
    raise AggregationError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")


# Where an average's memory comes from: (elements, dtype) -> a flat tensor to write it into.
Allocator = Callable[[int, torch.dtype], torch.Tensor]


def fedavg(states: Sequence[Mapping[str, torch.Tensor]],
           weights: Sequence[float] | None = None,
           flats: Sequence[Flat | None] | None = None,
           alloc: Allocator | None = None) -> dict[str, torch.Tensor]:
    """Weighted parameter average ``sum_i w_i theta_i / sum_i w_i`` (FedAvg; uniform by default).

    Accumulates in float64 in the given order, so the result is deterministic and independent
    of the transport; returns tensors of the input dtype.

    ``flats``, when given, are the states as their decoder laid them out
    (:attr:`fedrl.wire.codec.Assembler.flat`, one per state, each the flat tensor the state's
    tensors are views of): where all are there with one span (the same tensors in the same
    order), the average is taken over them directly, with no check of each tensor (their
    decoding checked them, and equal spans are compatible by construction).

    ``alloc``, when given, provides the memory of an average taken as one span (the usual
    case: updates decoded from the wire): the aggregator hands out buffers that earlier
    versions used, so the average is not written into freshly faulted pages every round.
    """
    if flats is not None and len(flats) == len(states) and states and _one_layout(flats):
        spans = [f.tensor for f in flats]
        mean, finite = _weighted_mean(spans, _alphas(weights, len(states)), alloc)
        if not finite:
            check_compatible(states)  # names the update at fault
        return flats[0].span.cut(mean)
    check_compatible(states, finite=False)  # finiteness is checked once, on the sum (below)
    alphas = _alphas(weights, len(states))
    # Accumulate in float64 with in-place mixed-dtype adds: the float32 operand is widened
    # element by element inside the add (no float64 copy of any update), in the same order as
    # the plain formula, so the bits are those of sum_i (w_i / W) * theta_i in float64.
    # 3x faster than widening whole updates first. A NaN or Inf in any update (even one weighted
    # 0: 0 * Inf is NaN) makes its coordinate of the float64 sum non-finite, and a weighted mean
    # of finite float32 values stays finite in float32: so the sum is checked instead of every
    # update (10x fewer checks for 10 agents); only when it fails are the updates searched, to
    # name the one at fault.
    keys = list(states[0])
    spans = _spans(states, keys)
    if spans is not None:
        # Updates decoded from the wire hold their tensors back to back in one buffer: each is
        # summed as one span (the same adds element by element, so the same bits; a Hopper
        # policy's round: 10 adds instead of ~100).
        mean, finite = _weighted_mean(spans, alphas, alloc)
        if not finite:
            check_compatible(states)
        out, pos = {}, 0
        for k in keys:
            n = states[0][k].numel()
            out[k] = mean[pos:pos + n].view(states[0][k].shape)
            pos += n
        return out
    out = {}
    for k in keys:
        mean, finite = _weighted_mean([s[k].reshape(-1) for s in states], alphas)
        if not finite:
            check_compatible(states)
        out[k] = mean.view(states[0][k].shape)
    return out


def _alphas(weights: Sequence[float] | None, n: int) -> list[float]:
    """Each update's share of the average: its weight over their sum (uniform by default)."""
    w = [1.0] * n if weights is None else [float(x) for x in weights]
    if len(w) != n:
        raise AggregationError(f"{len(w)} weights for {n} updates")
    if any(not x >= 0 for x in w) or sum(w) <= 0:
        raise AggregationError(f"weights must be non-negative with a positive sum, got {w}")
    total = sum(w)
    return [wi / total for wi in w]


def _one_layout(flats: Sequence[Flat | None]) -> bool:
    """Every update came with its flat tensor, all of one span (the same names, shapes, order)."""
    first = flats[0]
    return first is not None and all(f is not None and (f.span is first.span or f.span == first.span)
                                     for f in flats)


# FedAvg sums in blocks of this many elements: each update's block is added into one float64
# accumulator that stays in cache, which is then written out once. Per element these are the
# same adds in the same order as summing whole updates (the same bits, tested), but the whole-
# update sum streamed a 60 MB float64 accumulator through memory once per update of a 30 MB
# model: 10 such updates took 0.55-0.69 s, in blocks 0.06-0.15 s (2 threads and 1, this CPU).
# A Hopper policy (70,658 parameters) is one block.
FEDAVG_BLOCK = 1 << 17


# Large models are averaged by this many threads, each taking a contiguous run of blocks (the
# adds release the GIL). Every element still gets the same adds in the same order: same bits.
# At a round's close the agents wait for this, so it has the machine: 10 x 30 MB updates took
# 114-118 ms on one thread and 61-74 ms on two (this 2-core CPU). Below FEDAVG_PARALLEL_BLOCKS
# blocks (a Hopper policy is one) it stays on the caller's thread.
FEDAVG_THREADS = max(1, min(4, os.cpu_count() or 1))
FEDAVG_PARALLEL_BLOCKS = 8


def _weighted_mean(xs: Sequence[torch.Tensor], alphas: Sequence[float],
                   alloc: Allocator | None = None) -> tuple[torch.Tensor, bool]:
    """``sum_i alphas[i] * xs[i]`` accumulated in float64, returned in the inputs' dtype (flat,
    equal-length ``xs``; in memory from ``alloc`` where given, for CPU tensors), and whether
    every coordinate of the float64 sum is finite."""
    numel = xs[0].numel()
    if alloc is not None and xs[0].device.type == "cpu":
        out = alloc(numel, xs[0].dtype)
        if out.shape != (numel,) or out.dtype != xs[0].dtype:
            raise ValueError(f"the allocator gave {out.dtype}{list(out.shape)} for {numel} x {xs[0].dtype}")
    else:
        out = torch.empty(numel, dtype=xs[0].dtype, device=xs[0].device)
    blocks = -(-numel // FEDAVG_BLOCK)
    workers = FEDAVG_THREADS if blocks >= FEDAVG_PARALLEL_BLOCKS and xs[0].device.type == "cpu" else 1
    finite = [True] * workers

    def average(j: int) -> None:  # blocks [j * blocks / workers, (j + 1) * blocks / workers)
        acc = torch.empty(min(FEDAVG_BLOCK, numel), dtype=torch.float64, device=xs[0].device)
        for b in range(j * blocks // workers, (j + 1) * blocks // workers):
            i = b * FEDAVG_BLOCK
            a = acc[:min(FEDAVG_BLOCK, numel - i)]
            a.zero_()
            for x, alpha in zip(xs, alphas):
                a.add_(x[i:i + a.numel()], alpha=alpha)
            finite[j] = finite[j] and all_finite(a)
            out[i:i + a.numel()].copy_(a)

    errors: list[BaseException] = []

    def helper(j: int) -> None:
        try:
            average(j)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(e)

    helpers = [threading.Thread(target=helper, args=(j,), name=f"fedavg-{j}") for j in range(1, workers)]
    for t in helpers:
        t.start()
    try:
        average(0)
    finally:
        for t in helpers:
            t.join()
    if errors:  # a block left unwritten: nothing of ``out`` may be used
        raise errors[0]
    return out, all(finite)


def _spans(states: Sequence[Mapping[str, torch.Tensor]], keys: list[str]) -> list[torch.Tensor] | None:
    """Each state's tensors, in ``keys`` order, as one flat tensor over their memory, when they
    lie back to back in one CPU storage with one dtype (see ``fedrl.wire.tensorfile.views``); else None."""
    if not keys:
        return None
    dtype = states[0][keys[0]].dtype
    numel = sum(states[0][k].numel() for k in keys)
    out = []
    for s in states:
        first = s[keys[0]]
        end = first.data_ptr()
        for k in keys:
            t = s[k]
            if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or t.data_ptr() != end:
                return None
            end += t.numel() * t.element_size()
        try:  # bounds-checked: the span must lie inside the first tensor's storage
            out.append(torch.empty(0, dtype=dtype).set_(first.untyped_storage(), first.storage_offset(), (numel,)))
        except RuntimeError:
            return None
    return out


def _flat(states: Sequence[Mapping[str, torch.Tensor]]) -> tuple[torch.Tensor, list[str]]:
    keys = list(states[0])
    return torch.stack([torch.cat([s[k].reshape(-1).to(torch.float64) for k in keys]) for s in states]), keys


def _unflat(vec: torch.Tensor, ref: Mapping[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for k in keys:
        r = ref[k]
        out[k] = vec[offset:offset + r.numel()].reshape(r.shape).to(r.dtype)
        offset += r.numel()
    return out


def coordinate_median(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Coordinate-wise median (the mean of the two middle values for an even count).

    Robust to fewer than half the agents sending arbitrary values; ignores agent weights.
    """
    check_compatible(states)
    x, keys = _flat(states)
    srt = x.sort(dim=0).values
    n = len(states)
    med = srt[n // 2] if n % 2 else 0.5 * (srt[n // 2 - 1] + srt[n // 2])
    return _unflat(med, states[0], keys)


def trimmed_mean(states: Sequence[Mapping[str, torch.Tensor]], trim: float = 0.1) -> dict[str, torch.Tensor]:
    """Coordinate-wise mean after dropping the ``ceil(trim * n)`` largest and smallest values
    (at least one each when n >= 3). Ignores agent weights."""
    check_compatible(states)
    if not 0.0 <= trim < 0.5:
        raise AggregationError(f"trim fraction must be in [0, 0.5), got {trim}")
    n = len(states)
    k = min(max(math.ceil(trim * n), 1 if n >= 3 and trim > 0 else 0), (n - 1) // 2)
    x, keys = _flat(states)
    srt = x.sort(dim=0).values
    return _unflat(srt[k:n - k].mean(dim=0), states[0], keys)


def aggregate(method: str, states: Sequence[Mapping[str, torch.Tensor]],
              weights: Sequence[float] | None = None, trim: float = 0.1,
              flats: Sequence[Flat | None] | None = None, alloc: Allocator | None = None) -> dict[str, torch.Tensor]:
    """The next global parameters by ``method`` (one of :data:`AGGREGATIONS`).

    ``fedavg`` uses ``weights`` (and ``flats`` and ``alloc``, see :func:`fedavg`); the robust
    methods (``median``, ``trimmed-mean``) do not.
    """
    if method == "fedavg":
        return fedavg(states, weights, flats, alloc)
    if method == "median":
        return coordinate_median(states)
    if method == "trimmed-mean":
        return trimmed_mean(states, trim)
    raise AggregationError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {method!r}")
