"""100 agents joining at once complete rounds against a real aggregator process, whose memory
stays bounded by one round's updates (model size x agents), not by the run's history."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time

import pytest

from fedrl.cli.client import ControlClient
from fedrl.data.d4rl import write_d4rl
from fedrl.data.make import rollout_dataset
from tests.conftest import stand_policy
from tests.service.conftest import AgentThreads

pytestmark = pytest.mark.slow(reason="100 agent processes' worth of joins against a real aggregator")

N = 100


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def many_episodes(tmp_path):
    raw = rollout_dataset("Hopper-v5", stand_policy, transitions=20 * N, seed=3, max_episode_steps=20)
    return write_d4rl(tmp_path / "hopper-short.hdf5", raw, {"env_id": "Hopper-v5"})


def test_hundred_agents_complete_rounds_in_bounded_memory(tmp_path, many_episodes):
    pf = tmp_path / "port"
    agg = subprocess.Popen([sys.executable, "-m", "aggregator_service", "--port", "0", "--port-file", str(pf),
                            "--state-dir", str(tmp_path / "state"), "--task-wait", "2"],
                           stdout=open(tmp_path / "agg.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    agents = AgentThreads()
    try:
        end = time.monotonic() + 60
        while not pf.exists():
            assert agg.poll() is None and time.monotonic() < end, "aggregator did not start"
            time.sleep(0.05)
        target = f"127.0.0.1:{pf.read_text()}"
        rounds = 16
        with ControlClient(target) as c:
            # The paper's network (2x256): ~280 KB a policy, ~28 MB of updates per round.
            c.start({"agents": N, "rounds": rounds, "local_steps": 1, "eval_episodes": 0, "seed": 1,
                     "round_timeout": 300, "join_timeout": 300,
                     "drpo": {"batch_size": 8, "cql_n_actions": 2}})
            agents.start(target, str(many_episodes), N, 1, 1)  # all at once
            samples: dict[int, float] = {}
            end = time.monotonic() + 600
            while (st := c.status())["state"] != "finished":
                assert st["state"] == "running" or st["state"] == "waiting_for_agents", st
                assert agg.poll() is None and time.monotonic() < end, "timed out"
                samples.setdefault(st["global_version"], rss_mb(agg.pid))
                time.sleep(0.1)
            assert st["global_version"] == rounds
            assert len(st["agents"]) == N and all(a["rounds_submitted"] == rounds for a in st["agents"])
        print(f"aggregator RSS by version (MB): {samples}")
        early = statistics.median(v for k, v in samples.items() if 2 <= k <= 4)
        late = statistics.median(v for k, v in samples.items() if k >= rounds - 3)
        # Keeping every round's updates would add ~28 MB a round: ~300 MB between the two windows.
        # The allocator's own noise here is about +-30 MB.
        assert late - early < 84, f"aggregator RSS grew {late - early:.0f} MB over {rounds - 6} rounds"
    finally:
        agents.stop()
        os.killpg(agg.pid, signal.SIGKILL)
        agg.wait(10)
