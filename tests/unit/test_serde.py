"""Weights messages serialised and read by hand (fedrl.wire.serde) against protobuf's own encoding."""

import pytest
import torch

from fedrl.proto.v1 import federation_pb2, weights_pb2
from fedrl.wire.codec import CodecError, assemble, encode
from fedrl.wire.serde import (
    chunk_in_part,
    manifest_from_proto,
    manifest_to_proto,
    read_weight_messages,
    read_weight_parts,
    update_messages,
    weight_part_bytes,
    weight_parts,
)


@pytest.mark.parametrize("chunk_bytes", [1, 100, 127, 128, 16_384, 1 << 20])
def test_serialised_parts_are_protobufs_own_bytes_and_read_back_in_place(chunk_bytes):
    state = {"w": torch.randn(40, 30), "b": torch.randn(7)}
    enc = encode(state, "run", 3, 2, 50, chunk_bytes=chunk_bytes)
    mine = weight_part_bytes(enc)
    theirs = [p.SerializeToString() for p in weight_parts(enc)]
    assert mine == theirs  # the same wire bytes as building and serialising each message
    assert chunk_in_part(mine[0]) is None  # the manifest part is not a chunk
    chunks = [chunk_in_part(p) for p in mine[1:]]
    assert b"".join(bytes(c) for c in chunks) == enc.payload
    # an UpdatePart holds its chunk in the same field: read the same way
    up = federation_pb2.UpdatePart(chunk=bytes(chunks[0])).SerializeToString()
    assert bytes(chunk_in_part(up)) == bytes(chunks[0])


def test_anything_but_exactly_one_chunk_field_is_left_to_the_parser():
    one = federation_pb2.UpdatePart(chunk=b"abc").SerializeToString()
    header = federation_pb2.UpdatePart(header=federation_pb2.UpdateHeader(agent_id="a")).SerializeToString()
    for data in (b"", b"\x12", header, one[:-1], one + b"x", one + one, b"\x12\xff\xff\xff",
                 b"\x12" + b"\x80" * 11 + b"\x01"):
        assert chunk_in_part(data) is None, data
    assert bytes(chunk_in_part(b"\x12\x00")) == b""  # an empty chunk is still a chunk
    # what the parser then makes of them: one + one is two chunk fields, the last one wins
    assert federation_pb2.UpdatePart.FromString(one + one).chunk == b"abc"
    assert weights_pb2.WeightsPart.FromString(one).chunk == b"abc"


def test_raw_streams_read_and_write_what_the_message_streams_do():
    state = {"w": torch.randn(300, 20), "b": torch.randn(9)}
    enc = encode(state, "run", 2, 1, 30, chunk_bytes=1000)
    # FetchGlobal received as bytes reads as the parsed stream does
    m1, c1 = read_weight_parts(weight_parts(enc))
    m2, c2 = read_weight_messages(weight_part_bytes(enc))
    assert m1 == m2 and [bytes(c) for c in c2] == c1
    got = assemble(m2, c2)
    assert all(torch.equal(got[k], state[k]) for k in state)
    # a stream of parts serialised by protobuf itself (another server) reads the same
    assert read_weight_messages(p.SerializeToString() for p in weight_parts(enc))[0] == m1
    # SubmitUpdate's messages are protobuf's own bytes for the same parts
    header = federation_pb2.UpdateHeader(agent_id="a0", weights=manifest_to_proto(enc.manifest))
    theirs = [federation_pb2.UpdatePart(header=header).SerializeToString(),
              *(federation_pb2.UpdatePart(chunk=c).SerializeToString() for c in enc.chunks())]
    assert list(update_messages(header, enc)) == theirs


def test_a_bad_raw_weights_stream_is_a_codec_error_naming_the_problem():
    enc = encode({"w": torch.randn(50)}, "run", 1, 0, 1, chunk_bytes=64)
    parts = weight_part_bytes(enc)
    for messages, says in (([], "must start with a manifest"), (parts[1:], "must start with a manifest"),
                           ([parts[0], parts[0]], "exactly one manifest"),
                           ([parts[0], b"\xff\xff"], "not a WeightsPart")):
        with pytest.raises(CodecError, match=says) as e:
            read_weight_messages(messages)
        assert e.value.reason == "bad_stream"


def test_updates_assembled_in_pooled_buffers_stay_intact_while_held():
    """The aggregator's path: each update assembled into a buffer of its pool, decoded in place
    (the tensors are views of it: the buffer stays out of the pool while they live), a later
    update never landing in the memory of one still held, and the buffer reused once it is free."""
    import gc

    from fedrl.wire.codec import Assembler
    from fedrl.wire.memory import BufferPool

    pool = BufferPool(keep=4)

    def receive(state, round_):
        enc = encode(state, "run", round_, 0, 10, chunk_bytes=1000)
        asm = Assembler(enc.manifest, pool)
        for c in enc.chunks():
            asm.add(memoryview(c))
        return asm.finish()

    first_in = {"w": torch.arange(600, dtype=torch.float32).reshape(20, 30), "b": torch.ones(7)}
    first = receive(first_in, 1)
    gc.collect()
    assert pool.free_buffers() == 0  # read in place: the buffer is held by the tensors
    second = receive({"w": -torch.ones(20, 30), "b": torch.zeros(7)}, 2)
    assert pool.mapped == 2 and all(torch.equal(first[k], first_in[k]) for k in first_in)
    del first
    third = receive({"w": torch.full((20, 30), 3.0), "b": torch.full((7,), 3.0)}, 3)
    assert (pool.mapped, pool.reused) == (2, 1)
    assert torch.equal(third["w"], torch.full((20, 30), 3.0)) and torch.equal(second["w"], -torch.ones(20, 30))


def test_safetensors_headers_that_nest_or_count_absurdly_are_refused_specifically():
    import struct

    from fedrl.wire.tensorfile import parse_safetensors

    for header, says in ((b"[" * 50_000 + b"]" * 50_000, "nests too deeply"),
                         (b'{"a": ' + b"9" * 5000 + b"}", "not JSON")):
        with pytest.raises(CodecError, match=says):
            parse_safetensors(struct.pack("<Q", len(header)) + header)


@pytest.mark.parametrize("framed", [False, True])
@pytest.mark.parametrize("chunk_bytes", [1, 5, 96, 1000, 1 << 20])
def test_chunks_cut_from_the_tensors_are_the_payloads_own(chunk_bytes, framed):
    """An encoded update is sent as chunks cut straight from its tensors (header, then each
    tensor's bytes): every chunk, its message and the checksum must be what the joined payload
    gives, across tensor boundaries, mixed dtypes and an empty tensor. ``framed``: the messages
    built, and their chunks hashed, as the update is encoded (what an agent streams)."""
    from fedrl.wire.codec import checksum, encoded_from_payload
    from fedrl.wire.serde import chunk_frame

    state = {"w": torch.randn(13, 7), "b": torch.randn(5).double(), "n": torch.arange(3, dtype=torch.int32),
             "e": torch.empty(0), "m": torch.tensor([True, False, True])}
    enc = encode(state, "run", 4, 3, 20, chunk_bytes=chunk_bytes, frame=chunk_frame if framed else None)
    assert (enc.framed is not None) == framed
    sent = list(update_messages(federation_pb2.UpdateHeader(agent_id="a"), enc))  # before any join
    if framed:
        assert all(a is b for a, b in zip(sent[1:], enc.framed, strict=True))  # the ones built at encoding
    whole = encoded_from_payload(enc.payload, "run", 4, 3, 20, chunk_bytes=chunk_bytes)
    assert enc.manifest.checksum == checksum(enc.payload) == whole.manifest.checksum
    assert enc.manifest.total_bytes == len(enc.payload)
    assert sent[1:] == [federation_pb2.UpdatePart(chunk=c).SerializeToString() for c in whole.chunks()]
    assert all(len(c) == chunk_bytes for c in list(whole.chunks())[:-1])
    got = assemble(enc.manifest, [bytes(chunk_in_part(m)) for m in sent[1:]])
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_a_tensor_changed_after_encoding_is_refused_not_sent_silently():
    """The chunks are cut from the live tensors: one changed between encoding and sending no
    longer matches the checksum taken at encoding, and the receiver refuses it."""
    state = {"w": torch.zeros(64)}
    enc = encode(state, "run", 1, 0, 1, chunk_bytes=100)
    state["w"][3] = 1.0
    with pytest.raises(CodecError) as e:
        assemble(enc.manifest, list(enc.chunks()))
    assert e.value.reason == "checksum_mismatch"


def test_manifests_read_and_written_with_a_remembered_tensor_list_are_exactly_their_own():
    """The tensor list read or written last is remembered (serde caches it): a manifest listing
    other tensors, even one shape apart, reads and writes as itself, and changing the message a
    list was read from afterwards changes nothing remembered."""
    a = encode({"w": torch.ones(2, 3), "b": torch.zeros(3)}, "run", 1, 0, 5).manifest
    b = encode({"w": torch.ones(3, 2), "b": torch.zeros(3)}, "run", 2, 1, 5).manifest
    c = encode({"w": torch.ones(3, 2), "b": torch.zeros(3), "c": torch.zeros(1)}, "run", 2, 1, 5).manifest
    for m in (a, b, a, a, c, b):
        p = manifest_to_proto(m)
        assert [(t.name, t.dtype, tuple(t.shape)) for t in p.tensors] == [tuple(t) for t in m.tensors]
        assert (p.run_id, p.round, p.base_version, p.total_bytes, p.xxh3_128) == (
            m.run_id, m.round, m.base_version, m.total_bytes, m.checksum)
        assert manifest_from_proto(p) == m
        p.tensors[0].shape[0] = 99  # the message read from changes afterwards
        assert manifest_from_proto(manifest_to_proto(m)) == m
        assert manifest_from_proto(p).tensors[0].shape[0] == 99


def test_an_event_of_a_kind_this_client_does_not_know_is_named_not_raised():
    """A newer aggregator's event kind made every older client's watch raise ValueError (the enum
    has no name for it): it is now named KIND_<n> for the caller to pass over, and a version not
    evaluated travels with its reason."""
    from fedrl.cli.show import event
    from fedrl.proto.v1 import control_pb2
    from fedrl.wire.serde import evaluation_from_proto, evaluation_to_proto, event_from_proto, event_to_proto

    unknown = control_pb2.RoundEvent(kind=99, run_id="r", version=3, time_unix=1.0)
    assert event_from_proto(unknown)["kind"] == "KIND_99"
    e = event_from_proto(event_to_proto({"kind": "NOT_EVALUATED", "run_id": "r", "round": 3, "version": 3,
                                         "message": "its actions are not finite", "time_unix": 1.0}))
    assert (e["kind"], e["version"], e["message"]) == ("NOT_EVALUATED", 3, "its actions are not finite")
    assert event(e).endswith("r  version 3 not evaluated: its actions are not finite")
    report = evaluation_from_proto(evaluation_to_proto({"run_id": "r", "version": 3, "not_evaluated": "why"}))
    assert report["not_evaluated"] == "why" and report["returns"] == []
    assert "not_evaluated" not in evaluation_from_proto(evaluation_to_proto({"run_id": "r", "version": 3,
                                                                             "returns": [1.0]}))
