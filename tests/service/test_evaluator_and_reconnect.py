"""The evaluator (following rounds and on demand) and agents surviving an aggregator restart."""

from __future__ import annotations

import dataclasses
import logging
import threading

import grpc
import pytest
import torch

from aggregator_service.servicer import FederationServicer
from evaluator_service.follower import Follower
from evaluator_service.servicer import EvaluatorServicer
from fedrl.algos.base import POLICY, prefixed_state
from fedrl.algos.nets import TanhGaussianPolicy
from fedrl.proto.v1 import (
    control_pb2,
    evaluator_pb2,
    evaluator_pb2_grpc,
    federation_pb2_grpc,
)
from fedrl.wire.codec import Encoded, encode
from fedrl.wire.rpc import create_channel, create_server
from fedrl.wire.serde import status_from_proto, weight_parts
from tests.service.conftest import Aggregator
from fedrl.cli.client import ControlClient
from tests.service.test_federation import RPC_BOUND, run_config, status, wait_for


@pytest.fixture
def evaluator():
    server = create_server([(evaluator_pb2_grpc.add_EvaluatorServicer_to_server, EvaluatorServicer(None, 2),
                             "fedrl.v1.Evaluator")], "127.0.0.1", 0)
    ch = create_channel(f"127.0.0.1:{server.port}")
    yield evaluator_pb2_grpc.EvaluatorStub(ch)
    ch.close()
    server.stop(0.5)


def _request(header, state, tamper=None):
    yield evaluator_pb2.EvaluatePart(header=header)
    parts = list(weight_parts(encode(state)))
    if tamper:
        parts = tamper(parts)
    for p in parts:
        yield evaluator_pb2.EvaluatePart(weights=p)


def test_on_demand_evaluation_and_its_refusals(evaluator):
    torch.manual_seed(0)
    state = prefixed_state(POLICY, TanhGaussianPolicy(11, 3, (16, 16)))
    rep = evaluator.Evaluate(_request(evaluator_pb2.EvaluateHeader(env_id="Hopper-v5", episodes=3, seed=1), state),
                             timeout=60)
    assert rep.env_id == "Hopper-v5" and len(rep.returns) == 3 and rep.env_steps > 0
    again = evaluator.Evaluate(_request(evaluator_pb2.EvaluateHeader(env_id="Hopper-v5", episodes=3, seed=1), state),
                               timeout=60)
    assert list(again.returns) == list(rep.returns)  # seeded

    def refused(header, st, code, text, tamper=None):
        with pytest.raises(grpc.RpcError) as ei:
            evaluator.Evaluate(_request(header, st, tamper), timeout=60)
        assert ei.value.code() == code and text in ei.value.details(), ei.value.details()

    refused(evaluator_pb2.EvaluateHeader(env_id="Pong-v5", episodes=1), state,
            grpc.StatusCode.INVALID_ARGUMENT, "unknown environment")
    # a name past gRPC's 16 KiB of trailers, echoed whole, came back as RESOURCE_EXHAUSTED
    refused(evaluator_pb2.EvaluateHeader(env_id="x" * 100_000, episodes=1), state,
            grpc.StatusCode.INVALID_ARGUMENT, f"unknown environment {'x' * 80!r}...; known: ")
    refused(evaluator_pb2.EvaluateHeader(env_id="Hopper-v5", episodes=0), state,
            grpc.StatusCode.INVALID_ARGUMENT, "episodes must be in")
    refused(evaluator_pb2.EvaluateHeader(env_id="Walker2d-v5", episodes=1), state,
            grpc.StatusCode.INVALID_ARGUMENT, "")
    refused(evaluator_pb2.EvaluateHeader(env_id="Hopper-v5", episodes=1), {"x": torch.zeros(2)},
            grpc.StatusCode.INVALID_ARGUMENT, "not a policy")
    bad = {**state, "policy.head.bias": torch.full((6,), float("nan"))}
    refused(evaluator_pb2.EvaluateHeader(env_id="Hopper-v5", episodes=1), bad,
            grpc.StatusCode.INVALID_ARGUMENT, "NaN")
    # finite weights whose actions overflow to NaN: MuJoCo's NaN rewards came back as a return
    huge = {k: torch.full_like(v, 3e38) if k.startswith("policy.trunk.") and k.endswith(".weight") else v
            for k, v in state.items()}
    refused(evaluator_pb2.EvaluateHeader(env_id="Hopper-v5", episodes=1), huge,
            grpc.StatusCode.INVALID_ARGUMENT, "the policy's actions are not finite at step 0 of an episode in Hopper-v5")

    def oversized(parts):  # a manifest declaring 1 GiB for a small policy: refused before any buffer
        parts[0].manifest.total_bytes = 1 << 30
        return parts
    refused(evaluator_pb2.EvaluateHeader(env_id="Hopper-v5", episodes=1), state,
            grpc.StatusCode.INVALID_ARGUMENT, "declared size 1073741824 bytes does not fit the listed tensors",
            oversized)


def test_follower_evaluates_every_version_and_catches_up(aggregator, agent_threads, stand_dataset):
    agent_threads.start(aggregator.target, str(stand_dataset), 2, 2, seed=3)
    wait_for(lambda: len(status(aggregator)["agents"]) == 2, what="agents")
    aggregator.control.StartRun(control_pb2.StartRunRequest(
        config_json=run_config(rounds=3, eval_episodes=1)), timeout=RPC_BOUND)
    wait_for(lambda: status(aggregator)["state"] == "finished", what="run to finish")
    # The evaluator starts late: it catches up on all three versions, each reported once.
    f = Follower(aggregator.target, seed=0, num_envs=1)
    t = threading.Thread(target=f.run, daemon=True)
    t.start()
    try:
        wait_for(lambda: len(f.reports) == 3, what="three evaluations")
        st = status(aggregator)
        assert st["last_evaluation"]["version"] == 3 and st["last_evaluation"]["env_id"] == "Hopper-v5"
        evaluated = [e for e in aggregator.coord.run.events if e["kind"] == "EVALUATED"]
        assert sorted(e["version"] for e in evaluated) == [1, 2, 3]
        kinds = [control_pb2.RoundEvent.Kind.Name(e.kind) for e in
                 aggregator.control.WatchRounds(control_pb2.WatchRequest(after_version=-1), timeout=RPC_BOUND)]
        assert kinds[-1] == "EVALUATED"  # the stream stays open until every version is evaluated
    finally:
        f.stop()
        t.join(10)
    # A second follower (a restarted evaluator) re-evaluates nothing: once it has followed the
    # run's whole watch, it has reported nothing.
    g = Follower(aggregator.target, seed=0, num_envs=1)
    t2 = threading.Thread(target=g.run, daemon=True)
    t2.start()
    try:
        wait_for(lambda: g.passes >= 1, what="the second follower's pass over the run")
    finally:
        g.stop()
        t2.join(10)
    assert g.reports == {}


def _finished_two_version_run(aggregator, first_of_a0=lambda g: g) -> str:
    """A finished run of two versions, each the average of two agents' copies of version 0 (agent
    a0's round-1 update: ``first_of_a0(version 0)``)."""
    from fedrl.proto.v1 import federation_pb2
    from fedrl.wire.codec import assemble
    from fedrl.wire.serde import read_weight_parts
    from tests.service.test_federation import join, submit

    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    run = status_from_proto(aggregator.control.StartRun(control_pb2.StartRunRequest(
        config_json=run_config(rounds=2, eval_episodes=1)), timeout=RPC_BOUND))["run_id"]
    g = assemble(*read_weight_parts(aggregator.fed.FetchGlobal(
        federation_pb2.FetchRequest(run_id=run, version=0), timeout=RPC_BOUND)))
    for r in (1, 2):
        for a in ("a0", "a1"):
            submit(aggregator, a, first_of_a0(g) if (a, r) == ("a0", 1) else g, run, round=r, base=r - 1)
        wait_for(lambda: status(aggregator)["global_version"] == r, what=f"round {r} to close")
    wait_for(lambda: status(aggregator)["state"] == "finished", what="the run to finish")
    return run


@pytest.mark.parametrize("bad", ["overflowing-policy", "damaged-on-disk"])
def test_a_version_that_cannot_be_evaluated_holds_up_none_after_it(aggregator, caplog, bad):
    """A hostile agent's finite update of weights near float32's limit made a finite global version
    whose actions are NaN: MuJoCo returned NaN rewards, the aggregator refused the NaN report, and
    the follower took that for a lost connection, evaluating the same version again and again and
    no version after it (as it did for a version whose file was damaged: DATA_LOSS). Now that
    version is logged and reported as not evaluated, naming why (a NOT_EVALUATED event: a watch
    of the run waits for it no longer), and the next one is evaluated."""
    from tests.service.test_faults import _rewrite_tensor_bytes

    def huge(g):
        return {k: torch.full_like(v, 3e38) if k.startswith("policy.trunk.") and k.endswith(".weight") else v
                for k, v in g.items()}

    run = _finished_two_version_run(aggregator, huge if bad == "overflowing-policy" else lambda g: g)
    assert all(torch.isfinite(v).all() for v in aggregator.store.load_version(run, 1).values())
    if bad == "damaged-on-disk":  # a flipped bit
        _rewrite_tensor_bytes(aggregator.store.version_path(run, 1), lambda raw, at: raw.__setitem__(at + 9, raw[at + 9] ^ 4))
    f = Follower(aggregator.target, seed=0, num_envs=1)
    t = threading.Thread(target=f.run, daemon=True)
    try:
        with caplog.at_level(logging.ERROR, logger="fedrl.evaluator"):
            t.start()
            wait_for(lambda: (run, 2) in f.reports, what="version 2's evaluation")  # kept once reported
        st = status(aggregator)
        assert (st["evaluated_versions"], st["not_evaluated_versions"]) == ([2], [1])
        assert [(r, v) for r, v in f.reports] == [(run, 2)]
        assert f.metrics.failures._value.get() == 1
        why = "the policy's actions are not finite" if bad == "overflowing-policy" else "DATA_LOSS"
        assert f"run {run} version 1 not evaluated: {why}" in caplog.text, caplog.text
        # told to the aggregator: its watchers see why, and end with the run while an evaluator
        # follows (else they wait out the 120 s grace for version 1: DEADLINE_EXCEEDED here)
        with ControlClient(aggregator.target) as c:
            ev = [e for e in c.watch(timeout=RPC_BOUND) if e["kind"] in ("EVALUATED", "NOT_EVALUATED")]
        assert [(e["kind"], e["version"]) for e in ev] == [("NOT_EVALUATED", 1), ("EVALUATED", 2)]
        assert ev[0]["message"].startswith(why), ev[0]
    finally:
        f.stop()
        t.join(10)


@pytest.mark.parametrize("fault", ["passing", "lasting", "unreadable-event"])
def test_an_unexpected_error_does_not_end_the_follower(aggregator, caplog, monkeypatch, fault):
    """An error of no kind the evaluation names (an OSError here; a library's own) ended the
    follower's thread: the evaluator went on answering, and evaluated no version again. Now the
    follower logs it and follows again after a pause: a passing fault costs nothing, a version
    that fails every time is reported not evaluated after its tries (and the next is evaluated),
    and an event the watch cannot read is followed again too."""
    import evaluator_service.follower as follower_mod

    run = _finished_two_version_run(aggregator)
    real_evaluate, real_event = follower_mod.evaluate, follower_mod.event_from_proto
    calls = {"evaluate": 0, "event": 0}
    fails = {"passing": 2, "lasting": follower_mod.UNEXPECTED_TRIES, "unreadable-event": 0}[fault]

    def evaluate(*a, **k):  # version 1 is evaluated first: its first ``fails`` tries meet the fault
        calls["evaluate"] += 1
        if calls["evaluate"] <= fails:
            raise OSError("the disk went away")
        return real_evaluate(*a, **k)

    def event_from_proto(ev):
        calls["event"] += 1
        if fault == "unreadable-event" and calls["event"] == 1:
            raise TypeError("an event this follower cannot read")
        return real_event(ev)

    monkeypatch.setattr(follower_mod, "evaluate", evaluate)
    monkeypatch.setattr(follower_mod, "event_from_proto", event_from_proto)
    f = Follower(aggregator.target, seed=0, num_envs=1)
    t = threading.Thread(target=f.run, daemon=True)
    try:
        with caplog.at_level(logging.WARNING, logger="fedrl.evaluator"):
            t.start()
            wait_for(lambda: (run, 2) in f.reports, what="version 2's evaluation")
        assert t.is_alive()
        st = status(aggregator)
        if fault == "lasting":
            assert (st["evaluated_versions"], st["not_evaluated_versions"]) == ([2], [1])
            tries = follower_mod.UNEXPECTED_TRIES
            assert f"run {run} version 1 not evaluated: OSError: the disk went away ({tries} tries)" in caplog.text
        else:
            assert (st["evaluated_versions"], st["not_evaluated_versions"]) == ([1, 2], [])
        failed = caplog.text.count("following the aggregator at")
        assert failed == {"passing": 2, "lasting": 2, "unreadable-event": 1}[fault], caplog.text
    finally:
        f.stop()
        t.join(RPC_BOUND)
    assert not t.is_alive()


def test_agent_rejoins_a_restarted_aggregator(tmp_path, agent_threads, stand_dataset, caplog):
    first = Aggregator(tmp_path / "s1")
    port = first.server.port
    agent_threads.start(first.target, str(stand_dataset), 1, 2, seed=0)
    wait_for(lambda: len(status(first)["agents"]) == 1, what="agent to join")
    first.close()
    # A new aggregator on the same port: the agent finds it by itself and takes part in a run.
    second = wait_for(lambda: _try_start(tmp_path / "s2", port), timeout=20, what="port to be free")
    try:
        wait_for(lambda: len(status(second)["agents"]) == 1, timeout=30, what="agent to rejoin")
        assert f"aggregator at {first.target} unavailable" in caplog.text  # a user can spot a wrong address
        st = status_from_proto(second.control.StartRun(control_pb2.StartRunRequest(
            config_json=run_config(agents=1, rounds=1)), timeout=RPC_BOUND))
        assert st["state"] == "running"
        wait_for(lambda: status(second)["state"] == "finished", what="run on the new aggregator")
    finally:
        second.close()


class PreSessionServicer(FederationServicer):
    """An aggregator from before the Session stream: that RPC answers UNIMPLEMENTED."""
    Session = federation_pb2_grpc.FederationServicer.Session


def test_agents_fall_back_to_calls_when_the_aggregator_has_no_session(tmp_path, agent_threads, stand_dataset):
    agg = Aggregator(tmp_path / "s", servicer=PreSessionServicer)
    try:
        agents = agent_threads.start(agg.target, str(stand_dataset), 2, 2, seed=0)
        wait_for(lambda: len(status(agg)["agents"]) == 2, what="agents to join")
        agg.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(rounds=2)), timeout=RPC_BOUND)
        wait_for(lambda: status(agg)["state"] == "finished", what="the run")
        wait_for(lambda: [a.rounds_done for a in agents] == [2, 2], what="the agents to see their updates taken")
        assert not any(a.use_session for a in agents)

        def handled(method, kind, code):
            return agg.metrics.registry.get_sample_value("grpc_server_handled_total", {
                "grpc_type": kind, "grpc_service": "fedrl.v1.Federation", "grpc_method": method,
                "grpc_code": code}) or 0
        assert handled("Session", "bidi_stream", "UNIMPLEMENTED") == 2  # asked once each
        assert handled("SubmitUpdateInline", "unary", "OK") == 4
    finally:
        agg.close()


def test_the_aggregator_warns_when_agents_come_near_its_rpc_threads(tmp_path, caplog):
    """Each connected agent's Session holds a server thread: more agents than --max-workers allows
    (less a reserve for control calls and watchers) would leave a stream waiting forever."""
    from aggregator_service.servicer import RESERVED_THREADS
    from tests.service.test_federation import join

    agg = Aggregator(tmp_path / "s", servicer=lambda coord, auth: FederationServicer(
        coord, auth, max_workers=RESERVED_THREADS + 2))
    try:
        join(agg, "a0", 0)
        join(agg, "a1", 1)
        assert "raise --max-workers" not in caplog.text
        join(agg, "a2", 2)
        assert f"3 agents have joined; each Session stream holds one of the server's {RESERVED_THREADS + 2} " \
               "RPC threads" in caplog.text
    finally:
        agg.close()


def test_an_agent_reconnects_when_its_session_goes_quiet(aggregator, agent_threads, stand_dataset, caplog):
    """An aggregator that stops answering (here: its coordinator's lock held) without dropping
    the connection: the agent gives up on the stream after task_wait + rpc_timeout seconds
    without a task, reconnects, and finishes the run once the aggregator answers again."""
    (agent,) = agent_threads.start(aggregator.target, str(stand_dataset), 1, 2, seed=0, rpc_timeout=1.0)
    wait_for(lambda: len(status(aggregator)["agents"]) == 1, what="agent to join")
    aggregator.control.StartRun(control_pb2.StartRunRequest(
        config_json=run_config(agents=1, rounds=6)), timeout=RPC_BOUND)
    wait_for(lambda: agent.rounds_done >= 1, what="a first round")
    with aggregator.coord.cond:  # the aggregator hangs
        wait_for(lambda: "no task for 2s on the session stream" in caplog.text, timeout=RPC_BOUND,
                 what="the agent to give up on its session")
    st = wait_for(lambda: (s := status(aggregator))["state"] == "finished" and s, what="the run")
    assert st["agents"][0]["rounds_submitted"] == 6 and agent.metrics.reconnects._value.get() >= 1


def _try_start(state_dir, port):
    try:
        return Aggregator(state_dir, port=port)
    except (OSError, RuntimeError):
        return None


@pytest.mark.parametrize("damage", ["flipped byte", "declared size"])
def test_an_agent_asks_again_for_a_global_model_damaged_on_the_way(aggregator, agent_threads, stand_dataset,
                                                                    damage, caplog):
    """A base version that fails verification at the agent (one flipped byte in transit, or a
    manifest declaring a size the model cannot have, refused before a buffer is sized from it)
    is refused, counted, and fetched again; the agent keeps running and the run completes."""
    real_next_task = aggregator.coord.tasks.next_task
    damaged: list[str] = []

    def next_task_damaging_the_first_two(agent_id, wait_seconds, **kw):
        t = real_next_task(agent_id, wait_seconds, **kw)
        base = t.get("base")
        if base is not None and len(damaged) < 2:
            damaged.append(agent_id)
            if damage == "flipped byte":
                bad = bytearray(base.payload)
                bad[-1] ^= 1
                t["base"] = Encoded(base.manifest, bytes(bad), base.chunk_bytes)
            else:
                t["base"] = Encoded(dataclasses.replace(base.manifest, total_bytes=2 << 30), base.payload,
                                    base.chunk_bytes)
        return t

    aggregator.coord.tasks.next_task = next_task_damaging_the_first_two  # the servicer looks it up per call
    agents = agent_threads.start(aggregator.target, str(stand_dataset), 2, 2, seed=0)
    wait_for(lambda: len(status(aggregator)["agents"]) == 2, what="agents to join")
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(agents=2, rounds=2)), timeout=RPC_BOUND)
    done = wait_for(lambda: (s := status(aggregator))["state"] == "finished" and s, what="run to finish")
    assert len(damaged) == 2 and done["global_version"] == 2
    refused = {a.cfg.agent_id: a.metrics.registry.get_sample_value(
        "fedrl_agent_downloads_rejected_total", {"agent": a.cfg.agent_id}) for a in agents}
    assert sum(refused.values()) == 2, refused
    reason = "checksum_mismatch" if damage == "flipped byte" else "bad_manifest"
    assert sum(f"global model refused ({reason}:" in r.getMessage() for r in caplog.records) == 2
    assert [a["rounds_submitted"] for a in done["agents"]] == [2, 2]
    assert all(t.is_alive() for t in agent_threads.threads)


class LosesTheFirstAnswer(FederationServicer):
    """Takes the first update, then drops the call before the agent hears that it was taken."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.lost: list[tuple[str, int]] = []

    def _submit_inline(self, context, header, payload):
        reply = super()._submit_inline(context, header, payload)
        if not self.lost:
            self.lost.append((header.agent_id, reply.round))
            context.abort(grpc.StatusCode.UNAVAILABLE, "connection lost after the update was taken (test)")
        return reply


@pytest.mark.parametrize("transport", ["session", "calls"])
def test_an_update_taken_as_the_connection_breaks_still_counts_at_its_agent(tmp_path, agent_threads, stand_dataset,
                                                                            transport, caplog):
    """The aggregator took an update, then the call broke before the agent heard (the next task
    on its Session stream, or the submit call's reply, never came): on rejoining, the Join reply
    says the round was taken, and the agent counts it; its count matches the aggregator's."""
    caplog.set_level(logging.INFO, "fedrl.agent")
    servicers: list[LosesTheFirstAnswer] = []

    def make(coord, auth):
        servicers.append(LosesTheFirstAnswer(coord, auth))
        return servicers[-1]

    agg = Aggregator(tmp_path / "s", servicer=make)
    try:
        agents = agent_threads.start(agg.target, str(stand_dataset), 2, 2, seed=0, session=transport == "session")
        wait_for(lambda: len(status(agg)["agents"]) == 2, what="agents to join")
        agg.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(rounds=3)), timeout=RPC_BOUND)
        st = wait_for(lambda: (s := status(agg))["state"] == "finished" and s, what="the run")
        (lost_by, lost_round), = servicers[0].lost
        assert lost_round == 1 and [a["rounds_submitted"] for a in st["agents"]] == [3, 3]
        wait_for(lambda: [a.rounds_done for a in agents] == [3, 3], timeout=RPC_BOUND,
                 what="each agent to count the 3 updates the aggregator took")
        loser = next(a for a in agents if a.cfg.agent_id == lost_by)
        assert loser.metrics.reconnects._value.get() >= 1
        assert "round 1: the update sent before the connection broke was taken" in caplog.text
    finally:
        agg.close()


def test_evaluate_refuses_a_declared_size_above_its_limit_before_allocating(evaluator):
    """A small upload whose manifest declares a huge policy (here 2 GiB of listed tensors) is
    refused from the manifest alone, before a buffer exists; the evaluator then still answers."""
    from evaluator_service.__main__ import build_parser
    from evaluator_service.servicer import MAX_POLICY_BYTES
    from fedrl.proto.v1 import weights_pb2
    from fedrl.wire.codec import Manifest, TensorSpec
    from fedrl.wire.serde import manifest_to_proto

    assert build_parser().parse_args([]).max_policy_mb << 20 == MAX_POLICY_BYTES
    from evaluator_service.servicer import MAX_INFLIGHT_BYTES
    assert build_parser().parse_args([]).max_inflight_mb << 20 == MAX_INFLIGHT_BYTES
    n = (2 << 30) // 4 - 64
    m = Manifest("", 0, 0, (TensorSpec("policy.head.weight", "F32", (n,)),), 0, n * 4 + 128, "0" * 32)

    def parts():
        yield evaluator_pb2.EvaluatePart(header=evaluator_pb2.EvaluateHeader(env_id="Hopper-v5", episodes=1))
        yield evaluator_pb2.EvaluatePart(weights=weights_pb2.WeightsPart(manifest=manifest_to_proto(m)))
        yield evaluator_pb2.EvaluatePart(weights=weights_pb2.WeightsPart(chunk=b"x" * 1024))

    with pytest.raises(grpc.RpcError) as ei:
        evaluator.Evaluate(parts(), timeout=30)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "exceeds this evaluator's limit" in ei.value.details()
    torch.manual_seed(0)
    state = prefixed_state(POLICY, TanhGaussianPolicy(11, 3, (16, 16)))
    rep = evaluator.Evaluate(_request(evaluator_pb2.EvaluateHeader(env_id="Hopper-v5", episodes=1, seed=1), state),
                             timeout=60)
    assert len(rep.returns) == 1


def test_evaluate_refuses_tensors_that_make_no_policy_before_building_one(evaluator):
    """Two bias vectors of 20,000 units (160 KB sent) declared a policy of two 20,000-unit layers:
    the evaluator built it (1.7 GB, 15 s of CPU) before finding its weights missing, and answered
    UNKNOWN. Every name and shape is now checked against the architecture the tensors imply
    before a parameter exists: a specific refusal naming the tensors, at once."""
    import resource

    torch.manual_seed(0)
    state = prefixed_state(POLICY, TanhGaussianPolicy(11, 3, (16, 16)))
    header = evaluator_pb2.EvaluateHeader(env_id="Hopper-v5", episodes=1, seed=1)
    wide = {"policy.obs_mean": torch.zeros(11), "policy.head.bias": torch.zeros(6),
            "policy.trunk.0.bias": torch.zeros(20_000), "policy.trunk.2.bias": torch.zeros(20_000)}
    cases = [
        (wide, "missing policy.head.weight, policy.obs_std, policy.trunk.0.weight, policy.trunk.2.weight"),
        ({**state, "policy.trunk.0.weight": torch.zeros(16, 12)}, "policy.trunk.0.weight is [16, 12], not [16, 11]"),
        ({**state, "policy.head.bias": torch.zeros(7)}, "policy.head.bias is [7], not [6]"),
        ({**state, "policy.obs_mean": torch.tensor(0.0)}, "policy.obs_mean has shape [], not a vector"),
        ({k: v for k, v in state.items() if ".trunk." not in k}, "0 trunk layers"),
        ({**state, "policy.trunk.x.bias": torch.zeros(3)}, "'policy.trunk.x.bias' of shape [3] is no trunk layer's bias"),
        ({**state, **{f"policy.trunk.{2 * i}.bias": torch.zeros(1) for i in range(65)}}, "65 trunk layers (a policy has 1 to 64)"),
    ]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for st, text in cases:
        with pytest.raises(grpc.RpcError) as ei:
            evaluator.Evaluate(_request(header, st), timeout=60)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in ei.value.details(), ei.value.details()
    # the server runs in this process: the wide policy's 1.6 GB of layers was never allocated
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) << 10 < 400 << 20
    rep = evaluator.Evaluate(_request(header, state), timeout=60)
    assert len(rep.returns) == 1
