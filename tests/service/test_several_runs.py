"""One federation, several runs at once: each run's versions are those it makes alone, its
agents take the runs' tasks in turn, and a restarted aggregator resumes every run."""

from __future__ import annotations

import json

import grpc
import pytest
import torch

from fedrl.federation.simulate import SimConfig
from fedrl.federation.simulate import run as simulate
from fedrl.proto.v1 import control_pb2
from fedrl.wire.serde import status_from_proto
from tests.service.conftest import Aggregator
from tests.service.test_federation import (  # noqa: F401
    RPC_BOUND,
    SMALL,
    SMALL_BC,
    one_thread,
    run_config,
    status,
    wait_for,
)

# Two runs as different as one fleet allows: a clear DRPO run, and a secure Fed-BC one whose
# round 0 gathers the moments masked, each with its own rounds and local steps (the seed also
# splits the simulator's data: the agents' shards are those of seed 7).
RUNS = (dict(algo="drpo", rounds=3, local_steps=3, seed=7),
        dict(algo="fed-bc", rounds=2, local_steps=5, seed=7, secagg_threshold=2))


def alone(data: str, tmp_path, algo: str, rounds: int, local_steps: int, seed: int,
          secagg_threshold: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    """The global model after each round of the run alone (the simulator: the same versions
    as a service run, tests/service/test_federation.py shows it)."""
    states: dict[int, dict[str, torch.Tensor]] = {}
    simulate(SimConfig(algo=algo, datasets=(data,), agents=2, trajectories=2, rounds=rounds,
                       local_steps=local_steps, eval_episodes=0, seed=seed, device="cpu",
                       secagg_threshold=secagg_threshold, drpo=SMALL, bc=SMALL_BC),
             tmp_path / f"sim-{algo}", log=lambda m: None, on_round=lambda r, s: states.__setitem__(r, s))
    return states


def start(agg, **cfg) -> dict:
    """StartRun of ``run_config(**cfg)``: the new run's status."""
    return status_from_proto(agg.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(**cfg)),
                                                  timeout=RPC_BOUND))


def run_status(agg, run_id: str) -> dict:
    return status_from_proto(agg.control.GetStatus(control_pb2.StatusRequest(run_id=run_id), timeout=RPC_BOUND))


def stop(agg, run_id: str) -> None:
    agg.control.StopRun(control_pb2.StopRunRequest(run_id=run_id), timeout=RPC_BOUND)


def ended(agg) -> dict | bool:
    """The status once every run held has ended (False before)."""
    s = status(agg)
    return all(r["state"] not in ("running", "waiting_for_agents") for r in s["runs"]) and s


@pytest.mark.parametrize("runs_at_once", [1, 2])
def test_two_runs_together_make_the_versions_each_makes_alone(step_deadline, aggregator, agent_threads, stand_dataset,
                                                               tmp_path, one_thread, runs_at_once):
    """In turn (each agent trains one run's round after the other's) or at once (a lane each),
    every version of each run is the one it makes alone, bit for bit."""
    expected = [alone(str(stand_dataset), tmp_path, **r) for r in RUNS]
    agents = agent_threads.start(aggregator.target, str(stand_dataset), 2, 2, seed=7, runs_at_once=runs_at_once)
    wait_for(lambda: len(status(aggregator)["agents"]) == 2, what="agents to join")
    # each secure step's deadline: the agents take the two runs' tasks in turn
    ids = [start(aggregator, **r, round_timeout=4 * step_deadline)["run_id"] for r in RUNS]
    done = wait_for(lambda: ended(aggregator), timeout=60 + 8 * step_deadline, what="both runs to end")
    assert [r["state"] for r in done["runs"]] == ["finished", "finished"], [r["message"] for r in done["runs"]]
    for run_id, r, states in zip(ids, RUNS, expected):
        for v in range(1, r["rounds"] + 1):
            stored = aggregator.store.load_version(run_id, v)
            assert stored.keys() == states[v].keys()
            assert all(torch.equal(stored[k], states[v][k]) for k in stored), f"run {r['algo']}: version {v} differs"
    # each agent took part in both, and counted its rounds per run; each learner went with its run's STOP
    for run_id, r in zip(ids, RUNS):
        st = run_status(aggregator, run_id)
        assert [a["rounds_submitted"] for a in st["agents"]] == [r["rounds"]] * 2
    wait_for(lambda: all(not a.learners for a in agents), what="the agents to drop both runs' learners")
    if runs_at_once > 1:  # each agent trained both runs at once at some point
        assert [a.lanes.peak for a in agents] == [2, 2]
    # Which run's task comes first is the aggregator's rule (the round that opened first), shown
    # where it is decided: test_an_agent_in_busy_runs_gets_another_runs_task. How the two runs'
    # closes fall in time is the machine's pace, not a rule: the first run may end first.


def test_a_restarted_aggregator_resumes_every_run(tmp_path, agent_threads, stand_dataset, one_thread):
    """The aggregator goes down with two runs mid-way; the one started on its state directory
    picks both up from their stored versions, the agents come back, and both finish."""
    agg = Aggregator(tmp_path / "state")
    port = int(agg.target.rsplit(":", 1)[1])
    agent_threads.start(agg.target, str(stand_dataset), 2, 2, seed=7)
    wait_for(lambda: len(status(agg)["agents"]) == 2, what="agents to join")
    cfgs = [dict(algo="drpo", rounds=4, local_steps=40, seed=7), dict(algo="fed-bc", rounds=4, local_steps=40, seed=8)]
    ids = [start(agg, **c)["run_id"] for c in cfgs]
    wait_for(lambda: all(r["global_version"] >= 1 for r in status(agg)["runs"]), what="a version of each run")
    agg.close()  # down mid-way: neither run ended
    kept = {i: {v: agg.store.load_version(i, v) for v in agg.store.versions(i)} for i in ids}
    assert all(len(k) < 5 for k in kept.values())

    again = Aggregator(tmp_path / "state", port=port, resume=True)
    try:
        st = status(again)
        assert [r["run_id"] for r in st["runs"]] == ids and all(r["state"] == "running" for r in st["runs"])
        done = wait_for(lambda: ended(again), timeout=300, what="both runs to finish after the restart")
        assert [r["state"] for r in done["runs"]] == ["finished"] * 2, [r["message"] for r in done["runs"]]
        for i in ids:
            events = again.store.read_run(i)["events"]
            assert [e["kind"] for e in events].count("RUN_RESUMED") == 1
            assert [e["version"] for e in events if e["kind"] == "ROUND_CLOSED"] == [1, 2, 3, 4]
            for v, state in kept[i].items():  # what was stored before stays, bit for bit
                assert all(torch.equal(state[k], again.store.load_version(i, v)[k]) for k in state)
    finally:
        again.close()


def test_an_agent_in_busy_runs_gets_another_runs_task(aggregator, stand_dataset):
    """``busy_runs`` (an agent training several runs at once): a call is given no task of a run
    its other threads train; with every run of it busy, it waits."""
    from tests.service.test_federation import join

    join(aggregator, "a0", 0)
    ids = [start(aggregator, agents=1, rounds=1, seed=s)["run_id"] for s in (1, 2)]
    from fedrl.proto.v1 import federation_pb2

    def task(*busy):
        return aggregator.fed.NextTask(federation_pb2.TaskRequest(agent_id="a0", wait_seconds=0,
                                                                  busy_runs=list(busy)), timeout=RPC_BOUND)
    assert task().run_id == ids[0]  # in turn: the round that opened first
    assert task(ids[0]).run_id == ids[1]
    assert task(*ids).kind == federation_pb2.Task.WAIT
    probe = aggregator.fed.NextTask(federation_pb2.TaskRequest(agent_id="a0", probe=True, run_id=ids[1]),
                                    timeout=RPC_BOUND)
    assert (probe.kind, probe.run_id) == (federation_pb2.Task.TRAIN, ids[1])
    # a stopped run's STOP names it, and comes before the other run's task
    stop(aggregator, ids[1])
    t = task()
    assert (t.kind, t.run_id) == (federation_pb2.Task.STOP, ids[1])
    assert task().run_id == ids[0]


@pytest.mark.parametrize("field", ["run_active", "global_version"])
def test_each_run_has_its_own_metric_series(aggregator, field):
    """Each run held is a series labelled ``run``; a run no longer held leaves none behind."""
    ids = []
    aggregator.coord.lifecycle.max_runs = 2
    for s in (1, 2):
        ids.append(start(aggregator, seed=s)["run_id"])
    reg = aggregator.metrics.registry
    name = f"fedrl_aggregator_{field}"
    assert {i: reg.get_sample_value(name, {"run": i}) for i in ids} == {i: 1.0 if field == "run_active" else 0.0
                                                                        for i in ids}
    stop(aggregator, ids[0])
    assert reg.get_sample_value("fedrl_aggregator_run_active", {"run": ids[0]}) == 0.0
    assert reg.get_sample_value("fedrl_aggregator_runs_active") == 1.0
    for s in range(3, 9):  # past the ended runs kept: the oldest is forgotten, its series too
        stop(aggregator, start(aggregator, seed=s)["run_id"])
    assert reg.get_sample_value(name, {"run": ids[0]}) is None
    assert json.loads(json.dumps(status(aggregator)["runs"]))[0]["run_id"] != ids[0]


def test_a_run_the_fleet_cannot_serve_is_refused_with_the_reason(aggregator):
    """Every agent the aggregator can hold is connected, and none has data of the run's env: no
    agent of it could ever join, so StartRun says so instead of a run that waits to time out.
    A run of the agents' own task starts beside another one."""
    from tests.service.test_federation import assert_refused, join

    aggregator.coord.max_agents = 2
    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    assert_refused(lambda: start(aggregator, env="Walker2d-v5"), grpc.StatusCode.FAILED_PRECONDITION,
                   "the fleet cannot serve this run: env Walker2d-v5, but all 2 agents this aggregator holds "
                   "(--max-agents 2) are connected, and none has data of it")
    assert status(aggregator)["state"] == "idle"  # nothing was started
    for seed in (1, 2):
        st = start(aggregator, env="Hopper-v5", seed=seed, rounds=1)
        assert st["state"] == "running", st["message"]
    aggregator.coord.max_agents = 3  # room for another agent: the run is taken (and, as every agent connected
    st = start(aggregator, env="Walker2d-v5")  # is of another task, fails at its start, saying so)
    assert st["run_id"] and st["message"] == "env Walker2d-v5 in the run config, but the agents' data is for Hopper-v5"


@pytest.mark.parametrize("session", [True, False])
def test_a_round_an_agent_sits_out_does_not_hold_up_its_other_runs(step_deadline, aggregator, agent_threads,
                                                                   stand_dataset, monkeypatch, session):
    """agent-1 cannot read the first run's config (a setting newer than it), so it sits that run's
    round out. The round stays open for its deadline, but the agent is not offered it again and
    again: the second run's rounds, which it can train, go on and finish meanwhile."""
    from agent_service.client import Agent

    learner_for = Agent._learner_for

    def newer(self, task):
        if self.cfg.agent_id == "agent-1" and json.loads(task.run_config_json)["seed"] == 1:
            task.run_config_json = json.dumps({**json.loads(task.run_config_json), "a_future_setting": 1})
        return learner_for(self, task)

    monkeypatch.setattr(Agent, "_learner_for", newer)
    agent_threads.start(aggregator.target, str(stand_dataset), 2, 2, seed=7, session=session)
    wait_for(lambda: len(status(aggregator)["agents"]) == 2, what="agents to join")
    held = start(aggregator, seed=1, rounds=1, min_agents=1, round_timeout=3600.0, algo="fed-bc")["run_id"]
    other = start(aggregator, seed=2, rounds=3, algo="fed-bc")["run_id"]
    wait_for(lambda: run_status(aggregator, other)["state"] == "finished",
             timeout=60 + 3 * step_deadline,  # three short rounds
             what="the other run to finish beside the held round")
    first = run_status(aggregator, held)
    assert (first["state"], first["round"]) == ("running", 1)  # still waiting for agent-1, until its deadline
    assert [a["rounds_submitted"] for a in first["agents"]] == [1, 0]
    stop(aggregator, held)


def test_the_evaluator_follows_every_run(step_deadline, aggregator, agent_threads, stand_dataset):
    """One evaluator, two runs: each run's every version is evaluated and reported to its run,
    and the evaluator's gauges hold each run's latest score under its own label."""
    import threading

    from evaluator_service.follower import Follower

    agent_threads.start(aggregator.target, str(stand_dataset), 2, 2, seed=7)
    wait_for(lambda: len(status(aggregator)["agents"]) == 2, what="agents to join")
    f = Follower(aggregator.target, seed=0, num_envs=1)
    t = threading.Thread(target=f.run, daemon=True)
    t.start()
    try:
        ids = [start(aggregator, seed=7, rounds=r, eval_episodes=1, algo="fed-bc")["run_id"] for r in (2, 3)]
        wait_for(lambda: len(f.reports) == 5, timeout=120 + 5 * step_deadline, what="five evaluations")
        assert sorted(f.reports) == sorted([(ids[0], 1), (ids[0], 2), (ids[1], 1), (ids[1], 2), (ids[1], 3)])
        for run_id, last in zip(ids, (2, 3)):
            st = run_status(aggregator, run_id)
            assert st["evaluated_versions"] == list(range(1, last + 1)) and st["last_evaluation"]["run_id"] == run_id
            assert f.metrics.registry.get_sample_value("fedrl_evaluator_evaluated_version", {"run": run_id}) == last
    finally:
        f.stop()
        t.join(10)
