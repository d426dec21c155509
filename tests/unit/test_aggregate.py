"""Aggregation as a pure function: table tests."""

from dataclasses import replace

import pytest
import torch

from fedrl.federation.aggregate import AggregationError, _spans, agent_weights, fedavg
from fedrl.wire.codec import Assembler, assemble, checksum, encode


def s(*vals, dtype=torch.float32):
    return {"w": torch.tensor(vals, dtype=dtype)}


@pytest.mark.parametrize("states, weights, expected", [
    ([s(1.0, 2.0)], None, [1.0, 2.0]),                          # one agent: itself
    ([s(1.0, 2.0), s(3.0, 6.0)], None, [2.0, 4.0]),             # uniform mean
    ([s(1.0, 2.0), s(3.0, 6.0)], [1, 3], [2.5, 5.0]),           # weighted
    ([s(0.0), s(10.0), s(20.0)], [0, 1, 1], [15.0]),            # a zero weight drops an agent
    ([s(1.0), s(1.0), s(1.0)], [5, 6, 7], [1.0]),               # identical inputs: unchanged
])
def test_fedavg_table(states, weights, expected):
    assert torch.allclose(fedavg(states, weights)["w"], torch.tensor(expected))


def test_fedavg_keeps_dtype_and_is_exact_for_identical_inputs():
    x = {"a": torch.randn(3, 4), "b": torch.randn(2)}
    out = fedavg([x, x, x])
    assert all(torch.equal(out[k], x[k]) and out[k].dtype == x[k].dtype for k in x)


@pytest.mark.parametrize("states, weights, message", [
    ([], None, "no updates"),
    ([s(1.0), {"v": torch.tensor([1.0])}], None, "different tensor names"),
    ([s(1.0), s(1.0, 2.0)], None, r"'w' is torch.float32\[2\], expected torch.float32\[1\]"),
    ([s(1.0), s(1.0, dtype=torch.float64)], None, "float64"),
    ([s(1.0), s(float("nan"))], None, "update 1: 'w' contains NaN or Inf"),
    ([s(1.0, float("inf")), s(2.0, 3.0)], None, "update 0: 'w' contains NaN or Inf"),
    ([s(float("inf")), s(float("-inf"))], None, "update 0: 'w' contains NaN or Inf"),   # Inf - Inf
    ([s(1.0), s(float("nan"))], [1.0, 0.0], "update 1: 'w' contains NaN or Inf"),     # even weighted 0
    ([s(1.0), s(2.0)], [1.0], "1 weights for 2 updates"),
    ([s(1.0), s(2.0)], [0.0, 0.0], "positive sum"),
    ([s(1.0), s(2.0)], [-1.0, 2.0], "non-negative"),
])
def test_fedavg_rejects(states, weights, message):
    with pytest.raises(AggregationError, match=message):
        fedavg(states, weights)


def test_fedavg_near_the_float32_limit_is_finite_and_accepted():
    # the finiteness check runs on the float64 sum: large finite updates must still pass
    out = fedavg([s(3e38, 3e38), s(3e38, -3e38)])["w"]
    assert torch.equal(out, torch.tensor([3e38, 0.0]))


def test_agent_weights():
    assert agent_weights("uniform", [10, 30]) == [1.0, 1.0]
    assert agent_weights("samples", [10, 30]) == [10.0, 30.0]
    with pytest.raises(AggregationError, match="positive"):
        agent_weights("samples", [0, 3])
    with pytest.raises(AggregationError, match="uniform, samples"):
        agent_weights("median", [1])


def test_robust_aggregation_ignores_one_wild_agent():
    from fedrl.federation.aggregate import aggregate
    torch.manual_seed(0)
    honest = [{"w": torch.randn(4, 3) * 0.01 + 1.0, "b": torch.randn(3) * 0.01} for _ in range(4)]
    wild = {"w": torch.full((4, 3), 1e6), "b": torch.full((3,), -1e6)}
    states = honest + [wild]
    avg = aggregate("fedavg", states)
    assert avg["w"].abs().max() > 1e5  # FedAvg is dragged away by one agent
    for method in ("median", "trimmed-mean"):
        g = aggregate(method, states, trim=0.2)
        assert (g["w"] - 1.0).abs().max() < 0.05 and g["b"].abs().max() < 0.05, method
        assert g["w"].dtype == torch.float32 and g["w"].shape == (4, 3)


def test_median_and_trimmed_mean_values():
    from fedrl.federation.aggregate import (
        AggregationError,
        coordinate_median,
        trimmed_mean,
    )
    s = [{"x": torch.tensor([v, -v])} for v in (1.0, 2.0, 10.0, 4.0)]
    assert torch.equal(coordinate_median(s)["x"], torch.tensor([3.0, -3.0]))  # mean of 2 and 4
    assert torch.equal(coordinate_median(s[:3])["x"], torch.tensor([2.0, -2.0]))
    assert torch.equal(trimmed_mean(s, 0.25)["x"], torch.tensor([3.0, -3.0]))  # drops 1 and 10
    assert torch.allclose(trimmed_mean(s, 0.0)["x"], torch.tensor([4.25, -4.25]))
    with pytest.raises(AggregationError, match="trim fraction"):
        trimmed_mean(s, 0.5)


def _decoded(state):
    """``state`` as the aggregator holds an update: decoded from its wire bytes."""
    enc = encode(state, "run", 1, 0, 10)
    return assemble(enc.manifest, [enc.payload])


def test_fedavg_of_decoded_updates_sums_each_as_one_span_with_the_same_bits():
    g = torch.Generator().manual_seed(0)
    shapes = {"policy.l0.weight": (256, 11), "policy.l0.bias": (256,), "policy.head.weight": (6, 256),
              "policy.head.bias": (6,), "policy.mean": (11,), "policy.odd": (7, 3)}
    plain = [{k: torch.randn(sh, generator=g) * (i + 1) for k, sh in shapes.items()} for i in range(5)]
    decoded = [_decoded(x) for x in plain]
    keys = list(decoded[0])
    assert _spans(decoded, keys) is not None and _spans(plain, list(plain[0])) is None
    for w in (None, [1, 2, 3, 4, 5], [0.5, 0, 2, 7, 1e-3]):
        a, b = fedavg(plain, w), fedavg(decoded, w)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].shape == b[k].shape for k in a)
    # one tensor of another dtype, or one that is not in the shared buffer: summed tensor by tensor
    mixed = [_decoded({**x, "policy.count": torch.arange(3, dtype=torch.float64)}) for x in plain]
    assert _spans(mixed, list(mixed[0])) is None
    moved = [dict(x) for x in decoded]
    moved[2]["policy.odd"] = moved[2]["policy.odd"].clone()
    assert _spans(moved, keys) is None
    assert all(torch.equal(fedavg(moved)[k], fedavg(plain)[k]) for k in keys)


def test_a_non_finite_decoded_update_is_named():
    x = {"a": torch.ones(3, 4), "b": torch.zeros(5)}
    states = [_decoded(x) for _ in range(3)]
    states[1]["b"][2] = float("nan")  # after decoding (which refuses it): in the span, not at its start
    assert _spans(states, list(states[0])) is not None
    with pytest.raises(AggregationError, match="update 1: 'b' contains NaN or Inf"):
        fedavg(states)


def test_fedavg_in_blocks_has_the_bits_of_whole_update_sums(monkeypatch):
    import fedrl.federation.aggregate as agg
    g = torch.Generator().manual_seed(1)
    plain = [{"w": torch.randn(1000, generator=g) * 10 ** i, "b": torch.randn(37, generator=g)} for i in range(4)]
    decoded = [_decoded(x) for x in plain]
    w = [0.3, 1.0, 2.5, 1e-3]
    total = sum(w)

    def reference(k):  # the formula summed whole, update by update, in float64
        acc = torch.zeros(plain[0][k].shape, dtype=torch.float64)
        for x, wi in zip(plain, w):
            acc.add_(x[k], alpha=wi / total)
        return acc.to(torch.float32)

    monkeypatch.setattr(agg, "FEDAVG_BLOCK", 64)  # many blocks and a ragged last one, on both paths
    late = [dict(x) for x in decoded]
    late[3]["w"] = late[3]["w"].clone()
    late[3]["w"][999] = float("inf")  # in the last, ragged block only
    for threads in (1, 3):  # 16 blocks of w: on the caller's thread, and split 5/5/6 over three
        monkeypatch.setattr(agg, "FEDAVG_THREADS", threads)
        for states in (plain, decoded):
            out = fedavg(states, w)
            assert all(torch.equal(out[k], reference(k)) for k in ("w", "b"))
        with pytest.raises(AggregationError, match="update 3: 'w' contains NaN or Inf"):
            fedavg(late, w)
    plain[2]["b"][30] = float("nan")
    with pytest.raises(AggregationError, match="update 2: 'b' contains NaN or Inf"):
        fedavg(plain, w)


def _received(state):
    """``state`` as the aggregator receives it: its decoded tensors and the decoder's flat tensor."""
    enc = encode(state, "run", 1, 0, 10)
    a = Assembler(enc.manifest)
    a.add(enc.payload)
    return a.finish(), a.flat


def _reordered(state):
    """``state`` decoded from a payload another writer laid out: the same tensors, their bytes
    in reverse name order (a valid safetensors file; the decoder's span then differs)."""
    import json

    names = sorted(state, reverse=True)
    header, pos = {}, 0
    for k in names:
        n = state[k].numel() * 4
        header[k] = {"dtype": "F32", "shape": list(state[k].shape), "data_offsets": [pos, pos + n]}
        pos += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    payload = len(h).to_bytes(8, "little") + h + b"".join(state[k].numpy().tobytes() for k in names)
    m = encode(state, "run", 1, 0, 10).manifest
    m = replace(m, total_bytes=len(payload), checksum=checksum(payload))
    a = Assembler(m)
    a.add(payload)
    return a.finish(), a.flat


def test_fedavg_over_the_decoders_flat_tensors_is_the_plain_average_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    shapes = {"policy.l0.weight": (64, 11), "policy.l0.bias": (64,), "policy.head.weight": (6, 64),
              "policy.head.bias": (6,), "policy.mean": (11,), "policy.scalar": ()}
    plain = [{k: torch.randn(sh, generator=g) * (i + 1) for k, sh in shapes.items()} for i in range(5)]
    got = [_received(x) for x in plain]
    assert all(f is not None for _, f in got)
    for w in (None, [1, 2, 3, 4, 5], [0.5, 0, 2, 7, 1e-3]):
        want = fedavg(plain, w)
        out = fedavg([st for st, _ in got], w, [f for _, f in got])
        assert out.keys() == want.keys()
        assert all(torch.equal(out[k], want[k]) and out[k].shape == want[k].shape for k in want)
    # another writer's byte order (or a missing flat): the spans differ, so tensor by tensor
    mixed = [*got[:4], _reordered(plain[4])]
    assert mixed[4][1] is not None and mixed[4][1].span != got[0][1].span
    for states, flats in (([st for st, _ in mixed], [f for _, f in mixed]),
                          ([st for st, _ in got], [f for _, f in got[:4]] + [None])):
        out = fedavg(states, [1, 2, 3, 4, 5], flats)
        want = fedavg(plain, [1, 2, 3, 4, 5])
        assert all(torch.equal(out[k], want[k]) for k in want)


def test_a_non_finite_update_among_flat_tensors_is_named():
    x = {"a": torch.ones(3, 4), "b": torch.zeros(5)}
    got = [_received(x) for _ in range(3)]
    got[2][0]["a"][1, 1] = float("inf")  # after decoding: in the flat tensor too (the same memory)
    with pytest.raises(AggregationError, match="update 2: 'a' contains NaN or Inf"):
        fedavg([st for st, _ in got], None, [f for _, f in got])
