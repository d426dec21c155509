"""What secure aggregation sums, and the protocol run with every agent in one process
(``fedrl simulate``; the services run its steps over gRPC): a model weighted by its agent's share
(:func:`agent_vector`, :func:`average_from_sum`), and the observation moments of round 0
(:func:`moments_vector`, :func:`moments_from_sum`), in the fixed point of
:mod:`fedrl.federation.secagg`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from fedrl.federation.secagg import (
    SecAggError,
    SecAggParams,
    dequantize,
    quantize,
    rounding_bound,
    share_in_process,
)


# ---------------------------------------------------------------------------------------------
# a round's weighted average, every agent in this process (fedrl simulate)
# ---------------------------------------------------------------------------------------------
def agent_vector(state: Mapping, alpha: float, params: SecAggParams, noise_std: float = 0.0,
                 generator=None, extra: Sequence[float] = ()) -> np.ndarray:
    """What one agent masks: ``alpha * state`` (every tensor flattened in order, float64), then
    ``alpha * extra`` (adaptive clipping's share of the count, already noised), and ``alpha``
    last, quantized. With ``noise_std`` the agent first adds its share of differential
    privacy's noise to its state. The agent checks its own update: a non-finite value, or one
    past the clipping range, is refused here (no one else sees it to check)."""
    import torch

    parts = []
    for k in sorted(state):  # the order both sides use, whatever the dict's
        v = state[k]
        x = v.detach().to("cpu", torch.float64).reshape(-1)
        if noise_std > 0:
            x = x + noise_std * torch.randn(x.shape, generator=generator, dtype=torch.float64)
        parts.append(x.numpy())
    flat = np.concatenate([*parts, np.asarray(extra, np.float64), [1.0]]) * alpha
    if not np.isfinite(flat).all():
        raise SecAggError("the update holds NaN or Inf: it is not sent")
    top = float(np.abs(flat).max())
    if top > params.clip:
        raise SecAggError(f"a weighted value of magnitude {top:.3g} is past the clipping range {params.clip:g}")
    return quantize(flat, params)


def average_from_sum(s: np.ndarray, ref: Mapping) -> dict:
    """The average a dequantized sum of :func:`agent_vector`s gives: its values over its last
    (the summed weight), as tensors of ``ref``'s names (in sorted order), shapes and dtypes."""
    import torch

    weight = s[-1]
    if not weight > 0:
        raise SecAggError(f"the summed weight is {weight}: nothing to average")
    out, pos = {}, 0
    for k in sorted(ref):
        v = ref[k]
        n = v.numel()
        out[k] = torch.from_numpy(s[pos:pos + n] / weight).view(v.shape).to(v.dtype)
        pos += n
    return {k: out[k] for k in ref}


def extras_from_sum(s: np.ndarray, n: int) -> np.ndarray:
    """The weighted averages of the ``n`` extra values each :func:`agent_vector` carried (they sit
    just before the weight)."""
    weight = s[-1]
    if not weight > 0:
        raise SecAggError(f"the summed weight is {weight}: nothing to average")
    return s[len(s) - 1 - n:len(s) - 1] / weight


def average_bound(s: np.ndarray, n: int, params: SecAggParams) -> float:
    """How far the average of a sum ``s`` of ``n`` quantized vectors can be from the exact one."""
    weight = s[-1]
    return rounding_bound(n, params) * (1 + max(1.0, float(np.abs(s[:-1]).max(initial=0.0)) / weight)) / weight


def secure_sum(vectors: Mapping[str, Callable[[], np.ndarray]], params: SecAggParams,
               drop: Iterable[str] = ()) -> tuple[np.ndarray, list[str], list[str]]:
    """The protocol's sum of the agents' vectors, every agent and the aggregator here: each
    ``vectors[a]()`` is agent a's quantized vector (made only once it has the roster). Agents in
    ``drop`` leave after sharing their keys (their masks are then removed). Returns the
    dequantized sum, the survivors and the dropped."""
    agents, server = share_in_process(vectors, params)
    gone = set(drop)
    for a, make in vectors.items():
        if a not in gone:
            server.add_masked(a, agents[a].masked_input(make(), server.shared))
    survivors, dropped, _ = server.unmask_request()  # nobody is excluded: every share here opens
    answers = {a: agents[a].unmask(survivors, dropped) for a in survivors}
    return dequantize(server.finish(answers), params), survivors, dropped


def secure_fedavg(states, weights, params: SecAggParams, noise_std: float = 0.0, generator=None,
                  drop: Iterable[int] = (), extras: Sequence[Sequence[float]] | None = None) -> tuple[dict, dict]:
    """FedAvg of ``states`` with ``weights`` (public: each agent's sample count, or 1) taken by the
    protocol, every agent and the aggregator here: (the average, a record of the round). Agents
    of index in ``drop`` leave after sharing their keys (their masks are then removed). The
    average differs from plain FedAvg's by at most ``bound`` per value (the record's).
    ``extras``: each agent's extra values, summed with its model; their weighted averages are
    the record's ``extras``."""
    import time

    t0 = time.perf_counter()
    ids = [f"agent-{i:05d}" for i in range(len(states))]
    total = float(sum(weights))
    vectors = {a: (lambda i=i: agent_vector(states[i], weights[i] / total, params, noise_std, generator,
                                            extras[i] if extras else ()))
               for i, a in enumerate(ids)}
    s, survivors, dropped = secure_sum(vectors, params, [ids[i] for i in drop])
    out = average_from_sum(s, states[0])
    bound = average_bound(s, len(survivors), params)
    rec = {"threshold": params.threshold, "agents": len(ids), "survivors": len(survivors),
           "dropped": len(dropped), "bound": bound, "seconds": time.perf_counter() - t0}
    if extras:
        rec["extras"] = [float(x) for x in extras_from_sum(s, len(extras[0]))]
    return out, rec


# ---------------------------------------------------------------------------------------------
# observation moments (pooled normalisation), round 0 of a secure run
# ---------------------------------------------------------------------------------------------
# Their own fixed point: a mean or a mean square may be far larger than a policy's weights. Each
# agent sends alpha * mean and alpha * mean square (alpha = its share of the samples), each
# within +-2^19 (a mean of magnitude up to 524,288, a root mean square up to 724), with 28
# fractional bits: a sum of n is exact while n < 2^16, within n * 2^-29 of the exact one.
MOMENTS_FRAC_BITS, MOMENTS_CLIP = 28, 2.0 ** 19


def moments_params(threshold: int, context: bytes) -> SecAggParams:
    """Round 0's settings: the run's threshold, the moments' fixed point."""
    return SecAggParams(threshold=threshold, context=context, frac_bits=MOMENTS_FRAC_BITS, clip=MOMENTS_CLIP)


def moments_vector(count: int, total: np.ndarray, total_sq: np.ndarray, alpha: float,
                   params: SecAggParams) -> np.ndarray:
    """What one agent masks in round 0: ``alpha`` times its observations' mean and mean square
    per dimension, and ``alpha`` last, quantized. Refused (never sent) when not finite or past
    the range, naming the dimension."""
    if count <= 0:
        raise SecAggError("no observations: nothing to pool")
    mean = np.asarray(total, np.float64) / count
    sq = np.asarray(total_sq, np.float64) / count
    flat = np.concatenate([mean, sq, [1.0]]) * alpha
    if not np.isfinite(flat).all():
        raise SecAggError("the observation moments hold NaN or Inf: they are not sent")
    over = np.flatnonzero(np.abs(flat) > params.clip)
    if over.size:
        i, d = int(over[0]), len(mean)
        what = f"the mean of dimension {i}" if i < d else f"the mean square of dimension {i - d}"
        raise SecAggError(f"{what} (weighted: {flat[i]:.4g}) is past secure aggregation's range "
                          f"+-{params.clip:g}: normalise the observations first, or use obs_norm=none")
    return quantize(flat, params)


def moments_from_sum(s: np.ndarray, obs_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The pooled (mean, std) from a dequantized sum of :func:`moments_vector`s: each over the
    summed weight (the survivors' share of the samples), the std floored as in plain pooling."""
    from fedrl.data.normalize import ObsStats

    if len(s) != 2 * obs_dim + 1:
        raise SecAggError(f"a moments sum of {len(s)} values; obs_dim {obs_dim} needs {2 * obs_dim + 1}")
    weight = s[-1]
    if not weight > 0:
        raise SecAggError(f"the summed weight is {weight}: no moments to pool")
    return ObsStats(1, s[:obs_dim] / weight, s[obs_dim:2 * obs_dim] / weight).mean_std()


def secure_moments(stats, counts, params: SecAggParams, drop: Iterable[int] = ()
                   ) -> tuple[tuple[np.ndarray, np.ndarray], dict]:
    """Pooled normalisation of ``stats`` (fedrl.data.normalize.ObsStats, one per agent) by the
    protocol, every agent here: ((mean, std), a record). ``counts``: the public sample counts.
    The pooled mean and mean square are within the record's ``bound`` of the exact ones."""
    import time

    t0 = time.perf_counter()
    ids = [f"agent-{i:05d}" for i in range(len(stats))]
    total = float(sum(counts))
    vectors = {a: (lambda i=i: moments_vector(stats[i].count, stats[i].total, stats[i].total_sq,
                                              counts[i] / total, params))
               for i, a in enumerate(ids)}
    s, survivors, dropped = secure_sum(vectors, params, [ids[i] for i in drop])
    return moments_from_sum(s, len(stats[0].total)), {
        "threshold": params.threshold, "agents": len(ids), "survivors": len(survivors), "dropped": len(dropped),
        "bound": average_bound(s, len(survivors), params), "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------
# every agent's side of a round machine's secure aggregation, here (fedrl simulate, the cells)
# ---------------------------------------------------------------------------------------------
def agents_here(machine, vectors: Mapping[str, Callable[[float], np.ndarray]], drop: Iterable[str] = (),
                now: float = 0.0):
    """The four steps of the open round's secure aggregation in ``machine`` (a
    :class:`fedrl.federation.machine.RoundMachine`), every agent's side run here as the services'
    agents run it over gRPC (``agent_service.secure``): ``vectors[a](alpha)`` is agent a's
    quantized vector for its weight alpha. Agents in ``drop`` leave after sharing their keys; the
    masked step then closes at its deadline, as the aggregator's clock closes it. Returns the
    machine's action (its ``Closed`` version, ``Gathered`` moments, or ``Failed``). The machine's
    agents are named by str, as the protocol names them."""
    from fedrl.federation.secagg import AgentSession
    from fedrl.federation.secure_steps import Masked, Shares

    sec, r = machine.secure, machine.round
    if not all(isinstance(a, str) for a in vectors):
        raise TypeError(f"secure aggregation names its agents by str, not {sorted(map(repr, vectors))}")
    me = {a: AgentSession(a, sec.params) for a in vectors}
    for a, s in me.items():
        machine.offer(a, r, "keys", s.advertise(), now)
    for a, s in me.items():
        keys = sec.reply(a, "keys")
        machine.offer(a, r, "shares", Shares(s.share_keys(keys["roster"])), now)
    gone = set(drop)
    act = None
    for a, s in me.items():
        relay = sec.reply(a, "shares")
        s.receive_shares(relay["sealed"])
        if a in gone:
            continue
        y = s.masked_input(vectors[a](sec.reply(a, "keys")["alpha"][a]), relay["shared"])
        act = machine.offer(a, r, "masked", Masked(y.astype("<u8").tobytes(),
                                                   [u for u in s.unopened if u in relay["shared"]]), now)
    if sec.step == 2:  # someone dropped: the masked step closes at its deadline
        if not np.isfinite(sec.deadline):
            raise ValueError("a dropout needs a deadline: this plan has no round_timeout")
        now = sec.deadline
        act = machine.advance(now)
    if sec.step < 3:  # it failed
        return act
    ask = sec.reply(next(a for a in me if a not in gone), "masked")
    for a in ask["survivors"]:
        act = machine.offer(a, r, "answer", me[a].unmask(ask["survivors"], ask["dropped"], ask["excluded"]), now)
    return act
