"""Private rounds under a hostile agent or operator (issue 84), through a real aggregator on
loopback and the agent service's own code: no exception ends the aggregator's clock, settings the
arithmetic cannot take are refused at StartRun, and a secure sum that does not check out stores
nothing. Each protection's test fails with the protection removed (``benchmarks.mutants``)."""

from __future__ import annotations

import grpc
import pytest

from fedrl.federation.machine import RoundMachine
from fedrl.proto.v1 import control_pb2
from fedrl.wire.serde import status_from_proto
from tests.service.test_federation import one_thread, run_config, status, wait_for  # noqa: F401


def unknown_answers(agg) -> float:
    """How many calls any method of the aggregator answered UNKNOWN."""
    return sum(s.value for m in agg.metrics.registry.collect() if m.name == "grpc_server_handled"
               for s in m.samples if s.name == "grpc_server_handled_total" and s.labels.get("grpc_code") == "UNKNOWN")


def ended(agg) -> dict:
    return wait_for(lambda: (s := status(agg))["state"] in ("finished", "failed", "stopped") and s, what="run to end")


def start(agg, **cfg) -> dict:
    return status_from_proto(agg.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(**cfg)),
                                                  timeout=10))


@pytest.mark.parametrize("where, says", [
    ("close", "round 1's close failed: RuntimeError: injected"),  # in the RPC thread of the last update
    ("closable", "the aggregator's clock failed: RuntimeError: injected"),  # in the clock thread
])
def test_an_exception_at_a_close_fails_that_run_and_the_clock_goes_on(aggregator, agent_threads, stand_dataset,
                                                                      monkeypatch, one_thread, where, says):
    """An exception where a round closes (injected) fails the run, naming the cause; no caller
    gets UNKNOWN, the clock thread lives, and the next run's join deadline still fires."""
    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(RoundMachine, where, boom)
    agent_threads.start(aggregator.target, str(stand_dataset), 2, 2, seed=7)
    wait_for(lambda: len(status(aggregator)["agents"]) == 2, what="agents to join")
    assert start(aggregator)["state"] in ("running", "waiting_for_agents")
    done = ended(aggregator)
    assert done["state"] == "failed" and says in done["message"], done
    assert aggregator.coord._ticker.is_alive()
    monkeypatch.undo()
    # the clock still keeps time: a run short of agents fails at its join deadline
    assert start(aggregator, agents=3, join_timeout=0.5)["state"] == "waiting_for_agents"
    again = ended(aggregator)
    assert again["state"] == "failed" and "only 2 of the 3 agents" in again["message"], again
    assert unknown_answers(aggregator) == 0


def test_a_hostile_count_share_moves_the_norm_to_its_range_end_and_the_run_goes_on(aggregator, agent_threads,
                                                                                   stand_dataset, monkeypatch,
                                                                                   one_thread):
    """Adaptive clipping under the masks (3 agents, threshold 2): agent-2 masks a count share of
    -15,000 beside its model, inside the fixed point's range, so nobody can refuse it. The summed
    share (about -5,000) once overflowed ``exp`` in whichever thread closed the round and killed
    the clock. The norm now goes to the end of its range, and the run finishes."""
    import agent_service.secure as secure
    from fedrl.federation.privacy import CLIP_RANGE

    real_extra, real_update = secure.count_extra, secure.SecureSteps.update
    monkeypatch.setattr(secure, "count_extra",
                        lambda cfg, metrics, gen: [-15000.0] if metrics.get("hostile") else real_extra(cfg, metrics, gen))

    def update(self, stub, task, rc, res):
        if self.agent_id == "agent-2":
            res.metrics["hostile"] = 1.0
        return real_update(self, stub, task, rc, res)

    monkeypatch.setattr(secure.SecureSteps, "update", update)
    agent_threads.start(aggregator.target, str(stand_dataset), 3, 2, seed=7, share_moments=False)
    wait_for(lambda: len(status(aggregator)["agents"]) == 3, what="agents to join")
    start(aggregator, agents=3, rounds=2, secagg_threshold=2, algo="fed-bc", dp_clip=1.0, dp_clip_quantile=0.5)
    done = ended(aggregator)
    assert done["state"] == "finished", done["message"]
    closed = [e["metrics"] for e in aggregator.store.read_run(done["run_id"])["events"] if e["kind"] == "ROUND_CLOSED"]
    assert closed[0]["dp_unclipped_fraction"] < -1000 and closed[0]["dp_clip_next"] == pytest.approx(CLIP_RANGE[1])
    assert closed[1]["dp_clip"] == pytest.approx(CLIP_RANGE[1])
    assert aggregator.coord._ticker.is_alive() and unknown_answers(aggregator) == 0
