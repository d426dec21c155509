"""The global versions the aggregator serves (FetchGlobal): the runs' it holds, encoded in
memory, or an earlier run's from the state directory, sent as stored once their checksum holds.

A part of :class:`aggregator_service.coordinator.Coordinator`, given the shared state and the
store; it changes nothing."""

from __future__ import annotations

import logging

import grpc

from aggregator_service.records import RUN_ID, Shared
from aggregator_service.store import DamagedVersion, Store
from fedrl.wire.codec import CodecError, Encoded, encoded_from_payload
from fedrl.wire.rpc import ServiceError

log = logging.getLogger("fedrl.aggregator")


class Versions:
    def __init__(self, shared: Shared, store: Store) -> None:
        self.s, self.store = shared, store

    def global_weights(self, run_id: str, version: int, agent: str | None = None) -> Encoded:
        """A global version: of a run held (``run_id`` empty: the newest), or a stored version of
        an earlier run of the state directory; ``version`` -1 is the latest. ``agent``: the
        caller is that agent (its token says so), and gets only the versions of runs that
        selected it: a run's model is its participants', not every agent's of the aggregator."""
        if version < -1:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"version {version}: expected a version >= 0, or -1 for the latest", "bad_version")
        with self.s.cond:
            run = self.s.runs.get(run_id) if run_id else self.s.run
            current = run is not None
            if current:
                if agent is not None and agent not in run.selected:
                    raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                                       f"agent {agent!r} is not a participant of run {run.run_id}", "not_selected")
                if run.state == "waiting_for_agents" or (run.state == "running" and not run.encoded):
                    raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "the run has not made its first "
                                       "version yet")
                v = run.version if version < 0 else version
                enc = run.encoded.get(v)
                if enc is not None:
                    return enc
                if v > run.version:
                    raise ServiceError(grpc.StatusCode.NOT_FOUND, f"version {v} does not exist yet "
                                       f"(latest is {run.version})", "unknown_version")
        if current:
            run_id = run.run_id
        else:  # an earlier run's stored version
            if not run_id or not RUN_ID.fullmatch(run_id) or run_id not in self.store.run_ids():
                raise ServiceError(grpc.StatusCode.NOT_FOUND, f"unknown run {run_id[:80]!r}", "unknown_run")
            if agent is not None and agent not in self.store.selected(run_id):
                raise ServiceError(grpc.StatusCode.PERMISSION_DENIED,
                                   f"agent {agent!r} is not a participant of run {run_id}", "not_selected")
            stored = self.store.versions(run_id)
            if not stored:
                raise ServiceError(grpc.StatusCode.NOT_FOUND, f"run {run_id} has no stored version", "unknown_version")
            v = stored[-1] if version < 0 else version
        try:  # an older version: its stored bytes, sent as written once their checksum holds
            payload = self.store.read_version(run_id, v)
        except FileNotFoundError:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"version {v} of run {run_id} is not stored",
                               "unknown_version") from None
        except DamagedVersion as e:
            log.error("%s; not served", e)
            raise ServiceError(grpc.StatusCode.DATA_LOSS, str(e), "corrupt_version") from None
        try:
            return encoded_from_payload(payload, run_id, v, v)
        except CodecError as e:
            raise ServiceError(grpc.StatusCode.DATA_LOSS, f"stored version {v} is unreadable: {e}",
                               "corrupt_version") from None
