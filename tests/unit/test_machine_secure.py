"""The round machine's secure rounds and round 0 (fedrl.federation.machine with
fedrl.federation.secure_steps), every agent's side run here by ``secagg_sums.agents_here``: the
protocol's specification as values in and actions out. What a round's sum gives, who it waits
for and until when, what it refuses and why, and how it fails."""

import numpy as np
import pytest
import torch

from fedrl.data.normalize import ObsStats, global_normalizer
from fedrl.federation.machine import Closed, Failed, Gather, Gathered, Open, Plan, Refused, RoundMachine
from fedrl.federation.secagg import AgentSession
from fedrl.federation.secagg_sums import agent_vector, agents_here, moments_vector
from fedrl.federation.secure_steps import Keys, Shares

AGENTS = ("a", "b", "c")


def state(x: float, y: float = 0.0) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([x, y], dtype=torch.float64)}


# The machine has no clock: every time below (round_timeout, now) is a value the test passes, so no
# machine's speed can change an outcome.
def secure(samples=(1, 2, 3), weighting="samples", **kw) -> RoundMachine:
    plan = Plan(3, AGENTS, secagg_threshold=2, samples=samples, weighting=weighting, round_timeout=10.0,
                context="test", **kw)
    return RoundMachine(plan, state(0.0))


def models(m: RoundMachine, states: dict) -> dict:
    params = m.secure.params
    return {a: (lambda alpha, s=s: agent_vector(s, alpha, params)) for a, s in states.items()}


STATES = {"a": state(1.0, 2.0), "b": state(4.0, -1.0), "c": state(-2.0, 0.5)}


@pytest.mark.parametrize("drop", [(), ("b",)])
def test_a_secure_round_gives_the_weighted_average_of_its_survivors(drop):
    m = secure()
    assert m.begin(now=100.0) == Open(1, 0, 110.0)
    closed = agents_here(m, models(m, STATES), drop, now=101.0)
    assert isinstance(closed, Closed) and closed.version == 1
    live = [a for a in AGENTS if a not in drop]
    w = {"a": 1.0, "b": 2.0, "c": 3.0}
    want = sum(w[a] * STATES[a]["w"] for a in live) / sum(w[a] for a in live)
    torch.testing.assert_close(closed.state["w"], want, atol=1e-8, rtol=0)
    assert closed.agents == tuple(live)
    assert m.version == 0  # not current before it is committed
    assert m.commit(closed, now=120.0) == Open(2, 1, 130.0)
    assert m.secure is not None and m.secure.params.context == b"test/2"


def test_a_dropout_waits_for_the_masked_steps_deadline_and_not_before():
    m = secure()
    m.begin(now=0.0)
    sec = m.secure
    for a in AGENTS[:2]:  # c trains past the round's deadline
        pk = AgentSession(a, sec.params).advertise()
        assert m.offer(a, 1, "keys", Keys(pk.share_key, pk.mask_key), now=5.0) is None
    assert sec.step == 0 and m.advance(now=9.99) is None and sec.step == 0  # the keys step waits for c
    assert m.advance(now=10.0) is None and sec.step == 1 and sec.expected == {"a", "b"}  # closed at the deadline
    with pytest.raises(Refused) as e:
        m.offer("c", 1, "keys", Keys(b"\x09" * 32, b"\x0a" * 32), now=10.5)
    assert e.value.reason == "secagg_late"
    with pytest.raises(Refused) as e:  # nor any later step of this round
        m.offer("c", 1, "shares", Shares({"a": b"\x00" * 60, "b": b"\x00" * 60}), now=10.5)
    assert e.value.reason == "secagg_late"
    assert sec.reply("a", "keys")["alpha"] == {"a": 1 / 3, "b": 2 / 3}  # the weights of those whose keys came


def test_below_the_threshold_the_round_fails_and_nothing_is_made():
    m = secure()
    m.begin(now=0.0)
    out = agents_here(m, models(m, STATES), drop=("a", "b"), now=1.0)
    assert isinstance(out, Failed) and "fewer than the threshold 2" in out.message
    assert out.message.startswith("round 1: the masked step closed with 1 of the 3")
    assert m.phase == "failed" and m.version == 0 and m.secure is None
    with pytest.raises(Refused) as e:
        m.check("a", 1, step="answer")
    assert e.value.reason == "closed_round"


def test_round_zero_gathers_the_pooled_moments_then_version_zero_opens_round_one():
    rng = np.random.default_rng(0)
    obs = {a: rng.normal(i, 1 + i, (20 * (i + 1), 3)) for i, a in enumerate(AGENTS)}
    stats = {a: ObsStats.of(o) for a, o in obs.items()}
    plan = Plan(2, AGENTS, secagg_threshold=2, samples=tuple(len(o) for o in obs.values()), gather=3,
                round_timeout=5.0, context="run")
    m = RoundMachine(plan, None)
    assert m.begin(now=0.0) == Gather(5.0)
    with pytest.raises(Refused) as e:  # no update in the clear while the moments are gathered
        m.check("a", 0, 0)
    assert e.value.reason == "closed_round"
    params = m.secure.params
    vec = {a: (lambda alpha, st=st: moments_vector(st.count, st.total, st.total_sq, alpha, params))
           for a, st in stats.items()}
    got = agents_here(m, vec)
    assert isinstance(got, Gathered) and got.agents == AGENTS
    mean, std = global_normalizer("pooled", list(stats.values()))
    np.testing.assert_allclose(got.mean, mean, atol=1e-6)
    np.testing.assert_allclose(got.std, std, atol=1e-6)
    assert m.found(state(0.0), now=7.0) == Open(1, 0, 12.0)
    assert m.secure.params.context == b"run/1"


def test_what_a_secure_round_refuses_and_why():
    m = secure()
    m.begin()
    cases = [
        (lambda: m.check("z", 1, step="keys"), "not_selected"),
        (lambda: m.check("a", 2, step="keys"), "future_round"),
        (lambda: m.check("a", 0, step="keys"), "stale_round"),
        (lambda: m.check("a", 1, 0), "secagg_only"),
        (lambda: m.check("a", 1, step="shares"), "secagg_order"),
        (lambda: m.check("a", 1, step="sums"), "secagg_bad"),
        (lambda: m.offer("a", 1, "keys", Shares({})), "secagg_bad"),
        (lambda: m.offer("a", 1, "keys", Keys(b"short", b"\x01" * 32)), "secagg_bad"),
        (lambda: m.offer("a", 1, "keys", Keys(b"\x00" * 32, b"\x00" * 32)), "secagg_bad"),  # small order
    ]
    for call, reason in cases:
        with pytest.raises(Refused) as e:
            call()
        assert e.value.reason == reason, (reason, str(e.value))
    assert m.secure.step == 0 and not m.secure.server.roster  # nothing taken
    clear = RoundMachine(Plan(2, AGENTS), state(0.0))
    clear.begin()
    with pytest.raises(Refused) as e:
        clear.offer("a", 1, "keys", Keys(b"\x01" * 32, b"\x02" * 32))
    assert e.value.reason == "closed_round"


def test_a_repeated_message_is_answered_from_the_step_and_not_taken_again():
    m = secure()
    m.begin()
    pk = AgentSession("a", m.secure.params).advertise()
    m.offer("a", 1, "keys", Keys(pk.share_key, pk.mask_key))
    assert m.check("a", 1, step="keys") is False
    m.offer("a", 1, "keys", Keys(b"\x05" * 32, b"\x06" * 32))  # a repeat: ignored, not checked again
    assert m.secure.server.roster["a"].share_key == pk.share_key
