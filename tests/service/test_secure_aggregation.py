"""Secure aggregation through the services (issue 64): a real aggregator on loopback and the
agent service's own code, each round's update sent masked (SecureAggregation), never in the
clear, and the observation moments too (a MOMENTS task, round 0: the agents send none at Join).
The stored versions are the simulation's under the same protocol bit for bit; an agent that
stops after masking is recovered; one gone before masking is left out; below the threshold the
run fails, saying so, and no version is stored."""

from __future__ import annotations

import grpc
import pytest
import torch

from fedrl.federation.round import RoundInterrupted
from fedrl.data.normalize import ObsStats
from fedrl.federation.simulate import SimConfig, load_shards, secure_normalizer
from fedrl.federation.simulate import run as simulate
from fedrl.proto.v1 import control_pb2
from fedrl.wire.serde import status_from_proto
from tests.service.test_federation import SMALL, SMALL_BC, one_thread, run_config, status, wait_for  # noqa: F401
from tests.service.test_federation import RPC_BOUND


def _start(aggregator, agent_threads, data, n, session=True, **cfg):
    agents = agent_threads.start(aggregator.target, str(data), n, 2, seed=7, session=session, share_moments=False)
    wait_for(lambda: len(status(aggregator)["agents"]) == n, what="agents to join")
    st = status_from_proto(aggregator.control.StartRun(
        control_pb2.StartRunRequest(config_json=run_config(agents=n, **cfg)), timeout=RPC_BOUND))
    assert st["state"] == "running", st
    return agents, st["run_id"]


def _stop_at(agent, step: str, round_: int = 1):
    """``agent`` stops (as if killed) when it is about to send ``step`` of round ``round_`` (0:
    the observation moments')."""
    call = agent.secure._call

    def stopping(stub, task, **kw):
        if step in kw and task.round == round_:
            agent.stop()
            raise RoundInterrupted(f"stopped before {step}")
        return call(stub, task, **kw)

    agent.secure._call = stopping


def _sim(tmp_path, data, n, rounds, t, drops=None):
    states = {}
    simulate(SimConfig(algo="drpo", datasets=(str(data),), agents=n, trajectories=2, rounds=rounds, local_steps=3,
                       eval_episodes=0, seed=7, device="cpu", drpo=SMALL, bc=SMALL_BC, secagg_threshold=t),
             tmp_path / "sim", log=lambda m: None, on_round=lambda r, s: states.__setitem__(r, s), secure_drops=drops)
    return states


def test_a_secure_run_equals_the_simulation_under_the_same_protocol(aggregator, agent_threads, stand_dataset,
                                                                     tmp_path, one_thread, monkeypatch):
    """The ring sum does not depend on the masks: the service's versions are the simulation's
    bits. No update travelled in the clear (no SubmitUpdate of either kind was taken), and what
    the aggregator received of an agent looks uniform (a chi-square test of its bytes) and is
    uncorrelated with the model it carries."""
    import numpy as np

    from fedrl.federation.secagg import SecAggParams, quantize
    from fedrl.federation.secure_steps import SecureSteps

    seen, sent_metrics = {}, []
    take = SecureSteps._take_masked

    def recording(self, agent_id, msg):
        seen.setdefault((agent_id, self.params.context), bytes(msg.vector))
        sent_metrics.append(msg.sent_metrics)
        return take(self, agent_id, msg)

    monkeypatch.setattr(SecureSteps, "_take_masked", recording)
    sim = _sim(tmp_path, stand_dataset, 3, 2, 2)
    _, run_id = _start(aggregator, agent_threads, stand_dataset, 3, session=False, rounds=2, secagg_threshold=2)
    done = wait_for(lambda: (s := status(aggregator))["state"] in ("finished", "failed") and s, what="run to end")
    assert done["state"] == "finished", done["message"]
    assert all(a.stats is None for a in aggregator.coord.agents.values())  # no moments in the clear
    v0 = aggregator.store.load_version(run_id, 0)
    shards, _ = load_shards([str(stand_dataset)], 3, 2, 7, None, lambda m: None)
    cfg = SimConfig(algo="drpo", datasets=(str(stand_dataset),), agents=3, secagg_threshold=2)
    mean, std = secure_normalizer(cfg, [ObsStats.of(sh.transitions.obs) for sh in shards])[0]
    norm = {k: v for k, v in v0.items() if k.endswith(("obs_mean", "obs_std"))}  # the policy's normaliser
    assert norm and all(torch.equal(v, torch.from_numpy(mean if k.endswith("mean") else std)) for k, v in norm.items())
    for v in (1, 2):
        stored = aggregator.store.load_version(run_id, v)
        for k in stored:
            assert torch.equal(stored[k], sim[v][k]), f"version {v}: {k} differs"
    taken = sum(aggregator.metrics.registry.get_sample_value("grpc_server_handled_total", {
        "grpc_type": kind, "grpc_service": "fedrl.v1.Federation", "grpc_method": m, "grpc_code": "OK"}) or 0
        for m, kind in (("SubmitUpdate", "client_stream"), ("SubmitUpdateInline", "unary")))
    assert taken == 0
    assert aggregator.metrics.registry.get_sample_value("grpc_server_handled_total", {
        "grpc_type": "unary", "grpc_service": "fedrl.v1.Federation", "grpc_method": "SecureAggregation",
        "grpc_code": "OK"}) >= 3 * 2 * 4
    ours = [k for k in seen if k[1].startswith(run_id.encode())]  # the simulation's own go through the machine too
    assert len(ours) == 3 * 3  # the moments and two rounds, from each agent
    # no agent's round metrics (statistics of its data) came in the clear, and none were recorded
    assert sent_metrics and not any(sent_metrics), sent_metrics
    closes = [e for e in aggregator.coord.run.events if e["kind"] == "ROUND_CLOSED"]
    assert len(closes) == 2 and all(not e["metrics"] for e in closes), closes
    obs_dim = len(mean)
    assert len(seen[("agent-0", f"{run_id}/0".encode())]) == 8 * (2 * obs_dim + 1)
    y = np.frombuffer(seen[("agent-0", f"{run_id}/1".encode())], dtype="<u8")
    counts = np.bincount(y.view(np.uint8), minlength=256)
    expected = y.nbytes / 256
    assert float(((counts - expected) ** 2 / expected).sum()) < 380  # 255 dof: P(> 380) < 1e-6
    v1 = aggregator.store.load_version(run_id, 1)
    x = quantize(np.concatenate([v1[k].double().reshape(-1).numpy() for k in sorted(v1)] + [np.ones(1)]) / 3,
                 SecAggParams(threshold=2, context=b""))  # about what agent-0 masked: a third of the average
    corr = np.corrcoef((y >> np.uint64(11)).astype(float), (x >> np.uint64(11)).astype(float))[0, 1]
    # uncorrelated: |corr| of n independent pairs is about N(0, 1/n); 5 / sqrt(n) fails one run in
    # ~2 million by chance (0.05 failed one in 25 at this model's ~1,700 values); unmasked, corr is 1
    assert abs(corr) < 5 / np.sqrt(len(y)), (corr, len(y))


def test_an_agent_that_stops_after_masking_is_recovered(step_deadline, aggregator, agent_threads, stand_dataset, tmp_path,
                                                       one_thread):
    """agent-2 sends its masked update and stops before answering: the others' answers (2, the
    threshold) rebuild its self mask, and its update is in the round's average, as in the
    simulation where nobody stops."""
    sim = _sim(tmp_path, stand_dataset, 3, 1, 2)
    agents, run_id = _start(aggregator, agent_threads, stand_dataset, 3, rounds=1, secagg_threshold=2,
                            round_timeout=step_deadline)
    _stop_at(agents[2], "answer")
    done = wait_for(lambda: (s := status(aggregator))["state"] in ("finished", "failed") and s, what="run to end")
    assert done["state"] == "finished", done["message"]
    stored = aggregator.store.load_version(run_id, 1)
    for k in stored:
        assert torch.equal(stored[k], sim[1][k]), k


def test_an_agent_gone_before_masking_is_left_out(step_deadline, aggregator, agent_threads, stand_dataset, tmp_path,
                                                  one_thread):
    """agent-2 shares its keys and stops before masking: the masked step closes at its deadline
    without it, and the version is the survivors' weighted average, bit for bit the simulation's
    with the same dropout (the same round machine, every agent's side played in one process)."""
    sim = _sim(tmp_path, stand_dataset, 3, 1, 2, drops={1: [2]})
    agents, run_id = _start(aggregator, agent_threads, stand_dataset, 3, rounds=1, secagg_threshold=2,
                            round_timeout=step_deadline)
    _stop_at(agents[2], "masked")
    done = wait_for(lambda: (s := status(aggregator))["state"] in ("finished", "failed") and s, what="run to end")
    assert done["state"] == "finished", done["message"]
    closed = [e for e in aggregator.store.read_run(run_id)["events"] if e["kind"] == "ROUND_CLOSED"]
    assert [e["agents"] for e in closed] == [["agent-0", "agent-1"]]
    stored = aggregator.store.load_version(run_id, 1)
    for k in stored:
        assert torch.equal(stored[k], sim[1][k]), k


def test_adaptive_clipping_under_the_masks_moves_the_norm_from_the_agents_summed_bits(aggregator, agent_threads,
                                                                                     stand_dataset, one_thread,
                                                                                     monkeypatch):
    """Each agent clips its update to the norm its task gives and sums its centred bit with its
    model under the masks: the aggregator's masked vectors carry one value more, and the norm
    moves by the share the sum gives (every update within a norm of 1e3: the share is 1)."""
    import math

    from fedrl.federation.secure_steps import SecureSteps

    lengths = []
    take = SecureSteps._take_masked
    monkeypatch.setattr(SecureSteps, "_take_masked",
                        lambda self, a, msg: (lengths.append((self.size, len(msg.vector))), take(self, a, msg))[1])
    _, run_id = _start(aggregator, agent_threads, stand_dataset, 3, rounds=2, secagg_threshold=2, algo="fed-bc",
                       dp_clip=1e3, dp_clip_quantile=0.5, dp_clip_lr=0.5)
    done = wait_for(lambda: (s := status(aggregator))["state"] in ("finished", "failed") and s, what="run to end")
    assert done["state"] == "finished", done["message"]
    closed = [e["metrics"] for e in aggregator.store.read_run(run_id)["events"] if e["kind"] == "ROUND_CLOSED"]
    assert [c["dp_clip"] for c in closed] == [1e3, pytest.approx(1e3 * math.exp(-0.25))]
    assert all(c["dp_unclipped_fraction"] == pytest.approx(1.0, abs=1e-8) for c in closed)
    numel = sum(t.numel() for t in aggregator.store.load_version(run_id, 1).values())
    rounds = [(size, n) for size, n in lengths if size == numel + 1]  # the moments' round 0 is its own size
    assert len(rounds) == 2 * 3 and all(n == 8 * (numel + 2) for _, n in rounds)


def test_an_agent_whose_task_gives_no_norm_sits_the_round_out_and_the_others_close_it(step_deadline, aggregator, agent_threads,
                                                                                      stand_dataset, one_thread,
                                                                                      caplog, monkeypatch):
    """Adaptive clipping under the masks, one agent's tasks without the round's norm (as from an
    aggregator too old to send it): that agent trains nothing, says why, and stays up; the round
    closes with the two others (the threshold is 2)."""
    from agent_service.client import Agent

    train, trained = Agent._train, []

    def without_norm(self, stub, task, *a, **k):
        if self.cfg.agent_id != "agent-2":
            return train(self, stub, task, *a, **k)
        task.dp_clip = 0.0
        trained.append(train(self, stub, task, *a, **k))
        return trained[-1]

    monkeypatch.setattr(Agent, "_train", without_norm)
    agents, run_id = _start(aggregator, agent_threads, stand_dataset, 3, rounds=1, secagg_threshold=2,
                            algo="fed-bc", dp_clip=1e3, dp_clip_quantile=0.5, dp_clip_lr=0.5, round_timeout=step_deadline)
    done = wait_for(lambda: (s := status(aggregator))["state"] in ("finished", "failed") and s, what="run to end")
    assert done["state"] == "finished", done["message"]
    closed = [e for e in aggregator.store.read_run(run_id)["events"] if e["kind"] == "ROUND_CLOSED"]
    assert len(closed) == 1 and sorted(closed[0]["agents"]) == ["agent-0", "agent-1"], closed
    # the aggregator offers it the round's task until the round closes (at its deadline): one refusal logged,
    # and the offers taken no faster than its long poll (1 s here), never a tight loop
    assert set(trained) == {None} and len(trained) <= 8, len(trained)
    assert caplog.text.count("round 1: no part in the secure aggregation: round 1's task gives no clipping "
                             "norm") == 1
    assert agent_threads.threads[2].is_alive()  # it waits for the next task; it did not crash


def test_an_agent_that_refuses_a_secure_step_does_not_train_that_round_again(step_deadline, aggregator, agent_threads,
                                                                              stand_dataset, one_thread, caplog,
                                                                              monkeypatch):
    """An agent whose secure steps end in a refusal (a step of the protocol it must refuse) is
    offered the round's task again until the round closes: it trains the round once, not once an
    offer, and the two others close the round."""
    from agent_service.secure import SecureSteps
    from fedrl.federation.secagg import SecAggError

    update, refused = SecureSteps.update, []

    def refusing(self, stub, task, rc, res):
        if self.agent_id != "agent-2":
            return update(self, stub, task, rc, res)
        refused.append(task.round)
        raise SecAggError("a refusal of this test's")

    monkeypatch.setattr(SecureSteps, "update", refusing)
    _, run_id = _start(aggregator, agent_threads, stand_dataset, 3, rounds=1, secagg_threshold=2, algo="fed-bc",
                       round_timeout=step_deadline)
    done = wait_for(lambda: (s := status(aggregator))["state"] in ("finished", "failed") and s, what="run to end")
    assert done["state"] == "finished", done["message"]
    closed = [e for e in aggregator.store.read_run(run_id)["events"] if e["kind"] == "ROUND_CLOSED"]
    assert len(closed) == 1 and sorted(closed[0]["agents"]) == ["agent-0", "agent-1"], closed
    assert refused == [1], refused
    assert caplog.text.count("round 1: no part in the secure aggregation: a refusal of this test's") == 1


def test_an_agent_that_refuses_its_moments_step_tries_it_once(step_deadline, aggregator, agent_threads, stand_dataset,
                                                                one_thread, caplog, monkeypatch):
    """The same in round 0: an agent whose observation moments end in a refusal is offered the
    MOMENTS task again until the step closes, and runs the protocol for them once."""
    from agent_service.secure import SecureSteps
    from fedrl.federation.secagg import SecAggError

    steps, refused = SecureSteps._steps, []

    def refusing(self, stub, task, *a, **k):
        if self.agent_id != "agent-2" or task.round != 0:
            return steps(self, stub, task, *a, **k)
        refused.append(task.round)
        raise SecAggError("a refusal of this test's")

    monkeypatch.setattr(SecureSteps, "_steps", refusing)
    _start(aggregator, agent_threads, stand_dataset, 3, rounds=1, secagg_threshold=2, algo="fed-bc",
           round_timeout=step_deadline)
    done = wait_for(lambda: (s := status(aggregator))["state"] in ("finished", "failed") and s, what="run to end")
    assert done["state"] == "finished", done["message"]  # the two others' moments, then the round
    assert refused == [0], refused
    assert caplog.text.count("the observation moments: no part in the secure aggregation: a refusal") == 1


def test_round_metrics_an_agent_sends_under_the_masks_are_dropped_unread(aggregator, agent_threads, stand_dataset,
                                                                          one_thread, caplog):
    """An agent that still sends its round metrics with its masked vector (an older agent): the
    aggregator records none of them, and says which agent sent them."""
    agents, run_id = _start(aggregator, agent_threads, stand_dataset, 2, rounds=1, secagg_threshold=2)
    for a in agents:
        steps = a.secure._steps

        def leaky(stub, task, params, vector, masked, steps=steps):
            if task.round >= 1:
                masked.metrics["q_data"] = 12.5
            return steps(stub, task, params, vector, masked)

        a.secure._steps = leaky
    done = wait_for(lambda: (s := status(aggregator))["state"] in ("finished", "failed") and s, what="run to end")
    assert done["state"] == "finished", done["message"]
    closed = [e for e in aggregator.store.read_run(run_id)["events"] if e["kind"] == "ROUND_CLOSED"]
    assert len(closed) == 1 and closed[0]["metrics"] == {}, closed
    assert "agent agent-0 sent its round metrics in the clear under secure aggregation" in caplog.text


def test_below_the_threshold_the_run_fails_and_nothing_is_stored(step_deadline, aggregator, agent_threads, stand_dataset,
                                                                  one_thread):
    agents, run_id = _start(aggregator, agent_threads, stand_dataset, 3, rounds=1, secagg_threshold=3,
                            round_timeout=step_deadline)
    _stop_at(agents[2], "masked")
    done = wait_for(lambda: (s := status(aggregator))["state"] in ("finished", "failed") and s, what="run to end")
    assert done["state"] == "failed"
    assert "the masked step closed with 2 of the 3 agents it waited for, fewer than the threshold 3" in done["message"]
    assert aggregator.store.versions(run_id) == [0]


def test_below_the_threshold_in_the_moments_round_no_version_is_made(step_deadline, aggregator, agent_threads, stand_dataset,
                                                                      one_thread):
    agents, run_id = _start(aggregator, agent_threads, stand_dataset, 3, rounds=1, secagg_threshold=3,
                            round_timeout=step_deadline)
    _stop_at(agents[2], "masked", round_=0)
    done = wait_for(lambda: (s := status(aggregator))["state"] in ("finished", "failed") and s, what="run to end")
    assert done["state"] == "failed"
    assert done["message"].startswith("the observation moments (round 0): the masked step closed with 2 of the 3")
    assert aggregator.store.versions(run_id) == []


def test_a_plain_pooled_run_names_the_agents_that_keep_their_moments(aggregator, agent_threads, stand_dataset,
                                                                      one_thread):
    agent_threads.start(aggregator.target, str(stand_dataset), 2, 2, seed=7, share_moments=False)
    wait_for(lambda: len(status(aggregator)["agents"]) == 2, what="agents to join")
    st = status_from_proto(aggregator.control.StartRun(
        control_pb2.StartRunRequest(config_json=run_config(agents=2, rounds=1)), timeout=RPC_BOUND))
    done = wait_for(lambda: (s := status(aggregator))["state"] in ("finished", "failed") and s, what="run to end")
    assert done["state"] == "failed", st
    assert "agent-0, agent-1 kept theirs private: set secagg_threshold" in done["message"]


def test_an_update_in_the_clear_is_refused_in_a_secure_run(aggregator, stand_dataset):
    from fedrl.proto.v1 import federation_pb2
    from fedrl.wire.codec import assemble
    from fedrl.wire.serde import read_weight_parts
    from tests.service.test_federation import assert_refused, join, submit

    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    st = status_from_proto(aggregator.control.StartRun(
        control_pb2.StartRunRequest(config_json=run_config(secagg_threshold=2, obs_norm="none")), timeout=RPC_BOUND))
    g = assemble(*read_weight_parts(aggregator.fed.FetchGlobal(
        federation_pb2.FetchRequest(run_id=st["run_id"], version=0), timeout=RPC_BOUND)))
    for inline in (False, True):
        assert_refused(lambda: submit(aggregator, "a0", g, st["run_id"], inline=inline),
                       grpc.StatusCode.FAILED_PRECONDITION, "never in the clear")
    assert status(aggregator)["round"] == 1


def test_round_0_gathers_the_moments_before_any_version(aggregator):
    """A secure pooled run starts with a MOMENTS task, and serves no version until their sum has
    made version 0."""
    from fedrl.proto.v1 import federation_pb2
    from tests.service.test_federation import assert_refused, join

    join(aggregator, "a0", 0)
    join(aggregator, "a1", 1)
    st = status_from_proto(aggregator.control.StartRun(
        control_pb2.StartRunRequest(config_json=run_config(secagg_threshold=2)), timeout=RPC_BOUND))
    task = aggregator.fed.NextTask(federation_pb2.TaskRequest(agent_id="a0", wait_seconds=1), timeout=RPC_BOUND)
    assert (task.kind, task.round, task.run_id) == (federation_pb2.Task.MOMENTS, 0, st["run_id"])
    st0 = status(aggregator)
    assert st0["round"] == 0
    from fedrl.cli.show import status as status_text

    assert "round 0 of 2 (the agents' observation moments, by secure aggregation)" in status_text(st0)
    assert_refused(lambda: list(aggregator.fed.FetchGlobal(federation_pb2.FetchRequest(run_id=st["run_id"], version=0),
                                                           timeout=RPC_BOUND)),
                   grpc.StatusCode.FAILED_PRECONDITION, "has not made its first version")


def test_weighting_by_samples_and_round_0_are_right_when_shards_differ_in_size(aggregator, agent_threads,
                                                                               random_dataset, tmp_path, one_thread):
    """Shards of 3 different sizes, weighting=samples: version 0's normaliser is the exact pooled
    moments (within the fixed point's bound; uniform weights would be far off) and version 1 is
    the simulation's under the same protocol, bit for bit (its weighted average)."""
    import numpy as np

    from fedrl.data.normalize import ObsStats

    shards, _ = load_shards([str(random_dataset)], 3, 2, 7, None, lambda m: None)
    sizes = [len(sh.transitions) for sh in shards]
    assert len(set(sizes)) == 3, sizes
    states = {}
    simulate(SimConfig(algo="drpo", datasets=(str(random_dataset),), agents=3, trajectories=2, rounds=1, local_steps=3,
                       eval_episodes=0, seed=7, device="cpu", drpo=SMALL, bc=SMALL_BC, secagg_threshold=2,
                       weighting="samples"),
             tmp_path / "sim", log=lambda m: None, on_round=lambda r, s: states.__setitem__(r, s))
    _, run_id = _start(aggregator, agent_threads, random_dataset, 3, session=False, rounds=1, secagg_threshold=2,
                       weighting="samples")
    done = wait_for(lambda: (s := status(aggregator))["state"] in ("finished", "failed") and s, what="run to end")
    assert done["state"] == "finished", done["message"]
    v0 = aggregator.store.load_version(run_id, 0)
    exact_mean, exact_std = ObsStats.pool([ObsStats.of(sh.transitions.obs) for sh in shards]).mean_std()
    uniform = np.mean([ObsStats.of(sh.transitions.obs).mean_std()[0] for sh in shards], axis=0)
    got = v0["policy.obs_mean"].numpy()
    assert np.allclose(got, exact_mean, atol=1e-5) and np.allclose(v0["policy.obs_std"].numpy(), exact_std, atol=1e-5)
    assert np.abs(uniform - exact_mean).max() > 100 * np.abs(got - exact_mean).max()  # the weights matter here
    stored = aggregator.store.load_version(run_id, 1)
    for k in stored:
        assert torch.equal(stored[k], states[1][k]), k


def test_adaptive_clipping_counts_the_survivors_alone_when_an_agent_drops(step_deadline, aggregator, agent_threads, stand_dataset,
                                                                          one_thread):
    """Every update within the norm (1e3), no noise: the share within it is 1 whoever survives.
    agent-2 leaves before masking: the sum's count and weight are the two survivors', so the
    share is still 1 (not 2/3: the estimate stays unbiased)."""
    agents, run_id = _start(aggregator, agent_threads, stand_dataset, 3, rounds=1, secagg_threshold=2, algo="fed-bc",
                            dp_clip=1e3, dp_clip_quantile=0.5, dp_clip_lr=0.5, round_timeout=step_deadline)
    _stop_at(agents[2], "masked")
    done = wait_for(lambda: (s := status(aggregator))["state"] in ("finished", "failed") and s, what="run to end")
    assert done["state"] == "finished", done["message"]
    closed = [e for e in aggregator.store.read_run(run_id)["events"] if e["kind"] == "ROUND_CLOSED"]
    assert closed[0]["agents"] == ["agent-0", "agent-1"]
    assert closed[0]["metrics"]["dp_unclipped_fraction"] == pytest.approx(1.0, abs=1e-8)
