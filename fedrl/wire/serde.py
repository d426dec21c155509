"""Domain <-> protobuf conversions. Servicers and clients call these; nothing else sees protos."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from google.protobuf.message import DecodeError

from fedrl.proto.v1 import control_pb2, federation_pb2, weights_pb2
from fedrl.wire.manifest import CodecError, Encoded, Manifest, TensorSpec


def manifest_to_proto(m: Manifest) -> weights_pb2.WeightsManifest:
    p = weights_pb2.WeightsManifest(run_id=m.run_id, round=m.round, base_version=m.base_version,
                                    num_samples=m.num_samples, total_bytes=m.total_bytes, xxh3_128=m.checksum,
                                    encoding=m.encoding)
    p.MergeFrom(_tensor_list_proto(m.tensors))  # one C-level copy of the list, not a message per tensor
    return p


@functools.lru_cache(maxsize=16)
def _tensor_list_proto(tensors: tuple[TensorSpec, ...]) -> weights_pb2.WeightsManifest:
    """A manifest holding just ``tensors`` (every update of a run lists the same; read only)."""
    return weights_pb2.WeightsManifest(
        tensors=[weights_pb2.TensorSpec(name=t.name, dtype=t.dtype, shape=list(t.shape)) for t in tensors])


def _field_key(number: int, length: int) -> bytes:
    """The key and length that open a length-delimited field ``number`` of ``length`` bytes."""
    out = bytearray()
    for v in ((number << 3) | 2, length):  # wire type 2: length-delimited
        while v > 0x7F:
            out.append(v & 0x7F | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def length_delimited_field(number: int, data: bytes, prefix: bytes = b"") -> bytes:
    """``data`` (e.g. a serialised message) as field ``number`` of an enclosing message, in the
    protobuf wire format: appended to that message's own bytes it sets the field (parsers take
    fields in any order). ``prefix`` (those bytes) is joined in front in the same single copy."""
    return b"".join((prefix, _field_key(number, len(data)), data))


def session_update(header: federation_pb2.UpdateHeader, payload: bytes | Encoded) -> bytes:
    """``SessionMessage(update=InlineUpdate(header=header, payload=payload))`` serialised, with
    one copy of the payload (building the message and serialising it copies it twice). An
    :class:`Encoded` payload is copied from its pieces (the tensors), never joined first."""
    pieces = payload.pieces() if isinstance(payload, Encoded) else (payload,)
    size = sum(map(len, pieces))
    head = header.SerializeToString()
    inner = b"".join((_field_key(federation_pb2.InlineUpdate.HEADER_FIELD_NUMBER, len(head)), head,
                      _field_key(federation_pb2.InlineUpdate.PAYLOAD_FIELD_NUMBER, size)))
    return b"".join((_field_key(federation_pb2.SessionMessage.UPDATE_FIELD_NUMBER, len(inner) + size),
                     inner, *pieces))


def _varint(data: bytes | memoryview, i: int) -> tuple[int, int] | None:
    """The varint at ``data[i]`` and the position after it; None if it runs past the end or
    past 10 bytes."""
    n, shift, end = 0, 0, min(len(data), i + 10)
    while i < end:
        b = data[i]
        n |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return n, i
        shift += 7
    return None


def _bytes_field_at(data: memoryview, i: int, number: int) -> tuple[memoryview, int] | None:
    """The value of length-delimited field ``number`` whose key is at ``data[i]`` (a key of one
    byte: fields 1-15), and the position after it; None if another key is there, or the length
    runs past the end."""
    if i >= len(data) or data[i] != (number << 3) | 2:
        return None
    got = _varint(data, i + 1)
    if got is None or got[1] + got[0] > len(data):
        return None
    n, start = got
    return data[start:start + n], start + n


def with_leading_bytes_field(number: int, pieces: Sequence[bytes | memoryview], rest: bytes) -> bytes:
    """A serialised message (``rest``) with length-delimited field ``number`` (the joined
    ``pieces``) written first, in one copy of the pieces. Parsers take fields in any order;
    a receiver that finds the field first reads it in place (:func:`leading_bytes_field`)."""
    return b"".join((_field_key(number, sum(map(len, pieces))), *pieces, rest))


def leading_bytes_field(data: bytes, number: int) -> tuple[memoryview, memoryview] | None:
    """For a serialised message that opens with length-delimited field ``number`` (fields 1-15):
    that field's bytes and the rest of the message, as views of ``data`` (no copy); None for
    any other message (parse it whole then)."""
    mv = memoryview(data)
    got = _bytes_field_at(mv, 0, number)
    return None if got is None else (got[0], mv[got[1]:])


def read_task(data: bytes) -> tuple[federation_pb2.Task, memoryview | None]:
    """A serialised Task, and its inline weights (``base_payload``) as a view of ``data`` where
    they come first (as the aggregator writes them): no copy of them into a parsed message and
    out again. Else (None): the task's own ``base_payload`` holds them, if any. Bytes that are
    not a Task are a :class:`CodecError` (``bad_task``)."""
    split = leading_bytes_field(data, federation_pb2.Task.BASE_PAYLOAD_FIELD_NUMBER)
    try:
        if split is None:
            return federation_pb2.Task.FromString(data), None
        weights, rest = split
        task = federation_pb2.Task.FromString(rest)
    except DecodeError as e:  # refused like a damaged download: the agent asks again
        raise CodecError("bad_task", f"a task that is not a valid message: {e}") from None
    if task.base_payload:  # the field again later: the last one is the value (protobuf's rule)
        return task, None
    return task, weights


_UPDATE = federation_pb2.SessionMessage.UPDATE_FIELD_NUMBER
_HEADER = federation_pb2.InlineUpdate.HEADER_FIELD_NUMBER
_PAYLOAD = federation_pb2.InlineUpdate.PAYLOAD_FIELD_NUMBER


def inline_update_in_session(data: bytes) -> tuple[memoryview, memoryview] | None:
    """The header (serialised) and payload of a serialised SessionMessage that is exactly one
    InlineUpdate holding a header, then a payload (as :func:`session_update` writes it), as views
    of ``data`` (no copy); None for any other message, which is then parsed whole."""
    mv = memoryview(data)
    update = _bytes_field_at(mv, 0, _UPDATE)
    if update is None or update[1] != len(mv):
        return None
    inner = update[0]
    header = _bytes_field_at(inner, 0, _HEADER)
    payload = None if header is None else _bytes_field_at(inner, header[1], _PAYLOAD)
    if payload is None or payload[1] != len(inner):
        return None
    return header[0], payload[0]


# WeightsPart (FetchGlobal's stream) and UpdatePart (SubmitUpdate's) carry a chunk as field 2.
CHUNK_FIELD = weights_pb2.WeightsPart.CHUNK_FIELD_NUMBER
assert federation_pb2.UpdatePart.CHUNK_FIELD_NUMBER == CHUNK_FIELD


def weight_part_bytes(enc: Encoded) -> list[bytes]:
    """:func:`weight_parts` serialised: the manifest part, then each chunk part, each chunk's
    bytes copied once (building a message per chunk and serialising it copies them twice more).
    Sent to every agent that fetches the version, so it is built once per version."""
    return [weights_pb2.WeightsPart(manifest=manifest_to_proto(enc.manifest)).SerializeToString(),
            *_chunk_parts(enc)]


def chunk_frame(n: int) -> bytes:
    """What opens a serialised chunk part (WeightsPart or UpdatePart) of a chunk of ``n``
    bytes: pass it to ``codec.encode(frame=...)`` to have the parts built as the payload is
    encoded and hashed (:func:`update_messages` then sends those)."""
    return _field_key(CHUNK_FIELD, n)


def _chunk_parts(enc: Encoded) -> Iterator[bytes]:
    """Each chunk of ``enc``'s payload as a serialised chunk part (field 2), copied once (from
    its tensors when it was encoded from them and not joined), or as encode() built them."""
    if enc.framed is not None and enc.frame is chunk_frame:
        yield from enc.framed
        return
    for views in enc.chunk_views():
        yield b"".join((_field_key(CHUNK_FIELD, sum(len(v) for v in views)), *views))


def chunk_in_part(data: bytes) -> memoryview | None:
    """The chunk of a serialised WeightsPart or UpdatePart that holds just its chunk, as a view
    of ``data`` (no copy); None for any other message, which is then parsed as one."""
    got = _bytes_field_at(memoryview(data), 0, CHUNK_FIELD)
    return got[0] if got is not None and got[1] == len(data) else None


def manifest_from_proto(p: weights_pb2.WeightsManifest) -> Manifest:
    if p.sha256 and not p.xxh3_128:
        raise CodecError("old_contract", "the weights manifest carries a sha256 and no xxh3_128: the peer speaks "
                                         "wire contract v1 (fedrl before 2026-11-26); upgrade it to v2")
    return Manifest(p.run_id, p.round, p.base_version, _tensor_list(p.tensors),
                    p.num_samples, p.total_bytes, p.xxh3_128, p.encoding)


# The tensor list read last, as protobuf and as TensorSpecs: every manifest of a run lists the same
# tensors, and comparing the lists (in C) costs a fraction of building the tuple again. One slot,
# replaced whole (threads read it without a lock).
_last_list: tuple[Any, tuple[TensorSpec, ...]] | None = None


def _tensor_list(listed) -> tuple[TensorSpec, ...]:
    global _last_list
    last = _last_list
    if last is not None and listed == last[0].tensors:
        return last[1]
    specs = tuple(TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in listed)
    kept = weights_pb2.WeightsManifest()
    kept.tensors.extend(listed)  # a copy: the message it came from may change or go
    _last_list = (kept, specs)
    return specs


def weight_parts(enc: Encoded) -> Iterator[weights_pb2.WeightsPart]:
    """A manifest part, then one part per chunk."""
    yield weights_pb2.WeightsPart(manifest=manifest_to_proto(enc.manifest))
    for c in enc.chunks():
        yield weights_pb2.WeightsPart(chunk=c)


def read_weight_parts(parts: Iterable[weights_pb2.WeightsPart]) -> tuple[Manifest, list[bytes]]:
    """Split a weights stream into its manifest and chunks (structure only; no verification)."""
    it = iter(parts)
    first = next(it, None)
    if first is None or first.WhichOneof("part") != "manifest":
        raise ValueError("weights stream must start with a manifest")
    chunks = []
    for p in it:
        if p.WhichOneof("part") != "chunk":
            raise ValueError("a weights stream has exactly one manifest, first")
        chunks.append(p.chunk)
    return manifest_from_proto(first.manifest), chunks


# Per raw stream kind: the field its first message must hold, and what a refusal says when it
# does not, when a later message is not a chunk, and when a message does not parse.
_RAW_STREAMS = {
    weights_pb2.WeightsPart: ("manifest", "weights stream must start with a manifest",
                              "a weights stream has exactly one manifest, first",
                              "a weights stream message is not a WeightsPart"),
    federation_pb2.UpdatePart: ("header", "an update stream must start with its header",
                                "a second header in one update stream",
                                "an update stream message is not an UpdatePart"),
}


def read_raw_parts(messages: Iterable[bytes], kind: type) -> tuple[Any, Iterator[bytes | memoryview]]:
    """A stream of ``kind`` messages (WeightsPart or UpdatePart) received as bytes: its first
    message parsed, and its chunks as they arrive, each read in place (:func:`chunk_in_part`),
    not copied out of a parsed message. Raises :class:`CodecError` (``bad_stream``) naming what
    is wrong: no manifest/header first, a second one later, a message that does not parse."""
    head_field, no_head, second_head, not_parsed = _RAW_STREAMS[kind]

    def parse(data: bytes):
        try:
            return kind.FromString(data)
        except DecodeError as e:
            raise CodecError("bad_stream", f"{not_parsed}: {e}") from None

    it = iter(messages)
    first = next(it, None)
    head = None if first is None else parse(first)
    if head is None or head.WhichOneof("part") != head_field:
        raise CodecError("bad_stream", no_head)

    def chunks() -> Iterator[bytes | memoryview]:
        for data in it:
            chunk = chunk_in_part(data)
            if chunk is None:
                part = parse(data)
                if part.WhichOneof("part") != "chunk":
                    raise CodecError("bad_stream", second_head)
                chunk = part.chunk
            yield chunk
    return head, chunks()


def read_weight_stream(messages: Iterable[bytes]) -> tuple[Manifest, Iterator[bytes | memoryview]]:
    """A weights stream received as bytes (see ``fedrl.wire.rpc.weights_calls``): its manifest, and
    its chunks as they arrive (to be assembled while the rest is still on its way)."""
    head, chunks = read_raw_parts(messages, weights_pb2.WeightsPart)
    return manifest_from_proto(head.manifest), chunks


def read_weight_messages(messages: Iterable[bytes]) -> tuple[Manifest, list[bytes | memoryview]]:
    """:func:`read_weight_parts` for a stream received as bytes: the whole stream read."""
    manifest, chunks = read_weight_stream(messages)
    return manifest, list(chunks)


def update_messages(header: federation_pb2.UpdateHeader, enc: Encoded) -> Iterator[bytes]:
    """A SubmitUpdate stream serialised: the header part, then one part per chunk, each chunk's
    bytes copied once (see :func:`weight_part_bytes`)."""
    yield federation_pb2.UpdatePart(header=header).SerializeToString()
    yield from _chunk_parts(enc)


def evaluation_to_proto(d: dict | None) -> control_pb2.EvaluationReport | None:
    if not d:
        return None
    return control_pb2.EvaluationReport(
        run_id=d.get("run_id", ""), version=int(d.get("version", 0)), env_id=d.get("env_id", ""),
        returns=list(d.get("returns", [])), return_mean=d.get("return_mean", 0.0),
        return_std=d.get("return_std", 0.0), score_mean=d.get("score_mean", 0.0),
        score_std=d.get("score_std", 0.0), env_steps=int(d.get("env_steps", 0)),
        seconds=d.get("seconds", 0.0), not_evaluated=d.get("not_evaluated", ""))


def evaluation_from_proto(p: control_pb2.EvaluationReport) -> dict:
    """A report as a dict; ``not_evaluated`` (why there are no returns) only where it is set."""
    return {"run_id": p.run_id, "version": p.version, "env_id": p.env_id, "returns": list(p.returns),
            "return_mean": p.return_mean, "return_std": p.return_std, "score_mean": p.score_mean,
            "score_std": p.score_std, "env_steps": p.env_steps, "seconds": p.seconds,
            **({"not_evaluated": p.not_evaluated} if p.not_evaluated else {})}


def status_to_proto(s: dict) -> control_pb2.RunStatus:
    msg = control_pb2.RunStatus(
        run_id=s.get("run_id", ""), state=s["state"], round=s.get("round", 0), rounds=s.get("rounds", 0),
        global_version=s.get("global_version", 0), message=s.get("message", ""),
        config_json=s.get("config_json", ""), env_id=s.get("env_id", ""),
        evaluated_versions=s.get("evaluated_versions", []), evaluators_following=s.get("evaluators_following", 0),
        not_evaluated_versions=s.get("not_evaluated_versions", []),
        agents=[control_pb2.AgentInfo(**a) for a in s["agents"]])
    ev = evaluation_to_proto(s.get("last_evaluation"))
    if ev is not None:
        msg.last_evaluation.CopyFrom(ev)
    if s.get("privacy"):
        msg.privacy.CopyFrom(control_pb2.PrivacySpent(**s["privacy"]))
    msg.runs.extend(status_to_proto(r) for r in s.get("runs", []))
    return msg


def event_to_proto(e: dict) -> control_pb2.RoundEvent:
    msg = control_pb2.RoundEvent(
        kind=control_pb2.RoundEvent.Kind.Value(e["kind"]), run_id=e["run_id"], round=e["round"],
        version=e["version"], agents=e.get("agents", []), metrics=e.get("metrics", {}),
        seconds=e.get("seconds", 0.0), message=e.get("message", ""), time_unix=e["time_unix"])
    ev = evaluation_to_proto(e.get("evaluation"))
    if ev is not None:
        msg.evaluation.CopyFrom(ev)
    return msg


def status_from_proto(p: control_pb2.RunStatus) -> dict:
    d = {"run_id": p.run_id, "state": p.state, "round": p.round, "rounds": p.rounds,
         "global_version": p.global_version, "message": p.message, "config_json": p.config_json,
         "env_id": p.env_id, "evaluated_versions": list(p.evaluated_versions),
         "not_evaluated_versions": list(p.not_evaluated_versions),
         "evaluators_following": p.evaluators_following, "agents": [{"agent_id": a.agent_id, "agent_index": a.agent_index, "num_samples": a.num_samples,
                     "connected": a.connected, "last_seen_unix": a.last_seen_unix,
                     "rounds_submitted": a.rounds_submitted, "steps_done": a.steps_done,
                     "steps_total": a.steps_total} for a in p.agents]}
    if p.HasField("last_evaluation"):
        d["last_evaluation"] = evaluation_from_proto(p.last_evaluation)
    if p.HasField("privacy"):
        q = p.privacy
        d["privacy"] = {"epsilon": q.epsilon, "delta": q.delta, "rounds": q.rounds, "noise_multiplier": q.noise_multiplier,
                        "clip": q.clip, "epsilon_budget": q.epsilon_budget}
        if q.clip_quantile:
            d["privacy"] |= {"clip_quantile": q.clip_quantile, "count_noise": q.count_noise,
                             "update_noise_multiplier": q.update_noise_multiplier}
    if p.runs:
        d["runs"] = [status_from_proto(r) for r in p.runs]
    return d


def event_from_proto(p: control_pb2.RoundEvent) -> dict:
    """An event as a dict; a kind this client does not know (a newer aggregator's) is named
    ``KIND_<number>``, for the caller to pass over."""
    kinds = control_pb2.RoundEvent.Kind
    kind = kinds.Name(p.kind) if p.kind in kinds.values() else f"KIND_{p.kind}"
    d = {"kind": kind, "run_id": p.run_id, "round": p.round,
         "version": p.version, "agents": list(p.agents), "metrics": dict(p.metrics),
         "seconds": p.seconds, "message": p.message, "time_unix": p.time_unix}
    if p.HasField("evaluation"):
        d["evaluation"] = evaluation_from_proto(p.evaluation)
    return d
