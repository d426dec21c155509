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
from tests.service.test_federation import RPC_BOUND


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


def _tamper(monkeypatch, step: str, change, rounds=(1,)):
    """agent-2 sends ``change(message, task)`` in place of its ``step`` message of ``rounds``;
    returns the status codes its tampered calls were answered with."""
    from agent_service.secure import SecureSteps

    call, codes = SecureSteps._call, []

    class Recording:  # the stub, with the status of each refused call recorded
        def __init__(self, stub):
            self.stub = stub

        def SecureAggregation(self, *a, **k):  # noqa: N802 - the RPC's name
            try:
                return self.stub.SecureAggregation(*a, **k)
            except grpc.RpcError as e:
                codes.append(e.code())
                raise

    def tampering(self, stub, task, **kw):
        if self.agent_id == "agent-2" and step in kw and task.round in rounds:
            kw[step] = change(kw[step], task)
            return call(self, Recording(stub), task, **kw)
        return call(self, stub, task, **kw)

    monkeypatch.setattr(SecureSteps, "_call", tampering)
    return codes


def _secure_run(aggregator, agent_threads, data, deadline, rounds=1, **cfg):
    agent_threads.start(aggregator.target, str(data), 3, 2, seed=7, share_moments=False)
    wait_for(lambda: len(status(aggregator)["agents"]) == 3, what="agents to join")
    start(aggregator, agents=3, rounds=rounds, secagg_threshold=2, algo="fed-bc", round_timeout=deadline, **cfg)
    done = ended(aggregator)
    assert all(t.is_alive() for t in agent_threads.threads)  # a refused step ends no agent, hostile or not
    return done


def _key(name, value):
    def change(msg, task):
        k = type(msg)()
        k.CopyFrom(msg)
        setattr(k, name, value(msg))
        return k
    return change


@pytest.mark.parametrize("change", [
    _key("mask_key", lambda m: bytes(32)),  # the point of order 1 (x = 0)
    _key("share_key", lambda m: (1).to_bytes(32, "little")),  # x = 1: order 4, every agreement zero
    _key("share_key", lambda m: m.mask_key),  # one key twice
], ids=["zero-key", "small-order-key", "repeated-key"])
def test_a_key_that_is_no_usable_point_or_repeats_is_refused_at_its_step(step_deadline, aggregator, agent_threads, stand_dataset,
                                                                         monkeypatch, one_thread, change):
    """The keys step refuses it (INVALID_ARGUMENT), so that no mask or share's key is made of it;
    the round goes on with the two honest agents (the threshold)."""
    codes = _tamper(monkeypatch, "keys", change)
    done = _secure_run(aggregator, agent_threads, stand_dataset, step_deadline)
    assert codes and set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}, codes
    assert done["state"] == "finished", done["message"]
    closed = [e for e in aggregator.store.read_run(done["run_id"])["events"] if e["kind"] == "ROUND_CLOSED"]
    assert sorted(closed[-1]["agents"]) == ["agent-0", "agent-1"]
    assert unknown_answers(aggregator) == 0


def _sealed(make):
    def change(msg, task):
        from fedrl.proto.v1 import federation_pb2

        return federation_pb2.SecAggShares(sealed={a: make(b) for a, b in msg.sealed.items()})
    return change


@pytest.mark.parametrize("make", [lambda b: b"", lambda b: b[:-1], lambda b: b + b"\0"], ids=["empty", "short", "long"])
def test_a_sealed_share_not_of_its_length_is_refused_at_its_step(step_deadline, aggregator, agent_threads, stand_dataset,
                                                                 monkeypatch, one_thread, make):
    codes = _tamper(monkeypatch, "shares", _sealed(make))
    done = _secure_run(aggregator, agent_threads, stand_dataset, step_deadline)
    assert codes and set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}, codes
    assert done["state"] == "finished", done["message"]
    assert unknown_answers(aggregator) == 0


def test_a_sender_whose_sealed_shares_do_not_open_is_left_out_and_the_sum_is_the_others(step_deadline,
        aggregator, agent_threads, stand_dataset, monkeypatch, one_thread, caplog):
    """agent-2 seals right-length random bytes where its shares belong: the aggregator cannot
    tell (it cannot open them), its peers can. They name it with their masked vectors, it is
    excluded, and their pairwise seeds with it unmask the others' sum: the round's unmasked sum is
    agent-0's and agent-1's vectors' ring sum, exactly, and the run finishes."""
    import os

    import numpy as np

    from fedrl.federation.secagg import AgentSession, ServerSession

    plain, totals = {}, {}
    masked_input, finish = AgentSession.masked_input, ServerSession.finish

    def recording(self, x, shared):
        plain[(self.id, self.params.context)] = np.array(x, dtype=np.uint64)
        return masked_input(self, x, shared)

    def summed(self, answers, check=None):
        totals[self.params.context] = out = finish(self, answers, check)
        return out

    monkeypatch.setattr(AgentSession, "masked_input", recording)
    monkeypatch.setattr(ServerSession, "finish", summed)
    codes = _tamper(monkeypatch, "shares", _sealed(lambda b: os.urandom(len(b))))
    done = _secure_run(aggregator, agent_threads, stand_dataset, step_deadline)
    assert not codes  # nothing the aggregator could refuse
    assert done["state"] == "finished", done["message"]
    closed = [e for e in aggregator.store.read_run(done["run_id"])["events"] if e["kind"] == "ROUND_CLOSED"]
    assert sorted(closed[-1]["agents"]) == ["agent-0", "agent-1"]
    ctx = f"{done['run_id']}/1".encode()
    assert np.array_equal(totals[ctx], plain[("agent-0", ctx)] + plain[("agent-1", ctx)])
    assert "the shares of agent-2 opened for fewer than the threshold" in caplog.text
    assert unknown_answers(aggregator) == 0


def _answer(change_share):
    def change(msg, task):
        from fedrl.proto.v1 import federation_pb2

        return federation_pb2.SecAggAnswer(shares={a: change_share(s) for a, s in msg.shares.items()})
    return change


def test_an_answer_at_another_agents_point_is_refused_and_the_sum_is_made_without_it(step_deadline,
        aggregator, agent_threads, stand_dataset, monkeypatch, one_thread):
    from fedrl.proto.v1 import federation_pb2

    codes = _tamper(monkeypatch, "answer", _answer(lambda s: federation_pb2.SecAggShare(
        point=1 if s.point != 1 else 2, share=s.share)))
    done = _secure_run(aggregator, agent_threads, stand_dataset, step_deadline)
    assert codes and set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}, codes
    assert done["state"] == "finished", done["message"]
    assert unknown_answers(aggregator) == 0


@pytest.mark.parametrize("share", [lambda s: bytes(16), lambda s: bytes(b ^ 1 for b in s)], ids=["zeros", "flipped"])
def test_an_answer_off_the_polynomial_is_left_out_and_the_version_is_the_honest_one(step_deadline,
        aggregator, agent_threads, stand_dataset, monkeypatch, one_thread, tmp_path, share, caplog):
    """agent-2 answers the unmasking with shares that fit no polynomial (accepted: only their sum
    can tell). Three answers for a threshold of 2: the aggregator leaves out the set that does not
    check out, says whose, and stores the version of the honest run, bit for bit."""
    import torch

    from fedrl.proto.v1 import federation_pb2
    from tests.service.test_secure_aggregation import _sim

    _tamper(monkeypatch, "answer", _answer(lambda s: federation_pb2.SecAggShare(point=s.point, share=share(s.share))))
    done = _secure_run(aggregator, agent_threads, stand_dataset, step_deadline)
    assert done["state"] == "finished", done["message"]
    assert "the unmasking shares of agent-2 do not fit the others'" in caplog.text
    honest = SecAggRun.honest_version(tmp_path, stand_dataset)
    stored = aggregator.store.load_version(done["run_id"], 1)
    assert stored.keys() == honest.keys() and all(torch.equal(stored[k], honest[k]) for k in stored)


class SecAggRun:
    @staticmethod
    def honest_version(tmp_path, data):
        """Version 1 of the same secure run with every agent honest (the simulation's)."""
        from fedrl.federation.simulate import SimConfig
        from fedrl.federation.simulate import run as simulate
        from tests.service.test_federation import SMALL, SMALL_BC

        states = {}
        simulate(SimConfig(algo="fed-bc", datasets=(str(data),), agents=3, trajectories=2, rounds=1, local_steps=3,
                           eval_episodes=0, seed=7, device="cpu", drpo=SMALL, bc=SMALL_BC, secagg_threshold=2),
                 tmp_path / "sim", log=lambda m: None, on_round=lambda r, s: states.__setitem__(r, s))
        return states[1]


def test_a_replayed_masked_vector_is_refused(step_deadline, aggregator, agent_threads, stand_dataset, monkeypatch, one_thread):
    """agent-2 sends its round-1 masked vector again in round 2: refused at the step (its masks
    were for round 1 and would not cancel); round 2 is made without agent-2, and is finite."""
    import torch

    kept = {}

    def replay(msg, task):
        if task.round == 1:
            kept["v"] = bytes(msg.vector)
            return msg
        out = type(msg)()
        out.CopyFrom(msg)
        out.vector = kept["v"]
        return out

    codes = _tamper(monkeypatch, "masked", replay, rounds=(1, 2))
    done = _secure_run(aggregator, agent_threads, stand_dataset, step_deadline, rounds=2)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT], codes
    assert done["state"] == "finished", done["message"]
    closed = [e for e in aggregator.store.read_run(done["run_id"])["events"] if e["kind"] == "ROUND_CLOSED"]
    assert sorted(closed[0]["agents"]) == ["agent-0", "agent-1", "agent-2"]
    assert sorted(closed[1]["agents"]) == ["agent-0", "agent-1"]
    v2 = aggregator.store.load_version(done["run_id"], 2)
    assert all(torch.isfinite(t).all() for t in v2.values())
    assert unknown_answers(aggregator) == 0


def test_a_dp_runs_first_epsilon_is_computed_off_the_lock(aggregator, monkeypatch):
    """StartRun computes a DP run's privacy once before it takes the coordinator's lock (the
    accountant's first call imports it: seconds at load); meanwhile other calls are answered."""
    import threading

    import aggregator_service.lifecycle as lifecycle

    inside, release, real = threading.Event(), threading.Event(), lifecycle.privacy_spent

    def slow(*a, **k):
        inside.set()
        release.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(lifecycle, "privacy_spent", slow)
    t = threading.Thread(target=start, args=(aggregator,), kwargs=dict(dp_clip=1.0, dp_noise=1.1), daemon=True)
    t.start()
    try:
        assert inside.wait(30)
        assert not status(aggregator)["run_id"]  # answered (under the lock it would time out): no run yet
    finally:
        release.set()
        t.join(30)
    assert status(aggregator)["state"] == "waiting_for_agents"


def test_settings_the_accountant_cannot_take_are_refused_at_start_run(aggregator, monkeypatch):
    import aggregator_service.lifecycle as lifecycle

    def overflow(*a, **k):
        raise OverflowError(34, "Numerical result out of range")

    monkeypatch.setattr(lifecycle, "privacy_spent", overflow)
    with pytest.raises(grpc.RpcError) as e:
        start(aggregator, dp_clip=1.0, dp_noise=1.1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "privacy accountant" in e.value.details()
    assert unknown_answers(aggregator) == 0


def _learned_delta(agg, run_id, v=1):
    """Version v minus version 0 over the learned tensors, as one float64 vector."""
    import torch

    from fedrl.federation.privacy import learned

    a, b = agg.store.load_version(run_id, v), agg.store.load_version(run_id, 0)
    return torch.cat([(a[k].double() - b[k].double()).reshape(-1) for k in sorted(a) if learned(k)])


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-clip", "adaptive-clip"])
def test_a_secure_dp_run_through_the_agent_service_carries_its_clip_and_its_noise(aggregator, agent_threads,
                                                                                  stand_dataset, one_thread,
                                                                                  adaptive):
    """Each agent (the agent service's own code) clips its update to the round's norm C and adds
    N(0, (sigma_u C)^2 / t) before masking: without noise the round's change is within C (the
    unclipped change is larger); with it, the change's std per value is sigma_u C / sqrt(t n)
    (uniform weights 1/n), within the sampling error of its ~1,700 values."""
    import math

    from fedrl.federation.privacy import update_noise

    c, t, n = 1e-4, 2, 3
    extra = {"dp_clip_quantile": 0.5, "dp_count_noise": 1.0} if adaptive else {}
    agent_threads.start(aggregator.target, str(stand_dataset), n, 2, seed=7, share_moments=False)
    wait_for(lambda: len(status(aggregator)["agents"]) == n, what="agents to join")
    runs = {}
    for noise in (0.0, 1.0):
        if noise == 0.0 and adaptive:
            kw = {"dp_clip_quantile": 0.5}  # adaptive clipping without noise: no count noise either
        else:
            kw = extra
        start(aggregator, agents=n, rounds=1, secagg_threshold=t, algo="fed-bc", dp_clip=c, dp_noise=noise, **kw)
        done = ended(aggregator)
        assert done["state"] == "finished", done["message"]
        runs[noise] = _learned_delta(aggregator, done["run_id"])
    start(aggregator, agents=n, rounds=1, secagg_threshold=t, algo="fed-bc")
    plain = _learned_delta(aggregator, ended(aggregator)["run_id"])
    assert float(plain.norm()) > 10 * c  # the clip has work to do
    assert float(runs[0.0].norm()) <= c * (1 + 1e-3)
    sigma_u = update_noise(1.0, 1.0) if adaptive else 1.0
    want, got = sigma_u * c / math.sqrt(t * n), float(runs[1.0].std())
    assert runs[1.0].numel() > 1000 and abs(got / want - 1) < 0.1, (got, want)


def _unchanged_updates(agg, run_id, agents, round_=1, base=0):
    """``agents`` each send the global model back unchanged (a zero update) for ``round_``."""
    from fedrl.wire.codec import encode

    g = agg.coord.run.global_state
    m = encode(g, run_id, round_, base, 100).manifest
    for a in agents:
        agg.coord.submit(a, m, g, {}, 0.0)


def test_a_round_closed_at_its_deadline_by_a_quorum_gets_the_noise_the_accountant_assumes(aggregator):
    """Central DP, 3 agents, a quorum of 2: two send zero updates and the round closes at its
    deadline. The accountant assumes noise of std sigma C on the sum of the updates taken, so
    sigma C / 2 on their average: the new version's change, all noise, has that std per value."""
    import math

    from tests.service.test_federation import join

    for i in range(3):
        join(aggregator, f"a{i}", i)
    sigma, c = 1.1, 1e-3
    run_id = start(aggregator, agents=3, min_agents=2, rounds=1, round_timeout=0.5, dp_clip=c, dp_noise=sigma,
                   obs_norm="none")["run_id"]
    _unchanged_updates(aggregator, run_id, ["a0", "a1"])
    done = ended(aggregator)
    assert done["state"] == "finished", done["message"]
    closed = [e for e in aggregator.store.read_run(run_id)["events"] if e["kind"] == "ROUND_CLOSED"]
    assert closed[0]["agents"] == ["a0", "a1"]
    d = _learned_delta(aggregator, run_id)
    want = sigma * c / 2
    assert d.numel() > 1000 and abs(float(d.std()) / want - 1) < 0.1 and abs(float(d.mean())) < 5 * want / math.sqrt(d.numel())


@pytest.mark.parametrize("delta", [1e-3, 1e-7])
def test_dp_delta_reaches_the_round_records_and_the_budget_stop(aggregator, delta):
    """The epsilon each ROUND_CLOSED carries, and the budget's stop, are at the run's own delta."""
    from fedrl.federation.privacy import PRIVACY_EPSILON, epsilon
    from tests.service.test_federation import join

    for i in range(2):
        join(aggregator, f"a{i}", i)
    sigma = 1.1
    budget = (epsilon(sigma, 2, delta) + epsilon(sigma, 3, delta)) / 2  # room for 2 rounds, not 3
    run_id = start(aggregator, rounds=5, dp_clip=1.0, dp_noise=sigma, dp_delta=delta, dp_epsilon_budget=budget,
                   obs_norm="none")["run_id"]
    for r in (1, 2):
        _unchanged_updates(aggregator, run_id, ["a0", "a1"], round_=r, base=r - 1)
    done = ended(aggregator)
    assert done["state"] == "stopped" and f"delta {delta:g}" in done["message"], done
    events = aggregator.store.read_run(run_id)["events"]
    spent = [e["metrics"][PRIVACY_EPSILON] for e in events if e["kind"] == "ROUND_CLOSED"]
    assert spent == [pytest.approx(epsilon(sigma, r, delta), rel=1e-12) for r in (1, 2)]


@pytest.mark.parametrize("how", ["stream", "inline"])
def test_an_update_that_arrives_after_stop_run_makes_no_version(aggregator, how):
    """Over each call an update travels by: taken before StopRun, refused after it
    (FAILED_PRECONDITION), and no version is made of either. (A Session stream is given STOP
    after StopRun: it has no task to answer.)"""
    from tests.service.test_federation import join, submit

    for i in range(2):
        join(aggregator, f"a{i}", i)
    run_id = start(aggregator, rounds=3, obs_norm="none")["run_id"]
    g = aggregator.coord.run.global_state
    submit(aggregator, "a0", g, run_id, inline=True)
    aggregator.control.StopRun(control_pb2.StopRunRequest(reason="test"), timeout=RPC_BOUND)
    with pytest.raises(grpc.RpcError) as e:
        submit(aggregator, "a1", g, run_id, inline=how == "inline")
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value
    assert aggregator.store.versions(run_id) == [0] and status(aggregator)["state"] == "stopped"
    assert unknown_answers(aggregator) == 0


def test_no_accountant_call_runs_under_the_coordinators_lock(aggregator, monkeypatch):
    """A DP run with a budget over six rounds: every epsilon a close or a budget check asks for
    was computed ahead, off the lock (StartRun, then the clock); under the lock they are read."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    from fedrl.federation.privacy import epsilon
    from tests.service.test_federation import join

    epsilon.cache_clear()
    held, real = [], rdp.RdpAccountant.get_epsilon
    lock = aggregator.coord.shared.cond

    def recording(self, *a, **k):
        held.append(lock._is_owned())
        return real(self, *a, **k)

    monkeypatch.setattr(rdp.RdpAccountant, "get_epsilon", recording)
    import aggregator_service.ticker as ticker_mod

    warmed, warm = set(), ticker_mod.warm_epsilon
    monkeypatch.setattr(ticker_mod, "warm_epsilon", lambda cfg, r: (warm(cfg, r), warmed.add(r)))
    for i in range(2):
        join(aggregator, f"a{i}", i)
    run_id = start(aggregator, rounds=6, dp_clip=1.0, dp_noise=1.1, dp_epsilon_budget=100.0, obs_norm="none")["run_id"]
    for r in range(1, 7):
        # the clock warms round r's values once the round is open (a tick is 20 ms here)
        wait_for(lambda: aggregator.coord.status()["round"] == r and r in warmed, what=f"round {r}'s epsilon ahead of its close")
        _unchanged_updates(aggregator, run_id, ["a0", "a1"], round_=r, base=r - 1)
    assert ended(aggregator)["state"] == "finished"
    assert held and not any(held), held  # computed, and never with the lock held
