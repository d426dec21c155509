"""What secure aggregation costs a round: ``fedrl.federation.secagg.secure_fedavg`` (every agent's
keys, shares, masks and the aggregator's unmasking, all in this process, one thread) beside plain
FedAvg of the same states, at Hopper's model sizes (the policy; the policy and both critics).

    python -m benchmarks.system.secagg_cost [--agents 5,10] [--repeats 3]

Writes ``benchmarks/results/secagg-cost.json``: per case the median seconds of each over
``--repeats``, their ratio and the rounding bound the round met. Both are timed in one run, so the
ratio holds on a shared machine; the seconds are this machine's (2 cores, busy or not). Each
row also gives the bytes one agent moves in a round, from the sizes of the real messages
(``SecureAggregation``'s four requests and replies, serialised), beside a plain round's (its
float32 update up; both get the version down in their task, which is not counted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from benchmarks.common import RESULTS
from fedrl.algos import DRPOConfig
from fedrl.federation.aggregate import fedavg
from fedrl.federation.round import initial_global_state
from fedrl.federation.secagg import SecAggParams, share_in_process
from fedrl.federation.secagg_sums import agent_vector, secure_fedavg
from fedrl.proto.v1 import federation_pb2 as pb

OUT = RESULTS / "secagg-cost.json"
HOPPER = (11, 3)


def _states(n: int, federate_critic: bool) -> list[dict[str, torch.Tensor]]:
    g = initial_global_state(DRPOConfig(), *HOPPER, 0, np.zeros(HOPPER[0], np.float32), np.ones(HOPPER[0], np.float32),
                             federate_critic)
    gen = torch.Generator().manual_seed(0)
    return [{k: v + 0.01 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
             for k, v in g.items()} for _ in range(n)]


def wire_bytes(states: list[dict[str, torch.Tensor]], params: SecAggParams) -> dict[str, int]:
    """The bytes agent 0 sends and receives in one secure round (its four calls, serialised), and
    the bytes of its update in a plain round (the float32 values)."""
    ids = [f"agent-{i:05d}" for i in range(len(states))]
    agents, server = share_in_process(ids, params)
    me, a0 = agents[ids[0]], ids[0]
    pk = server.roster[a0]
    roster = pb.SecAggReply(roster=pb.SecAggRoster(
        keys={a: pb.SecAggKeys(share_key=k.share_key, mask_key=k.mask_key) for a, k in server.roster.items()},
        alpha={a: 1 / len(ids) for a in ids}, threshold=params.threshold))
    sealed = server.sealed[a0]  # what agent 0 sent at the shares step
    relay = pb.SecAggReply(relay=pb.SecAggRelay(sealed=server.shares_for(a0), shared=server.shared))
    y = me.masked_input(agent_vector(states[0], 1 / len(ids), params), server.shared)
    answer = me.unmask(list(ids), [])
    up = [pb.SecAggMessage(agent_id=a0, run_id="r" * 22, round=1, keys=pb.SecAggKeys(share_key=pk.share_key,
                                                                                 mask_key=pk.mask_key)),
          pb.SecAggMessage(agent_id=a0, run_id="r" * 22, round=1, shares=pb.SecAggShares(sealed=sealed)),
          pb.SecAggMessage(agent_id=a0, run_id="r" * 22, round=1, masked=pb.SecAggMasked(vector=y.astype("<u8").tobytes())),
          pb.SecAggMessage(agent_id=a0, run_id="r" * 22, round=1, answer=pb.SecAggAnswer(
              shares={a: pb.SecAggShare(point=q, share=sh) for a, (q, sh) in answer.shares.items()}))]
    down = [roster, relay, pb.SecAggReply(unmask=pb.SecAggUnmask(survivors=ids)), pb.SecAggReply(done=True)]
    return {"secure_up": sum(m.ByteSize() for m in up), "secure_down": sum(m.ByteSize() for m in down),
            "plain_up": 4 * sum(v.numel() for v in states[0].values())}


def measure(agents: list[int], repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for federate_critic in (False, True):
        for n in agents:
            states, w = _states(n, federate_critic), [1.0] * n
            plain, secure, bound = [], [], 0.0
            for _ in range(repeats):
                t = time.perf_counter()
                fedavg(states, w)
                plain.append(time.perf_counter() - t)
                t = time.perf_counter()
                _, rec = secure_fedavg(states, w, SecAggParams(threshold=max(2, n * 2 // 3), context=b"bench"))
                secure.append(time.perf_counter() - t)
                bound = rec["bound"]
            p, s = statistics.median(plain), statistics.median(secure)
            rows.append({"model": "policy+critic" if federate_critic else "policy", "agents": n,
                         "values": sum(v.numel() for v in states[0].values()), "fedavg_s": p, "secure_s": s,
                         "ratio": s / p, "bound": bound,
                         "bytes_per_agent": wire_bytes(states, SecAggParams(threshold=max(2, n * 2 // 3),
                                                                           context=b"bench"))})
            print(f"{rows[-1]['model']:>13}  {n:>3} agents  {rows[-1]['values']:>9,} values  fedavg {p * 1e3:8.1f} ms  "
                  f"secure {s:7.2f} s  x{s / p:,.0f}  bound {bound:.1e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", default="5,10")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    rows = measure([int(x) for x in a.agents.split(",")], a.repeats)
    OUT.write_text(json.dumps({"command": "python -m benchmarks.system.secagg_cost", "threads": 1,
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
