"""The Control API's calls from the client side: the channel, the stubs, protobuf in and domain
dicts out. :class:`fedrl.cli.client.ControlClient` (scripts, notebooks, ``fedrl ctl``) builds on it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fedrl.proto.v1 import (
    control_pb2,
    control_pb2_grpc,
    federation_pb2,
    federation_pb2_grpc,
)
from fedrl.wire.rpc import create_channel, wait_ready, weights_calls
from fedrl.wire.security import TLSFiles
from fedrl.wire.serde import event_from_proto, read_weight_messages, status_from_proto

if TYPE_CHECKING:  # torch comes with the codec, loaded only by the calls that fetch weights (fedrl ctl
    import torch   # status, watch, stop... never load it)


class ControlCalls:
    def __init__(self, target: str, timeout: float = 30.0, connect_timeout: float | None = 10.0,
                 tls: TLSFiles | None = None, token: str | None = None) -> None:
        """``tls``: trust (and client certificate) for a TLS aggregator; ``token``: the admin token."""
        self.target, self.timeout = target, timeout
        self.channel = create_channel(target, tls, token)
        if connect_timeout:
            try:
                wait_ready(self.channel, connect_timeout)
            except Exception:
                self.channel.close()
                raise ConnectionError(f"no aggregator answering at {target} within {connect_timeout:g} s") from None
        self.control = control_pb2_grpc.ControlStub(self.channel)
        self.fed = federation_pb2_grpc.FederationStub(self.channel)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def start_json(self, config_json: str) -> dict[str, Any]:
        """Start a run from its settings as JSON (the server validates them too)."""
        return status_from_proto(self.control.StartRun(control_pb2.StartRunRequest(config_json=config_json),
                                                       timeout=self.timeout))

    def status(self, run_id: str = "") -> dict[str, Any]:
        """``run_id``'s status; without it the newest run's, with every run held in ``runs``."""
        return status_from_proto(self.control.GetStatus(control_pb2.StatusRequest(run_id=run_id),
                                                        timeout=self.timeout))

    def stop(self, reason: str = "", run_id: str = "") -> dict[str, Any]:
        """Stop ``run_id`` (empty: the only active run)."""
        return status_from_proto(self.control.StopRun(control_pb2.StopRunRequest(reason=reason, run_id=run_id),
                                                      timeout=self.timeout))

    def runs(self, limit: int = 100) -> list[dict[str, Any]]:
        """The state directory's runs, newest first."""
        reply = self.control.ListRuns(control_pb2.ListRunsRequest(limit=limit), timeout=self.timeout)
        return [{"run_id": r.run_id, "state": r.state, "algo": r.algo, "agents": r.agents, "rounds": r.rounds,
                 "latest_version": r.latest_version, "started_unix": r.started_unix,
                 "best_score": r.best_score if r.has_score else None,
                 "best_version": r.best_version if r.has_score else None, "message": r.message}
                for r in reply.runs]

    def versions(self, run_id: str = "") -> dict[str, Any]:
        """A run's stored versions (default: the newest run's)."""
        reply = self.control.ListVersions(control_pb2.ListVersionsRequest(run_id=run_id), timeout=self.timeout)
        return {"run_id": reply.run_id, "versions": [
            {"version": v.version, "time_unix": v.time_unix, "size_bytes": v.size_bytes, "sha256": v.sha256,
             "score_mean": v.score_mean if v.evaluated else None, "return_mean": v.return_mean if v.evaluated else None,
             "episodes": v.episodes} for v in reply.versions]}

    def watch(self, after_version: int = -1, timeout: float | None = None,
              run_id: str = "") -> Iterator[dict[str, Any]]:
        """Round events (dicts) of ``run_id`` until it ends (empty: of every run held, until all have)."""
        for e in self.control.WatchRounds(control_pb2.WatchRequest(after_version=after_version, run_id=run_id),
                                          timeout=timeout):
            yield event_from_proto(e)

    def fetch_version(self, run_id: str = "", version: int = -1) -> tuple[dict[str, torch.Tensor], dict[str, str], int, str]:
        """A global version's tensors (verified), the metadata it was written with (its run,
        algorithm, environment, hyperparameters), its version and its run: of ``run_id``
        (default: the current run) or any stored run, ``version`` -1 the latest."""
        from fedrl.wire.codec import assemble
        from fedrl.wire.tensorfile import payload_metadata

        fetch, _ = weights_calls(self.channel)
        manifest, chunks = read_weight_messages(fetch(federation_pb2.FetchRequest(run_id=run_id, version=version),
                                                      timeout=max(self.timeout, 120)))
        meta = payload_metadata(chunks)
        return assemble(manifest, chunks), meta, manifest.base_version, manifest.run_id

    def fetch_payload(self, run_id: str = "", version: int = -1) -> tuple[bytes, dict[str, str], int, str]:
        """A global version's safetensors bytes, checked against its manifest's size and checksum
        without torch (``ctl fetch`` writes a file of them), the metadata they were written with,
        its version and its run. CodecError when they are not what the manifest says."""
        import json

        from fedrl.wire.manifest import CodecError, checksum

        fetch, _ = weights_calls(self.channel)
        manifest, chunks = read_weight_messages(fetch(federation_pb2.FetchRequest(run_id=run_id, version=version),
                                                      timeout=max(self.timeout, 120)))
        payload = b"".join(bytes(c) for c in chunks)
        if len(payload) != manifest.total_bytes:
            raise CodecError("truncated", f"received {len(payload)} of {manifest.total_bytes} declared bytes")
        if checksum(payload) != manifest.checksum:
            raise CodecError("checksum_mismatch", "the version's bytes do not match its manifest's checksum")
        n = int.from_bytes(payload[:8], "little")
        try:
            meta = json.loads(payload[8:8 + n]).get("__metadata__") or {}
        except (ValueError, UnicodeDecodeError):
            raise CodecError("bad_header", "the version's safetensors header is not JSON") from None
        return payload, meta, manifest.base_version, manifest.run_id

    def fetch_global(self, run_id: str = "", version: int = -1) -> dict[str, torch.Tensor]:
        """Tensors of a global version (verified: size, checksum, names, shapes, finiteness)."""
        from fedrl.wire.codec import assemble

        fetch, _ = weights_calls(self.channel)
        return assemble(*read_weight_messages(fetch(federation_pb2.FetchRequest(run_id=run_id, version=version),
                                                    timeout=max(self.timeout, 120))))
