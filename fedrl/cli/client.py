"""A small Python client for the aggregator's Control service (scripts, notebooks, ``fedrl ctl``).

    from fedrl.cli.client import ControlClient
    with ControlClient("127.0.0.1:50051") as c:
        c.start({"agents": 3, "rounds": 5, "local_steps": 100})
        for event in c.watch():
            print(event["kind"], event["round"], event.get("evaluation"))
        policy_state = c.fetch_global()          # the latest global model's tensors
        c.save_policy("policy.safetensors")      # ... as a file `fedrl evaluate` reads
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedrl.federation.runconfig import RunConfig, parse_run_config
from fedrl.wire.control import ControlCalls


class ControlClient(ControlCalls):
    """The Control API's calls plus what a caller wants around them: run settings checked here
    first, and a global version saved as a policy file."""

    def start(self, config: RunConfig | dict[str, Any] | str) -> dict[str, Any]:
        """Start a run; ``config`` is validated locally first (same parser as the server)."""
        if isinstance(config, RunConfig):
            return self.start_json(config.to_json())
        return self.start_json(parse_run_config(config if isinstance(config, dict) else str(config)).to_json())

    def save_policy(self, path: str | Path, version: int = -1, run_id: str = "") -> dict[str, Any]:
        """Write a global version as a policy file (``fedrl evaluate`` reads it): of ``run_id``
        (default: the current run), ``version`` (default: its latest). Returns the metadata
        written with it (run, version, env, algo, hyperparameters), read from the version itself."""
        from fedrl.algos.policy_file import policy_tensors, write_policy_file

        if not run_id and not self.status().get("run_id"):
            raise ValueError("the aggregator has no run: nothing to fetch (a stored run: --run RUN; see runs)")
        payload, info, v, rid = self.fetch_payload(run_id, version)  # no torch: a file moves, nothing trains
        hp = json.loads(info.get("hparams") or "{}")
        meta = {"env_id": info.get("env_id", ""), "algo": info.get("algo", ""), "run_id": rid, "version": v,
                "hparams": hp}
        write_policy_file(policy_tensors(payload), path, meta, (hp.get("log_std_min", -5.0), hp.get("log_std_max", 2.0)))
        return meta


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)
