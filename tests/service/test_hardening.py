"""Issue 54's second pass, against real servers: poison that is finite, a Join of another task,
odd agent ids, negative versions, a failure message that counts what is there."""

from __future__ import annotations

import grpc
import pytest

from fedrl.proto.v1 import control_pb2, federation_pb2
from fedrl.wire.codec import assemble
from fedrl.wire.serde import read_weight_parts
from tests.service.test_federation import assert_refused, join, open_round, run_config, status, submit, wait_for  # noqa: F401
from tests.service.test_federation import RPC_BOUND


def _join_moments(agg, agent_id, total, total_sq, count=100, obs_dim=11):
    return agg.fed.Join(federation_pb2.JoinRequest(
        agent_id=agent_id, agent_index=0, num_samples=100, obs_dim=obs_dim, act_dim=3, env_id="Hopper-v5",
        obs_moments=federation_pb2.ObsMoments(count=count, sum=[total] * obs_dim, sum_sq=[total_sq] * obs_dim)),
        timeout=RPC_BOUND)


@pytest.mark.parametrize("total, total_sq, says", [
    (3e38 * 100, 9e76 * 100, "a mean of magnitude 3e+38 exceeds 1e+06"),  # finite, and absurd
    (1.0, -5.0, "a sum of squares is negative"),
    (0.0, 1e60 * 100, "a standard deviation of 1e+30 exceeds 1e+06"),
    (100.0 * 100, 1.0 * 100, "a variance is negative"),  # mean 100, mean of squares 1
])
def test_observation_moments_no_observation_can_have_are_refused_at_join(aggregator, total, total_sq, says):
    assert_refused(lambda: _join_moments(aggregator, "poison", total, total_sq), grpc.StatusCode.INVALID_ARGUMENT, says)
    assert status(aggregator)["agents"] == []  # nothing registered
    _join_moments(aggregator, "honest", 5.0, 3.0)  # and an honest one still joins
    assert [a["agent_id"] for a in status(aggregator)["agents"]] == ["honest"]


def test_a_join_of_another_task_is_refused_and_the_run_goes_on(aggregator):
    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(rounds=3)), timeout=RPC_BOUND)
    assert wait_for(lambda: status(aggregator)["state"] == "running")
    assert_refused(lambda: join(aggregator, "other", 2, obs_dim=17), grpc.StatusCode.FAILED_PRECONDITION,
                   "another task than run")
    walker = federation_pb2.JoinRequest(agent_id="walker", agent_index=3, num_samples=100, obs_dim=11, act_dim=3,
                                        env_id="Walker2d-v5", obs_moments=federation_pb2.ObsMoments(
                                            count=100, sum=[1.0] * 11, sum_sq=[2.0] * 11))
    assert_refused(lambda: aggregator.fed.Join(walker, timeout=RPC_BOUND), grpc.StatusCode.FAILED_PRECONDITION,
                   "env Walker2d-v5 (the run's: Hopper-v5)")
    st = status(aggregator)
    assert st["state"] == "running" and {a["agent_id"] for a in st["agents"]} == {"a0", "a1"}
    join(aggregator, "a2", 2)  # the same task still joins (a spare for later runs)


def test_a_join_of_another_task_is_refused_while_the_run_waits_for_agents(aggregator):
    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(agents=3)), timeout=RPC_BOUND)
    # two agents that agree are the task; one that differs from them is refused
    assert_refused(lambda: join(aggregator, "other", 2, obs_dim=17), grpc.StatusCode.FAILED_PRECONDITION,
                   "obs_dim 17, act_dim 3 (the run's: 11, 3)")
    join(aggregator, "a2", 2)
    assert wait_for(lambda: status(aggregator)["state"] == "running")


def test_a_first_join_of_another_task_decides_nothing_for_the_honest_agents(aggregator):
    """A squatter joins first with a made-up task (obs_dim 12): it used to fix the run's task, every
    honest agent after it was refused and gave up, and the run failed at its join timeout. Now the
    honest agents join, the run begins with the largest group that agrees, and the squatter is
    left out (and refused when it joins again)."""
    join(aggregator, "squat", 0, obs_dim=12)
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(agents=2)), timeout=RPC_BOUND)
    join(aggregator, "h1", 1)
    join(aggregator, "h2", 2)
    st = wait_for(lambda: (s := status(aggregator))["state"] == "running" and s, what="the run to begin")
    assert sorted(aggregator.coord.run.selected) == ["h1", "h2"]
    assert_refused(lambda: join(aggregator, "squat", 0, obs_dim=12), grpc.StatusCode.FAILED_PRECONDITION,
                   "obs_dim 12, act_dim 3 (the run's: 11, 3)")
    assert st["round"] == 1


def test_a_run_config_that_names_its_env_is_the_task_whoever_joins_first(aggregator):
    """With env in the run config no Join decides: a squatter of another task is refused at once,
    first or not, and the honest agents begin the run."""
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(agents=2, env="Hopper-v5")),
                                timeout=RPC_BOUND)
    assert_refused(lambda: join(aggregator, "squat", 0, obs_dim=12), grpc.StatusCode.FAILED_PRECONDITION,
                   "cannot evaluate the agents' 12-dim observations")
    join(aggregator, "h1", 1)
    join(aggregator, "h2", 2)
    assert wait_for(lambda: status(aggregator)["state"] == "running")


@pytest.mark.parametrize("agent_id", ["a\x00b", "\u202eevil", "../../etc", "", "x" * 129, "-lead", "a b"])
def test_agent_ids_outside_the_documented_character_set_are_refused(aggregator, agent_id):
    assert_refused(lambda: join(aggregator, agent_id, 0), grpc.StatusCode.INVALID_ARGUMENT,
                   "letters, digits and . _ -")
    assert status(aggregator)["agents"] == []


@pytest.mark.parametrize("field,top", [("env_id", 200), ("device", 64)])
def test_a_joins_text_fields_are_bounded(aggregator, field, top):
    """A Join's env_id and device were kept as sent, up to the 8 MiB message: without tokens,
    the aggregator's 1,024 agent records could hold 8 GiB of them."""
    def join_with(text):
        kw = {"env_id": "Hopper-v5", "device": "cpu", field: text}
        return aggregator.fed.Join(federation_pb2.JoinRequest(agent_id="a0", agent_index=0, num_samples=100,
                                                              obs_dim=11, act_dim=3, **kw), timeout=RPC_BOUND)

    assert_refused(lambda: join_with("x" * (top + 1) if field == "device" else "Hopper-v5" + "x" * (top - 8)),
                   grpc.StatusCode.INVALID_ARGUMENT, f"{field} of {top + 1} characters (at most {top})")
    assert status(aggregator)["agents"] == []
    join_with("x" * top if field == "device" else "Hopper-v5")
    assert [a["agent_id"] for a in status(aggregator)["agents"]] == ["a0"]


@pytest.mark.parametrize("version", [-2, -(2**63)])
def test_a_negative_version_other_than_latest_is_refused(aggregator, version):
    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config()), timeout=RPC_BOUND)
    assert wait_for(lambda: status(aggregator)["state"] == "running")

    def fetch():
        return list(aggregator.fed.FetchGlobal(federation_pb2.FetchRequest(version=version), timeout=RPC_BOUND))

    assert_refused(fetch, grpc.StatusCode.INVALID_ARGUMENT, "expected a version >= 0, or -1 for the latest")


def test_a_run_short_of_agents_says_how_many_are_connected(aggregator):
    join(aggregator, "a0", 0)
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(agents=2, join_timeout=0.3)),
                                timeout=RPC_BOUND)
    assert wait_for(lambda: status(aggregator)["state"] == "failed")
    assert status(aggregator)["message"] == "only 1 of the 2 agents the run needs were connected within 0.3s"


@pytest.mark.parametrize("drpo, says", [
    ({"critic_lr": 1e30, "actor_lr": 1e30}, "actor_lr must be at most 1"),
    ({"target_entropy": 1e308}, "target_entropy must be in [-1000, 1000]"),
    ({"cql_weight": 1e9}, "cql_weight must be at most 10000"),
])
def test_settings_that_cannot_train_are_refused_at_start(aggregator, drpo, says):
    """Finite but absurd settings wedged a run (every update NaN, refused, the agents gone): now
    StartRun refuses them naming the field, and nothing starts."""
    import json

    cfg = json.loads(run_config())
    cfg["drpo"] = {**cfg["drpo"], **drpo}
    assert_refused(lambda: aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=json.dumps(cfg)),
                                                       timeout=RPC_BOUND), grpc.StatusCode.INVALID_ARGUMENT, says)
    assert status(aggregator)["state"] == "idle"


def _evaluator(tmp_path, *flags: str):
    """A real evaluator process on a free port, once it serves: (process, target)."""
    import subprocess
    import sys
    import time

    pf = tmp_path / "port"
    p = subprocess.Popen([sys.executable, "-m", "evaluator_service", "--port", "0", "--port-file", str(pf), *flags],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 60
    while not pf.exists():
        if p.poll() is not None or time.monotonic() > end:
            p.terminate()
            raise AssertionError("the evaluator did not start")
        time.sleep(0.05)
    return p, f"127.0.0.1:{pf.read_text()}"


def _evaluate_messages(tmp_path, *flags: str):
    """A real evaluator process with its metrics port: (process, target, received), where
    ``received()`` is its own count of Evaluate stream messages received."""
    import re
    import urllib.request

    p, target = _evaluator(tmp_path, *flags, "--metrics-port", "0", "--metrics-port-file", str(tmp_path / "m.port"))
    wait_for(lambda: (tmp_path / "m.port").exists(), 60, "the evaluator's metrics port")
    metrics = f"http://127.0.0.1:{(tmp_path / 'm.port').read_text().strip()}/metrics"

    def received() -> int:
        text = urllib.request.urlopen(metrics, timeout=RPC_BOUND).read().decode()
        m = re.search(r'^grpc_server_msg_received_total\{[^}]*grpc_method="Evaluate"[^}]*\} (\S+)$', text, re.M)
        return int(float(m.group(1))) if m else 0

    return p, target, received


def _declaring(nbytes: int, hold=None):
    """An Evaluate stream that declares a policy of ``nbytes`` and sends 2 KiB of it in two chunks,
    then waits for ``hold`` (an Event) before it ends. The evaluator asks for the second chunk only
    once it has handled the first, so its count of four messages received says the first chunk's
    buffer exists."""
    from fedrl.proto.v1 import evaluator_pb2, weights_pb2

    manifest = weights_pb2.WeightsManifest(
        run_id="r", tensors=[weights_pb2.TensorSpec(name="policy.x", dtype="F32", shape=[nbytes // 4 - 1024])],
        total_bytes=nbytes, encoding="safetensors", xxh3_128="0" * 32)
    yield evaluator_pb2.EvaluatePart(header=evaluator_pb2.EvaluateHeader(env_id="Hopper-v5", episodes=1))
    yield evaluator_pb2.EvaluatePart(weights=weights_pb2.WeightsPart(manifest=manifest))
    yield evaluator_pb2.EvaluatePart(weights=weights_pb2.WeightsPart(chunk=b"\x00" * 1024))
    yield evaluator_pb2.EvaluatePart(weights=weights_pb2.WeightsPart(chunk=b"\x00" * 1024))
    if hold is not None:
        hold.wait(60)


def test_the_evaluators_memory_follows_the_bytes_received_not_those_declared(tmp_path):
    """Streams each declaring a 60 MiB policy (under --max-policy-mb) and sending 2 KiB held the
    declared size each (40 of them took an evaluator from 255 MiB to 2.8 GiB); now its memory
    grows by what was sent. A real evaluator process whose in-flight budget (--max-inflight-mb)
    has room for 8 such streams, all held open; it is measured once its own metrics count every
    stream's messages received."""
    import threading

    from fedrl.proto.v1 import evaluator_pb2_grpc
    from fedrl.wire.rpc import create_channel

    streams, per_stream = 8, 4
    p, target, received = _evaluate_messages(tmp_path, "--max-inflight-mb", "600")  # room for all 8

    def rss_mb() -> float:
        for line in open(f"/proc/{p.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    release = threading.Event()
    try:
        ch = create_channel(target)
        stub = evaluator_pb2_grpc.EvaluatorStub(ch)
        received()  # the metrics server answers: the evaluator is up
        before = rss_mb()
        calls = [stub.Evaluate.future(_declaring(60 << 20, release), timeout=60) for _ in range(streams)]
        wait_for(lambda: received() >= streams * per_stream or any(c.done() for c in calls), 60,
                 "the evaluator to receive every stream's messages")
        assert not any(c.done() for c in calls), [c.exception() for c in calls if c.done()]
        grew = rss_mb() - before
        release.set()
        for c in calls:
            try:
                c.result(timeout=60)
            except grpc.RpcError:
                pass  # the 2 KiB payload is refused as truncated (DATA_LOSS): not what is measured
        ch.close()
        assert grew < 60, f"the evaluator grew by {grew:.0f} MB for 16 KiB received (8 x 60 MiB declared)"
    finally:
        release.set()
        p.terminate()
        p.wait(30)


def test_a_global_model_larger_than_the_limit_is_refused_before_it_is_built(aggregator, monkeypatch):
    """The width and depth limits allowed a 635 MiB version 0 (36 s and 1.5 GiB to build): the
    run now fails at its start, naming the size and the limit, with nothing built or stored."""
    import json

    import aggregator_service.start as start_mod
    from fedrl.federation.runconfig import MAX_MODEL_BYTES

    built = []
    real = start_mod.initial_global_state
    monkeypatch.setattr(start_mod, "initial_global_state", lambda *a, **k: built.append(a) or real(*a, **k))
    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    cfg = json.loads(run_config(federate="policy+critic"))
    cfg["drpo"] = {**cfg["drpo"], "hidden": [4096] * 8}
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=json.dumps(cfg)), timeout=RPC_BOUND)
    st = wait_for(lambda: (s := status(aggregator))["state"] == "failed" and s, RPC_BOUND, "the run to fail")
    assert not built  # refused from the sizes alone: no version 0 was begun
    assert f"a run's model may be at most {MAX_MODEL_BYTES >> 20} MiB" in st["message"], st["message"]
    assert not list(aggregator.store.root.rglob("v*.safetensors"))


@pytest.fixture
def quick_aggregator(tmp_path):
    """An aggregator whose agents count as gone 6 s after their last call (max_task_wait 0.5)."""
    from tests.service.conftest import Aggregator

    agg = Aggregator(tmp_path / "state", task_wait=0.5)
    yield agg
    agg.close()


def _nan_round(agg):
    """a0 and a1 in a started run; the global model, and a NaN copy of it."""
    import torch

    from fedrl.wire.codec import assemble
    from fedrl.wire.serde import read_weight_parts, status_from_proto

    join(agg, "a0", 0)
    join(agg, "a1", 1)
    st = status_from_proto(agg.control.StartRun(control_pb2.StartRunRequest(config_json=run_config()), timeout=RPC_BOUND))
    g = assemble(*read_weight_parts(agg.fed.FetchGlobal(
        federation_pb2.FetchRequest(run_id=st["run_id"], version=0), timeout=RPC_BOUND)))
    return st["run_id"], g, {k: torch.full_like(v, float("nan")) for k, v in g.items()}


def test_a_run_whose_every_agent_sends_non_finite_updates_fails_saying_why(quick_aggregator):
    """Settings that train to NaN: each agent's update is refused and the agents give up; the run
    used to wait at round 1 for ever. Once every selected agent's update of a round was refused as
    non-finite and every one of them has gone silent, the run fails, saying so. One such agent is
    not enough, and neither is the refusal alone while the agents might still be there."""
    from tests.service.test_federation import submit

    agg = quick_aggregator
    run_id, _, nan = _nan_round(agg)
    assert_refused(lambda: submit(agg, "a0", nan, run_id), grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf")
    assert status(agg)["state"] == "running"  # one agent's is not the run's
    assert_refused(lambda: submit(agg, "a1", nan, run_id), grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf")
    assert status(agg)["state"] == "running"  # until the agents are gone (6 s here)
    assert wait_for(lambda: status(agg)["state"] == "failed", timeout=RPC_BOUND)
    assert "every agent's update had NaN or Inf values" in status(agg)["message"]


def test_non_finite_updates_sent_under_live_agents_ids_do_not_end_the_run(quick_aggregator):
    """Issue 63, finding 7: without tokens anyone can send an update under a selected agent's id,
    and two refused NaN updates used to end any run at once. Now a refusal counts only once its
    agent has gone silent: the agents here keep calling, so their round goes on, and the update
    of an agent not in the run is refused before it is read, and counts for nothing."""
    import time

    from tests.service.test_federation import submit

    agg = quick_aggregator
    run_id, g, nan = _nan_round(agg)
    join(agg, "outsider", 2)
    assert_refused(lambda: submit(agg, "outsider", nan, run_id), grpc.StatusCode.PERMISSION_DENIED,
                   "not a participant")
    for victim in ("a0", "a1"):  # the forger's updates, under the participants' ids
        assert_refused(lambda: submit(agg, victim, nan, run_id), grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf")
    until = time.monotonic() + 8  # past the 6 s after which a silent agent counts as gone
    while time.monotonic() < until:  # the real agents, alive, ask for their task
        for a in ("a0", "a1"):
            agg.fed.NextTask(federation_pb2.TaskRequest(agent_id=a, wait_seconds=0.2), timeout=RPC_BOUND)
        assert status(agg)["state"] == "running", status(agg)["message"]
    submit(agg, "a0", g, run_id)  # and their real updates are taken
    submit(agg, "a1", g, run_id)
    assert wait_for(lambda: status(agg)["round"] >= 2 or status(agg)["state"] == "completed")


def test_settings_whose_first_step_cannot_be_allocated_are_refused_at_start(aggregator):
    """batch_size 65,536 x cql_n_actions 1,024 is inside each field's cap, but a step would need
    ~2,300 GiB: StartRun refuses it with the estimate (the agents used to fail their first step and
    the run stayed at round 1 for ever), and nothing starts."""
    import json

    cfg = json.loads(run_config())
    cfg["drpo"] = {**cfg["drpo"], "batch_size": 65_536, "cql_n_actions": 1_024, "hidden": [256, 256]}
    assert_refused(lambda: aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=json.dumps(cfg)),
                                                       timeout=RPC_BOUND), grpc.StatusCode.INVALID_ARGUMENT,
                   "one local step would need about")
    assert status(aggregator)["state"] == "idle"


def test_a_step_too_large_for_the_agents_task_fails_the_run_at_once_saying_why(aggregator):
    """Fine on the smallest task, too large on the agents' one (a wide observation): the run fails
    when it begins, naming the estimate, instead of waiting for agents that cannot train."""
    import json

    from fedrl.federation.runconfig import MAX_STEP_BYTES, step_bytes
    from fedrl.algos import DRPOConfig

    # the largest batch whose step fits on a 1-dim task but not on the 5,000-dim one joined below
    hp = DRPOConfig(hidden=[256, 256], cql_n_actions=64, batch_size=1024)
    assert step_bytes(hp, 1, 1) <= MAX_STEP_BYTES < step_bytes(hp, 5000, 3) * 100
    big = next(b for b in range(1024, 65_537, 1024)
               if step_bytes(DRPOConfig(hidden=[256, 256], cql_n_actions=64, batch_size=b), 5000, 3) > MAX_STEP_BYTES)
    cfg = json.loads(run_config(agents=1))
    cfg["drpo"] = {**cfg["drpo"], "batch_size": big, "cql_n_actions": 64, "hidden": [256, 256]}
    join(aggregator, "a0", 0, obs_dim=5000)
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=json.dumps(cfg)), timeout=RPC_BOUND)
    st = wait_for(lambda: (s := status(aggregator))["state"] == "failed" and s, what="the run to fail")
    assert "one local step would need about" in st["message"] and "obs_dim 5000" in st["message"]


def test_a_probe_told_stop_does_not_use_the_stop_up(aggregator):
    """A training agent's probe that learns of a stopped run used to consume the run's one STOP,
    so the agent's next NextTask got WAIT and it never heard the run had ended."""
    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config()), timeout=RPC_BOUND)
    wait_for(lambda: status(aggregator)["state"] == "running")
    aggregator.control.StopRun(control_pb2.StopRunRequest(reason="enough"), timeout=RPC_BOUND)
    probe = aggregator.fed.NextTask(federation_pb2.TaskRequest(agent_id="a0", probe=True), timeout=RPC_BOUND)
    assert probe.kind == federation_pb2.Task.STOP
    task = aggregator.fed.NextTask(federation_pb2.TaskRequest(agent_id="a0", wait_seconds=0.2), timeout=RPC_BOUND)
    assert task.kind == federation_pb2.Task.STOP
    again = aggregator.fed.NextTask(federation_pb2.TaskRequest(agent_id="a0", wait_seconds=0.2), timeout=RPC_BOUND)
    assert again.kind == federation_pb2.Task.WAIT  # told once


def test_the_evaluator_holds_a_memory_budget_across_its_streams(tmp_path):
    """Streams each sending a 60 MiB policy could together take gigabytes (24 took an evaluator from
    299 to 2,345 MiB). A real evaluator with --max-inflight-mb 100: while one 60 MiB stream is
    being received a second is refused at once (RESOURCE_EXHAUSTED, naming the flag); once the
    first ends, another is taken."""
    import threading

    from fedrl.proto.v1 import evaluator_pb2_grpc
    from fedrl.wire.rpc import create_channel

    p, target, received = _evaluate_messages(tmp_path, "--max-inflight-mb", "100")
    release = threading.Event()

    def code(call):
        try:
            call.result(timeout=30)
        except grpc.RpcError as e:
            return e.code(), e.details()
        return grpc.StatusCode.OK, ""

    try:
        ch = create_channel(target)
        stub = evaluator_pb2_grpc.EvaluatorStub(ch)
        first = stub.Evaluate.future(_declaring(60 << 20, release), timeout=60)
        wait_for(lambda: received() >= 4 or first.done(), 60, "the first stream's messages")
        assert not first.done(), first.exception()  # its manifest is in: 60 MiB reserved
        c, details = code(stub.Evaluate.future(_declaring(60 << 20), timeout=30))
        assert c == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-inflight-mb" in details, (c, details)
        release.set()
        assert code(first)[0] == grpc.StatusCode.DATA_LOSS  # truncated: refused, its reservation given back
        c, details = code(stub.Evaluate.future(_declaring(60 << 20), timeout=30))
        assert c == grpc.StatusCode.DATA_LOSS, (c, details)  # taken (then refused as truncated), not for room
        ch.close()
    finally:
        release.set()
        p.terminate()
        p.wait(30)


def test_one_poisoned_join_cannot_make_the_honest_agents_data_degenerate(aggregator):
    """A Join with mean 10^6 and std 0 (inside every bound) among three honest agents used to move
    the pooled normaliser so that the honest data normalised to about -2,700 with a spread of
    10^-3. Its moments now stay out of the pool: the honest data keep mean 0 and std 1 to within
    1e-6 (the exact pool of the honest agents: their moments here are equal)."""
    import numpy as np

    honest_mean, honest_std = 1.0, 2.0
    for i in range(3):
        join(aggregator, f"h{i}", i, moments=(100 * honest_mean, 100 * (honest_std**2 + honest_mean**2)))
    join(aggregator, "poison", 3, moments=(100 * 1e6, 100 * 1e12))  # mean 1e6, std 0
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(agents=4)), timeout=RPC_BOUND)
    wait_for(lambda: status(aggregator)["state"] == "running")
    g = aggregator.coord.run.global_state
    mean, std = g["policy.obs_mean"].double().numpy(), g["policy.obs_std"].double().numpy()
    assert np.allclose((honest_mean - mean) / std, 0.0, atol=1e-6)  # the honest data's normalised mean
    assert np.allclose(honest_std / std, 1.0, atol=1e-6)  # and spread


def test_an_agent_that_cannot_read_the_runs_config_sits_out_and_says_why(step_deadline, aggregator, agent_threads, stand_dataset,
                                                                         caplog, monkeypatch):
    """A task whose run config holds a setting this agent does not know (an aggregator newer than
    the agent): the agent trains nothing, says why once, stays up, and the round closes with the
    quorum of the others at its deadline. It used to end the agent with a traceback."""
    import json

    from agent_service.client import Agent

    learner_for = Agent._learner_for

    def newer(self, task):
        if self.cfg.agent_id == "agent-2":
            task.run_config_json = json.dumps({**json.loads(task.run_config_json), "a_future_setting": 1})
        return learner_for(self, task)

    monkeypatch.setattr(Agent, "_learner_for", newer)
    agent_threads.start(aggregator.target, str(stand_dataset), 3, 2, seed=7)
    wait_for(lambda: len(status(aggregator)["agents"]) == 3)
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(
        agents=3, min_agents=2, rounds=1, round_timeout=step_deadline, algo="fed-bc", local_steps=5)), timeout=RPC_BOUND)
    assert wait_for(lambda: status(aggregator)["state"] in ("finished", "failed"), timeout=60 + 2 * step_deadline)
    st = status(aggregator)
    assert st["state"] == "finished", st["message"]
    run = aggregator.store.read_run(st["run_id"])
    closed = [e for e in run["events"] if e["kind"] == "ROUND_CLOSED"]
    assert len(closed) == 1 and sorted(closed[0]["agents"]) == ["agent-0", "agent-1"], closed
    assert caplog.text.count("round 1: no part in run") == 1 and "unknown field(s) a_future_setting" in caplog.text
    assert agent_threads.threads[2].is_alive()


def test_evaluation_reports_are_checked_and_one_per_version_is_kept(aggregator, agent_threads, stand_dataset):
    """ReportEvaluation took any report: NaN and Inf scores went into the status and the journal,
    and each report, however often repeated, was appended to the run's events in memory and on
    disk (20 reports of 10^6 returns grew the aggregator by 858 MB). A report is now checked
    (INVALID_ARGUMENT naming the field, nothing kept), and a version's first report stands: a
    later one is acknowledged and appends nothing."""
    agent_threads.start(aggregator.target, str(stand_dataset), 2, 2, seed=3)
    wait_for(lambda: len(status(aggregator)["agents"]) == 2, what="agents")
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(rounds=1)), timeout=RPC_BOUND)
    wait_for(lambda: status(aggregator)["state"] == "finished", what="run to finish")
    run_id = status(aggregator)["run_id"]

    def report(**kw):
        fields = dict(run_id=run_id, version=1, env_id="Hopper-v5", returns=[800.0, 820.0], return_mean=810.0,
                      return_std=10.0, score_mean=25.5, score_std=0.3, env_steps=400, seconds=1.5)
        aggregator.control.ReportEvaluation(control_pb2.EvaluationReport(**{**fields, **kw}), timeout=RPC_BOUND)

    for kw, says in [(dict(score_mean=float("nan")), "score_mean not finite"),
                     (dict(return_mean=float("inf"), score_std=float("-inf")), "return_mean, score_std not finite"),
                     (dict(returns=[1.0, float("nan")]), "returns not finite"),
                     (dict(returns=[1.0] * 1001), "1001 returns; a run evaluates at most 1000 episodes"),
                     (dict(env_steps=-1), "env_steps negative"),
                     (dict(seconds=-1.0, return_std=-2.0), "return_std, seconds negative"),
                     (dict(env_id="x" * 201), "an env_id of 201 characters (at most 200)"),
                     (dict(not_evaluated="its actions are not finite"), "2 returns with not_evaluated"),
                     (dict(returns=[], not_evaluated="x" * 1001), "a not_evaluated reason of 1001 characters")]:
        assert_refused(lambda: report(**kw), grpc.StatusCode.INVALID_ARGUMENT, says)
    assert status(aggregator)["evaluated_versions"] == []
    assert not [e for e in aggregator.store.read_run(run_id)["events"] if e["kind"] == "NOT_EVALUATED"]

    def evaluated_events():
        return [e for e in aggregator.store.read_run(run_id)["events"] if e["kind"] == "EVALUATED"]

    report()
    report(score_mean=99.0, returns=[3000.0])  # a second report of version 1: acknowledged, not kept
    st = status(aggregator)
    assert st["evaluated_versions"] == [1] and st["last_evaluation"]["score_mean"] == 25.5
    assert [e["evaluation"]["score_mean"] for e in evaluated_events()] == [25.5]
    runs = aggregator.control.ListRuns(control_pb2.ListRunsRequest(), timeout=RPC_BOUND).runs
    assert [(r.run_id, r.best_score) for r in runs] == [(run_id, 25.5)]


@pytest.mark.parametrize("how", ["stream", "inline", "session"])
def test_an_updates_metrics_are_bounded_before_its_weights_are_read(open_round, how):
    """An update's metrics are averaged into its round's ROUND_CLOSED event, which the journal
    keeps: one agent sending 10^5 metrics (or names of kilobytes) grew every round's event by up
    to the 8 MiB message. More than 64 metrics, or a name outside 1-64 characters of
    letters, digits and _ . : / -, is refused before the weights are read; the round goes on.
    So is a name the machine uses for differential privacy's record (in a run with fixed clipping
    an agent's ``dp_clip`` stood in fedrl up's privacy record as the run's clipping norm)."""
    agg, run_id, g, _ = open_round
    kw = {"inline": how == "inline", "session": how == "session"}
    many = {f"m{i}": 1.0 for i in range(65)}
    for metrics, says in [(many, "65 metrics; an update carries at most 64"),
                          ({"x" * 65: 1.0}, f"metric name {'x' * 40!r}...: 1-64 characters"),
                          ({"a b": 1.0}, "metric name 'a b'"),
                          ({"critic_td": 1.0, "dp_clip": 1e-3}, "metric 'dp_clip' is the aggregator's own"),
                          ({"privacy_epsilon": 0.0}, "metric 'privacy_epsilon' is the aggregator's own")]:
        assert_refused(lambda: submit(agg, "a0", g, run_id, metrics=metrics, **kw), grpc.StatusCode.INVALID_ARGUMENT,
                       says)
    assert agg.metrics.rejected.labels("bad_metrics")._value.get() == 5
    honest = {f"m{i}": float(i) for i in range(64)}
    for a in ("a0", "a1"):
        submit(agg, a, g, run_id, metrics=honest, **kw)
    assert wait_for(lambda: status(agg)["global_version"] == 1)
    closed = next(e for e in agg.store.read_run(run_id)["events"] if e["kind"] == "ROUND_CLOSED")
    assert {k: v for k, v in closed["metrics"].items() if k in honest} == honest


def test_a_sessions_progress_is_checked_and_its_run_id_bounded(open_round):
    """A Session's progress message was checked for its step counts only: its run_id, kept with
    the agent's record, could be megabytes (1,024 records, 8 MiB each). A run_id that is not a
    run's, or counts out of order, end the stream with INVALID_ARGUMENT; the agent's status is
    unchanged."""
    agg, run_id, _, _ = open_round
    hello = federation_pb2.SessionMessage(hello=federation_pb2.TaskRequest(agent_id="a0", wait_seconds=1))

    def progress(**kw):
        msg = federation_pb2.SessionMessage(progress=federation_pb2.TaskProgress(round=1, **kw))
        call = agg.fed.Session(iter([hello, msg]), timeout=RPC_BOUND)
        try:
            assert next(call).kind == federation_pb2.Task.TRAIN
            next(call)
        finally:
            call.cancel()

    for kw, says in [(dict(steps_done=5, steps_total=10, run_id="x" * (1 << 20)), "not a run id"),
                     (dict(steps_done=5, steps_total=10, run_id="../" + run_id), "not a run id"),
                     (dict(steps_done=11, steps_total=10, run_id=run_id), "expected 0 <= steps_done <= steps_total")]:
        assert_refused(lambda: progress(**kw), grpc.StatusCode.INVALID_ARGUMENT, says)
    mine = next(a for a in status(agg)["agents"] if a["agent_id"] == "a0")
    assert (mine["steps_done"], mine["steps_total"]) == (0, 0)
    assert agg.coord.agents["a0"].progress[0] in ("", run_id)


@pytest.mark.parametrize("how", ["stream", "inline"])
def test_an_update_cannot_weigh_more_or_less_than_its_agents_joined_count(aggregator, how):
    """Under sample-count weighting an update weighed what its manifest said: one agent counting
    0 failed the run ("sample-count weighting needs positive counts"), and 10^12 outweighed every
    other agent. An update counting other than its agent's Join is refused before its weights are
    read (INVALID_ARGUMENT); the run goes on."""
    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    st = aggregator.control.StartRun(control_pb2.StartRunRequest(
        config_json=run_config(rounds=2, weighting="samples")), timeout=RPC_BOUND)
    parts = aggregator.fed.FetchGlobal(federation_pb2.FetchRequest(run_id=st.run_id, version=0), timeout=RPC_BOUND)
    g = assemble(*read_weight_parts(parts))

    def with_count(n):
        def tamper(m, chunks):
            m.num_samples = n
            return m, chunks
        return tamper

    for n in (0, 10**12):
        assert_refused(lambda: submit(aggregator, "a0", g, st.run_id, tamper=with_count(n), inline=how == "inline"),
                       grpc.StatusCode.INVALID_ARGUMENT, f"the update counts {n} samples; agent 'a0' joined with 100")
    assert aggregator.metrics.rejected.labels("wrong_samples")._value.get() == 2
    for a in ("a0", "a1"):  # join() says 100 samples, as submit() counts
        submit(aggregator, a, g, st.run_id, inline=how == "inline")
    assert wait_for(lambda: status(aggregator)["global_version"] == 1)
    assert status(aggregator)["state"] == "running"


def test_an_agent_of_a_running_run_cannot_rejoin_with_another_sample_count(open_round):
    """Its updates must count what the run selected it with; a rejoin with another count would
    have every later update refused as wrong_samples. It is refused at the Join, saying so."""
    agg, run_id, _, _ = open_round

    def rejoin(n):
        return agg.fed.Join(federation_pb2.JoinRequest(
            agent_id="a0", agent_index=0, num_samples=n, obs_dim=11, act_dim=3, env_id="Hopper-v5"),
            timeout=RPC_BOUND)

    assert_refused(lambda: rejoin(50), grpc.StatusCode.FAILED_PRECONDITION,
                   f"agent a0 rejoined with 50 samples; run {run_id} selected it with 100")
    assert rejoin(100).run_id == run_id


def test_a_refusal_that_names_a_callers_long_string_still_arrives_as_itself(open_round):
    """Refusals echoed the caller's strings whole: a 100,000-character agent id or tensor name
    passed gRPC's 16 KiB of trailers, and the caller got RESOURCE_EXHAUSTED ("received metadata
    size exceeds hard limit") instead of the refusal. Names are cut, and so is every message."""
    from fedrl.wire.rpc import STATUS_DETAILS_MAX

    agg, run_id, g, _ = open_round
    long_id = "x" * 100_000
    assert_refused(lambda: agg.fed.NextTask(federation_pb2.TaskRequest(agent_id=long_id), timeout=RPC_BOUND),
                   grpc.StatusCode.NOT_FOUND, f"unknown agent {'x' * 80!r}: call Join first")

    def long_name(m, chunks):
        m.tensors[0].name = "policy." + "y" * 100_000
        return m, chunks

    with pytest.raises(grpc.RpcError) as ei:
        submit(agg, "a0", g, run_id, tamper=long_name, inline=True)
    assert ei.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), ei.value.details()
    assert ei.value.details().endswith(" characters)") and len(ei.value.details()) < STATUS_DETAILS_MAX + 50
