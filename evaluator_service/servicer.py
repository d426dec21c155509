"""The Evaluator gRPC service: evaluate a streamed policy on demand; list reports."""

from __future__ import annotations

import threading

import grpc

from evaluator_service.follower import Follower
from fedrl.algos.policy_io import policy_from_state
from fedrl.envs.evaluation import evaluate
from fedrl.ops.metrics import EvaluatorMetrics
from fedrl.proto.v1 import evaluator_pb2, evaluator_pb2_grpc
from fedrl.wire.codec import Assembler, CodecError, check_manifest
from fedrl.wire.rpc import codec_status, status_details
from fedrl.wire.serde import evaluation_to_proto, manifest_from_proto

MAX_EPISODES = 1000
# The largest policy an on-demand Evaluate accepts (the paper's is ~280 KB): a declared size above
# it is refused before anything is allocated (--max-policy-mb).
MAX_POLICY_BYTES = 64 << 20
# What all on-demand Evaluate streams together may be receiving at once, by their declared sizes
# (--max-inflight-mb): each stream reserves its declared size before it reads a chunk, so 56
# streams of 60 MiB can no longer hold ~4.7 GiB; one past the budget is refused at once.
MAX_INFLIGHT_BYTES = 256 << 20


class EvaluatorServicer(evaluator_pb2_grpc.EvaluatorServicer):
    def __init__(self, follower: Follower | None, num_envs: int = 10,
                 metrics: EvaluatorMetrics | None = None, max_policy_bytes: int = MAX_POLICY_BYTES,
                 max_inflight_bytes: int = MAX_INFLIGHT_BYTES) -> None:
        self.follower, self.num_envs, self.max_policy_bytes = follower, num_envs, max_policy_bytes
        self.max_inflight_bytes = max(max_inflight_bytes, max_policy_bytes)  # one policy always fits
        self.metrics = metrics or (follower.metrics if follower else EvaluatorMetrics())
        self._lock = threading.Lock()  # one on-demand rollout at a time (CPU bound)
        self._budget = threading.Lock()
        self.inflight = 0  # bytes reserved by the Evaluate streams open now

    def _reserve(self, n: int) -> bool:
        with self._budget:
            if self.inflight + n > self.max_inflight_bytes:
                return False
            self.inflight += n
            return True

    def _release(self, n: int) -> None:
        with self._budget:
            self.inflight -= n
            idle = self.inflight == 0
        if idle:
            from fedrl.wire.memory import release_free_memory

            release_free_memory()  # the streams' buffers go back to the OS, not to malloc's arenas

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
            parts = (p.weights for p in request_iterator)
            first = next(parts, None)
            if first is None or first.WhichOneof("part") != "manifest":
                raise ValueError("weights stream must start with a manifest")
            manifest = manifest_from_proto(first.manifest)
            check_manifest(manifest)  # consistent with the tensors it lists (INVALID_ARGUMENT if not)
            if manifest.total_bytes > self.max_policy_bytes:  # before a byte is allocated or read
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"declared size {manifest.total_bytes} bytes exceeds this evaluator's limit of "
                              f"{self.max_policy_bytes} bytes (--max-policy-mb)")
            if not self._reserve(manifest.total_bytes):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{self.inflight >> 20} MiB of policies are being received; with this one's "
                              f"{manifest.total_bytes >> 20} MiB it would pass this evaluator's "
                              f"{self.max_inflight_bytes >> 20} MiB (--max-inflight-mb): retry later")
            try:
                asm = Assembler(manifest, grow=True)  # memory follows the bytes received
                for p in parts:
                    if p.WhichOneof("part") != "chunk":
                        raise ValueError("a weights stream has exactly one manifest, first")
                    asm.add(p.chunk)
                state = asm.finish()
                policy = policy_from_state(state)
                del asm, state
            finally:
                self._release(manifest.total_bytes)
        except CodecError as e:
            context.abort(codec_status(e.reason), status_details(str(e)))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_details(str(e)))
        try:
            with self._lock:
                res = evaluate(policy, h.env_id, int(h.episodes), int(h.seed), self.num_envs)
            self.metrics.rollout("on_demand", len(res.returns), res.env_steps, res.seconds)
        except ValueError as e:  # unknown env, layout mismatch, actions not finite
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_details(str(e)))
        d = {"run_id": manifest.run_id, "version": manifest.base_version, **res.as_dict()}
        return evaluation_to_proto(d)

    def GetReports(self, request, context):
        reports = [] if self.follower is None else list(self.follower.reports.values())
        if request.run_id:
            reports = [r for r in reports if r["run_id"] == request.run_id]
        return evaluator_pb2.ReportsReply(reports=[evaluation_to_proto(r) for r in reports])

