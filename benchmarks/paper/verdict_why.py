"""Why the early peak falls (issue 68, item 3), read from the verdict's result files only.

Each CQL-based cell, by seed: its early peak (the best score in rounds 1-5) and the lowest score
after it; the round at which Q on the data first reaches ``REACH`` of the data's discounted return
``G`` (the seed's, ``data_returns.json``) and the mean score before and from that round; the
critic's health (Q on the data's range, the TD error's first, largest and last values); and, for
DRPO, the Q term's share of the actor's gradient (Q term over the two regularisers') at the early
peak and at the last round. Three sentences follow, each from a rule stated in it:

- the regularisers are *drowned* when the Q term's share at the last round is above its share at
  the early peak;
- a curve *recovers* when its mean score from the round Q reaches ``REACH * G`` on is above its
  mean over the rounds between the early peak and that round;
- a critic *diverges* when Q on the data leaves ``[0, DIVERGE * G]`` in any round, or its TD error
  at the last round is above ``TD_GROWTH`` times its value at round 2.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.paper import tables

REACH = 0.95  # Q on the data "reaches" G at this share of it
DIVERGE = 1.5  # Q on the data above this many G, or below 0, is a diverged critic
TD_GROWTH = 5.0  # ... and so is a last TD error above this many times round 2's (TD error grows with Q's
# scale as Q climbs to G, so a smaller factor would call every converging critic diverged)
EARLY = 5  # the early peak is the best score of rounds 1..EARLY
CQL_METHODS = ("drpo", "drpo-returns-gradient", "fed-cql", "cql")


def _series(r: dict[str, Any], key: str) -> list[float] | None:
    v = r.get("losses_per_round", {}).get(key)
    return list(v) if v else None


def cell_reading(r: dict[str, Any], g: float) -> dict[str, Any] | None:
    """One cell's numbers (module docstring), or None when it logged no Q on the data."""
    q, td = _series(r, "q_data"), _series(r, "critic_td")
    if q is None or td is None:
        return None
    scores = [c["score_mean"] for c in r["curve"]]
    n = min(len(scores), len(q), len(td))
    scores, q, td = scores[:n], q[:n], td[:n]
    early = int(np.argmax(scores[:EARLY]))  # 0-based
    after = early + int(np.argmin(scores[early:]))
    reach = next((i for i, x in enumerate(q) if x >= REACH * g), None)
    out = {"seed": r["seed"], "rounds": n, "peak": scores[early], "peak_round": early + 1,
           "trough": scores[after], "trough_round": after + 1, "last": float(np.mean(scores[-5:])),
           "reach_round": None if reach is None else reach + 1, "q_last": q[-1], "g": g,
           "q_min": min(q), "q_max": max(q), "td_2": td[min(1, n - 1)], "td_max": max(td), "td_last": td[-1]}
    if reach is not None and reach > early + 1:
        out["before"] = float(np.mean(scores[early + 1:reach]))
        out["from"] = float(np.mean(scores[reach:]))
    out["diverged"] = bool(min(q) < 0 or max(q) > DIVERGE * g or td[-1] > TD_GROWTH * out["td_2"])
    gq, l1, l2 = (_series(r, k) for k in ("grad_q", "grad_lambda1", "grad_lambda2"))
    if gq and l1 and l2 and all(b + c > 0 for b, c in zip(l1, l2)):  # DRPO's (CQL's actor has no regulariser)
        share = [a / (b + c) for a, b, c in zip(gq, l1, l2)]
        out.update(share_peak=share[early], share_last=share[min(n, len(share)) - 1],
                   grad_q_growth=gq[min(n, len(gq)) - 1] / gq[0] if gq[0] else float("nan"),
                   q_growth=q[-1] / q[0] if q[0] else float("nan"))
    return out


def readings(results: list[dict[str, Any]], data_returns: dict[str, float]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        m = tables.method(r)
        g = data_returns.get(str(r["seed"]))
        if m in CQL_METHODS and g and (x := cell_reading(r, g)) is not None:
            out.setdefault(m, []).append(x)
    return {m: sorted(v, key=lambda x: x["seed"]) for m, v in out.items()}


def _cells(x: dict[str, Any]) -> list[str]:
    reach = (f"r{x['reach_round']}" if x["reach_round"] else
             f"not by r{x['rounds']} ({100 * x['q_last'] / x['g']:.0f}% of G)")
    split = f"{x['before']:.1f} -> {x['from']:.1f}" if "before" in x else "-"
    share = f"{x['share_peak']:.1f} -> {x['share_last']:.1f}" if "share_peak" in x else "-"
    return [f"{x['peak']:.1f} (r{x['peak_round']}) -> {x['trough']:.1f} (r{x['trough_round']}) -> {x['last']:.1f}",
            reach, split, f"{x['q_min']:.0f} to {x['q_max']:.0f} (G {x['g']:.0f})",
            f"{x['td_2']:.1f} / {x['td_max']:.1f} / {x['td_last']:.1f}", share]


def why_md(results: list[dict[str, Any]], data_returns: dict[str, float], label: dict[str, str]) -> str:
    """The table (one row a seed) and the three sentences; 'not run yet' without a CQL cell."""
    rd = readings(results, data_returns)
    if not rd:
        return "not run yet"
    rows = ["| method, seed | early peak -> lowest after it -> mean of the last 5 | Q on the data reaches "
            f"{REACH:.0%} of G | mean score before -> from then | Q on the data, min to max | TD error: round 2 / "
            "largest / last | Q term / regularisers: early peak -> last round |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for m in CQL_METHODS:
        for x in rd.get(m, []):
            rows.append(f"| {label[m]}, s{x['seed']} | " + " | ".join(_cells(x)) + " |")
    return "\n".join(rows) + "\n\n" + " ".join(s for s in (_drowned(rd, label), _recovers(rd, label),
                                                           _diverges(rd, label)) if s)


def _seeds(xs: list[dict[str, Any]]) -> str:
    return f"{len(xs)} seed{'s' if len(xs) != 1 else ''}"


def _join(xs: list[dict[str, Any]], fmt) -> str:
    return ", ".join(fmt(x) for x in xs)


def _drowned(rd: dict[str, list[dict[str, Any]]], label: dict[str, str]) -> str:
    parts = []
    for m in ("drpo", "drpo-returns-gradient"):
        xs = [x for x in rd.get(m, []) if "share_peak" in x]
        if not xs:
            continue
        drowned = sum(x["share_last"] > x["share_peak"] for x in xs)
        shares = _join(xs, lambda x: f"{x['share_peak']:.1f} -> {x['share_last']:.1f}")
        q = _join(xs, lambda x: f"{x['q_growth']:.0f}x")
        gq = _join(xs, lambda x: f"{x['grad_q_growth']:.1f}x")
        parts.append(f"{label[m]}: in {drowned} of {_seeds(xs)} the Q term's share at the last round is above its "
                     f"share at the early peak ({shares}), while Q on the data grows {q} from round 1 and the Q "
                     f"term's gradient {gq}")
    return ("**Does the growing Q scale drown the regularisers?** " + "; ".join(parts) + ".") if parts else ""


def _recovers(rd: dict[str, list[dict[str, Any]]], label: dict[str, str]) -> str:
    parts = []
    for m in CQL_METHODS:
        xs = rd.get(m, [])
        if not xs:
            continue
        split = [x for x in xs if "before" in x]
        unreached = len([x for x in xs if x["reach_round"] is None])
        said = []
        if split:
            up = sum(x["from"] > x["before"] for x in split)
            moves = _join(split, lambda x: f"r{x['reach_round']}: {x['before']:.1f} -> {x['from']:.1f}")
            said.append(f"recovers in {up} of the {len(split)} seed(s) whose Q reached it ({moves})")
        if unreached:
            said.append(f"Q has not reached it by the last round in {unreached} of {_seeds(xs)}")
        if not split and not unreached:
            said.append("Q reached it before or just after the early peak")
        parts.append(f"{label[m]} {'; '.join(said)}")
    return (f"**Do the curves recover once Q on the data reaches the data's return** (mean score between the "
            f"early peak and the round Q first reaches {REACH:.0%} of G, against from then on)? " + "; ".join(parts)
            + ".") if parts else ""


def _diverges(rd: dict[str, list[dict[str, Any]]], label: dict[str, str]) -> str:
    parts, healthy_last, sick_last = [], [], []
    for m in CQL_METHODS:
        xs = rd.get(m, [])
        if not xs:
            continue
        bad = [x for x in xs if x["diverged"]]
        parts.append(f"{label[m]} in {len(bad)} of {_seeds(xs)}")
        healthy_last += [x["last"] for x in xs if not x["diverged"]]
        sick_last += [x["last"] for x in bad]
    cost = ""
    if sick_last and healthy_last:
        cost = (f" The diverged cells' mean of the last 5 rounds is {np.mean(sick_last):.1f}, the others' "
                f"{np.mean(healthy_last):.1f}.")
    elif not sick_last:
        cost = " No divergence, so none costs returns by the last round."
    return (f"**Does a critic diverge** (Q on the data outside [0, {DIVERGE:g} G], or a last TD error above "
            f"{TD_GROWTH:g}x its round-2 value)? " + "; ".join(parts) + "." + cost) if parts else ""
