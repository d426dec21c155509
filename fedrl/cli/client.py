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

    def save_policy(self, path: str | Path, version: int = -1) -> dict[str, Any]:
        """Write a global version of the current run as a policy file (``fedrl evaluate`` reads it;
        default: the latest); returns the metadata written with it (run, version, env, algo,
        hyperparameters)."""
        from fedrl.algos.config import config_to_dict
        from fedrl.algos.policy_io import policy_from_state, save_policy
        from fedrl.federation.round import algo_config

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
