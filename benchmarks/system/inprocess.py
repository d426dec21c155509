"""A round's own work without gRPC: the aggregator's and the agents' code paths called in one
process, so the services' overhead can be set beside what the round itself costs."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from benchmarks.system.procs import WARMUP_ROUNDS, dataset




class _LocalContext:
    """What the servicer asks of a gRPC context, for calls made in-process (no peer, no token)."""

    def is_active(self) -> bool:
        return True

    def invocation_metadata(self) -> tuple:
        return ()

    def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")

def bench_inprocess(agents: int, rounds: int, repeats: int = 5) -> dict:
    """The round's own work without gRPC: the aggregator's servicer and coordinator and N agents
    in this one process, each round every agent taking its task as the Session stream sends it
    (serialised), training zero steps and answering with its serialised update, which the
    servicer checks and takes as it does off the stream. CPU per round (min over ``repeats``
    blocks), split between the two sides, and one agent's ``_train`` alone (timeit, min of 3)."""
    import timeit

    import torch

    from agent_service.client import Agent, AgentConfig
    from aggregator_service.coordinator import Coordinator
    from aggregator_service.servicer import FederationServicer, session_answer
    from aggregator_service.store import Store
    from fedrl.federation.simulate import load_shards
    from fedrl.ops.metrics import AggregatorMetrics
    from fedrl.wire.security import Authenticator
    from fedrl.wire.serde import read_task, session_update

    torch.set_num_threads(1)
    ctx = _LocalContext()
    with tempfile.TemporaryDirectory() as d:
        data = dataset(Path(d))
        shards, env = load_shards([f"{data}:{agents}"], agents, 5, 0, None, lambda *_: None)
        coord = Coordinator(Store(Path(d) / "state"), metrics=AggregatorMetrics())
        svc = FederationServicer(coord, Authenticator())
        members = [Agent(AgentConfig("in-process", f"agent-{i}", i, env.gym_id, torch.device("cpu")), shards[i])
                   for i in range(agents)]
        class LocalStub:  # what Agent._join calls, answered by the servicer in this process
            def Join(self, request, **_):
                return svc.Join(request, ctx)

        for a in members:
            a._join(LocalStub())  # the agent's own JoinRequest
        block = max(1, rounds // repeats)
        timed = WARMUP_ROUNDS + block * repeats  # then one more round, open while _train is timed alone
        coord.start_run(json.dumps({"algo": "drpo", "agents": agents, "rounds": timed + 1,
                                    "local_steps": 0, "eval_episodes": 0}))
        split = {"aggregator": 0.0, "agents": 0.0}

        def one_round() -> None:
            for a in members:
                t0 = time.process_time()
                _, task, _ = svc._task(ctx, a.cfg.agent_id, 1.0)
                t1 = time.process_time()
                up = session_update(*a._train(None, *read_task(task)))
                t2 = time.process_time()
                _, header, payload = session_answer(up, ctx)
                svc._submit_inline(ctx, header, payload)
                t3 = time.process_time()
                split["aggregator"] += (t1 - t0) + (t3 - t2)
                split["agents"] += t2 - t1

        for _ in range(WARMUP_ROUNDS):
            one_round()
        blocks = []
        for _ in range(repeats):
            split.update(aggregator=0.0, agents=0.0)
            t = time.process_time()
            for _ in range(block):
                one_round()
            blocks.append(((time.process_time() - t) / block * 1e3, split["aggregator"] / block * 1e3,
                           split["agents"] / block * 1e3))
        best = min(blocks)
        a = members[0]
        _, task_bytes, _ = svc._task(ctx, a.cfg.agent_id, 1.0)
        task = read_task(task_bytes)
        train_us = min(timeit.repeat(lambda: a._train(None, *task), number=200, repeat=3)) / 200 * 1e6
        closed = coord.status()["global_version"]
        coord.close()
    return {"agents": agents, "rounds_per_block": block, "rounds_closed": closed,
            "cpu_ms_per_round": round(best[0], 3),
            "aggregator_cpu_ms_per_round": round(best[1], 3), "agents_cpu_ms_per_round": round(best[2], 3),
            "agent_train_us": round(train_us, 1),
            "what": "aggregator servicer + coordinator and the agents' per-round work in one process, no gRPC; "
                    "cpu per round is the best of the blocks"}
