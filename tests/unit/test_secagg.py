"""Secure aggregation's protocol (fedrl.federation.secagg) against its definition: the sum is
the survivors' plain sum, exactly in the ring; what the aggregator holds of one agent looks
uniform and carries nothing of its input; dropouts are recovered down to the threshold and no
further; no agent hands out both shares of a peer."""

from __future__ import annotations

import numpy as np
import pytest

from fedrl.federation import secagg as sa
from fedrl.federation.secagg import AgentSession, SecAggError, SecAggParams, ServerSession
from fedrl.federation.secagg_sums import agent_vector


def params(t=3, **kw):
    return SecAggParams(threshold=t, context=b"run-1/round-4", **kw)


def setup_round(ids, p):
    """Keys advertised and shares relayed for every agent of ``ids``: (agents, server)."""
    return sa.share_in_process(ids, p)


def run_round(xs, p, drop_before_mask=(), silent_at_unmask=()):
    """One round over the quantized vectors ``xs`` (by agent); returns (the sum, the server)."""
    agents, server = setup_round(list(xs), p)
    for a, s in agents.items():
        if a not in drop_before_mask:
            server.add_masked(a, s.masked_input(xs[a], server.shared))
    survivors, dropped, excluded = server.unmask_request()
    answers = {a: agents[a].unmask(survivors, dropped, excluded) for a in survivors if a not in silent_at_unmask}
    return server.finish(answers), server


def vectors(n, size=257, seed=0):
    rng = np.random.default_rng(seed)
    return {f"agent-{i}": rng.integers(0, 2**64, size=size, dtype=np.uint64) for i in range(n)}


def ring_sum(vs):
    vs = list(vs)
    total = np.zeros_like(vs[0])
    for v in vs:
        total += v
    return total


def test_the_sum_is_the_plain_sum_in_the_ring():
    xs = vectors(5)
    total, _ = run_round(xs, params())
    assert np.array_equal(total, ring_sum(xs.values()))


def test_agents_that_drop_after_sharing_are_left_out_and_their_masks_removed():
    """Two of six drop before masking (their pairwise masks are in everyone else's input), and one
    survivor does not answer the unmasking: the sum of the four survivors, exactly."""
    xs = vectors(6, seed=1)
    gone = {"agent-1", "agent-4"}
    total, server = run_round(xs, params(t=3), drop_before_mask=gone, silent_at_unmask={"agent-5"})
    assert np.array_equal(total, ring_sum(v for a, v in xs.items() if a not in gone))
    assert server.unmask_request() == (["agent-0", "agent-2", "agent-3", "agent-5"], sorted(gone), [])


def test_below_the_threshold_the_round_fails_and_no_sum_comes_out():
    xs = vectors(5, seed=2)
    with pytest.raises(SecAggError, match="3 masked inputs came, fewer than the threshold 4"):
        run_round(xs, params(t=4), drop_before_mask={"agent-0", "agent-1"})
    with pytest.raises(SecAggError, match="2 agents answered the unmasking, fewer than the threshold 3"):
        run_round(xs, params(t=3), silent_at_unmask={"agent-0", "agent-1", "agent-2"})


def test_fewer_shares_than_the_threshold_rebuild_nothing():
    """t - 1 shares of a seed give another seed: the threshold is Shamir's, not a check of ours."""
    seed = bytes(range(16))
    shares = sa._split(seed, 3, 5)
    assert sa._combine(shares[1:4]) == seed
    assert sa._combine(shares[:2]) != seed


def test_no_agent_hands_out_both_shares_of_a_peer():
    xs = vectors(4, seed=3)
    agents, server = setup_round(list(xs), params())
    for a, s in agents.items():
        server.add_masked(a, s.masked_input(xs[a], server.shared))
    ids = sorted(xs)
    with pytest.raises(SecAggError, match="both survived and dropped"):
        agents["agent-0"].unmask(ids, ["agent-3"])
    first = agents["agent-1"].unmask(ids, [])
    assert {a: len(s) for a, (_, s) in first.shares.items()} == {a: 16 for a in ids} and not first.pair_seeds
    # having had every self-seed share, the aggregator now claims agent-3 dropped: refused
    with pytest.raises(SecAggError, match="already answered"):
        agents["agent-1"].unmask(ids[:3], ["agent-3"])
    with pytest.raises(SecAggError, match="fewer than the threshold"):
        agents["agent-0"].unmask(ids[:2], ids[2:])
    with pytest.raises(SecAggError, match="not those it masked for"):
        agents["agent-2"].unmask(ids[:3], [])  # agent-3 vanishes from the request


def test_a_survivors_answer_is_its_self_seed_share_and_a_dropped_agents_its_mask_seed_share():
    """Each answer's share, combined over t agents, rebuilds the seed it must: the self mask of a
    survivor, the mask key of a dropped agent (a swap of the two would pass a sum test only when
    nobody drops)."""
    xs = vectors(4, seed=4)
    agents, server = setup_round(list(xs), params())
    for a in ("agent-0", "agent-1", "agent-2"):
        server.add_masked(a, agents[a].masked_input(xs[a], server.shared))
    u3, d, _ = server.unmask_request()
    answers = [agents[a].unmask(u3, d) for a in u3]
    assert sa._combine(r.shares["agent-0"] for r in answers) == agents["agent-0"]._self_seed
    assert sa._combine(r.shares["agent-3"] for r in answers) == agents["agent-3"]._mask_seed


def test_the_masked_input_looks_uniform_and_carries_nothing_of_the_input():
    """The aggregator's view of one agent: a chi-square test of its bytes against uniform, and
    no correlation with the agent's input, even for an input that is all zeros but one block."""
    size = 1 << 15
    x = np.zeros(size, dtype=np.uint64)
    x[: size // 2] = sa.quantize(np.full(size // 2, 3.5), params())
    xs = {"agent-0": x, **{f"agent-{i}": np.zeros(size, dtype=np.uint64) for i in range(1, 4)}}
    agents, server = setup_round(list(xs), params())
    y = agents["agent-0"].masked_input(x, server.shared)
    counts = np.bincount(y.view(np.uint8), minlength=256)
    expected = y.nbytes / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 330, chi2  # 255 degrees of freedom: P(chi2 > 330) < 0.1 %
    top = (y >> np.uint64(63)).astype(np.float64)  # the bit a sign would set
    assert abs(top[: size // 2].mean() - top[size // 2:].mean()) < 0.05
    corr = np.corrcoef((y >> np.uint64(11)).astype(np.float64), (x >> np.uint64(11)).astype(np.float64))[0, 1]
    assert abs(corr) < 0.05, corr
    assert not np.array_equal(y, x)


def test_a_share_cannot_be_read_or_altered_on_the_way():
    """The aggregator relays ciphertexts: one addressed to another agent, or altered by a byte,
    is refused by the agent that opens it."""
    xs = vectors(3, seed=5)
    p = params()
    agents = {a: AgentSession(a, p) for a in xs}
    server = ServerSession(p)
    for a, s in agents.items():
        server.add_keys(a, s.advertise())
    for a, s in agents.items():
        server.add_shares(a, s.share_keys(server.roster))
    to_1 = server.shares_for("agent-1")
    assert agents["agent-2"].receive_shares(to_1) == sorted(to_1)  # another agent's: none opens
    assert agents["agent-2"].unopened == ["agent-0", "agent-1"] and not agents["agent-2"]._held
    bad = dict(server.shares_for("agent-2"))
    blob = bytearray(bad["agent-0"])
    blob[20] ^= 1
    bad["agent-0"] = bytes(blob)
    assert agents["agent-2"].receive_shares(bad) == ["agent-0"]
    assert agents["agent-2"].unopened == ["agent-0"]  # the others' opened; the altered one is named


def test_a_share_of_one_round_does_not_open_in_another():
    p1, p2 = params(), SecAggParams(threshold=3, context=b"run-1/round-5")
    a = {i: AgentSession(f"a{i}", p1) for i in range(3)}
    server = ServerSession(p1)
    for s in a.values():
        server.add_keys(s.id, s.advertise())
    blobs = {s.id: s.share_keys(server.roster) for s in a.values()}
    replay = AgentSession.__new__(AgentSession)
    replay.__dict__.update(a[1].__dict__, params=p2)
    replay._held = {}
    assert replay.receive_shares({"a0": blobs["a0"]["a1"]}) == ["a0"] and not replay._held


def test_quantization_meets_its_stated_bound_and_refuses_a_sum_that_could_wrap():
    p = params(frac_bits=20, clip=4.0)
    rng = np.random.default_rng(6)
    xs = [rng.uniform(-4, 4, size=1000) for _ in range(7)]
    got = sa.dequantize(ring_sum(sa.quantize(x, p) for x in xs), p)
    assert np.abs(got - np.sum(xs, axis=0)).max() <= sa.rounding_bound(7, p)
    assert np.array_equal(sa.quantize(np.array([9.0, -9.0]), p), sa.quantize(np.array([4.0, -4.0]), p))  # clipped
    with pytest.raises(SecAggError, match="could wrap"):
        SecAggParams(threshold=2, context=b"c", frac_bits=48, clip=2.0 ** 15).check_capacity(2)


def test_the_roster_must_hold_the_agents_own_keys_and_enough_agents():
    p = params()
    me = AgentSession("a0", p)
    other = AgentSession("a1", p)
    with pytest.raises(SecAggError, match="own keys"):
        me.share_keys({"a0": other.advertise(), "a1": other.advertise(), "a2": AgentSession("a2", p).advertise()})
    with pytest.raises(SecAggError, match="fewer than the threshold"):
        me.share_keys({"a0": me.advertise(), "a1": other.advertise()})


def test_an_agents_share_of_the_noise_has_the_stated_std_and_the_sum_at_least_the_central():
    """Distributed DP: each agent adds N(0, s^2) to its own model before masking (s = sigma C /
    sqrt(t) in the services and simulate). Measured on the unmasked sum of t agents' zero
    models: std sqrt(t) * s = sigma C, the central mechanism's, within a chi-square interval."""
    import torch

    p = params(t=4, frac_bits=32, clip=100.0)
    sigma_c, size = 0.8, 40_000
    s = sigma_c / np.sqrt(p.threshold)
    gen = torch.Generator().manual_seed(3)
    zero = {"policy.w": torch.zeros(size)}
    xs = {f"agent-{i}": agent_vector(zero, 1.0, p, s, gen) for i in range(p.threshold)}
    total, _ = run_round(xs, p)
    noise = sa.dequantize(total, p)[:-1]
    var = float(np.var(noise))
    # var * n / sigma^2 ~ chi-square(n): within +-5 sd of its mean n (sd sqrt(2n))
    assert abs(var / sigma_c ** 2 - 1) < 5 * np.sqrt(2 / size), var
    assert abs(float(np.mean(noise))) < 5 * sigma_c / np.sqrt(size)


def test_what_an_agent_hands_out_rebuilds_its_seeds_only_with_t_peers():
    """The shares an agent's session seals to its peers, opened by each peer as the protocol
    does: any t - 1 peers together rebuild neither of its seeds, any t rebuild both (the split is
    Shamir's; this checks what the agent sends, and that no share carries the seed itself)."""
    import itertools

    p = params(t=3)
    agents, server = setup_round([f"agent-{i}" for i in range(5)], p)
    x = agents["agent-0"]
    secret = {"mask": x._mask_seed, "self": x._self_seed}
    held = {peer: s._held["agent-0"] for peer, s in agents.items()}  # what each peer opened of agent-0's
    for peer, (m, s) in held.items():
        assert m != secret["mask"] and s != secret["self"]
    points = {peer: sorted(agents).index(peer) + 1 for peer in agents}  # Shamir's points: the roster's order
    for k, ok in ((2, False), (3, True)):
        for group in itertools.combinations(sorted(agents), k):
            for i, name in ((0, "mask"), (1, "self")):
                rebuilt = sa._combine((points[g], held[g][i]) for g in group)
                assert (rebuilt == secret[name]) is ok, (group, name)


def hostile_round(xs, p, garbage_to, sender="agent-1", drop_before_mask=(), unopened_lie=None):
    """One round over ``xs`` in which ``sender`` seals right-length random bytes to the agents
    ``garbage_to`` instead of its shares (an authenticated ciphertext it cannot fake for others).
    ``unopened_lie``: what ``sender`` claims it could not open. Returns (agents, server)."""
    import os

    agents = {a: AgentSession(a, p) for a in xs}
    server = ServerSession(p)
    for a, s in agents.items():
        server.add_keys(a, s.advertise())
    for a, s in agents.items():
        sealed = s.share_keys(server.roster)
        if a == sender:
            sealed = {b: (os.urandom(len(blob)) if b in garbage_to else blob) for b, blob in sealed.items()}
        server.add_shares(a, sealed)
    for a, s in agents.items():
        s.receive_shares(server.shares_for(a))
    for a, s in agents.items():
        if a not in drop_before_mask:
            y = s.masked_input(xs[a], server.shared)
            told = unopened_lie if (a == sender and unopened_lie is not None) else s.unopened
            server.add_masked(a, y, told)
    return agents, server


def answer_all(agents, server, silent=()):
    u3, d, e = server.unmask_request()
    return {a: agents[a].unmask(u3, d, e) for a in u3 if a not in silent}


@pytest.mark.parametrize("masks", [True, False], ids=["it-masks", "it-drops"])
def test_a_sender_whose_shares_open_nowhere_is_excluded_and_the_others_sum_is_exact(masks):
    """agent-1 seals garbage to every peer: nobody holds its seeds. It is excluded whether or not
    its masked input came, and the survivors' pairwise seeds with it remove its masks from theirs:
    the sum is the other four's, exactly. Nobody hands out a share of its self seed: its own input
    stays masked."""
    xs = vectors(5, seed=11)
    others = [a for a in xs if a != "agent-1"]
    agents, server = hostile_round(xs, params(t=3), garbage_to=others,
                                   drop_before_mask=() if masks else ("agent-1",))
    assert all(agents[a].unopened == ["agent-1"] for a in others)
    assert server.unmask_request() == (others, [], ["agent-1"])
    answers = answer_all(agents, server)
    assert all("agent-1" not in r.shares and set(r.pair_seeds) == {"agent-1"} for r in answers.values())
    assert np.array_equal(server.finish(answers), ring_sum(xs[a] for a in others))


def test_a_sender_whose_shares_open_at_enough_peers_stays_in_the_sum():
    """Garbage to one peer of five (t = 3): four still hold agent-1's seeds, so it survives; the
    peer that could not open them answers without that share. The sum of all five, exactly."""
    xs = vectors(5, seed=12)
    agents, server = hostile_round(xs, params(t=3), garbage_to=["agent-3"])
    assert server.unmask_request() == (sorted(xs), [], [])
    answers = answer_all(agents, server)
    assert "agent-1" not in answers["agent-3"].shares
    assert np.array_equal(server.finish(answers, lambda last: True), ring_sum(xs.values()))


def test_a_false_report_of_unopened_shares_excludes_nobody_while_a_survivor_is_spare():
    """agent-1 claims that no peer's shares opened (a lie the aggregator cannot check): each peer
    is still held by the other survivors, at least the threshold of them, so nobody is excluded."""
    xs = vectors(5, seed=13)
    agents, server = hostile_round(xs, params(t=4), garbage_to=[],
                                   unopened_lie=[a for a in xs if a != "agent-1"])
    assert server.unmask_request() == (sorted(xs), [], [])
    answers = answer_all(agents, server)
    answers["agent-1"] = sa.Answer({"agent-1": answers["agent-1"].shares["agent-1"]})
    assert np.array_equal(server.finish(answers), ring_sum(xs.values()))


def test_exclusion_needs_every_survivors_pairwise_seeds():
    xs = vectors(5, seed=14)
    others = [a for a in xs if a != "agent-1"]
    agents, server = hostile_round(xs, params(t=3), garbage_to=others)
    with pytest.raises(SecAggError, match=r"\['agent-4'\] gave no pairwise seeds"):
        server.finish(answer_all(agents, server, silent={"agent-4"}))


def test_below_the_threshold_after_exclusion_the_round_fails():
    xs = vectors(4, seed=15)
    agents, server = hostile_round(xs, params(t=4), garbage_to=[a for a in xs if a != "agent-1"])
    with pytest.raises(SecAggError, match=r"shares of \['agent-1'\] opened for fewer than the threshold 4"):
        server.unmask_request()


def test_the_unmasking_request_and_the_reports_are_checked():
    xs = vectors(4, seed=16)
    agents, server = setup_round(list(xs), params())
    y = agents["agent-0"].masked_input(xs["agent-0"], server.shared)
    with pytest.raises(SecAggError, match="only other agents that shared"):
        server.add_masked("agent-0", y, ["agent-0"])
    with pytest.raises(SecAggError, match="only other agents that shared"):
        server.add_masked("agent-0", y, ["agent-9"])
    ids = sorted(xs)
    with pytest.raises(SecAggError, match="as excluded and also"):
        agents["agent-0"].unmask(ids, [], ["agent-3"])
    with pytest.raises(SecAggError, match="not those it masked for"):
        agents["agent-0"].unmask(ids[:3], [], [])
    answer = agents["agent-0"].unmask(ids[:3], [], ["agent-3"])  # agent-3 excluded: its pairwise seed
    assert set(answer.pair_seeds) == {"agent-3"} and set(answer.shares) == set(ids[:3])
    assert answer.pair_seeds["agent-3"] == sa._pair_seed(agents["agent-3"]._mask_sk, server.roster["agent-0"].mask_key,
                                                         "agent-3", "agent-0", params())
