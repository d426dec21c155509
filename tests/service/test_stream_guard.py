"""Idle streams cannot starve a real aggregator: a stream that keeps the server waiting is ended,
streams are capped per caller and in all (refused ones hold no worker), unauthenticated ones are
refused before they are counted, and health, Control and Join answer while the server is
flooded, from its reserved workers (the flood's streams still held); a Session agent that trains longer than the idle limit stays connected because
it reports progress."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedrl.proto.v1 import control_pb2, federation_pb2
from fedrl.wire.streams import RESERVED_WORKERS
from fedrl.wire.security import Authenticator, TokenClientInterceptor

from .conftest import Aggregator
from tests.service.test_federation import RPC_BOUND, wait_for

SUBMIT = "/fedrl.v1.Federation/SubmitUpdate"


def own_connection(target: str) -> grpc.Channel:
    """A channel on its own TCP connection (channels in one process share one by default)."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


class IdleStreams:
    """Client streams that send nothing until released (bounded: released at teardown)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.futures: list = []

    def open(self, channel: grpc.Channel, n: int, timeout: float = 60):
        call = channel.stream_unary(SUBMIT, request_serializer=None, response_deserializer=None)

        def nothing():
            self.release.wait(timeout)
            return
            yield

        futs = [call.future(nothing(), timeout=timeout) for _ in range(n)]
        self.futures += futs
        return futs

    def close(self) -> None:
        self.release.set()
        for f in self.futures:
            f.cancel()


@pytest.fixture
def idle():
    s = IdleStreams()
    yield s
    s.close()


def _code(fut, timeout=10.0):
    try:
        fut.result(timeout=timeout)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_an_idle_stream_is_ended_after_the_idle_limit(tmp_path, idle):
    agg = Aggregator(tmp_path / "s", stream_idle_seconds=1.0)
    try:
        t = time.monotonic()
        (fut,) = idle.open(agg.channel, 1)
        code, details = _code(fut, RPC_BOUND)
        took = time.monotonic() - t
        # the guard's own words: not the call's 60 s deadline, and not before the idle limit
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "no message for 1s" in details, (code, details)
        assert took > 0.9, took
        # its worker is free again: the guard counts no open stream
        end = time.monotonic() + 5
        while agg.server.guard.open_streams and time.monotonic() < end:
            time.sleep(0.05)
        assert agg.server.guard.open_streams == 0
    finally:
        agg.close()


def test_a_flood_of_idle_streams_is_refused_and_the_server_keeps_answering(tmp_path, idle):
    workers, per_caller = 24, 4
    agg = Aggregator(tmp_path / "s", max_workers=workers, streams_per_identity=per_caller, stream_idle_seconds=30)
    chans = [own_connection(agg.target) for _ in range(100)]
    try:
        futs = [f for ch in chans for f in idle.open(ch, 10)]  # 1,000 streams, 10 per connection
        end = time.monotonic() + 20
        while sum(f.done() for f in futs) < len(futs) - (workers - RESERVED_WORKERS) and time.monotonic() < end:
            time.sleep(0.1)
        refused = [f for f in futs if f.done()]
        codes = {_code(f)[0] for f in refused}
        assert codes == {grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        open_now = len(futs) - len(refused)
        assert open_now == workers - RESERVED_WORKERS, open_now  # the cap in all, reached
        # a connection's streams past the 4th are refused at once, naming the per-caller limit
        details = {_code(f)[1] for f in refused}
        assert any("streams open, the most one caller may" in d for d in details), details
        # while they stay open: health, Control and Join answer, repeatedly, from the reserved
        # workers: no held stream ends meanwhile (none is idle 30 s), so none freed a worker for them
        hc = health_pb2_grpc.HealthStub(agg.channel)
        for _ in range(5):
            r = hc.Check(health_pb2.HealthCheckRequest(), timeout=RPC_BOUND)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
            agg.control.GetStatus(control_pb2.StatusRequest(), timeout=RPC_BOUND)
        reply = agg.fed.Join(federation_pb2.JoinRequest(
            agent_id="a0", agent_index=0, num_samples=10, obs_dim=2, act_dim=1, env_id="Hopper-v5",
            obs_moments=federation_pb2.ObsMoments(count=10, sum=[0, 0], sum_sq=[10, 10])), timeout=RPC_BOUND)
        assert reply.agent_id == "a0"
        assert sum(f.done() for f in futs) == len(refused), "a held stream ended before the calls were answered"
    finally:
        idle.close()
        for ch in chans:
            ch.close()
        agg.close()


def test_one_caller_cannot_hold_more_than_its_streams(tmp_path, idle):
    agg = Aggregator(tmp_path / "s", streams_per_identity=3, stream_idle_seconds=30)
    try:
        first = idle.open(agg.channel, 3)
        assert wait_for(lambda: agg.server.guard.open_streams == 3 or any(f.done() for f in first))
        assert not any(f.done() for f in first)
        (fourth,) = idle.open(agg.channel, 1)
        code, details = _code(fourth)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "3 streams open" in details, (code, details)
        other = own_connection(agg.target)  # another caller is not affected
        (theirs,) = idle.open(other, 1)
        assert wait_for(lambda: agg.server.guard.open_streams == 4 or theirs.done())
        assert not theirs.done()
        idle.close()
        other.close()
    finally:
        agg.close()


def test_unauthenticated_streams_are_refused_before_they_count(tmp_path, idle):
    auth = Authenticator(admin_token="admin-secret-0123456789", agent_tokens={"a0": "agent-secret-0123456789"})
    agg = Aggregator(tmp_path / "s", auth=auth, streams_per_identity=2, max_workers=16, stream_idle_seconds=30)
    try:
        anon = [own_connection(agg.target) for _ in range(10)]
        futs = [f for ch in anon for f in idle.open(ch, 5)]
        assert {_code(f)[0] for f in futs} == {grpc.StatusCode.UNAUTHENTICATED}
        # the agent's own streams still open
        ch = grpc.intercept_channel(own_connection(agg.target), TokenClientInterceptor("agent-secret-0123456789"))
        mine = idle.open(ch, 2)
        assert wait_for(lambda: agg.server.guard.open_streams == 2 or any(f.done() for f in mine))
        assert not any(f.done() for f in mine)
        for c in anon:
            c.close()
    finally:
        agg.close()


@pytest.mark.slow(reason="an agent trains past the stream's idle limit")
def test_a_session_agent_training_past_the_idle_limit_stays_connected_by_its_progress(
        tmp_path, agent_threads, stand_dataset, caplog):
    from .test_federation import run_config, status, wait_for

    agg = Aggregator(tmp_path / "s", stream_idle_seconds=1.0)
    try:
        agent_threads.start(agg.target, str(stand_dataset), 2, 2, seed=1, progress_seconds=0.2)
        wait_for(lambda: len(status(agg)["agents"]) == 2, what="agents to join")
        t0 = time.monotonic()
        agg.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(rounds=1, local_steps=800)),
                             timeout=10)
        seen = []

        def progressed():
            st = status(agg)
            seen.extend((a["steps_done"], a["steps_total"]) for a in st["agents"] if a["steps_total"])
            return st["state"] in ("finished", "failed", "stopped") and st

        st = wait_for(progressed, timeout=120, what="the run to end")
        assert st["state"] == "finished", st
        assert time.monotonic() - t0 > 2.0  # it did train for longer than the idle limit
        assert seen and all(0 <= d <= t == 800 for d, t in seen), seen[:5]
        wait_for(lambda: all(a.rounds_done == 1 for a in agent_threads.agents), timeout=20,
                 what="the agents to see their updates taken")
        assert not [r for r in caplog.records if "no message for" in r.getMessage()]  # no stream was ended
    finally:
        agent_threads.stop()
        agg.close()


def test_a_flood_of_long_polls_is_capped_and_health_status_and_join_still_answer(tmp_path):
    """NextTask long polls hold a worker each while they wait: 200 of them (as a joined agent,
    on 20 connections) took every worker of the aggregator and its main port stopped answering.
    They now count with the streams: past the cap they are refused at once, and health,
    GetStatus and Join answer while the polls held are still waiting (none freed a worker)."""
    workers, per_caller = 24, 4
    agg = Aggregator(tmp_path / "s", task_wait=20.0, max_workers=workers, streams_per_identity=per_caller)
    agg.fed.Join(federation_pb2.JoinRequest(
        agent_id="a0", agent_index=0, num_samples=100, obs_dim=11, act_dim=3, env_id="Hopper-v5",
        obs_moments=federation_pb2.ObsMoments(count=100, sum=[1.0] * 11, sum_sq=[2.0] * 11)), timeout=RPC_BOUND)
    chans = [own_connection(agg.target) for _ in range(20)]
    futs = []
    try:
        for ch in chans:
            poll = ch.unary_unary("/fedrl.v1.Federation/NextTask", request_serializer=None, response_deserializer=None)
            req = federation_pb2.TaskRequest(agent_id="a0", wait_seconds=20).SerializeToString()
            futs += [poll.future(req, timeout=30) for _ in range(10)]
        end = time.monotonic() + 20
        while sum(f.done() for f in futs) < len(futs) - (workers - RESERVED_WORKERS) and time.monotonic() < end:
            time.sleep(0.1)
        refused = [f for f in futs if f.done()]
        assert {_code(f)[0] for f in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert len(futs) - len(refused) <= workers - RESERVED_WORKERS
        h = health_pb2_grpc.HealthStub(agg.channel)
        assert h.Check(health_pb2.HealthCheckRequest(), timeout=RPC_BOUND).status == \
            health_pb2.HealthCheckResponse.SERVING
        agg.control.GetStatus(control_pb2.StatusRequest(), timeout=RPC_BOUND)
        agg.fed.Join(federation_pb2.JoinRequest(
            agent_id="a1", agent_index=1, num_samples=100, obs_dim=11, act_dim=3, env_id="Hopper-v5",
            obs_moments=federation_pb2.ObsMoments(count=100, sum=[1.0] * 11, sum_sq=[2.0] * 11)), timeout=RPC_BOUND)
        assert sum(f.done() for f in futs) == len(refused), "a held poll ended before the calls were answered"
    finally:
        for f in futs:
            f.cancel()
        for ch in chans:
            ch.close()
        agg.close()


def test_made_up_tokens_identify_nobody_where_tokens_are_not_checked(tmp_path, idle):
    """Without tokens, one connection sending a new made-up authorization header on each stream
    got past the per-caller limit; the connection is the caller there, whatever it claims."""
    per_caller = 4
    agg = Aggregator(tmp_path / "s", streams_per_identity=per_caller, stream_idle_seconds=30)
    ch = own_connection(agg.target)
    try:
        call = ch.stream_unary(SUBMIT, request_serializer=None, response_deserializer=None)

        def nothing():
            idle.release.wait(30)
            return
            yield

        futs = [call.future(nothing(), timeout=30, metadata=(("authorization", f"Bearer made-up-{i}"),))
                for i in range(12)]
        idle.futures += futs
        end = time.monotonic() + 10
        while sum(f.done() for f in futs) < 12 - per_caller and time.monotonic() < end:
            time.sleep(0.05)
        refused = [f for f in futs if f.done()]
        assert len(refused) == 12 - per_caller, len(refused)
        assert all("this caller has 4 streams open" in _code(f)[1] for f in refused)
    finally:
        idle.close()
        ch.close()
        agg.close()


def test_an_agent_refused_for_capacity_backs_off_and_comes_in_when_there_is_room(tmp_path, idle, stand_dataset,
                                                                                 caplog):
    """Every stream slot taken by idle streams (a flood, without tokens): a real agent's Session
    is refused with RESOURCE_EXHAUSTED; it retries with backoff (it used to exit, 'giving up')
    and takes part once the slots free."""
    from .conftest import AgentThreads

    workers = 12
    agg = Aggregator(tmp_path / "s", max_workers=workers, streams_per_identity=100, stream_idle_seconds=30)
    agents = AgentThreads()
    try:
        flood = own_connection(agg.target)
        idle.open(flood, workers)  # more than the streams' share of the workers
        end = time.monotonic() + 10
        while agg.server.guard.open_streams < agg.server.guard.total and time.monotonic() < end:
            time.sleep(0.05)
        with caplog.at_level("WARNING"):
            agents.start(agg.target, str(stand_dataset), 1, 2, seed=1)
            end = time.monotonic() + 20
            while not any("RESOURCE_EXHAUSTED" in r.getMessage() for r in caplog.records) and time.monotonic() < end:
                time.sleep(0.05)
        assert any("RESOURCE_EXHAUSTED" in r.getMessage() and "retrying" in r.getMessage() for r in caplog.records)
        assert agents.threads[0].is_alive()  # it did not give up
        idle.close()  # the flood ends: room again
        end = time.monotonic() + 30
        while not agg.coord.status()["agents"] or not agg.coord.status()["agents"][0]["connected"]:
            assert time.monotonic() < end, "the agent never came in"
            time.sleep(0.1)
        flood.close()
    finally:
        agents.stop()
        agg.close()


def test_an_agent_kept_out_for_capacity_backs_off_although_its_joins_succeed(tmp_path, idle, stand_dataset):
    """Joins go through (they have reserved workers) while the task streams after them are refused
    for capacity: the agent's retries still back off (a successful Join used to reset the delay to
    0.2 s, and two agents made 356 retries in 40 s)."""
    from .conftest import AgentThreads

    workers = 12
    agg = Aggregator(tmp_path / "s", max_workers=workers, streams_per_identity=100, stream_idle_seconds=30)
    agents = AgentThreads()
    try:
        flood = own_connection(agg.target)
        idle.open(flood, workers)
        end = time.monotonic() + 10
        while agg.server.guard.open_streams < agg.server.guard.total and time.monotonic() < end:
            time.sleep(0.05)
        joins = []
        real = agg.coord.join

        def counted(*a, **kw):
            joins.append(time.monotonic())
            return real(*a, **kw)

        agg.coord.join = counted
        agents.start(agg.target, str(stand_dataset), 1, 2, seed=1, backoff_initial=0.2, backoff_max=10.0)  # the defaults
        time.sleep(8.0)
        # doubling from 0.2 s (each wait 0.5-1.5x): at most ~7 attempts in 8 s; without backoff ~40
        gaps = [round(b - a, 2) for a, b in zip(joins, joins[1:])]
        assert 2 <= len(joins) <= 8, f"{len(joins)} joins in 8 s, gaps {gaps}"
        assert agents.threads[0].is_alive()
        flood.close()
    finally:
        agents.stop()
        agg.close()


@pytest.mark.parametrize("asked", [float("nan"), -1.0, 0.0])
def test_a_sessions_wait_heartbeats_come_at_most_once_a_second_whatever_its_hello_asks(tmp_path, asked):
    """An idle Session is sent a WAIT task at most every SESSION_MIN_WAIT seconds. A hello asking
    to wait NaN seconds passed ``max(nan, 1.0)`` as NaN, the wait became 0 and the stream sent WAITs
    in a hot loop (13,488 in 2 s, a core of the aggregator's for one agent). Timed from below: a
    loaded machine only makes the heartbeats later."""
    from aggregator_service.servicer import SESSION_MIN_WAIT
    from tests.service.test_federation import join

    agg = Aggregator(tmp_path / "state")
    release = threading.Event()

    def messages():
        yield federation_pb2.SessionMessage(hello=federation_pb2.TaskRequest(agent_id="a0", wait_seconds=asked))
        release.wait(60)

    call = None
    try:
        join(agg, "a0", 0)
        call = agg.fed.Session(messages(), timeout=60)
        t0 = time.monotonic()
        tasks = [next(call) for _ in range(3)]
        elapsed = time.monotonic() - t0
        assert all(t.kind == federation_pb2.Task.WAIT for t in tasks)
        assert elapsed >= 3 * SESSION_MIN_WAIT * 0.95, f"3 WAITs in {elapsed:.3f} s"
    finally:
        release.set()
        if call is not None:
            call.cancel()
        agg.close()
