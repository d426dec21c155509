"""Property-based, per RPC, against real servers: random bytes and random well-formed messages
(every field of the request type, with extreme numbers, NaN, odd strings, nested messages) get
a specific status, never UNKNOWN or INTERNAL, within a bounded time (3 s; 1.5 s for a stream
of answers, which may wait for events), and the global model, its
stored versions and the run's round stay as they were."""

from __future__ import annotations

import hashlib
import math

import grpc
import pytest
import torch
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evaluator_service.servicer import EvaluatorServicer
from fedrl.proto.v1 import control_pb2, evaluator_pb2, evaluator_pb2_grpc, federation_pb2
from fedrl.wire.codec import assemble
from fedrl.wire.rpc import create_channel, create_server
from fedrl.wire.serde import read_weight_parts, status_from_proto

from .conftest import Aggregator
from .test_federation import join, run_config
from tests.service.test_federation import RPC_BOUND

BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
NAMES = st.sampled_from(["a0", "a1", "agent-0", "", "Hopper-v5", "policy.head.weight", "run", "\x00", "é" * 40])
INT64 = st.one_of(st.integers(-3, 3), st.sampled_from([-(2**63), 2**63 - 1, 2**31, 10**12]),
                  st.integers(-(2**63), 2**63 - 1))
DOUBLES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e308, -1e308, 5e-324]))


def _scalar(f):
    t = f.type
    if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return INT64
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return st.integers(-(2**31), 2**31 - 1)
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1)
    if t == F.TYPE_DOUBLE:
        return DOUBLES
    if t == F.TYPE_FLOAT:
        return st.floats(width=32, allow_nan=True, allow_infinity=True)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return st.one_of(NAMES, st.text(max_size=60))
    if t == F.TYPE_BYTES:
        return st.binary(max_size=300)
    if t == F.TYPE_ENUM:
        return st.sampled_from([v.number for v in f.enum_type.values] + [99])
    raise AssertionError(t)


def messages(desc, depth: int = 0):
    """A strategy for random, well-formed messages of ``desc`` (fields set or left at random)."""
    cls = message_factory.GetMessageClass(desc)
    parts = {}
    for f in desc.fields:
        if f.type == F.TYPE_MESSAGE:
            if f.message_type.GetOptions().map_entry:
                k, v = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                if v.type != F.TYPE_MESSAGE:
                    parts[f.name] = st.dictionaries(_scalar(k), _scalar(v), max_size=4)
                elif depth < 3:  # a map of messages (SecAggRoster.keys)
                    parts[f.name] = st.dictionaries(_scalar(k), messages(v.message_type, depth + 1), max_size=4)
            elif depth < 3:
                sub = messages(f.message_type, depth + 1)
                parts[f.name] = st.lists(sub, max_size=3) if f.is_repeated else sub
        else:
            parts[f.name] = st.lists(_scalar(f), max_size=8) if f.is_repeated else _scalar(f)

    def build(values):
        m = cls()
        for name, v in values.items():
            field = getattr(m, name)
            fd = desc.fields_by_name[name]
            if fd.type == F.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry:
                if fd.message_type.fields_by_name["value"].type == F.TYPE_MESSAGE:
                    for key, value in v.items():
                        field[key].CopyFrom(value)
                else:
                    field.update(v)
            elif fd.is_repeated:
                (field.extend(v) if fd.type != F.TYPE_MESSAGE else [field.add().CopyFrom(x) for x in v])
            elif fd.type == F.TYPE_MESSAGE:
                field.CopyFrom(v)
            else:
                setattr(m, name, v)
        return m

    return st.fixed_dictionaries({}, optional=parts).map(build)


# The kinds of value every scalar field is given in the explicit examples, whatever the random
# search draws: the property tests must not depend on a generator's internal distribution
# (hypothesis 6.170 stopped drawing NaN into map values at these settings; 6.155 did).
EXTREMES = {
    "int": [0, -1, 2**31 - 1, -(2**31)], "int64": [0, -1, 2**63 - 1, -(2**63)],
    "uint": [0, 1, 2**32 - 1, 2**31], "uint64": [0, 1, 2**64 - 1, 2**63],
    "double": [0.0, math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324],
    "float": [0.0, math.nan, math.inf, -math.inf, 3.4e38, -3.4e38, 1e-45],
    "bool": [False, True], "string": ["", "\x00", "../../etc", "é" * 40, "Hopper-v5"],
    "bytes": [b"", b"\x00" * 300, b"\xff" * 7],
}


def _extreme_kind(f) -> str:
    t = f.type
    if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return "int64"
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return "int"
    return {F.TYPE_UINT64: "uint64", F.TYPE_FIXED64: "uint64", F.TYPE_UINT32: "uint", F.TYPE_FIXED32: "uint",
            F.TYPE_DOUBLE: "double", F.TYPE_FLOAT: "float", F.TYPE_BOOL: "bool", F.TYPE_STRING: "string",
            F.TYPE_BYTES: "bytes"}[t]


def _extreme_value(f, i: int):
    if f.type == F.TYPE_ENUM:
        vals = [v.number for v in f.enum_type.values] + [99]
        return vals[i % len(vals)]
    vals = EXTREMES[_extreme_kind(f)]
    return vals[i % len(vals)]


def explicit_messages(desc, depth: int = 0) -> list:
    """Messages of ``desc`` that set every field, one per extreme value of each kind: variant i
    gives every scalar its kind's i-th extreme (NaN, infinities, the integer limits, empty and
    odd strings), nests sub-messages three deep, fills repeated fields with three entries and
    maps with two. Together they cover every kind of field and value, deterministically."""
    cls = message_factory.GetMessageClass(desc)
    n = max(len(v) for v in EXTREMES.values())
    out = []
    for i in range(n):
        m = cls()
        for f in desc.fields:
            if f.type == F.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
                k, v = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                field = getattr(m, f.name)
                for j in range(2):
                    key = _extreme_value(k, i + j)
                    if v.type == F.TYPE_MESSAGE:
                        if depth < 3:
                            field[key].CopyFrom(explicit_messages(v.message_type, depth + 1)[i])
                    else:
                        field[key] = _extreme_value(v, i + j)
            elif f.type == F.TYPE_MESSAGE:
                if depth >= 3:
                    continue
                sub = explicit_messages(f.message_type, depth + 1)[i]
                if f.is_repeated:
                    for _ in range(3):
                        getattr(m, f.name).add().CopyFrom(sub)
                else:
                    getattr(m, f.name).CopyFrom(sub)
            elif f.is_repeated:
                getattr(m, f.name).extend(_extreme_value(f, i + j) for j in range(3))
            else:
                setattr(m, f.name, _extreme_value(f, i))
        out.append(m)
    return out


def explicit_requests(method) -> list[bytes]:
    """The explicit examples of ``method``'s request type, serialised, plus bytes that are no message."""
    return [m.SerializeToString() for m in explicit_messages(method.input_type)] + [b"\xff" * 9, b"\x0a\xff"]


def requests(method):
    """Serialised requests for ``method``: a valid message of its type, or random bytes."""
    return st.one_of(messages(method.input_type).map(lambda m: m.SerializeToString()),
                     st.binary(max_size=200))


def call(channel, name, method, reqs: list[bytes]) -> grpc.StatusCode:
    cs, ss = method.client_streaming, method.server_streaming
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[(cs, ss)]
    c = kind(name, request_serializer=None, response_deserializer=None)
    try:
        out = c(iter(reqs) if cs else reqs[0], timeout=0.5 if ss else 3)  # a watch waits: a bad one fails at once
        if ss:
            for i, _ in enumerate(out):  # a stream that answers (watch, session): two answers suffice
                if i >= 1:
                    out.cancel()
                    break
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _methods(desc):
    return [(f"/{desc.full_name}/{m.name}", m) for m in desc.methods]


FED = _methods(federation_pb2.DESCRIPTOR.services_by_name["Federation"])
CONTROL = [m for m in _methods(control_pb2.DESCRIPTOR.services_by_name["Control"])
           if m[1].name not in ("StopRun", "StartRun")]  # an admin's legitimate calls change the run
EVAL = _methods(evaluator_pb2.DESCRIPTOR.services_by_name["Evaluator"])


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    agg = Aggregator(tmp_path_factory.mktemp("fuzz") / "state", task_wait=0.2)
    join(agg, "a0", 0)
    join(agg, "a1", 1)
    st_ = status_from_proto(agg.control.StartRun(
        control_pb2.StartRunRequest(config_json=run_config(rounds=3)), timeout=RPC_BOUND))
    run_id = st_["run_id"]
    g = assemble(*read_weight_parts(agg.fed.FetchGlobal(federation_pb2.FetchRequest(run_id=run_id, version=0),
                                                         timeout=RPC_BOUND)))
    digest = hashlib.sha256(agg.store.version_path(run_id, 0).read_bytes()).hexdigest()
    yield agg, run_id, g, digest
    agg.close()


FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.mark.parametrize("name,method", FED + CONTROL, ids=[n.rsplit("/", 1)[1] for n, _ in FED + CONTROL])
def test_aggregator_rpc_answers_random_requests_specifically_and_keeps_the_model(running, name, method):
    agg, run_id, g, digest = running

    for req in explicit_requests(method):  # every kind of field and value, whatever hypothesis draws
        code = call(agg.channel, name, method, [req])
        assert code not in BAD, (name, code, "explicit")

    @FUZZ
    @given(st.lists(requests(method), min_size=1, max_size=3))
    def each(reqs):
        code = call(agg.channel, name, method, reqs)
        assert code not in BAD, (name, code)

    each()
    st_ = status_from_proto(agg.control.GetStatus(control_pb2.StatusRequest(), timeout=RPC_BOUND))
    assert st_["run_id"] == run_id and st_["global_version"] == 0 and st_["round"] == 1
    assert st_["state"] == "running"
    assert agg.store.versions(run_id) == [0]
    assert hashlib.sha256(agg.store.version_path(run_id, 0).read_bytes()).hexdigest() == digest
    assert all(torch.equal(agg.coord.run.global_state[k], g[k]) for k in g)


@pytest.fixture(scope="module")
def evaluator():
    server = create_server([(evaluator_pb2_grpc.add_EvaluatorServicer_to_server, EvaluatorServicer(None, 1),
                             "fedrl.v1.Evaluator")], "127.0.0.1", 0)
    ch = create_channel(f"127.0.0.1:{server.port}")
    yield ch
    ch.close()
    server.stop(0.5)


@pytest.mark.parametrize("name,method", EVAL, ids=[n.rsplit("/", 1)[1] for n, _ in EVAL])
def test_evaluator_rpc_answers_random_requests_specifically(evaluator, name, method):
    for req in explicit_requests(method):
        assert call(evaluator, name, method, [req]) not in BAD, (name, "explicit")

    @FUZZ
    @given(st.lists(requests(method), min_size=1, max_size=3))
    def each(reqs):
        assert call(evaluator, name, method, reqs) not in BAD

    each()
    assert evaluator_pb2_grpc.EvaluatorStub(evaluator).GetReports(evaluator_pb2.ReportsRequest(), timeout=RPC_BOUND) is not None


def _kinds(m) -> set[str]:
    seen = set()
    if m.HasField("header") and m.header.HasField("weights"):
        seen.add("nested")
        if len(m.header.weights.tensors):
            seen.add("repeated")
    if m.HasField("header") and len(m.header.metrics):
        seen.add("map")
        if any(math.isnan(v) or math.isinf(v) for v in m.header.metrics.values()):
            seen.add("non-finite")
    return seen


def test_the_explicit_examples_set_every_kind_of_field():
    """The fuzz tests' explicit examples are not vacuous: together they set nested, repeated and
    map fields and non-finite numbers, deterministically (no dependence on hypothesis's draws)."""
    seen = set().union(*(_kinds(m) for m in explicit_messages(federation_pb2.InlineUpdate.DESCRIPTOR)))
    assert seen == {"nested", "repeated", "map", "non-finite"}, seen
    for desc in (federation_pb2.InlineUpdate.DESCRIPTOR, control_pb2.StartRunRequest.DESCRIPTOR):
        for m in explicit_messages(desc):  # every singular sub-message of the type is set in every example
            assert all(m.HasField(f.name) for f in desc.fields if f.type == F.TYPE_MESSAGE and not f.is_repeated)



def _secure_run_of_two(tmp_path, obs_norm: str):
    """An aggregator whose secure run (threshold 2) has agents a0 and a1 joined and open:
    (aggregator, run id, the SecureAggregation method's path and descriptor)."""
    agg = Aggregator(tmp_path / "state", task_wait=0.2)
    join(agg, "a0", 0)
    join(agg, "a1", 1)
    run_id = status_from_proto(agg.control.StartRun(control_pb2.StartRunRequest(
        config_json=run_config(secagg_threshold=2, obs_norm=obs_norm)), timeout=60))["run_id"]  # a bound, not a pace
    name, method = next((n, m) for n, m in FED if m.name == "SecureAggregation")
    return agg, run_id, name, method


@pytest.mark.parametrize("obs_norm, round_", [("none", 1), ("pooled", 0)])
def test_secure_aggregation_steps_of_the_run_s_own_agents_answer_random_content_specifically(tmp_path, obs_norm,
                                                                                              round_):
    """The fuzz above reaches SecureAggregation with made-up agents and runs; here every message
    names a real agent of an open secure run and its round (1; or 0, the observation moments'),
    so the steps' own checks (sizes, order, shares per roster agent) meet random content: never
    UNKNOWN/INTERNAL, and no version is made of it."""
    agg, run_id, name, method = _secure_run_of_two(tmp_path, obs_norm)
    try:
        assert agg.coord.run.round == round_

        def own(m, agent):
            m.agent_id, m.run_id, m.round = agent, run_id, round_
            return m.SerializeToString()

        for i, m in enumerate(explicit_messages(method.input_type)):
            assert call(agg.channel, name, method, [own(m, f"a{i % 2}")]) not in BAD, ("explicit", i)

        @FUZZ
        @given(messages(method.input_type), st.sampled_from(["a0", "a1"]))
        def each(m, agent):
            assert call(agg.channel, name, method, [own(m, agent)]) not in BAD

        each()
        # both agents' keys, well formed: the keys step closes and the random content now meets
        # the shares step (and, for what gets through, the masked one)
        for i, agent in enumerate(("a0", "a1")):
            keys = federation_pb2.SecAggMessage(keys=federation_pb2.SecAggKeys(
                share_key=bytes([i + 1]) * 32, mask_key=bytes([i + 3]) * 32))
            assert call(agg.channel, name, method, [own(keys, agent)]) not in BAD
        assert agg.coord.run.machine.secure.step == 1
        each()
        s = status_from_proto(agg.control.GetStatus(control_pb2.StatusRequest(), timeout=RPC_BOUND))
        assert s["run_id"] == run_id and s["global_version"] == 0 and agg.coord.run.round == round_
        assert agg.store.versions(run_id) == ([0] if round_ else [])
    finally:
        agg.close()


@pytest.mark.parametrize("obs_norm, round_", [("none", 1), ("pooled", 0)])
def test_secure_aggregation_played_as_real_agents_answers_random_content_at_every_step(tmp_path, obs_norm, round_):
    """Two real agents' sessions (``AgentSession``) of an open secure run take the protocol step by
    step; at the masked and the answer steps random content meets the steps' checks: never
    UNKNOWN/INTERNAL. Well-formed answers that are wrong then close the round: its sum does not
    check out, the run fails saying so, and no version is made of it."""
    import os

    from fedrl.federation.secagg import AgentSession, PublicKeys, SecAggParams
    from fedrl.federation.secagg_sums import moments_params

    agg, run_id, name, method = _secure_run_of_two(tmp_path, obs_norm)
    try:
        context = f"{run_id}/{round_}".encode()
        params = moments_params(2, context) if round_ == 0 else SecAggParams(threshold=2, context=context)
        me = {a: AgentSession(a, params) for a in ("a0", "a1")}

        def step(agent, wait=0.0, **kw):
            return agg.fed.SecureAggregation(federation_pb2.SecAggMessage(
                agent_id=agent, run_id=run_id, round=round_, wait_seconds=wait, **kw), timeout=60)

        def both(make):  # the first sends without waiting, the second closes the step, the first's repeat reads it
            step("a0", **make("a0"))
            step("a1", wait=5, **make("a1"))
            return {a: step(a, wait=5, **make(a)) for a in ("a0", "a1")}

        def keys(a):
            pk = me[a].advertise()
            return {"keys": federation_pb2.SecAggKeys(share_key=pk.share_key, mask_key=pk.mask_key)}

        replies = both(keys)
        roster = {a: PublicKeys(bytes(k.share_key), bytes(k.mask_key)) for a, k in replies["a0"].roster.keys.items()}
        sealed = {a: me[a].share_keys(roster) for a in me}
        both(lambda a: {"shares": federation_pb2.SecAggShares(sealed=sealed[a])})
        assert agg.coord.run.machine.secure.step == 2

        def own(m, agent):
            m.agent_id, m.run_id, m.round = agent, run_id, round_
            return m.SerializeToString()

        @FUZZ
        @given(messages(method.input_type), st.sampled_from(["a0", "a1"]))
        def each(m, agent):
            assert call(agg.channel, name, method, [own(m, agent)]) not in BAD

        each()  # the masked step meets random content
        size = agg.coord.run.machine.secure.size + 1
        for a in ("a0", "a1"):  # a masked vector of the right size: random, as a hostile agent's own input may be
            step(a, masked=federation_pb2.SecAggMasked(vector=os.urandom(8 * size)))
        assert agg.coord.run.machine.secure.step == 3
        each()  # the answer step meets random content
        for a in ("a0", "a1"):  # well-formed answers at each agent's own point, with random shares
            point = sorted(roster).index(a) + 1
            step(a, answer=federation_pb2.SecAggAnswer(shares={
                b: federation_pb2.SecAggShare(point=point, share=os.urandom(16)) for b in roster}))
        s = status_from_proto(agg.control.GetStatus(control_pb2.StatusRequest(), timeout=60))
        assert s["state"] == "failed" and "does not check out" in s["message"], s
        assert agg.store.versions(run_id) == ([0] if round_ else [])
        assert s["global_version"] == 0
    finally:
        agg.close()
