"""What Python gRPC alone costs per federation round, for three message patterns.

    python -m benchmarks.system.grpc_patterns [--agents 10] [--rounds 200] [--bytes 282352] [--repeats 2]

N client processes and one server exchange, per round, the global payload down and an update
of the same size up, with identity serialisers and no work: the floor any round built on that
pattern stands on. Patterns:

- ``two-calls``: a long-poll call that returns the task with the weights inline and a unary
  submit (the federation's first protocol);
- ``one-call``: a submit answered with the next round's task (one call per agent per round:
  ``agent_service --transport calls``);
- ``session``: one bidirectional stream per agent for the whole run, a message each way per round
  (the agents' default, the Session RPC);
- ``session-aio``: the same stream from a ``grpc.aio`` client (one event loop, messages written
  with ``call.write``: no thread consuming a request iterator), against the same server.

The server closes a round when all N updates are in and releases the waiting clients.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import threading
import time
from concurrent import futures

import numpy as np

PATTERNS = ("two-calls", "one-call", "session", "session-aio")
WARMUP_ROUNDS = 3  # the first rounds include connection set-up


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _server(port_q, result_q, pattern: str, agents: int, rounds: int, payload_bytes: int) -> None:
    import grpc

    from fedrl.wire.rpc import SERVER_OPTIONS
    payload = b"\x01" * payload_bytes
    cond = threading.Condition()
    st = {"round": 1, "subs": 0, "closed": [], "cpu": {}}

    def wait_next(last: int) -> bytes:  # the next round's number and the global payload
        with cond:
            while st["round"] == last:
                cond.wait(10)
            r = st["round"]
        return b"stop" if r > rounds else b"%08d" % r + payload

    def update_in() -> None:
        with cond:
            st["subs"] += 1
            if st["subs"] == agents:
                st["closed"].append(time.perf_counter())
                if len(st["closed"]) in (WARMUP_ROUNDS, rounds):
                    st["cpu"][len(st["closed"])] = _cpu()
                st["subs"], st["round"] = 0, st["round"] + 1
                cond.notify_all()

    def task(request, context):
        return wait_next(int(request))

    def submit(request, context):
        update_in()
        return b"ok"

    def submit_next(request, context):
        update_in()
        return wait_next(int(request[:8]))

    def session(request_iterator, context):
        next(request_iterator)  # join
        last = 0
        while True:
            msg = wait_next(last)
            yield msg
            if msg == b"stop":
                return
            last = int(msg[:8])
            next(request_iterator)
            update_in()

    handler = grpc.method_handlers_generic_handler("bare.Round", {
        "Task": grpc.unary_unary_rpc_method_handler(task),
        "Submit": grpc.unary_unary_rpc_method_handler(submit),
        "SubmitNext": grpc.unary_unary_rpc_method_handler(submit_next),
        "Session": grpc.stream_stream_rpc_method_handler(session)})
    server = grpc.server(futures.ThreadPoolExecutor(64), options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_q.put(port)
    with cond:
        while st["round"] <= rounds:
            cond.wait(1)
    t = np.diff(st["closed"])[WARMUP_ROUNDS - 1:] * 1e3
    result_q.put({"round_ms_median": float(np.median(t)), "rounds_measured": len(t),
                  "server_cpu_ms_per_round": (st["cpu"][rounds] - st["cpu"][WARMUP_ROUNDS])
                  / (rounds - WARMUP_ROUNDS) * 1e3})
    time.sleep(0.5)  # let the clients read their STOP
    server.stop(0)


def _client(port: int, pattern: str, rounds: int, cpu_q) -> None:
    import queue

    import grpc

    from fedrl.wire.rpc import CHANNEL_OPTIONS
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    cpu_at = None

    def seen(r: int) -> None:
        nonlocal cpu_at
        if r == WARMUP_ROUNDS + 1:
            cpu_at = _cpu()

    if pattern == "session-aio":
        import asyncio

        async def session() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ach:
                call = ach.stream_stream("/bare.Round/Session")(timeout=600)
                await call.write(b"join")
                while (msg := await call.read()) not in (b"stop", grpc.aio.EOF):
                    seen(int(msg[:8]))
                    await call.write(msg[8:])  # the update: as many bytes as the global payload
                await call.done_writing()
        asyncio.run(session())
    elif pattern == "session":
        out: queue.Queue = queue.Queue()

        def requests():
            yield b"join"
            while (m := out.get()) is not None:
                yield m
        for msg in ch.stream_stream("/bare.Round/Session")(requests(), timeout=600):
            if msg == b"stop":
                out.put(None)
                break
            seen(int(msg[:8]))
            out.put(msg[8:])  # the update: as many bytes as the global payload
    else:
        task, submit = ch.unary_unary("/bare.Round/Task"), ch.unary_unary("/bare.Round/Submit")
        submit_next = ch.unary_unary("/bare.Round/SubmitNext")
        b = task(b"0", timeout=60)
        while b != b"stop":
            r = int(b[:8])
            seen(r)
            if pattern == "one-call":
                b = submit_next(b"%08d" % r + b[8:], timeout=60)
            else:
                submit(b[8:], timeout=60)
                b = task(b"%d" % r, timeout=60)
    cpu_q.put((_cpu() - cpu_at) / (rounds - WARMUP_ROUNDS) * 1e3)
    ch.close()


def rounds(pattern: str, agents: int, n_rounds: int, payload_bytes: int, timeout: float = 600.0) -> dict:
    """Run ``n_rounds`` of ``pattern`` with ``agents`` client processes; per-round wall and CPU.
    Raises ``queue.Empty`` if the run does not finish within ``timeout`` seconds."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}")
    if n_rounds <= WARMUP_ROUNDS + 1:
        raise ValueError(f"need more than {WARMUP_ROUNDS + 1} rounds")
    ctx = mp.get_context("spawn")
    port_q, result_q, cpu_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    srv = ctx.Process(target=_server, args=(port_q, result_q, pattern, agents, n_rounds, payload_bytes))
    srv.start()
    port = port_q.get(timeout=60)
    clients = [ctx.Process(target=_client, args=(port, pattern, n_rounds, cpu_q)) for _ in range(agents)]
    for c in clients:
        c.start()
    try:
        res = result_q.get(timeout=timeout)
        res["clients_cpu_ms_per_round"] = sum(cpu_q.get(timeout=60) for _ in clients)
    finally:
        for proc in (*clients, srv):
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    return {"pattern": pattern, **res}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=10)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--bytes", type=int, default=282_352, help="payload each way (default: the Hopper policy)")
    p.add_argument("--repeats", type=int, default=2, help="patterns are run in turn, this many times")
    a = p.parse_args(argv)
    for _ in range(a.repeats):
        for pattern in PATTERNS:
            print(json.dumps(rounds(pattern, a.agents, a.rounds, a.bytes)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
