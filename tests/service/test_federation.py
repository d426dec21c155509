"""The aggregator and agents over real gRPC on loopback: runs, equivalence, refusals."""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time

import grpc
import numpy as np
import pytest
import torch
import xxhash
from safetensors import safe_open

from fedrl.algos import BCConfig, DRPOConfig
from fedrl.federation.runconfig import RunConfig
from fedrl.federation.simulate import SimConfig
from fedrl.federation.simulate import run as simulate
from fedrl.proto.v1 import control_pb2, federation_pb2
from fedrl.wire.codec import assemble, encode
from fedrl.wire.serde import (
    manifest_from_proto,
    manifest_to_proto,
    read_weight_parts,
    status_from_proto,
)

SMALL = DRPOConfig(hidden=(32, 32), batch_size=16, cql_n_actions=2)
SMALL_BC = BCConfig(hidden=(32, 32), batch_size=16)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def run_config(**kw) -> str:
    base = dict(algo="drpo", agents=2, rounds=2, local_steps=3, seed=7, eval_episodes=0,
                round_timeout=30.0, join_timeout=30.0, drpo=SMALL, bc=SMALL_BC)
    return RunConfig(**{**base, **kw}).to_json()


# One call's bound, not a deadline the test is about: on a loaded machine a call that does
# little can still take seconds to be answered.
RPC_BOUND = 60.0


def wait_for(pred, timeout: float = 60.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def status(agg) -> dict:
    return status_from_proto(agg.control.GetStatus(control_pb2.StatusRequest(), timeout=RPC_BOUND, wait_for_ready=True))


@pytest.mark.parametrize("algo,obs_norm,session,weighting", [
    ("drpo", "pooled", True, "uniform"), ("drpo", "local", False, "uniform"), ("fed-bc", "local", True, "uniform"),
    ("drpo", "pooled", True, "samples")])
def test_grpc_run_equals_in_process_simulation(aggregator, agent_threads, stand_dataset, random_dataset, tmp_path,
                                               algo, obs_norm, session, weighting, one_thread):
    """Same config and seeds: the service run's stored global versions are bit-identical to
    the in-process simulator's global model after every round. (PyTorch's CPU kernels split
    work by thread count, so both sides use one thread per learner, as ``fedrl up`` does.)
    The drpo cases send their updates inline, on Session streams or as a call each; the fed-bc
    case streams them with SubmitUpdate (and answers its Session's tasks with done): every path
    gives the same bits. The sample-weighted case runs on episodes of uneven length, so that
    its agents hold different numbers of transitions and the weights differ from uniform."""
    data = random_dataset if weighting == "samples" else stand_dataset
    sim_states: dict[int, dict[str, torch.Tensor]] = {}
    simulate(SimConfig(algo=algo, datasets=(str(data),), agents=2, trajectories=2, rounds=2,
                       local_steps=3, eval_episodes=0, seed=7, device="cpu", obs_norm=obs_norm,
                       weighting=weighting, drpo=SMALL, bc=SMALL_BC),
             tmp_path / "sim", log=lambda m: None, on_round=lambda r, s: sim_states.__setitem__(r, s))
    rows = [json.loads(x) for x in (tmp_path / "sim" / "rounds.jsonl").read_text().splitlines()]
    if weighting == "samples":  # otherwise the case could not tell the weightings apart
        assert len({a["num_samples"] for a in rows[0]["agents"]}) == 2, rows[0]["agents"]

    agent_threads.start(aggregator.target, str(data), 2, 2, seed=7, session=session,
                        **({"inline_max_bytes": 0} if algo == "fed-bc" else {}))
    wait_for(lambda: len(status(aggregator)["agents"]) == 2, what="agents to join")
    st = status_from_proto(aggregator.control.StartRun(
        control_pb2.StartRunRequest(config_json=run_config(algo=algo, obs_norm=obs_norm, weighting=weighting)),
        timeout=10))
    assert st["state"] == "running" and st["round"] == 1
    done = wait_for(lambda: (s := status(aggregator))["state"] == "finished" and s, what="run to finish")
    assert done["global_version"] == 2
    for v in (1, 2):
        stored = aggregator.store.load_version(done["run_id"], v)
        assert stored.keys() == sim_states[v].keys()
        for k in stored:
            assert torch.equal(stored[k], sim_states[v][k]), f"version {v}: {k} differs"
    for v in (0, 1, 2):  # the stored file is the very payload served, with its provenance inside
        path = aggregator.store.version_path(done["run_id"], v)
        manifest, chunks = read_weight_parts(aggregator.fed.FetchGlobal(
            federation_pb2.FetchRequest(run_id=done["run_id"], version=v), timeout=RPC_BOUND))
        assert b"".join(chunks) == path.read_bytes()
        assert manifest.checksum == xxhash.xxh3_128_hexdigest(path.read_bytes())  # an independent XXH3
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        assert (meta["run_id"], meta["version"], meta["algo"]) == (done["run_id"], str(v), algo)
        assert json.loads(meta["hparams"])["batch_size"] == SMALL.batch_size == SMALL_BC.batch_size
    old = aggregator.store.version_path(done["run_id"], 0)  # damaged on disk: a clear refusal
    old.write_bytes(b"\x08" + old.read_bytes()[1:])
    assert_refused(lambda: list(aggregator.fed.FetchGlobal(
        federation_pb2.FetchRequest(run_id=done["run_id"], version=0), timeout=RPC_BOUND)),
        grpc.StatusCode.DATA_LOSS, "version 0 of run")
    assert [a["rounds_submitted"] for a in done["agents"]] == [2, 2]
    def sample(name, method, kind, **labels):
        return aggregator.metrics.registry.get_sample_value(name, {
            "grpc_type": kind, "grpc_service": "fedrl.v1.Federation", "grpc_method": method, **labels}) or 0

    used = {"SubmitUpdate": sample("grpc_server_handled_total", "SubmitUpdate", "client_stream", grpc_code="OK"),
            "SubmitUpdateInline": sample("grpc_server_handled_total", "SubmitUpdateInline", "unary", grpc_code="OK"),
            # per agent: its hello, then an update (or done) per round
            "Session messages": sample("grpc_server_msg_received_total", "Session", "bidi_stream"),
            "NextTask": sample("grpc_server_started_total", "NextTask", "unary")}
    assert used == {"SubmitUpdate": 4 if algo == "fed-bc" else 0,
                    "SubmitUpdateInline": 0 if algo == "fed-bc" or session else 4,
                    "Session messages": 6 if session else 0, "NextTask": 0 if session else used["NextTask"]}, used


def test_watch_streams_round_events_and_replays(aggregator, agent_threads, stand_dataset):
    agent_threads.start(aggregator.target, str(stand_dataset), 2, 2, seed=1)
    wait_for(lambda: len(status(aggregator)["agents"]) == 2, what="agents to join")
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(rounds=3)), timeout=RPC_BOUND)
    kinds = [control_pb2.RoundEvent.Kind.Name(e.kind) for e in
             aggregator.control.WatchRounds(control_pb2.WatchRequest(after_version=-1), timeout=60)]
    assert kinds[0] == "RUN_STARTED" and kinds[-1] == "RUN_FINISHED"
    assert kinds.count("ROUND_CLOSED") == 3 and kinds.count("ROUND_OPENED") == 3
    # A watcher that saw version 2 gets only what came after it.
    later = list(aggregator.control.WatchRounds(control_pb2.WatchRequest(after_version=2), timeout=RPC_BOUND))
    closed = [e for e in later if e.kind == control_pb2.RoundEvent.ROUND_CLOSED]
    assert [e.version for e in closed] == [3]
    assert set(closed[0].metrics) >= {"critic_td", "cql_penalty", "reg_data", "reg_global"}


# -- bad input: a hand-driven federation whose round 1 stays open ---------------------------------

def join(agg, agent_id: str, index: int, obs_dim: int = 11, moments: tuple[float, float] = (1.0, 2.0)):
    """Join as an agent with 100 samples whose observation sum and sum of squares are ``moments``
    in every dimension."""
    return agg.fed.Join(federation_pb2.JoinRequest(
        agent_id=agent_id, agent_index=index, num_samples=100, obs_dim=obs_dim, act_dim=3,
        env_id="Hopper-v5", obs_moments=federation_pb2.ObsMoments(
            count=100, sum=[moments[0]] * obs_dim, sum_sq=[moments[1]] * obs_dim)), timeout=RPC_BOUND)


@pytest.fixture
def open_round(aggregator):
    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    st = status_from_proto(aggregator.control.StartRun(
        control_pb2.StartRunRequest(config_json=run_config(rounds=3)), timeout=RPC_BOUND))
    parts = aggregator.fed.FetchGlobal(federation_pb2.FetchRequest(run_id=st["run_id"], version=0), timeout=RPC_BOUND)
    manifest, chunks = read_weight_parts(parts)
    g = assemble(manifest, chunks)
    path = aggregator.store.version_path(st["run_id"], 0)
    return aggregator, st["run_id"], g, hashlib.sha256(path.read_bytes()).hexdigest()


def submit(agg, agent_id, state, run_id, round=1, base=0, tamper=None, extra_chunks=(), chunk_bytes=1 << 20,
           inline=False, session=False, metrics=None):
    """An update as a stream (SubmitUpdate) or, with ``inline``, as one message (SubmitUpdateInline),
    or, with ``session``, as the answer to the first task of a Session stream; ``metrics``: its
    header's."""
    enc = encode(state, run_id, round, base, 100, chunk_bytes=chunk_bytes)
    m = manifest_to_proto(enc.manifest)
    chunks = list(enc.chunks())
    if tamper:
        m, chunks = tamper(m, chunks)
    header = federation_pb2.UpdateHeader(agent_id=agent_id, weights=m, metrics=metrics or {})
    update = federation_pb2.InlineUpdate(header=header, payload=b"".join([*chunks, *extra_chunks]))
    if session:
        return session_answer(agg, agent_id, federation_pb2.SessionMessage(update=update))
    if inline:
        return agg.fed.SubmitUpdateInline(update, timeout=RPC_BOUND)

    def parts():
        yield federation_pb2.UpdatePart(header=header)
        for c in [*chunks, *extra_chunks]:
            yield federation_pb2.UpdatePart(chunk=c)

    return agg.fed.SubmitUpdate(parts(), timeout=RPC_BOUND)


def session_answer(agg, agent_id, answer, first=None):
    """Open a Session as ``agent_id`` (or with ``first`` as its first message), expect a TRAIN
    task and send ``answer``; the reply is the next message: a task means it was taken."""
    hello = federation_pb2.SessionMessage(hello=federation_pb2.TaskRequest(agent_id=agent_id, wait_seconds=1))
    call = agg.fed.Session(iter([first or hello, answer]), timeout=RPC_BOUND)
    try:
        task = next(call)
        assert task.kind == federation_pb2.Task.TRAIN, task
        after = next(call)
        return federation_pb2.SubmitReply(accepted=True, round=task.round, next_task=after)
    finally:
        call.cancel()


def assert_refused(call, code: grpc.StatusCode, text: str) -> None:
    with pytest.raises(grpc.RpcError) as ei:
        call()
    assert ei.value.code() == code, ei.value.details()
    assert text in ei.value.details(), ei.value.details()


def _v1(m):
    """A manifest as a wire contract v1 peer sends it: its sha256, no xxh3_128."""
    m.sha256, m.xxh3_128 = "ab" * 32, ""
    return m


def assert_untouched(agg, run_id, g, digest) -> None:
    st = status(agg)
    assert st["global_version"] == 0 and st["round"] == 1 and st["state"] == "running"
    assert agg.store.versions(run_id) == [0]
    assert hashlib.sha256(agg.store.version_path(run_id, 0).read_bytes()).hexdigest() == digest
    assert all(torch.equal(agg.coord.run.global_state[k], g[k]) for k in g)


@pytest.mark.parametrize("path", ["stream", "inline", "session"])
def test_bad_updates_are_refused_and_leave_the_global_model_alone(open_round, path):
    agg, run_id, g, digest = open_round

    def submit_(*a, **kw):
        return submit(*a, inline=path == "inline", session=path == "session", **kw)
    k0 = "policy.head.weight"

    def with_(k, v):
        return {**g, k: v}

    cases = [
        ("wrong name", lambda: submit_(agg, "a0", {**{k: v for k, v in g.items() if k != k0}, "policy.extra": g[k0]}, run_id),
         grpc.StatusCode.INVALID_ARGUMENT, "tensor names differ"),
        ("wrong shape", lambda: submit_(agg, "a0", with_(k0, torch.zeros(7, 32)), run_id),
         grpc.StatusCode.INVALID_ARGUMENT, "'policy.head.weight' is F32[7, 32]"),
        ("wrong dtype", lambda: submit_(agg, "a0", with_(k0, g[k0].double()), run_id),
         grpc.StatusCode.INVALID_ARGUMENT, "F64"),
        ("NaN", lambda: submit_(agg, "a0", with_(k0, torch.full_like(g[k0], float("nan"))), run_id),
         grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf"),
        ("Inf", lambda: submit_(agg, "a0", with_(k0, torch.full_like(g[k0], float("inf"))), run_id),
         grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf"),
        ("checksum", lambda: submit_(agg, "a0", g, run_id, tamper=lambda m, c: (m, [bytes([c[0][0] ^ 1]) + c[0][1:], *c[1:]])),
         grpc.StatusCode.DATA_LOSS, "xxh3-128 does not match"),
        ("contract v1 (sha256)", lambda: submit_(agg, "a0", g, run_id, tamper=lambda m, c: (_v1(m), c)),
         grpc.StatusCode.FAILED_PRECONDITION, "wire contract v1"),
        ("extra chunk", lambda: submit_(agg, "a0", g, run_id, extra_chunks=[b"x"]),
         grpc.StatusCode.OUT_OF_RANGE, "exceed the declared"),
        ("truncated", lambda: submit_(agg, "a0", g, run_id, chunk_bytes=1000, tamper=lambda m, c: (m, c[:-1])),
         grpc.StatusCode.DATA_LOSS, "received"),
        ("unknown agent", lambda: submit_(agg, "mallory", g, run_id),
         grpc.StatusCode.NOT_FOUND, "unknown agent 'mallory'"),
        ("future round", lambda: submit_(agg, "a0", g, run_id, round=2),
         grpc.StatusCode.FAILED_PRECONDITION, "round 2 is in the future"),
        ("closed round", lambda: submit_(agg, "a0", g, run_id, round=0),
         grpc.StatusCode.FAILED_PRECONDITION, "round 0 is closed"),
        ("wrong run", lambda: submit_(agg, "a0", g, "other-run"),
         grpc.StatusCode.FAILED_PRECONDITION, "update for run 'other-run'"),
        ("pickle encoding", lambda: submit_(agg, "a0", g, run_id, tamper=lambda m, c: (_set(m, encoding="pickle"), c)),
         grpc.StatusCode.INVALID_ARGUMENT, "encoding 'pickle' is not accepted"),
        # the receiver sizes its buffer from the manifest: a size the model cannot have is refused
        # before any chunk (2 GiB here would otherwise be allocated for a 50 KB model)
        ("declared size", lambda: submit_(agg, "a0", g, run_id, tamper=lambda m, c: (_set(m, total_bytes=2 << 30), c)),
         grpc.StatusCode.INVALID_ARGUMENT, "declared size 2147483648 bytes does not fit"),
        ("manifest lies about a shape", lambda: submit_(agg, "a0", g, run_id, tamper=lambda m, c: (
            _prepend_dim(m, k0), c)),
         grpc.StatusCode.INVALID_ARGUMENT, "manifest says tensor 'policy.head.weight' is F32[1,"),
    ]
    if path == "inline":
        cases.append(("no header", lambda: agg.fed.SubmitUpdateInline(federation_pb2.InlineUpdate(payload=b"x"), timeout=RPC_BOUND),
                      grpc.StatusCode.INVALID_ARGUMENT, "needs its header"))
    if path == "stream":  # the aggregator reads these messages as bytes (RAW_REQUESTS): what is not a chunk
        enc = encode(g, run_id, 1, 0, 100)
        head = federation_pb2.UpdatePart(header=federation_pb2.UpdateHeader(
            agent_id="a0", weights=manifest_to_proto(enc.manifest))).SerializeToString()
        chunk = federation_pb2.UpdatePart(chunk=enc.payload[:1000]).SerializeToString()
        raw = agg.channel.stream_unary("/fedrl.v1.Federation/SubmitUpdate", request_serializer=None,
                                       response_deserializer=federation_pb2.SubmitReply.FromString)
        cases += [
            ("a second header", lambda: raw(iter([head, chunk, head]), timeout=10),
             grpc.StatusCode.INVALID_ARGUMENT, "a second header in one update stream"),
            ("not a message", lambda: raw(iter([head, chunk, b"\xff\xff\xff"]), timeout=10),
             grpc.StatusCode.INVALID_ARGUMENT, "an update stream message is not an UpdatePart"),
            ("not a message first", lambda: raw(iter([b"\x0a\x05ab"]), timeout=10),
             grpc.StatusCode.INVALID_ARGUMENT, "an update stream message is not an UpdatePart"),
            # a chunk whose length prefix claims more bytes than the message has: parsed, refused
            ("a cut chunk", lambda: raw(iter([head, chunk[:-1]]), timeout=10),
             grpc.StatusCode.INVALID_ARGUMENT, "an update stream message is not an UpdatePart"),
        ]
    if path == "session":
        enc = encode(g, run_id, 1, 0, 100)
        update = federation_pb2.InlineUpdate(
            header=federation_pb2.UpdateHeader(agent_id="a1", weights=manifest_to_proto(enc.manifest)),
            payload=enc.payload)
        hello = federation_pb2.SessionMessage(hello=federation_pb2.TaskRequest(agent_id="a0"))
        cases += [
            ("no header", lambda: session_answer(agg, "a0", federation_pb2.SessionMessage(
                update=federation_pb2.InlineUpdate(payload=b"x"))), grpc.StatusCode.INVALID_ARGUMENT, "needs its header"),
            ("no hello first", lambda: list(agg.fed.Session(iter([federation_pb2.SessionMessage(update=update)]),
                                                            timeout=10)),
             grpc.StatusCode.INVALID_ARGUMENT, "must start with its hello"),
            ("another agent's update", lambda: session_answer(agg, "a0", federation_pb2.SessionMessage(update=update)),
             grpc.StatusCode.PERMISSION_DENIED, "the session of agent 'a0' carried an update of agent 'a1'"),
            ("a hello for an answer", lambda: session_answer(agg, "a0", hello),
             grpc.StatusCode.INVALID_ARGUMENT, "answers a TRAIN task with its update or done, not hello"),
        ]
    for name, call, code, text in cases:
        assert_refused(call, code, text)
        assert_untouched(agg, run_id, g, digest)

    # A valid update is taken once; the second for the same round is refused (a Session does
    # not ask for it: it sends WAIT until the next round opens).
    assert submit_(agg, "a0", g, run_id).accepted
    if path == "session":
        call = agg.fed.Session(iter([hello]), timeout=RPC_BOUND)
        assert next(call).kind == federation_pb2.Task.WAIT
        call.cancel()
    else:
        assert_refused(lambda: submit_(agg, "a0", g, run_id), grpc.StatusCode.ALREADY_EXISTS, "already submitted")
    assert agg.store.versions(run_id) == [0]
    # The other agent completes the round: version 1 exists and equals the average.
    assert submit_(agg, "a1", g, run_id).round == 1
    st = wait_for(lambda: (s := status(agg))["global_version"] == 1 and s, what="round 1 to close")
    assert st["round"] == 2
    v1 = agg.store.load_version(run_id, 1)
    assert all(torch.equal(v1[k], g[k]) for k in g)
    # Now round 1 is closed for everyone.
    assert_refused(lambda: submit_(agg, "a0", g, run_id, round=1, base=1), grpc.StatusCode.FAILED_PRECONDITION,
                   "round 1 is closed")


def _prepend_dim(m, name):
    """The manifest (proto) with a leading 1 added to tensor ``name``'s shape."""
    t = next(t for t in m.tensors if t.name == name)
    shape = [1, *t.shape]
    del t.shape[:]
    t.shape.extend(shape)
    return m


def _set(m, **kw):
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def test_bad_configs_and_control_misuse(aggregator):
    c = aggregator.control
    bad = [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"agents": 0}), "agents: must be >= 1"),
        (json.dumps({"algo": "ppo"}), "algo: 'ppo' is not one of drpo, fed-cql, fed-bc"),
        (json.dumps({"rounds": "five"}), "rounds: expected an integer"),
        (json.dumps({"colour": "red"}), "unknown field(s) colour"),
        (json.dumps({"drpo": {"lambda1": -1}}), "drpo: lambda1 must be >= 0"),
        (json.dumps({"drpo": {"learning_rate": 1}}), "drpo: unknown field(s) learning_rate"),
        (json.dumps({"agents": 2, "min_agents": 3}), "min_agents: 3 exceeds agents"),
        (json.dumps({"env": "Pong-v5"}), "env: unknown environment"),
    ]
    for text, msg in bad:
        assert_refused(lambda: c.StartRun(control_pb2.StartRunRequest(config_json=text), timeout=RPC_BOUND),
                       grpc.StatusCode.INVALID_ARGUMENT, msg)
    assert status(aggregator)["state"] == "idle"
    assert_refused(lambda: c.StopRun(control_pb2.StopRunRequest(), timeout=RPC_BOUND),
                   grpc.StatusCode.FAILED_PRECONDITION, "no active run")
    first = c.StartRun(control_pb2.StartRunRequest(config_json=run_config()), timeout=RPC_BOUND).run_id
    assert status(aggregator)["state"] == "waiting_for_agents"
    # a second run beside it, up to --max-runs; a stop must then name its run
    aggregator.coord.lifecycle.max_runs = 2
    second = c.StartRun(control_pb2.StartRunRequest(config_json=run_config()), timeout=RPC_BOUND).run_id
    assert second != first and [r["run_id"] for r in status(aggregator)["runs"]] == [first, second]
    assert_refused(lambda: c.StartRun(control_pb2.StartRunRequest(config_json=run_config()), timeout=RPC_BOUND),
                   grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-runs 2")
    assert_refused(lambda: c.StopRun(control_pb2.StopRunRequest(reason="test"), timeout=RPC_BOUND),
                   grpc.StatusCode.FAILED_PRECONDITION, "name the one to stop")
    assert_refused(lambda: c.StopRun(control_pb2.StopRunRequest(run_id="20990101-000000-abcdef"), timeout=RPC_BOUND),
                   grpc.StatusCode.NOT_FOUND, "unknown run")
    assert_refused(lambda: c.GetStatus(control_pb2.StatusRequest(run_id="nope"), timeout=RPC_BOUND),
                   grpc.StatusCode.NOT_FOUND, "unknown run 'nope'")
    st = status_from_proto(c.StopRun(control_pb2.StopRunRequest(reason="test", run_id=first), timeout=RPC_BOUND))
    assert st["run_id"] == first and st["state"] == "stopped" and st["message"] == "test"
    assert_refused(lambda: c.StopRun(control_pb2.StopRunRequest(run_id=first), timeout=RPC_BOUND),
                   grpc.StatusCode.FAILED_PRECONDITION, "is stopped: nothing to stop")
    st = status_from_proto(c.StopRun(control_pb2.StopRunRequest(reason="test"), timeout=RPC_BOUND))
    assert st["run_id"] == second and st["state"] == "stopped"
    assert status_from_proto(c.GetStatus(control_pb2.StatusRequest(run_id=first), timeout=RPC_BOUND))["state"] == "stopped"


def test_join_and_task_refusals(aggregator):
    f = aggregator.fed
    assert_refused(lambda: f.NextTask(federation_pb2.TaskRequest(agent_id="nobody", wait_seconds=0), timeout=RPC_BOUND),
                   grpc.StatusCode.NOT_FOUND, "unknown agent 'nobody'")
    assert_refused(lambda: f.Join(federation_pb2.JoinRequest(agent_id="", obs_dim=1, act_dim=1, num_samples=1), timeout=RPC_BOUND),
                   grpc.StatusCode.INVALID_ARGUMENT, "agent_id")
    assert_refused(lambda: f.Join(federation_pb2.JoinRequest(
        agent_id="x", obs_dim=3, act_dim=1, num_samples=5,
        obs_moments=federation_pb2.ObsMoments(count=5, sum=[1.0], sum_sq=[1.0])), timeout=RPC_BOUND),
        grpc.StatusCode.INVALID_ARGUMENT, "obs_dim=3")
    join(aggregator, "a0", 0)
    t0 = time.monotonic()
    task = f.NextTask(federation_pb2.TaskRequest(agent_id="a0", wait_seconds=0.3), timeout=RPC_BOUND)
    assert task.kind == federation_pb2.Task.WAIT and time.monotonic() - t0 > 0.25  # it waited as asked
    # Agents whose data disagree on dimensions: no group of one task is large enough, so the run
    # waits for one (neither decides for the other) and fails at its join timeout, saying why.
    join(aggregator, "a1", 1, obs_dim=17)
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(join_timeout=0.5)), timeout=RPC_BOUND)
    st = wait_for(lambda: (s := status(aggregator))["state"] == "failed" and s, what="the run to fail")
    assert "they hold 2 different tasks" in st["message"] and "Hopper-v5 17/3" in st["message"]
    assert_refused(lambda: f.FetchGlobal(federation_pb2.FetchRequest(run_id="nope", version=0), timeout=RPC_BOUND).next(),
                   grpc.StatusCode.NOT_FOUND, "unknown run 'nope'")


def test_agent_records_are_bounded_and_those_of_agents_gone_are_forgotten(aggregator):
    coord = aggregator.coord
    coord.max_agents = 3
    for i in range(3):
        join(aggregator, f"a{i}", i)
    # all three connected: a fourth is refused, nothing registered
    assert_refused(lambda: join(aggregator, "a3", 3), grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-agents 3")
    assert sorted(coord.agents) == ["a0", "a1", "a2"]
    # a run may not want more agents than the aggregator keeps
    assert_refused(lambda: aggregator.control.StartRun(control_pb2.StartRunRequest(
        config_json=run_config(agents=4)), timeout=RPC_BOUND), grpc.StatusCode.INVALID_ARGUMENT, "--max-agents 3")
    # a0 has gone (not connected): its record makes room; a known agent rejoining always may
    coord.agents["a0"].last_seen -= 2 * coord.max_task_wait + 10
    join(aggregator, "a3", 3)
    assert sorted(coord.agents) == ["a1", "a2", "a3"]
    join(aggregator, "a1", 1)
    # a record unseen for longer than the TTL is dropped at the next Join, even with room left
    coord.max_agents = 10
    coord.agents["a2"].last_seen -= coord.agent_ttl + 1
    join(aggregator, "a4", 4)
    assert sorted(coord.agents) == ["a1", "a3", "a4"]


def test_agents_selected_in_a_running_run_are_never_forgotten(aggregator):
    coord = aggregator.coord
    coord.max_agents = 2
    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config()), timeout=RPC_BOUND)
    wait_for(lambda: status(aggregator)["state"] == "running", what="the run to start")
    for a in ("a0", "a1"):
        coord.agents[a].last_seen -= coord.agent_ttl + 1
    assert_refused(lambda: join(aggregator, "a2", 2), grpc.StatusCode.RESOURCE_EXHAUSTED, "in the run")
    assert sorted(coord.agents) == ["a0", "a1"]


@pytest.mark.parametrize("env, message", [
    ("HalfCheetah-v5", "env HalfCheetah-v5 in the run config, but the agents' data is for Hopper-v5"),
    ("Ant-v5", "env Ant-v5 in the run config, but the agents' data is for Hopper-v5"),
])
def test_a_run_whose_env_is_not_the_agents_task_fails_at_its_start(aggregator, env, message):
    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(env=env)), timeout=RPC_BOUND)
    st = status(aggregator)
    assert st["state"] == "failed" and st["message"] == message and st["global_version"] == 0
    assert not list(aggregator.store.root.rglob("v*.safetensors"))  # no version 0 to evaluate


def test_a_run_env_of_the_agents_task_but_another_width_fails_at_its_start(aggregator):
    aggregator.fed.Join(federation_pb2.JoinRequest(  # an agent whose data reports no env id
        agent_id="a0", agent_index=0, num_samples=100, obs_dim=11, act_dim=6,
        obs_moments=federation_pb2.ObsMoments(count=100, sum=[1.0] * 11, sum_sq=[2.0] * 11)), timeout=RPC_BOUND)
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(agents=1, env="Hopper-v5")),
                                timeout=RPC_BOUND)
    assert status(aggregator)["message"] == "env Hopper-v5 in the run config has 3 action dims, the agents' data 6"


def test_round_closes_at_deadline_with_quorum(aggregator):
    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    st = status_from_proto(aggregator.control.StartRun(control_pb2.StartRunRequest(
        config_json=run_config(min_agents=1, round_timeout=0.5)), timeout=RPC_BOUND))
    g = assemble(*read_weight_parts(aggregator.fed.FetchGlobal(
        federation_pb2.FetchRequest(run_id=st["run_id"], version=0), timeout=RPC_BOUND)))
    scaled = {k: v * 2 if v.is_floating_point() else v for k, v in g.items()}
    submit(aggregator, "a0", scaled, st["run_id"])
    # a1 never sends: only the deadline can close the round (however late a loaded clock fires it)
    s = wait_for(lambda: (x := status(aggregator))["global_version"] == 1 and x, what="deadline close")
    assert s["round"] == 2
    v1 = aggregator.store.load_version(st["run_id"], 1)
    assert torch.equal(v1["policy.head.weight"], scaled["policy.head.weight"])  # only a0's update
    ev = [e for e in aggregator.coord.run.events if e["kind"] == "ROUND_CLOSED"]
    assert ev[0]["agents"] == ["a0"]
    np.testing.assert_allclose(v1["policy.obs_mean"].numpy(), 2 * g["policy.obs_mean"].numpy())


def test_a_round_short_of_its_quorum_says_so_and_closes_when_it_is_met(aggregator):
    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    st = status_from_proto(aggregator.control.StartRun(control_pb2.StartRunRequest(
        config_json=run_config(round_timeout=0.3)), timeout=RPC_BOUND))  # quorum: both agents
    g = assemble(*read_weight_parts(aggregator.fed.FetchGlobal(
        federation_pb2.FetchRequest(run_id=st["run_id"], version=0), timeout=RPC_BOUND)))
    submit(aggregator, "a0", g, st["run_id"])
    # the deadline may pass before a0's update lands ("0 of the 2"): the report follows the updates taken
    s = wait_for(lambda: "with 1 of" in (x := status(aggregator))["message"] and x, what="the stall to be reported")
    assert "round 1 is past its deadline with 1 of the 2 updates it needs" in s["message"]
    assert s["global_version"] == 0 and s["round"] == 1
    submit(aggregator, "a1", g, st["run_id"])
    s = wait_for(lambda: (x := status(aggregator))["global_version"] == 1 and x, what="round 1 to close")
    assert s["message"] == ""


@pytest.mark.parametrize("aggregation", ["fedavg", "median", "trimmed-mean"])
def test_one_byzantine_agent_corrupts_fedavg_but_not_robust_aggregation(aggregator, aggregation):
    for i in range(3):
        join(aggregator, f"a{i}", i)
    st = status_from_proto(aggregator.control.StartRun(control_pb2.StartRunRequest(
        config_json=run_config(agents=3, aggregation=aggregation, trim_fraction=0.34)), timeout=RPC_BOUND))
    g = assemble(*read_weight_parts(aggregator.fed.FetchGlobal(
        federation_pb2.FetchRequest(run_id=st["run_id"], version=0), timeout=RPC_BOUND)))
    submit(aggregator, "a0", g, st["run_id"])
    submit(aggregator, "a1", g, st["run_id"])
    submit(aggregator, "a2", {k: v * 1e6 if v.is_floating_point() else v for k, v in g.items()}, st["run_id"])
    wait_for(lambda: status(aggregator)["global_version"] == 1, what="round 1 to close")
    v1 = aggregator.store.load_version(st["run_id"], 1)
    w = "policy.trunk.0.weight"
    if aggregation == "fedavg":
        assert (v1[w] - g[w]).abs().max() > 1e3
    else:
        assert torch.equal(v1[w], g[w])


def test_averages_are_written_into_the_buffers_of_versions_no_longer_held(aggregator, monkeypatch):
    """Each round's average goes into a pooled buffer: one that a version still held (the
    current one, the one before, a version a caller keeps) never receives it, and the rounds
    settle on a few buffers in rotation instead of fresh memory every round. (The pool takes
    averages of 1 MiB and more; this small policy's are let in.)"""
    from aggregator_service import rounds

    monkeypatch.setattr(rounds, "AVERAGE_POOL_MIN_BYTES", 0)
    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    rounds = 8
    st = status_from_proto(aggregator.control.StartRun(control_pb2.StartRunRequest(
        config_json=run_config(rounds=rounds)), timeout=RPC_BOUND))
    run_id = st["run_id"]
    g = assemble(*read_weight_parts(aggregator.fed.FetchGlobal(
        federation_pb2.FetchRequest(run_id=run_id, version=0), timeout=RPC_BOUND)))
    held = None  # version 2 as the aggregator holds it, kept here as a late reader would
    for r in range(1, rounds + 1):
        for i, aid in enumerate(("a0", "a1")):
            submit(aggregator, aid, {k: v + r + i if v.is_floating_point() else v for k, v in g.items()},
                   run_id, round=r, base=r - 1)
        wait_for(lambda r=r: status(aggregator)["global_version"] == r, what=f"round {r} to close")
        if r == 2:
            held = dict(aggregator.coord.run.global_state)
            expected = {k: v.clone() for k, v in held.items()}
    pool = aggregator.coord.averages
    assert pool.reused >= rounds - 4 and pool.mapped <= 4, (pool.mapped, pool.reused)
    assert all(torch.equal(held[k], expected[k]) for k in held), "a held version's memory was written again"
    assert all(torch.equal(held[k], v) for k, v in aggregator.store.load_version(run_id, 2).items())
    last = aggregator.store.load_version(run_id, rounds)
    w = "policy.head.weight"
    torch.testing.assert_close(last[w], g[w] + rounds + 0.5)  # the mean of (g + r) and (g + r + 1)
    wait_for(lambda: pool.free_buffers() == 0, what="the run's spare buffers to be let go once it ended")


def test_an_inline_update_can_bring_back_the_next_task(open_round):
    """One call per agent per round: an update that asks for it is answered, once its round has
    closed, with the agent's next task (the new version inline), as NextTask would answer."""
    agg, run_id, g, _ = open_round

    def inline(agent_id, wait):
        enc = encode(g, run_id, 1, 0, 100)
        return agg.fed.SubmitUpdateInline(federation_pb2.InlineUpdate(
            header=federation_pb2.UpdateHeader(agent_id=agent_id, weights=manifest_to_proto(enc.manifest)),
            payload=enc.payload, next_task_wait_seconds=wait), timeout=30)

    replies = {}
    first = threading.Thread(target=lambda: replies.setdefault("a0", inline("a0", 20)))
    first.start()
    wait_for(lambda: "a0" in agg.coord.run.submissions, what="a0's update")
    assert first.is_alive()  # held: its round is still open
    replies["a1"] = inline("a1", 20)  # closes round 1
    first.join(10)
    assert not first.is_alive()
    for a in ("a0", "a1"):
        r = replies[a]
        assert r.accepted and r.round == 1 and r.HasField("next_task")
        t = r.next_task
        assert (t.kind, t.round, t.base_version) == (federation_pb2.Task.TRAIN, 2, 1)
        assert t.base_payload == agg.store.version_path(run_id, 1).read_bytes()
    # without the field: the plain reply, no task
    enc = encode(g, run_id, 2, 1, 100)
    plain = agg.fed.SubmitUpdateInline(federation_pb2.InlineUpdate(
        header=federation_pb2.UpdateHeader(agent_id="a0", weights=manifest_to_proto(enc.manifest)),
        payload=enc.payload), timeout=10)
    assert plain.accepted and plain.round == 2 and not plain.HasField("next_task")
    # a refused update is refused at once, whatever wait it asked for: well before the 20 s asked
    t0 = time.monotonic()
    assert_refused(lambda: inline("a0", 20), grpc.StatusCode.FAILED_PRECONDITION, "round 1 is closed")
    assert time.monotonic() - t0 < 10


def test_each_agent_gets_its_own_normaliser_in_every_task(aggregator):
    """Tasks are serialised once per round and shared while they are the same; with local
    observation statistics they are not, and no agent may be sent another's normaliser, whether
    the task comes from NextTask or in the reply to an inline update."""
    means = {"a0": 1.0, "a1": 5.0}
    for i, (a, mu) in enumerate(means.items()):  # std 2 around mean mu
        join(aggregator, a, i, moments=(100 * mu, 100 * (mu * mu + 4)))
    st = status_from_proto(aggregator.control.StartRun(control_pb2.StartRunRequest(
        config_json=run_config(obs_norm="local", rounds=3)), timeout=RPC_BOUND))
    run_id = st["run_id"]

    def check(task, agent, round):
        assert (task.kind, task.round) == (federation_pb2.Task.TRAIN, round)
        np.testing.assert_allclose(task.obs_mean, [means[agent]] * 11)
        np.testing.assert_allclose(task.obs_std, [2.0] * 11, rtol=1e-3)

    tasks = {a: aggregator.fed.NextTask(federation_pb2.TaskRequest(agent_id=a, wait_seconds=1), timeout=RPC_BOUND)
             for a in ("a0", "a1", "a0")}  # a0 again: after a1's task was made
    for a, t in tasks.items():
        check(t, a, 1)
    g = assemble(manifest_from_proto(tasks["a0"].base_manifest), [tasks["a0"].base_payload])
    for r in (1, 2):  # a0 waits on its reply, a1's closes the round: both replies carry round r+1
        enc = {a: encode(g, run_id, r, r - 1, 100) for a in means}
        replies = {}

        def inline(a):
            replies[a] = aggregator.fed.SubmitUpdateInline(federation_pb2.InlineUpdate(
                header=federation_pb2.UpdateHeader(agent_id=a, weights=manifest_to_proto(enc[a].manifest)),
                payload=enc[a].payload, next_task_wait_seconds=20), timeout=30)
        first = threading.Thread(target=inline, args=("a0",))
        first.start()
        wait_for(lambda: "a0" in aggregator.coord.run.submissions, what="a0's update")
        inline("a1")
        first.join(10)
        for a in means:
            check(replies[a].next_task, a, r + 1)
        g = assemble(manifest_from_proto(replies["a1"].next_task.base_manifest), [replies["a1"].next_task.base_payload])


@pytest.mark.parametrize("field,value,says", [
    ("sum", float("nan"), "must be finite"),
    ("sum_sq", float("inf"), "must be finite"),
    ("sum", 1e308, "exceeds 1e+06"),  # finite, but no observation has such a mean
    ("obs_dim", 300_000, "obs_dim must be in"),
    ("agent_index", -2**63, "index must be in"),
    ("num_samples", 2**40, "num_samples must be in"),
    ("count", 10**9, "over 1000000000 observations, but num_samples is 100"),  # a pool-weight of a billion
])
def test_join_validates_what_an_agent_declares_and_nothing_changes(aggregator, field, value, says):
    """Moments that are not finite (or whose mean and std are not), absurd dimensions, indices and
    sample counts: INVALID_ARGUMENT naming the problem, and the agent is not registered, so a run
    it would have wedged (a NaN version 0, a 295 MB one) starts with the honest agents."""
    kw = dict(agent_id="bad", agent_index=0, num_samples=100, obs_dim=11, act_dim=3, env_id="Hopper-v5")
    moments = dict(count=100, sum=[1.0] * 11, sum_sq=[2.0] * 11)
    if field in ("sum", "sum_sq"):
        moments[field] = [value] * 11
    elif field == "count":
        moments[field] = value
    else:
        kw[field] = value
        if field == "obs_dim":
            moments.update(sum=[1.0] * value, sum_sq=[2.0] * value)
    with pytest.raises(grpc.RpcError) as ei:
        aggregator.fed.Join(federation_pb2.JoinRequest(**kw, obs_moments=federation_pb2.ObsMoments(**moments)),
                            timeout=10)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in ei.value.details(), ei.value.details()
    assert "bad" not in aggregator.coord.agents
    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config()), timeout=RPC_BOUND)
    st = wait_for(lambda: (s := status(aggregator))["state"] == "running" and s, RPC_BOUND, "the run to start")
    v0 = aggregator.store.load_version(st["run_id"], 0)
    assert all(torch.isfinite(t).all() for t in v0.values())


def test_a_new_run_selects_only_agents_connected_now(aggregator):
    join(aggregator, "gone", 0)
    aggregator.coord.agents["gone"].last_seen -= 3600  # joined long ago, never heard of since
    join(aggregator, "a1", 1)
    join(aggregator, "a2", 2)
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config()), timeout=RPC_BOUND)
    wait_for(lambda: status(aggregator)["state"] == "running", RPC_BOUND, "the run to start")
    assert aggregator.coord.run.selected == ["a1", "a2"]


def test_the_aggregator_logs_its_lifecycle_one_line_per_event(aggregator, agent_threads, stand_dataset, caplog):
    import logging

    from fedrl.ops.logs import JSONFormatter

    with caplog.at_level(logging.INFO, logger="fedrl.aggregator"):
        agent_threads.start(aggregator.target, str(stand_dataset), 2, 2, seed=1)
        wait_for(lambda: len(status(aggregator)["agents"]) == 2, what="agents to join")
        aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(rounds=2)), timeout=RPC_BOUND)
        wait_for(lambda: status(aggregator)["state"] == "finished", what="the run to finish")
        agent_threads.stop()
        wait_for(lambda: sum(getattr(r, "event", {}).get("kind") == "AGENT_LEFT" for r in caplog.records) == 2,
                 timeout=20, what="the agents' sessions to end")
    kinds = [r.event["kind"] for r in caplog.records if isinstance(getattr(r, "event", None), dict)]
    for k in ("AGENT_JOINED", "AGENT_CONNECTED", "RUN_STARTED", "ROUND_OPENED", "ROUND_CLOSED", "RUN_FINISHED",
              "AGENT_LEFT"):
        assert k in kinds, (k, kinds)
    assert kinds.count("ROUND_CLOSED") == 2 and kinds.count("ROUND_OPENED") == 2
    closed = next(r for r in caplog.records if getattr(r, "event", {}).get("kind") == "ROUND_CLOSED")
    assert "round 1/2 closed with 2 updates" in closed.getMessage() and "version 1 stored" in closed.getMessage()
    line = json.loads(JSONFormatter().format(closed))  # what --log-format json writes
    assert line["kind"] == "ROUND_CLOSED" and line["version"] == 1 and line["level"] == "INFO"
    assert line["message"] == closed.getMessage() and line["logger"] == "fedrl.aggregator"


def test_differential_privacy_spends_its_budget_and_says_so(aggregator, agent_threads, stand_dataset):
    """A DP run reports its epsilon in each ROUND_CLOSED event, its status and the metrics, and stops,
    saying why, before the round that would exceed its budget."""
    from fedrl.federation.privacy import epsilon

    agent_threads.start(aggregator.target, str(stand_dataset), 2, 2, seed=1)
    wait_for(lambda: len(status(aggregator)["agents"]) == 2, what="agents to join")
    budget = epsilon(1.0, 2, 1e-5) + 1e-9
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(
        algo="fed-bc", rounds=4, dp_clip=0.5, dp_noise=1.0, dp_epsilon_budget=budget)), timeout=RPC_BOUND)
    st = wait_for(lambda: (s := status(aggregator))["state"] in ("stopped", "finished", "failed") and s,
                  what="the run to end")
    assert st["state"] == "stopped" and st["global_version"] == 2, st
    assert st["message"].startswith("privacy budget: round 3 would spend epsilon")
    assert st["privacy"]["rounds"] == 2 and st["privacy"]["epsilon"] == pytest.approx(epsilon(1.0, 2, 1e-5))
    events = list(aggregator.control.WatchRounds(control_pb2.WatchRequest(after_version=-1), timeout=RPC_BOUND))
    closed = [e for e in events if e.kind == control_pb2.RoundEvent.ROUND_CLOSED]
    assert [round(e.metrics["privacy_epsilon"], 6) for e in closed] == \
        [round(epsilon(1.0, r, 1e-5), 6) for r in (1, 2)]
    assert aggregator.coord.metrics.privacy_epsilon.labels(st["run_id"])._value.get() == pytest.approx(epsilon(1.0, 2, 1e-5))


def test_adaptive_clipping_moves_the_norm_round_by_round_and_status_says_so(aggregator, agent_threads,
                                                                           stand_dataset):
    """Adaptive clipping through the services: each ROUND_CLOSED names the norm its round clipped
    to, the noisy share within it and the next norm, which the next round uses; the status and
    ``fedrl ctl status`` show where the norm stands; epsilon is that of one Gaussian of the run's
    multiplier (the count's noise is paid for by the updates')."""
    from fedrl.cli import show
    from fedrl.federation.privacy import epsilon

    agent_threads.start(aggregator.target, str(stand_dataset), 2, 2, seed=1)
    wait_for(lambda: len(status(aggregator)["agents"]) == 2, what="agents to join")
    aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(
        algo="fed-bc", rounds=3, dp_clip=1e-4, dp_noise=1.0, dp_clip_quantile=0.5, dp_clip_lr=0.5,
        dp_count_noise=1.0)), timeout=RPC_BOUND)
    st = wait_for(lambda: (s := status(aggregator))["state"] in ("stopped", "finished", "failed") and s,
                  what="the run to end")
    assert st["state"] == "finished", st
    events = list(aggregator.control.WatchRounds(control_pb2.WatchRequest(after_version=-1), timeout=RPC_BOUND))
    closed = [dict(e.metrics) for e in events if e.kind == control_pb2.RoundEvent.ROUND_CLOSED]
    assert len(closed) == 3 and closed[0]["dp_clip"] == pytest.approx(1e-4)
    for a, b in zip(closed, closed[1:]):
        assert b["dp_clip"] == pytest.approx(a["dp_clip_next"], rel=1e-12)
    for c in closed:
        assert c["dp_clip_next"] == pytest.approx(c["dp_clip"] * math.exp(-0.5 * (c["dp_unclipped_fraction"] - 0.5)))
    assert st["privacy"]["clip"] == pytest.approx(closed[-1]["dp_clip_next"])
    assert st["privacy"]["epsilon"] == pytest.approx(epsilon(1.0, 3, 1e-5), rel=1e-6)
    assert "adaptive towards the 0.5 quantile of the update norms; count noise 1" in show.status(st)
    assert aggregator.coord.metrics.privacy_clip.labels(aggregator.coord.run.run_id)._value.get() == pytest.approx(closed[-1]["dp_clip_next"])


def test_the_aggregator_clips_an_update_its_agent_did_not(aggregator):
    """Under dp_clip an agent that sends its update unclipped cannot void the bound: the average the
    aggregator stores moved by at most the clip (no noise here, to see the bound itself)."""
    from fedrl.federation.privacy import update_norm

    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    st = status_from_proto(aggregator.control.StartRun(control_pb2.StartRunRequest(
        config_json=run_config(rounds=2, dp_clip=0.5)), timeout=RPC_BOUND))
    manifest, chunks = read_weight_parts(aggregator.fed.FetchGlobal(
        federation_pb2.FetchRequest(run_id=st["run_id"], version=0), timeout=RPC_BOUND))
    g = assemble(manifest, chunks)
    far = {k: (v + 1.0 if k.startswith("policy.trunk") else v.clone()) for k, v in g.items()}  # norm >> 0.5
    assert update_norm(far, g) > 30
    for a in ("a0", "a1"):
        assert submit(aggregator, a, far, st["run_id"]).accepted
    wait_for(lambda: status(aggregator)["global_version"] == 1, what="round 1 to close")
    v1 = aggregator.store.load_version(st["run_id"], 1)
    assert update_norm(v1, g) == pytest.approx(0.5, rel=1e-5)
