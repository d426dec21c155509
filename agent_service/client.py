"""The agent's side of the federation: join, wait for a task, fetch, train, submit; reconnect."""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from fedrl.codec import INLINE_MAX_BYTES, CodecError, assemble, check_manifest_matches, encode
from fedrl.data.normalize import ObsStats
from fedrl.data.partition import Shard
from fedrl.federation.round import LocalTrainer, algo_config
from fedrl.federation.runconfig import parse_run_config
from fedrl.metrics import AgentMetrics
from fedrl.proto.v1 import federation_pb2, federation_pb2_grpc
from fedrl.rpc import StopFlag, create_channel
from fedrl.security import TLSFiles
from fedrl.serde import manifest_from_proto, manifest_to_proto, read_weight_parts

log = logging.getLogger("fedrl.agent")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


@dataclass
class AgentConfig:
    target: str
    agent_id: str
    index: int
    env_id: str
    device: torch.device
    task_wait: float = 10.0
    backoff_initial: float = 0.2
    backoff_max: float = 10.0
    rpc_timeout: float = 120.0
    connect_timeout: float = 5.0  # a Join waits this long for the aggregator, then retries (stop() is seen)
    tls: TLSFiles | None = None
    token: str | None = None
    inline_max_bytes: int = INLINE_MAX_BYTES  # updates up to this size go as one message; larger ones stream


class Agent:
    """Runs until :meth:`stop`; survives aggregator restarts by rejoining with backoff."""

    def __init__(self, cfg: AgentConfig, shard: Shard, metrics: AgentMetrics | None = None) -> None:
        self.cfg, self.shard = cfg, shard
        self.metrics = metrics or AgentMetrics(cfg.agent_id, str(cfg.device))
        self.stats = ObsStats.of(shard.transitions.obs)
        self._stop = StopFlag()  # stop() may be called from a signal handler
        self._channel: grpc.Channel | None = None  # the one in use (closed by stop)
        self.trainer: LocalTrainer | None = None
        self.trainer_run = ""
        self.rounds_done = 0
        self._bad_streak = 0  # global models refused in a row

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Until :meth:`stop`: join, then wait, fetch, train and submit; rejoin after failures."""
        threading.Thread(target=self._close_channel_on_stop, name="agent-stop", daemon=True).start()
        delay = self.cfg.backoff_initial
        while not self._stop.is_set():
            channel = self._channel = create_channel(self.cfg.target, self.cfg.tls, self.cfg.token)
            try:
                if not self._stop.is_set():  # stop() may have come while the channel was made
                    delay = self._session(channel, delay)
            except Exception as e:
                if not self._stop.is_set():
                    raise
                # a call cancelled by _close_channel_on_stop, a local round cut short
                log.info("stopped: %s", e.details() if isinstance(e, grpc.RpcError) else e)
            finally:
                channel.close()

    def _close_channel_on_stop(self) -> None:
        """Once stopped, close the channel in use: that cancels a call in flight (a long-poll for
        a task, a transfer) at once. :meth:`stop` itself runs in a signal handler, which must
        not take the locks closing a channel takes."""
        self._stop.wait()
        channel = self._channel
        if channel is not None:
            channel.close()

    def _session(self, channel: grpc.Channel, delay: float) -> float:
        """Join and work on one channel until it fails; returns the next reconnection delay."""
        try:
            stub = federation_pb2_grpc.FederationStub(channel)
            self._join(stub)
            delay = self.cfg.backoff_initial
            self._loop(stub)
        except CodecError as e:
            # The global model failed verification on the way here (damaged in transit, a bad
            # store): nothing was trained or sent. Ask again after a pause, on a new channel.
            # The pause grows while no round succeeds (a successful submission resets it).
            wait = min(self.cfg.backoff_initial * 2 ** self._bad_streak, self.cfg.backoff_max)
            self._bad_streak += 1
            log.error("global model refused (%s: %s); asking again in %.1fs", e.reason, e, wait)
            self.metrics.bad_downloads.inc()
            self._stop.wait(wait * (0.5 + random.random()))
        except grpc.RpcError as e:
            code = e.code()
            if self._stop.is_set():
                raise
            if code not in RETRYABLE and code != grpc.StatusCode.NOT_FOUND:
                log.error("giving up: %s %s", code.name, e.details())
                raise
            log.warning("aggregator unavailable (%s: %s); retrying in %.1fs", code.name, e.details(), delay)
            self.metrics.reconnects.inc()
            self._stop.wait(delay * (0.5 + random.random()))
            delay = min(delay * 2, self.cfg.backoff_max)
        return delay

    def _join(self, stub) -> None:
        tr = self.shard.transitions
        req = federation_pb2.JoinRequest(
            agent_id=self.cfg.agent_id, agent_index=self.cfg.index, num_samples=len(tr),
            obs_dim=tr.obs.shape[1], act_dim=tr.actions.shape[1], env_id=self.cfg.env_id,
            obs_moments=federation_pb2.ObsMoments(count=self.stats.count, sum=self.stats.total.tolist(),
                                                  sum_sq=self.stats.total_sq.tolist()),
            device=str(self.cfg.device))
        reply = stub.Join(req, timeout=self.cfg.connect_timeout, wait_for_ready=True)
        log.info("joined as %s (run %s)", self.cfg.agent_id, reply.run_id or "none yet")

    def _loop(self, stub) -> None:
        task = None  # the next task, when the last submission's reply brought it
        while not self._stop.is_set():
            if task is None:
                task = stub.NextTask(federation_pb2.TaskRequest(agent_id=self.cfg.agent_id,
                                                                wait_seconds=self.cfg.task_wait),
                                     timeout=self.cfg.task_wait + 30)
            current, task = task, None
            if current.kind == federation_pb2.Task.TRAIN:
                task = self._train(stub, current)
            elif current.kind == federation_pb2.Task.STOP:
                log.info("run %s is over", current.run_id)
                self.trainer, self.trainer_run = None, ""

    def _trainer_for(self, task) -> LocalTrainer:
        if self.trainer is None or self.trainer_run != task.run_id:
            rc = parse_run_config(task.run_config_json)
            hp = algo_config(rc.algo, rc.drpo, rc.bc)
            self.trainer = LocalTrainer(
                self.cfg.index, hp, self.shard.transitions, np.asarray(task.obs_mean, np.float32),
                np.asarray(task.obs_std, np.float32), rc.seed, self.cfg.device,
                federate_critic=rc.federate == "policy+critic", local_normalizer=rc.obs_norm == "local")
            self.trainer_run = task.run_id
            # names, dtypes and shapes a base version must have (views of the live tensors)
            self.base_reference = self.trainer.learner.shared_state(self.trainer.federate_critic)
        return self.trainer

    def _train(self, stub, task):
        """Train on ``task`` and submit; returns the next task when the reply carried it."""
        trainer = self._trainer_for(task)
        if task.HasField("base_manifest"):  # small model: the base version came with the task
            manifest, chunks = manifest_from_proto(task.base_manifest), [task.base_payload]
            if (manifest.run_id, manifest.base_version) != (task.run_id, task.base_version):
                raise CodecError("bad_manifest", "the task's inline weights are not its base version")
        else:
            parts = stub.FetchGlobal(federation_pb2.FetchRequest(run_id=task.run_id, version=task.base_version),
                                     timeout=self.cfg.rpc_timeout)
            manifest, chunks = read_weight_parts(parts)
        check_manifest_matches(manifest, self.base_reference)  # before a buffer is sized from it
        state = assemble(manifest, chunks)
        res = trainer.train_round(state, task.local_steps, stop=self._stop.is_set)
        self.metrics.trained(task.local_steps, res.seconds, res.metrics)
        enc = encode(res.state, task.run_id, task.round, task.base_version, res.num_samples)
        header = federation_pb2.UpdateHeader(agent_id=self.cfg.agent_id, weights=manifest_to_proto(enc.manifest),
                                             metrics=res.metrics, train_seconds=res.seconds)

        def parts_out():
            yield federation_pb2.UpdatePart(header=header)
            for c in enc.chunks():
                yield federation_pb2.UpdatePart(chunk=c)

        try:
            if enc.manifest.total_bytes <= self.cfg.inline_max_bytes:  # small model: one unary call,
                # whose reply also brings the next task (no NextTask call between rounds)
                reply = stub.SubmitUpdateInline(
                    federation_pb2.InlineUpdate(header=header, payload=enc.payload,
                                                next_task_wait_seconds=self.cfg.task_wait),
                    timeout=self.cfg.rpc_timeout + self.cfg.task_wait)
            else:
                reply = stub.SubmitUpdate(parts_out(), timeout=self.cfg.rpc_timeout)
            self.rounds_done += 1
            self._bad_streak = 0
            self.metrics.rounds.inc()
            log.info("round %d: submitted after %d steps in %.1fs", task.round, task.local_steps, res.seconds)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
                log.warning("round %d: update not taken (%s)", task.round, e.details())
                return None
            raise
        return reply.next_task if reply.HasField("next_task") else None

