"""The Evaluator gRPC service: evaluate a streamed policy on demand; list reports."""

from __future__ import annotations

import threading

import grpc

from evaluator_service.follower import Follower
from fedrl.algos.policy_io import policy_from_state
from fedrl.envs.evaluation import evaluate
from fedrl.ops.metrics import EvaluatorMetrics
from fedrl.proto.v1 import evaluator_pb2, evaluator_pb2_grpc
from fedrl.wire.codec import CodecError, assemble
from fedrl.wire.rpc import codec_status
from fedrl.wire.serde import evaluation_to_proto, read_weight_parts

MAX_EPISODES = 1000


class EvaluatorServicer(evaluator_pb2_grpc.EvaluatorServicer):
    def __init__(self, follower: Follower | None, num_envs: int = 10,
                 metrics: EvaluatorMetrics | None = None) -> None:
        self.follower, self.num_envs = follower, num_envs
        self.metrics = metrics or (follower.metrics if follower else EvaluatorMetrics())
        self._lock = threading.Lock()  # one on-demand rollout at a time (CPU bound)

    def Evaluate(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("part") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "an Evaluate stream must start with its header")
        h = first.header
        if not h.env_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "env_id is required")
        if not 1 <= h.episodes <= MAX_EPISODES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"episodes must be in [1, {MAX_EPISODES}]")
        try:
            manifest, chunks = read_weight_parts(p.weights for p in request_iterator)
            state = assemble(manifest, chunks)
            policy = policy_from_state(state)
        except CodecError as e:
            context.abort(codec_status(e.reason), str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            with self._lock:
                res = evaluate(policy, h.env_id, int(h.episodes), int(h.seed), self.num_envs)
            self.metrics.rollout("on_demand", len(res.returns), res.env_steps, res.seconds)
        except ValueError as e:  # unknown env, layout mismatch
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        d = {"run_id": manifest.run_id, "version": manifest.base_version, **res.as_dict()}
        return evaluation_to_proto(d)

    def GetReports(self, request, context):
        reports = [] if self.follower is None else list(self.follower.reports.values())
        if request.run_id:
            reports = [r for r in reports if r["run_id"] == request.run_id]
        return evaluator_pb2.ReportsReply(reports=[evaluation_to_proto(r) for r in reports])

