"""The rounds' state machine (fedrl.federation.machine), on closed-form cases: what opens, what is
taken or refused and why, what a close averages, and when a run ends."""

import math

import pytest
import torch

from fedrl.federation.machine import Closed, Finished, Open, Plan, Refused, RoundMachine, Stopped, Update
from fedrl.federation.privacy import PRIVACY_EPSILON, epsilon


def state(x: float, y: float = 0.0) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([x, y], dtype=torch.float32), "obs_mean": torch.zeros(2)}


def machine(rounds: int = 2, agents=("a", "b"), **kw) -> RoundMachine:
    return RoundMachine(Plan(rounds, tuple(agents), **kw), state(0.0))


def test_a_run_opens_each_round_and_finishes_after_the_last():
    m = machine(rounds=2)
    assert m.begin() == Open(1, 0)
    assert m.take("a", 1, 0, Update(state(1.0), 1)) is False
    assert m.take("b", 1, 0, Update(state(4.0), 3)) is True
    closed = m.close()
    assert (closed.round, closed.version, closed.agents) == (1, 1, ("a", "b"))
    assert m.version == 0  # not current before it is committed
    assert m.commit(closed) == Open(2, 1)
    assert m.version == 1 and m.taken == {}
    # samples weighting: (1 * 1 + 3 * 4) / 4
    assert torch.equal(m.global_state["w"], torch.tensor([3.25, 0.0]))
    m.take("b", 2, 1, Update(state(1.0), 1))
    m.take("a", 2, 1, Update(state(3.0), 1))
    assert m.commit(m.close()) == Finished(2)
    assert m.phase == "finished" and m.round == 2 and m.version == 2
    assert torch.equal(m.global_state["w"], torch.tensor([2.0, 0.0]))
    with pytest.raises(Refused) as e:
        m.check("a", 3, 2)
    assert e.value.reason == "closed_round"


def test_uniform_weighting_ignores_the_sample_counts():
    m = machine(weighting="uniform")
    m.begin()
    m.take("a", 1, 0, Update(state(1.0), 1))
    m.take("b", 1, 0, Update(state(4.0), 3))
    m.commit(m.close())
    assert torch.equal(m.global_state["w"], torch.tensor([2.5, 0.0]))


@pytest.mark.parametrize("agent,round_,base,reason", [
    ("c", 1, 0, "not_selected"),
    ("a", 2, 0, "future_round"),
    ("a", 1, 1, "wrong_base"),
])
def test_an_update_the_round_does_not_take_is_refused_by_name(agent, round_, base, reason):
    m = machine()
    m.begin()
    with pytest.raises(Refused) as e:
        m.take(agent, round_, base, Update(state(1.0), 1))
    assert e.value.reason == reason and m.taken == {}


@pytest.mark.parametrize("counted", [0, 2, 10**12])
def test_an_update_counts_the_samples_its_agent_joined_with(counted):
    """The plan's counts (what the agents said when they joined) are the updates' weights: an
    update counting other than its agent's is refused, nothing taken."""
    m = machine(samples=(1, 3))
    m.begin()
    with pytest.raises(Refused) as e:
        m.take("b", 1, 0, Update(state(4.0), counted))
    assert e.value.reason == "wrong_samples" and "agent 'b' joined with 3" in str(e.value) and m.taken == {}
    m.take("a", 1, 0, Update(state(1.0), 1))
    m.take("b", 1, 0, Update(state(4.0), 3))
    m.commit(m.close())
    assert torch.equal(m.global_state["w"], torch.tensor([3.25, 0.0]))


def test_stale_and_duplicate_updates_are_refused():
    m = machine(rounds=3)
    m.begin()
    m.take("a", 1, 0, Update(state(1.0), 1))
    with pytest.raises(Refused) as e:
        m.take("a", 1, 0, Update(state(9.0), 1))
    assert e.value.reason == "duplicate" and torch.equal(m.taken["a"].state["w"], torch.tensor([1.0, 0.0]))
    m.take("b", 1, 0, Update(state(1.0), 1))
    m.commit(m.close())
    with pytest.raises(Refused) as e:
        m.take("a", 1, 1, Update(state(1.0), 1))
    assert e.value.reason == "stale_round"


def test_a_secure_run_takes_no_update_in_the_clear_only_a_sum():
    m = machine(secagg_threshold=2)
    m.begin()
    with pytest.raises(Refused) as e:
        m.take("a", 1, 0, Update(state(1.0), 1))
    assert e.value.reason == "secagg_only"
    closed = m.close_sum(state(5.0), ["b"], [{"loss": 2.0}])
    assert closed.agents == ("b",) and closed.metrics == {"loss": 2.0}
    assert m.commit(closed) == Open(2, 1) and torch.equal(m.global_state["w"], torch.tensor([5.0, 0.0]))
    with pytest.raises(ValueError, match="expected some of"):
        m.close_sum(state(1.0), ["z"])
    plain = machine()
    plain.begin()
    with pytest.raises(RuntimeError):
        plain.close_sum(state(1.0), ["a"])


def test_a_round_closes_early_only_past_its_deadline_with_its_quorum():
    m = machine(agents=("a", "b", "c"), quorum=2, round_timeout=10.0)
    assert m.begin(now=100.0) == Open(1, 0, 110.0)
    assert not m.closable(now=110.0)  # nothing taken
    m.take("a", 1, 0, Update(state(1.0), 1))
    assert not m.closable(now=110.0)  # below the quorum
    assert m.overdue(now=110.0) == "round 1 is past its deadline with 1 of the 2 updates it needs; waiting for agents"
    m.take("c", 1, 0, Update(state(3.0), 1))
    assert not m.closable(now=109.9) and not m.overdue(now=110.0)
    assert m.closable(now=110.0)
    closed = m.close()
    assert closed.agents == ("a", "c") and torch.equal(closed.state["w"], torch.tensor([2.0, 0.0]))


def test_closing_again_gives_the_same_version_until_another_update_comes():
    g = torch.Generator().manual_seed(0)
    m = machine(agents=("a", "b", "c"), quorum=1, dp_clip=10.0, dp_noise=1.0)
    m.begin()
    m.take("a", 1, 0, Update(state(1.0), 1))
    first = m.close(g)
    assert m.close(g) is first  # a retried close (a failed write) draws no new noise
    m.take("b", 1, 0, Update(state(1.0), 1))
    second = m.close(g)
    assert second is not first and second.agents == ("a", "b")
    with pytest.raises(RuntimeError, match="not the open round's close"):
        m.commit(first)


def test_differential_privacy_clips_each_update_and_reports_the_epsilon_spent():
    m = machine(dp_clip=1.0, dp_delta=1e-5)
    m.begin()
    m.take("a", 1, 0, Update(state(30.0, 40.0), 1))  # norm 50: clipped to (0.6, 0.8)
    m.take("b", 1, 0, Update(state(0.0, 0.5), 1))  # norm 0.5: kept
    closed = m.close()
    assert torch.allclose(closed.state["w"], torch.tensor([0.3, 0.65]))
    assert math.isinf(closed.metrics[PRIVACY_EPSILON])  # no noise: no guarantee
    noisy = machine(dp_clip=1.0, dp_noise=2.0)
    noisy.begin()
    noisy.take("a", 1, 0, Update(state(1.0), 1))
    noisy.take("b", 1, 0, Update(state(1.0), 1))
    with pytest.raises(ValueError, match="generator"):
        noisy.close()
    closed = noisy.close(torch.Generator().manual_seed(1))
    assert closed.metrics[PRIVACY_EPSILON] == pytest.approx(epsilon(2.0, 1, 1e-5))
    assert not torch.equal(closed.state["w"], torch.tensor([1.0, 0.0]))  # noised
    assert torch.equal(closed.state["obs_mean"], torch.zeros(2))  # the normaliser is not learned


def test_a_run_stops_before_the_round_that_would_exceed_its_budget():
    budget = (epsilon(2.0, 2, 1e-5) + epsilon(2.0, 3, 1e-5)) / 2  # rounds 1 and 2 fit, 3 does not
    m = machine(rounds=5, dp_clip=1.0, dp_noise=2.0, dp_epsilon_budget=budget)
    g = torch.Generator().manual_seed(0)
    assert m.begin() == Open(1, 0)
    for r in (1, 2):
        m.take("a", r, r - 1, Update(state(1.0), 1))
        m.take("b", r, r - 1, Update(state(1.0), 1))
        action = m.commit(m.close(g))
    assert isinstance(action, Stopped) and action.round == 3 and m.phase == "stopped"
    assert action.message.startswith("privacy budget: round 3 would spend epsilon")
    assert m.round == 2 and m.version == 2
    tight = machine(dp_clip=1.0, dp_noise=2.0, dp_epsilon_budget=epsilon(2.0, 1, 1e-5) / 2)
    assert isinstance(tight.begin(), Stopped)


def test_own_policies_keep_each_agents_state_and_no_average():
    m = machine(agents=("a", "b", "c"), quorum=2, own_policies=True)
    m.begin()
    m.take("a", 1, 0, Update(state(1.0), 1))
    m.take("c", 1, 0, Update(state(3.0), 1))
    closed = m.close()
    assert isinstance(closed, Closed)
    m.commit(closed)
    assert [float(s["w"][0]) for s in m.agent_states] == [1.0, 0.0, 3.0]  # b missed the round: its own stays
    assert torch.equal(m.global_state["w"], torch.tensor([0.0, 0.0]))


def test_a_resumed_run_opens_the_round_after_its_last_version():
    m = RoundMachine(Plan(5, ("a",)), state(2.0), version=3, rounds_done=3)
    assert m.begin() == Open(4, 3)
    with pytest.raises(RuntimeError, match="has begun"):
        m.begin()
    done = RoundMachine(Plan(3, ("a",)), state(2.0), version=3, rounds_done=3)
    assert done.begin() == Finished(3)


def test_a_plan_names_what_is_wrong_with_it():
    with pytest.raises(ValueError, match="distinct agents"):
        Plan(2, ("a", "a"))
    with pytest.raises(ValueError, match="quorum 3 for 2 agents"):
        Plan(2, ("a", "b"), quorum=3)


@pytest.mark.parametrize("secure", [False, True])
def test_an_average_that_is_not_finite_makes_no_version(secure, monkeypatch):
    """Every path's close refuses an average with NaN or Inf (an overflow, or noise past float32;
    the updates themselves are checked before): nothing is pending, the round stays open."""
    import fedrl.federation.machine as mod

    m = machine(secagg_threshold=2 * secure)
    m.begin()
    bad = state(float("inf"))
    monkeypatch.setattr(mod, "aggregate", lambda *a, **k: bad)
    with pytest.raises(ValueError, match="round 1's average holds NaN or Inf \\(in w\\)"):
        if secure:
            m.close_sum(bad, ["a", "b"])
        else:
            m.take("a", 1, 0, Update(state(2.0), 1))
            m.take("b", 1, 0, Update(state(1.0), 1))
            m.close()
    assert m.phase == "open" and m.version == 0 and m._pending is None


@pytest.mark.parametrize("fraction, lands", [(-5000.0, "high"), (5000.0, "low"), (1e308, "low")])
def test_adaptive_clipping_keeps_its_norm_in_range_whatever_the_count_says(fraction, lands):
    """A noisy count far outside [0, 1] (one agent's masked share of -15,000 gave -5,000 once, and
    exp overflowed in the aggregator's clock thread) moves the norm to the end of its range."""
    from fedrl.federation.privacy import CLIP_RANGE, next_clip

    low, high = CLIP_RANGE
    got = next_clip(1.0, fraction, 0.5, 0.2)
    assert got == pytest.approx(high if lands == "high" else low, rel=1e-12)
    assert next_clip(2.0, 0.75, 0.5, 0.2) == pytest.approx(2.0 * math.exp(-0.2 * 0.25), rel=1e-12)  # inside: exact
    for nan in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="not a finite number"):
            next_clip(1.0, nan, 0.5, 0.2)


def test_a_resumed_run_clips_at_the_norm_its_last_round_moved_it_to():
    from fedrl.federation.machine import resumed_clip

    adaptive = Plan(3, ("a",), dp_clip=1.0, dp_clip_quantile=0.5)
    assert resumed_clip(adaptive, {"dp_clip": 1.0, "dp_clip_next": 0.7}) == 0.7
    assert resumed_clip(adaptive, None) is None and resumed_clip(adaptive, {}) is None  # no round closed yet
    assert resumed_clip(Plan(3, ("a",), dp_clip=1.0), {"dp_clip_next": 0.7}) is None  # a fixed norm stays
