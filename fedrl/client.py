"""A small Python client for the aggregator's Control service (scripts, notebooks, ``fedrl ctl``).

    from fedrl.client import ControlClient
    with ControlClient("127.0.0.1:50051") as c:
        c.start({"agents": 3, "rounds": 5, "local_steps": 100})
        for event in c.watch():
            print(event["kind"], event["round"], event.get("evaluation"))
        policy_state = c.fetch_global()          # the latest global model's tensors
        c.save_policy("policy.safetensors")      # ... as a file `fedrl evaluate` reads
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fedrl.codec import assemble
from fedrl.federation.runconfig import RunConfig, parse_run_config
from fedrl.proto.v1 import control_pb2, control_pb2_grpc, federation_pb2, federation_pb2_grpc
from fedrl.rpc import create_channel, wait_ready, weights_calls
from fedrl.security import TLSFiles
from fedrl.serde import event_from_proto, read_weight_messages, status_from_proto


class ControlClient:
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
                raise ConnectionError(f"no aggregator answering at {target} within {connect_timeout:.0f}s") from None
        self.control = control_pb2_grpc.ControlStub(self.channel)
        self.fed = federation_pb2_grpc.FederationStub(self.channel)

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def start(self, config: RunConfig | dict[str, Any] | str) -> dict[str, Any]:
        """Start a run; ``config`` is validated locally first (same parser as the server)."""
        if isinstance(config, RunConfig):
            text = config.to_json()
        else:
            text = parse_run_config(config if isinstance(config, dict) else str(config)).to_json()
        return status_from_proto(self.control.StartRun(control_pb2.StartRunRequest(config_json=text),
                                                       timeout=self.timeout))

    def status(self) -> dict[str, Any]:
        return status_from_proto(self.control.GetStatus(control_pb2.StatusRequest(), timeout=self.timeout))

    def stop(self, reason: str = "") -> dict[str, Any]:
        return status_from_proto(self.control.StopRun(control_pb2.StopRunRequest(reason=reason),
                                                      timeout=self.timeout))

    def watch(self, after_version: int = -1, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Round events (dicts) of the current run until it ends."""
        for e in self.control.WatchRounds(control_pb2.WatchRequest(after_version=after_version), timeout=timeout):
            yield event_from_proto(e)

    def fetch_global(self, run_id: str = "", version: int = -1) -> dict[str, torch.Tensor]:
        """Tensors of a global version (verified: size, sha256, names, shapes, finiteness)."""
        fetch, _ = weights_calls(self.channel)
        return assemble(*read_weight_messages(fetch(federation_pb2.FetchRequest(run_id=run_id, version=version),
                                                    timeout=max(self.timeout, 120))))

    def save_policy(self, path: str | Path, version: int = -1) -> dict[str, Any]:
        """Write a global version of the current run as a policy file (``fedrl evaluate`` reads it;
        default: the latest); returns the metadata written with it (run, version, env, algo,
        hyperparameters)."""
        from fedrl.algos.config import config_to_dict
        from fedrl.federation.round import algo_config
        from fedrl.policy_io import policy_from_state, save_policy

        st = self.status()
        if not st.get("run_id"):
            raise ValueError("the aggregator has no run: nothing to fetch")
        v = st["global_version"] if version < 0 else version  # pinned: the metadata names these tensors
        state = self.fetch_global(st["run_id"], v)
        rc = parse_run_config(st["config_json"])
        hp = algo_config(rc.algo, rc.drpo, rc.bc)
        meta = {"env_id": st.get("env_id", ""), "algo": rc.algo, "run_id": st["run_id"], "version": v,
                "hparams": config_to_dict(hp)}
        save_policy(policy_from_state(state, hp.log_std_min, hp.log_std_max), path, meta)
        return meta


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)
