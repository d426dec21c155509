"""The agent's side of secure aggregation (fedrl/federation/secagg.py): its round's update, or in
round 0 its shard's observation moments, sent masked in the protocol's four steps, so that the
aggregator learns only the sum over the agents."""

from __future__ import annotations

import logging

import grpc

from fedrl.data.normalize import ObsStats
from fedrl.federation.privacy import count_extra, noise_generator, noise_share_std
from fedrl.federation.round import RoundInterrupted
from fedrl.federation.runconfig import RunConfig, parse_run_config
from fedrl.federation.secagg import AgentSession, PublicKeys, SecAggError, SecAggParams
from fedrl.federation.secagg_sums import agent_vector, moments_params, moments_vector
from fedrl.proto.v1 import federation_pb2
from fedrl.wire.rpc import StopFlag

log = logging.getLogger("fedrl.agent")


class SecureSteps:
    """An agent's secure aggregation calls to the aggregator (its ``SecureAggregation`` RPC)."""

    def __init__(self, agent_id: str, task_wait: float, rpc_timeout: float, stopped: StopFlag) -> None:
        self.agent_id, self.task_wait, self.rpc_timeout, self.stopped = agent_id, task_wait, rpc_timeout, stopped

    def update(self, stub, task, rc: RunConfig, res) -> None:
        """Round ``task``'s update ``res`` (a LocalResult). With differential privacy the agent
        adds its share of the noise first: N(0, (sigma * C)^2 / t), so that any t or more agents'
        sum carries at least the central noise. Its round metrics (losses, Q on its data, its
        update's norm: statistics of its data) stay here, on the agent's own metrics endpoint:
        the aggregator gets the sum and its training time, nothing else."""
        params = SecAggParams(threshold=rc.secagg_threshold, context=f"{task.run_id}/{task.round}".encode())
        clip = task.dp_clip or rc.dp_clip  # the round's norm (adaptive clipping moves it)
        std = noise_share_std(rc, clip)
        gen = noise_generator() if std else None
        # adaptive clipping: the centred bit "my update was within the norm", with its share of the
        # count's noise, summed under the masks with the model (the aggregator sees only the sum)
        extra = count_extra(rc, res.metrics, gen)
        self._steps(stub, task, params, lambda alpha: agent_vector(res.state, alpha, params, std, gen, extra),
                    federation_pb2.SecAggMasked(train_seconds=res.seconds))

    def moments(self, stub, task, st: ObsStats) -> bool:
        """A MOMENTS task (round 0 of a secure run): the shard's observation moments ``st``,
        weighted by its share of the samples. A refusal of this agent's own (moments past the
        fixed point's range) is logged, and the agent takes no part. Whether it took part."""
        rc = parse_run_config(task.run_config_json)
        params = moments_params(rc.secagg_threshold, f"{task.run_id}/0".encode())
        try:
            self._steps(stub, task, params, lambda alpha: moments_vector(st.count, st.total, st.total_sq, alpha, params),
                        federation_pb2.SecAggMasked())
        except SecAggError as e:
            log.error("the observation moments: no part in the secure aggregation: %s", e)
            return False
        log.info("observation moments sent by secure aggregation (run %s)", task.run_id)
        return True

    def _steps(self, stub, task, params, vector, masked) -> None:
        """The protocol's four steps for ``task``: keys, the seeds' shares sealed to the others,
        the masked ``vector(alpha)`` (sent in ``masked``), the shares that unmask the sum."""
        me = AgentSession(self.agent_id, params)
        pk = me.advertise()
        reply = self._call(stub, task, keys=federation_pb2.SecAggKeys(share_key=pk.share_key, mask_key=pk.mask_key))
        roster = {a: PublicKeys(bytes(k.share_key), bytes(k.mask_key)) for a, k in reply.roster.keys.items()}
        alpha = reply.roster.alpha[self.agent_id]
        reply = self._call(stub, task, shares=federation_pb2.SecAggShares(sealed=me.share_keys(roster)))
        me.receive_shares({a: bytes(b) for a, b in reply.relay.sealed.items()})
        shared = list(reply.relay.shared)
        y = me.masked_input(vector(alpha), shared)
        masked.vector = y.astype("<u8").tobytes()
        unopened = [a for a in me.unopened if a in shared]
        if unopened:  # a hostile or broken peer: named, so that the round can go on without it
            log.warning("round %d: the sealed shares of %s did not open here; the aggregator is told",
                        task.round, ", ".join(unopened))
        masked.unopened.extend(unopened)
        reply = self._call(stub, task, masked=masked)
        answer = me.unmask(list(reply.unmask.survivors), list(reply.unmask.dropped), list(reply.unmask.excluded))
        self._call(stub, task, answer=federation_pb2.SecAggAnswer(
            shares={a: federation_pb2.SecAggShare(point=p, share=sh) for a, (p, sh) in answer.shares.items()},
            pair_seeds=answer.pair_seeds))

    def _call(self, stub, task, **step):
        """One step, sent again while the reply says the others are not all there yet. A step the
        aggregator refuses as malformed (INVALID_ARGUMENT) is this agent's to refuse too
        (SecAggError): it sits the round out, and stays up."""
        msg = federation_pb2.SecAggMessage(agent_id=self.agent_id, run_id=task.run_id, round=task.round,
                                           wait_seconds=self.task_wait, **step)
        while True:
            try:
                reply = stub.SecureAggregation(msg, timeout=self.task_wait + self.rpc_timeout)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                raise SecAggError(f"the aggregator refused the {next(iter(step))} step: {e.details()}") from None
            if not reply.pending:
                return reply
            if self.stopped.is_set():
                raise RoundInterrupted("stopped during secure aggregation")
