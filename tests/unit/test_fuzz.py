"""Property-based fuzzing (hypothesis) of what strangers send: the weight manifest/chunk decoder
and the run config parser. Random, mutated and truncated inputs give a clean, specific error
(CodecError / ConfigError) or a valid result; never another exception, never a hang."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fedrl.federation.runconfig import ConfigError, RunConfig, parse_run_config
from fedrl.proto.v1 import federation_pb2
from fedrl.wire.codec import (
    Assembler,
    CodecError,
    Manifest,
    TensorSpec,
    assemble,
    checksum,
    decode,
    encode,
)
from fedrl.wire.serde import manifest_from_proto

FUZZ = settings(max_examples=300, deadline=timedelta(seconds=2), suppress_health_check=[HealthCheck.too_slow])
STATE = {"policy.w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "policy.b": torch.ones(4),
         "policy.n": torch.tensor([1, 2], dtype=torch.int64)}
ENC = encode(STATE, "run", 1, 0, 10, chunk_bytes=64)
PAYLOAD = ENC.payload


def redeclare(m: Manifest, payload: bytes) -> Manifest:
    """The manifest an attacker would send with ``payload``: size and checksum that match it."""
    return Manifest(m.run_id, m.round, m.base_version, m.tensors, m.num_samples, len(payload),
                    checksum(payload), m.encoding)


def decode_clean(m: Manifest, payload: bytes):
    try:
        out = decode(m, payload)
    except CodecError as e:
        assert e.reason in {"truncated", "checksum_mismatch", "bad_payload", "tensor_mismatch", "non_finite"}
        return None
    spec = m.spec()
    assert set(out) == set(spec)
    for k, v in out.items():
        assert tuple(v.shape) == spec[k].shape
        if v.is_floating_point():
            assert torch.isfinite(v).all()
    return out


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(PAYLOAD) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_mutated_payloads_with_matching_sha_are_refused_or_exact(flips):
    buf = bytearray(PAYLOAD)
    for pos, byte in flips:
        buf[pos] = byte
    decode_clean(redeclare(ENC.manifest, bytes(buf)), bytes(buf))


@FUZZ
@given(st.integers(0, len(PAYLOAD) - 1), st.booleans())
def test_truncated_payloads(cut, redeclared):
    part = PAYLOAD[:cut]
    m = redeclare(ENC.manifest, part) if redeclared and cut else ENC.manifest
    if not redeclared or not cut:
        with pytest.raises(CodecError):
            assemble(m, [part])
    else:
        assert decode_clean(m, part) is None  # a cut safetensors file never decodes


@FUZZ
@given(st.binary(min_size=1, max_size=2048))
def test_random_bytes_as_payload(payload):
    assert decode_clean(redeclare(ENC.manifest, payload), payload) is None


names = st.text(min_size=0, max_size=12)
specs = st.lists(st.builds(TensorSpec, names, st.sampled_from(["F32", "F16", "I64", "X9", "", "BOOL"]),
                           st.lists(st.integers(-3, 10**12), max_size=4).map(tuple)), max_size=4).map(tuple)
manifests = st.builds(Manifest, names, st.integers(-5, 2**63 - 1), st.integers(-5, 2**63 - 1), specs,
                      st.integers(-5, 2**63 - 1), st.integers(-5, 2**40),
                      st.one_of(st.text(max_size=70), st.just(ENC.manifest.checksum)),
                      st.sampled_from(["safetensors", "pickle", ""]))


@FUZZ
@given(manifests, st.lists(st.binary(max_size=300), max_size=5))
def test_random_manifests_and_chunks(m, chunks):
    try:
        a = Assembler(m)
        for c in chunks:
            a.add(c)
        out = a.finish()
    except CodecError:
        return
    assert set(out) == {t.name for t in m.tensors}


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_as_an_update_message(data):
    """What a broken or hostile client could put on the wire, through the same path as the servicer."""
    try:
        part = federation_pb2.UpdatePart.FromString(data)
    except Exception as e:  # protobuf's own DecodeError: grpc refuses such a message itself
        assert type(e).__name__ == "DecodeError"
        return
    if part.WhichOneof("part") == "header":
        try:
            Assembler(manifest_from_proto(part.header.weights)).finish()
        except CodecError:
            pass


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=12)
FIELDS = [f for f in RunConfig.__dataclass_fields__]
SUB_FIELDS = ["hidden", "batch_size", "lambda1", "lambda2", "gamma", "tau", "q_scale", "cql_n_actions", "lr", "loss"]


def parse_clean(value):
    try:
        cfg = parse_run_config(value)
    except ConfigError as e:
        assert str(e)  # a message naming the problem
        return None
    assert isinstance(cfg, RunConfig)
    assert parse_run_config(cfg.to_json()) == cfg  # what was accepted round-trips
    return cfg


@FUZZ
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200)))
def test_config_parser_on_random_text(text):
    parse_clean(text)


@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS + ["bogus"]), json_values, max_size=6),
       st.dictionaries(st.sampled_from(SUB_FIELDS), json_values, max_size=3))
def test_config_parser_on_random_fields(top, sub):
    if "drpo" in top or sub:
        top = {**top, "drpo": sub if sub else top.get("drpo")}
    parse_clean(top)
    parse_clean(json.dumps(top, default=str))


@FUZZ
@given(st.integers(0, 400))
def test_config_parser_on_truncated_json(cut):
    text = RunConfig().to_json()
    parse_clean(text[:cut])


def test_absurd_sizes_are_refused_before_anything_is_allocated():
    with pytest.raises(ConfigError, match="hidden: at most 8 layers of at most 4096"):
        parse_run_config({"drpo": {"hidden": [10**9, 10**9]}})
    with pytest.raises(ConfigError, match="agents: at most 10000"):
        parse_run_config({"agents": 10**12})
    with pytest.raises(ConfigError, match="batch_size: at most"):
        parse_run_config({"bc": {"batch_size": 10**9}})


@FUZZ
@given(st.dictionaries(st.text(min_size=1, max_size=6),
                       st.tuples(st.sampled_from([torch.float32, torch.float16, torch.int64, torch.uint8, torch.bool,
                                                  torch.bfloat16, torch.float64]),
                                 st.lists(st.integers(0, 4), max_size=3)), min_size=1, max_size=5))
def test_own_safetensors_parser_agrees_with_the_reference_library(spec):
    """The zero-copy parser the receivers use reads exactly what the safetensors library writes."""
    from safetensors.torch import load as reference_load

    from fedrl.wire.tensorfile import parse_safetensors

    state = {k: (torch.rand(shape) * 10).to(dt) for k, (dt, shape) in spec.items()}
    blob = encode(state, "r", 0, 0).payload
    ours, ref = parse_safetensors(bytearray(blob)), reference_load(blob)
    assert ours.keys() == ref.keys()
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape and torch.equal(ours[k], ref[k])


def test_all_finite_is_exact():
    from fedrl.wire.tensorfile import all_finite

    v = torch.randn(100, 100)
    assert all_finite(v) and all_finite(torch.full((1000, 1000), 3.4e38)) and all_finite(torch.arange(3))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            w = v.to(dt).clone()
            w[3, 4] = bad
            assert not all_finite(w), (bad, dt)
    # past the first block of 2^20 elements, and a non-finite value in the last, partial block
    big = torch.full((3 * (1 << 20) + 5,), 3.4e38)
    assert all_finite(big)
    for i in (0, (1 << 20) + 7, big.numel() - 1):
        w = big.clone()
        w[i] = float("nan")
        assert not all_finite(w), i


MIXED = {"a": torch.randn(7, 5), "b": torch.randn(3), "c": torch.randn(40, 2), "d": torch.arange(6),
         "e": torch.randn(4, dtype=torch.float64), "f": torch.randn(2, 2, dtype=torch.float64),
         "g": torch.randn(9).to(torch.float16), "z": torch.zeros(0)}


ONE_DTYPE = {"policy.w0": torch.randn(16, 11), "policy.b0": torch.randn(16), "policy.head": torch.randn(6, 16),
             "policy.mean": torch.randn(11)}


@FUZZ
@given(st.sampled_from([(s, k) for s in (MIXED, ONE_DTYPE) for k, v in s.items() if v.is_floating_point() and v.numel()]),
       st.integers(0, 1000), st.sampled_from([float("nan"), float("inf"), -float("inf")]))
def test_decode_names_the_tensor_holding_a_non_finite_value(where, pos, bad):
    """Finiteness is checked over runs of same-dtype tensors at once (a payload of one dtype, a
    policy, as one flat span cut into its tensors in one call); a failure still names exactly
    the tensor with the bad value, whichever it is and wherever in it, and a good payload
    decodes to exactly its tensors."""
    state, name = where
    good = encode(state)
    out = decode(good.manifest, good.payload)
    assert out.keys() == state.keys() and all(torch.equal(v, state[k]) for k, v in out.items())
    state = {k: v.clone() for k, v in state.items()}
    state[name].view(-1)[pos % state[name].numel()] = bad
    enc = encode(state, "run", 1, 0)
    with pytest.raises(CodecError, match=f"tensor '{name}' contains NaN or Inf") as e:
        decode(enc.manifest, enc.payload)
    assert e.value.reason == "non_finite"


def test_decode_returns_exactly_what_was_encoded():
    enc = encode(MIXED, "run", 1, 0)
    out = decode(enc.manifest, enc.payload)
    assert out.keys() == MIXED.keys()
    assert all(out[k].dtype == v.dtype and torch.equal(out[k], v) for k, v in MIXED.items())
    huge = {"w": torch.full((5, 5), 3e38), "b": torch.full((3,), -2e30)}  # finite, but their squares are not
    assert torch.equal(decode((h := encode(huge, "run", 1, 0)).manifest, h.payload)["w"], huge["w"])


@pytest.mark.parametrize("total", [0, 5, 8 + 4 * 21000, (1 << 30), 8 + 4 * 21000 + (1 << 20) + 1])
def test_a_declared_size_its_own_tensors_cannot_have_is_refused(total):
    """Any receiver (no model to compare with needed) sizes its buffer from the manifest."""
    m = replace(encode({"w": torch.randn(300, 70)}, "run", 1, 0).manifest, total_bytes=total)
    with pytest.raises(CodecError) as e:
        Assembler(m)
    assert e.value.reason == "bad_manifest" and str(total) in str(e.value)


def test_assembler_takes_exactly_the_declared_bytes():
    enc = encode({"w": torch.randn(300, 70)}, "run", 1, 0, chunk_bytes=4096)
    a = Assembler(enc.manifest)
    for c in enc.chunks():
        a.add(c)
    assert torch.equal(a.finish()["w"], decode(enc.manifest, enc.payload)["w"])
    short = Assembler(enc.manifest)
    short.add(enc.payload[:-3])
    with pytest.raises(CodecError, match=f"received {len(enc.payload) - 3} of {len(enc.payload)}") as e:
        short.finish()
    assert e.value.reason == "truncated"
    over = Assembler(enc.manifest)
    over.add(enc.payload)
    with pytest.raises(CodecError, match="exceed the declared") as e:
        over.add(b"x")
    assert e.value.reason == "oversize"


@FUZZ
@given(st.dictionaries(st.text(min_size=1, max_size=6),
                       st.tuples(st.sampled_from([torch.float32, torch.float16, torch.int64, torch.uint8, torch.bool,
                                                  torch.bfloat16, torch.float64, torch.int8]),
                                 st.lists(st.integers(0, 4), max_size=3)), min_size=1, max_size=6))
def test_own_safetensors_writer_is_read_by_the_reference_library(spec):
    from safetensors.torch import load as reference_load

    from fedrl.wire.tensorfile import write_safetensors

    state = {k: (torch.rand(shape) * 10).to(dt) for k, (dt, shape) in spec.items()}
    back = reference_load(write_safetensors(state))
    assert back.keys() == state.keys()
    for k in state:
        assert back[k].dtype == state[k].dtype and back[k].shape == state[k].shape and torch.equal(back[k], state[k])


@settings(max_examples=60, deadline=None)
@given(payload=st.binary(max_size=20_000), big=st.integers(0, 3), round=st.integers(0, 2**40),
       accepted=st.booleans())
def test_a_task_appended_as_bytes_parses_as_the_reply_built_with_it(payload, big, round, accepted):
    """The aggregator answers SubmitUpdateInline with SubmitReply bytes + length_delimited_field(4,
    Task bytes): protobuf must read exactly the message it would have serialised itself."""
    from fedrl.wire.serde import length_delimited_field

    payload *= 10 ** big  # lengths with 1 to 4 varint bytes
    task = federation_pb2.Task(kind=federation_pb2.Task.TRAIN, run_id="r", round=round, base_payload=payload,
                               obs_mean=[0.5, -1.0])
    head = federation_pb2.SubmitReply(accepted=accepted, round=round, received_bytes=len(payload))
    wire = head.SerializeToString() + length_delimited_field(4, task.SerializeToString())
    expected = federation_pb2.SubmitReply(accepted=accepted, round=round, received_bytes=len(payload),
                                          next_task=task)
    assert federation_pb2.SubmitReply.FromString(wire) == expected
    assert wire == expected.SerializeToString()  # field 4 is the last one: even the bytes agree


@settings(max_examples=60, deadline=None)
@given(payload=st.binary(max_size=20_000), big=st.integers(0, 3), agent=st.text(max_size=40),
       metrics=st.dictionaries(st.text(max_size=8), st.floats(allow_nan=False), max_size=3))
def test_a_session_update_built_by_hand_parses_as_the_message(payload, big, agent, metrics):
    """Agents serialise their Session update with one copy of the payload (fedrl.wire.serde.session_update):
    protobuf must read exactly the message it stands for."""
    from fedrl.wire.serde import session_update

    payload *= 10 ** big  # lengths with 1 to 4 varint bytes
    header = federation_pb2.UpdateHeader(agent_id=agent, metrics=metrics, train_seconds=1.5)
    wire = session_update(header, payload)
    expected = federation_pb2.SessionMessage(update=federation_pb2.InlineUpdate(header=header, payload=payload))
    assert federation_pb2.SessionMessage.FromString(wire) == expected
    if payload and len(metrics) <= 1:  # (an empty payload is written, where protobuf would leave
        assert wire == expected.SerializeToString()  # it out; a map's order on the wire is free)
    # an encoded update, copied from its pieces (header, then each tensor): the same bytes
    enc = encode({"w": torch.arange(len(payload) % 97 + 1, dtype=torch.float32), "b": torch.ones(3)})
    assert session_update(header, enc) == session_update(header, b"".join(enc.pieces())) == \
        session_update(header, enc.payload)


def test_checks_worked_out_once_per_layout_still_refuse_what_differs():
    """The manifest and header checks are remembered per layout (fedrl.wire.codec caches them): a
    payload of another shape under the same names, or a bad tensor list, is refused every time."""
    a = encode({"w": torch.ones(2, 3), "b": torch.zeros(3)})
    assert torch.equal(decode(a.manifest, a.payload)["w"], torch.ones(2, 3))  # the layout is now known
    b = encode({"w": torch.ones(3, 2), "b": torch.zeros(3)})  # same names and size, another shape
    m = replace(a.manifest, checksum=b.manifest.checksum)
    for _ in range(2):
        with pytest.raises(CodecError) as e:
            decode(m, b.payload)
        assert e.value.reason == "tensor_mismatch" and "'w'" in str(e.value)
    twice = replace(a.manifest, tensors=(TensorSpec("b", "F32", (3,)), TensorSpec("b", "F32", (3,))))
    for _ in range(2):  # a refusal is not remembered as an answer
        with pytest.raises(CodecError, match="twice"):
            Assembler(twice)
    assert torch.equal(decode(a.manifest, a.payload)["b"], torch.zeros(3))


def _layout_or_reason(buf: bytearray):
    from fedrl.wire.tensorfile import file_layout as _layout

    try:
        return _layout(buf)
    except CodecError as e:
        return e.reason


def _full_parse_or_reason(buf: bytearray):
    """What parsing the whole header, with no cache and no split, makes of ``buf``."""
    from fedrl.wire.tensorfile import _parse_header

    n = int.from_bytes(bytes(buf[:8]), "little")
    try:
        return 8 + n, _parse_header(bytes(buf[8:8 + n]), len(buf) - 8 - n)
    except CodecError as e:
        return e.reason


@FUZZ
@given(st.dictionaries(st.text(max_size=8), st.text(max_size=12), max_size=4),
       st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3))
def test_a_header_read_past_its_metadata_reads_as_the_whole_header_does(meta, flips):
    """A global version's header is read in two parts (its metadata, then its tensors' entries,
    parsed once per layout): for any metadata (quotes, braces, backslashes, any text) and any
    damage to the header, the answer is the whole header's parse: the same entries, or a
    bad_payload refusal."""
    buf = bytearray(encode(STATE, "r", 0, 0, metadata=meta).payload)
    n = int.from_bytes(bytes(buf[:8]), "little")
    for pos, byte in flips:
        buf[8 + pos % n] = byte
    full = _full_parse_or_reason(buf)
    assert _layout_or_reason(buf) == full
    assert _layout_or_reason(buf) == full  # and again, now from the cache


def test_a_header_whose_metadata_is_not_strings_is_refused_though_its_entries_are_known():
    good = bytearray(encode(STATE, "r", 0, 0, metadata={"version": "1"}).payload)
    assert isinstance(_layout_or_reason(good), tuple)  # the entries are now cached
    bad = bytearray(encode(STATE, "r", 0, 0, metadata={"version": "22"}).payload)
    i = bad.index(b'"22"')
    bad[i:i + 4] = b"22  "  # a number, padded to keep every offset
    assert _layout_or_reason(bad) == "bad_payload" == _full_parse_or_reason(bad)


def _task_with_weights(payload: bytes) -> federation_pb2.Task:
    enc = encode({"w": torch.ones(3)}, "run", 2, 1)
    from fedrl.wire.serde import manifest_to_proto

    return federation_pb2.Task(kind=federation_pb2.Task.TRAIN, run_id="run", round=2, base_version=1,
                               obs_mean=[0.5, 1.5], deadline_unix=7.0,
                               base_manifest=manifest_to_proto(enc.manifest), base_payload=payload)


@FUZZ
@given(st.binary(max_size=3000), st.integers(0, 2))
def test_a_task_with_its_weights_first_reads_them_in_place_and_the_rest_as_the_message(payload, big):
    """The aggregator writes a task's weights first (fedrl.wire.serde.with_leading_bytes_field);
    agents read them as a view of the bytes received (read_task). Any order a protobuf writer
    may use reads as the same task and weights."""
    from fedrl.wire.serde import read_task, with_leading_bytes_field

    payload *= 10 ** big
    task = _task_with_weights(payload)
    without = federation_pb2.Task()
    without.CopyFrom(task)
    without.base_payload = b""
    first = with_leading_bytes_field(federation_pb2.Task.BASE_PAYLOAD_FIELD_NUMBER, [payload[:7], payload[7:]],
                                     without.SerializeToString())
    assert federation_pb2.Task.FromString(first) == task  # what any protobuf reader sees
    for wire in (first, task.SerializeToString()):  # weights first (read in place), or last
        got, weights = read_task(wire)
        assert (got.base_payload if weights is None else bytes(weights)) == payload
        got.base_payload = payload
        assert got == task
    # the field twice (the last one is the value), and a bare task without weights
    twice = with_leading_bytes_field(federation_pb2.Task.BASE_PAYLOAD_FIELD_NUMBER, [b"old"], task.SerializeToString())
    got, weights = read_task(twice)
    assert (got.base_payload if weights is None else bytes(weights)) == (payload or b"old")
    assert read_task(federation_pb2.Task(kind=federation_pb2.Task.WAIT).SerializeToString())[1] is None
    for garbage in (b"\xff\xff\xff\xff\x0f", with_leading_bytes_field(11, [b"w"], b"\xff\xff")):
        with pytest.raises(CodecError) as e:  # the agent refuses it as a damaged download, and asks again
            read_task(garbage)
        assert e.value.reason == "bad_task"


@FUZZ
@given(st.binary(max_size=400))
def test_an_update_read_in_place_from_a_session_message_is_what_the_parser_reads(data):
    """Random bytes, and session_update's own: the in-place reader of a Session update either
    declines (None: the message is then parsed whole) or finds exactly the header and payload
    protobuf reads (or bytes that neither can parse)."""
    from google.protobuf.message import DecodeError

    from fedrl.wire.serde import inline_update_in_session, session_update

    header = federation_pb2.UpdateHeader(agent_id="a1", train_seconds=2.0)
    for wire in (data, session_update(header, data), session_update(header, b"") + data[:3]):
        got = inline_update_in_session(wire)
        if got is None:
            continue
        try:
            want = federation_pb2.SessionMessage.FromString(wire).update
        except DecodeError:
            with pytest.raises(DecodeError):
                federation_pb2.UpdateHeader.FromString(got[0])
            continue
        assert federation_pb2.UpdateHeader.FromString(got[0]) == want.header and bytes(got[1]) == want.payload
    got = inline_update_in_session(session_update(header, data))
    assert got is not None and bytes(got[1]) == data
    for other in (federation_pb2.SessionMessage(done=federation_pb2.TaskDone(round=3)),
                  federation_pb2.SessionMessage(update=federation_pb2.InlineUpdate(payload=b"no header")),
                  federation_pb2.SessionMessage(update=federation_pb2.InlineUpdate(
                      header=header, payload=b"x", next_task_wait_seconds=1.0))):
        assert inline_update_in_session(other.SerializeToString()) is None


@FUZZ
@example(64, "policy.w0", -1 % 176, float("nan"), -1, True)  # the payload's last float
@example(64, "policy.b0", 0, float("inf"), -1, False)  # its first
@example(1, "policy.w0", 175, float("nan"), -1, True)  # chunks of one byte
@given(st.integers(1, 700), st.sampled_from(sorted(ONE_DTYPE)), st.integers(-1, 400),
       st.sampled_from([float("nan"), float("inf"), -float("inf")]), st.integers(-1, 2000), st.booleans())
def test_a_payload_assembled_from_chunks_gives_the_answer_of_decoding_it_whole(chunk, name, pos, bad, flip, pooled):
    """A one-dtype payload streamed in chunks of any size (the header split anywhere), into a
    pooled buffer or not: the outcome is decode's on the whole payload, the same tensors or the
    same refusal. A NaN sent by its sender names its tensor; bytes damaged on the way are
    refused for their checksum first. (Checking each chunk's floats as it lands was tried on
    2026-11-27 and measured slower in place: see docs/performance.md.)"""
    from fedrl.wire.memory import BufferPool

    state = {k: v.clone() for k, v in ONE_DTYPE.items()}
    if pos >= 0:
        state[name].view(-1)[pos % state[name].numel()] = bad
    enc = encode(state, "run", 1, 0, chunk_bytes=chunk)
    payload = bytearray(enc.payload)
    if flip >= 0:
        payload[flip % len(payload)] ^= 0x40
    try:
        want = decode(enc.manifest, bytes(payload))
    except CodecError as e:
        want = (e.reason, str(e))
    a = Assembler(enc.manifest, BufferPool() if pooled else None)
    try:
        for i in range(0, len(payload), chunk):
            a.add(bytes(payload[i:i + chunk]))
        got = a.finish()
    except CodecError as e:
        got = (e.reason, str(e))
    if isinstance(want, tuple):
        assert got == want
    else:
        assert not isinstance(got, tuple) and got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want) and a.flat is not None
