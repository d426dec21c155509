"""Real gRPC servers on 127.0.0.1:0 (in this process) and real agents in threads."""

from __future__ import annotations

import threading

import pytest
import torch

from agent_service.client import Agent, AgentConfig
from aggregator_service.coordinator import Coordinator
from aggregator_service.servicer import ControlServicer, FederationServicer
from aggregator_service.store import Store
from fedrl.federation.simulate import load_shards
from fedrl.ops.metrics import AggregatorMetrics
from fedrl.proto.v1 import control_pb2_grpc, federation_pb2_grpc
from fedrl.wire.rpc import create_channel, create_server


class Aggregator:
    def __init__(self, state_dir, task_wait: float = 2.0, port: int = 0, tls=None, auth=None,
                 servicer=FederationServicer, resume: bool = False, **server_kw) -> None:
        from fedrl.wire.security import Authenticator, AuthInterceptor

        auth = auth or Authenticator()
        self.store = Store(state_dir)
        self.metrics = AggregatorMetrics()
        self.coord = Coordinator(self.store, max_task_wait=task_wait, tick=0.02, metrics=self.metrics, resume=resume)
        self.server = create_server([
            (federation_pb2_grpc.add_FederationServicer_to_server, servicer(self.coord, auth),
             "fedrl.v1.Federation"),
            (control_pb2_grpc.add_ControlServicer_to_server, ControlServicer(self.coord, auth), "fedrl.v1.Control"),
        ], "127.0.0.1", port, interceptors=[self.metrics.grpc, AuthInterceptor(auth)], tls=tls, **server_kw)
        self.target = f"127.0.0.1:{self.server.port}"
        self.channel = create_channel(self.target, tls)
        self.fed = federation_pb2_grpc.FederationStub(self.channel)
        self.control = control_pb2_grpc.ControlStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0.5)
        self.coord.close()


@pytest.fixture
def aggregator(tmp_path):
    agg = Aggregator(tmp_path / "state")
    yield agg
    agg.close()


class AgentThreads:
    """Real agent clients (the agent service's own code) running in threads."""

    def __init__(self) -> None:
        self.agents: list[Agent] = []
        self.threads: list[threading.Thread] = []

    def start(self, target: str, dataset: str, n: int, trajectories: int, seed: int,
              tls_for=lambda agent_id: None, token_for=lambda agent_id: None, **agent_kw) -> list[Agent]:
        shards, env = load_shards([dataset], n, trajectories, seed, None, lambda m: None)
        for s in shards:
            aid = f"agent-{s.agent}"
            kw = {"task_wait": 1.0, "backoff_initial": 0.05, "backoff_max": 0.5, **agent_kw}  # quick, unless asked
            a = Agent(AgentConfig(target, aid, s.agent, env.gym_id, torch.device("cpu"),
                                  tls=tls_for(aid), token=token_for(aid), **kw), s)
            t = threading.Thread(target=a.run, daemon=True)
            t.start()
            self.agents.append(a)
            self.threads.append(t)
        return self.agents

    def stop(self) -> None:
        for a in self.agents:
            a.stop()
        for t in self.threads:
            t.join(timeout=10)
            assert not t.is_alive(), "an agent thread did not stop"


@pytest.fixture
def agent_threads():
    at = AgentThreads()
    yield at
    at.stop()


@pytest.fixture(scope="session")
def step_deadline(stand_dataset, tmp_path_factory) -> float:
    """A round's deadline for tests whose honest agents must make it on this machine now: 8 times
    a clean 3-agent secure round (fed-bc, 2 trajectories each) measured here first, at least 4 s,
    so that however loaded the machine is, no honest agent misses a step; tests that wait for a
    deadline to pass take this long too."""
    from fedrl.proto.v1 import control_pb2
    from tests.service.test_federation import run_config, status, wait_for

    agg, agents = Aggregator(tmp_path_factory.mktemp("measure") / "state"), AgentThreads()
    try:
        agents.start(agg.target, str(stand_dataset), 3, 2, seed=7, share_moments=False)
        wait_for(lambda: len(status(agg)["agents"]) == 3, what="agents to join")
        agg.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(
            agents=3, rounds=1, secagg_threshold=2, algo="fed-bc")), timeout=10)
        done = wait_for(lambda: (s := status(agg))["state"] in ("finished", "failed", "stopped") and s,
                        what="the measuring run to end")
        assert done["state"] == "finished", done["message"]
        seconds = max(e["seconds"] for e in agg.store.read_run(done["run_id"])["events"] if e["kind"] == "ROUND_CLOSED")
    finally:
        agents.stop()
        agg.close()
    return max(4.0, 8 * seconds)
