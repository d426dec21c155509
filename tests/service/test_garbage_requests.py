"""Bytes that are not a valid message, sent to every RPC of a real aggregator and evaluator:
each ends with INVALID_ARGUMENT naming the method (not grpc's INTERNAL), nothing is logged as
an error, and the server answers normally afterwards."""

from __future__ import annotations

import logging

import grpc
import pytest

from evaluator_service.servicer import EvaluatorServicer
from fedrl.proto.v1 import control_pb2, evaluator_pb2, evaluator_pb2_grpc, federation_pb2
from fedrl.wire.rpc import create_channel, create_server
from tests.service.test_federation import RPC_BOUND

GARBAGE = b"\xff\xff\xff\xff\x0f"  # a varint that never ends: no message parses from it


def _methods(descriptor):
    for m in descriptor.methods:
        yield f"/{descriptor.full_name}/{m.name}", m.client_streaming, m.server_streaming


def _call(channel, method, client_streaming, server_streaming):
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[(client_streaming, server_streaming)]
    call = kind(method, request_serializer=None, response_deserializer=None)
    req = iter([GARBAGE]) if client_streaming else GARBAGE
    out = call(req, timeout=10)
    if server_streaming:
        list(out)


def _assert_refused(channel, descriptor, raw_ok=()):
    for method, cs, ss in _methods(descriptor):
        with pytest.raises(grpc.RpcError) as ei:
            _call(channel, method, cs, ss)
        code = ei.value.code()
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (method, code, ei.value.details())
        if method not in raw_ok:
            assert code == grpc.StatusCode.INVALID_ARGUMENT and method in ei.value.details(), (method, code)


def test_every_aggregator_rpc_refuses_garbage_specifically(aggregator, caplog):
    ch = create_channel(aggregator.target)
    with caplog.at_level(logging.ERROR):
        _assert_refused(ch, federation_pb2.DESCRIPTOR.services_by_name["Federation"],
                        raw_ok=("/fedrl.v1.Federation/SubmitUpdate",))
        _assert_refused(ch, control_pb2.DESCRIPTOR.services_by_name["Control"])
    assert not [r for r in caplog.records if "deserializ" in r.getMessage().lower()]
    # still answering
    from fedrl.proto.v1 import control_pb2_grpc
    assert control_pb2_grpc.ControlStub(ch).GetStatus(control_pb2.StatusRequest(), timeout=RPC_BOUND) is not None
    ch.close()


def test_every_evaluator_rpc_refuses_garbage_specifically():
    server = create_server([(evaluator_pb2_grpc.add_EvaluatorServicer_to_server, EvaluatorServicer(None, 1),
                             "fedrl.v1.Evaluator")], "127.0.0.1", 0)
    ch = create_channel(f"127.0.0.1:{server.port}")
    try:
        _assert_refused(ch, evaluator_pb2.DESCRIPTOR.services_by_name["Evaluator"])
        assert evaluator_pb2_grpc.EvaluatorStub(ch).GetReports(evaluator_pb2.ReportsRequest(), timeout=RPC_BOUND) is not None
    finally:
        ch.close()
        server.stop(0.5)
