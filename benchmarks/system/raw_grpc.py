"""Raw gRPC byte streaming, the transfer benchmark's baseline: the same bytes in 1 MiB chunks
between the same number of client processes, with identity serialisers (no protobuf messages)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from concurrent import futures




# Rounds each raw client runs before the clock starts, as the federation's measurement leaves out
# its first round (connections, the server's threads, first-touch of fresh buffers).
RAW_WARMUP_ROUNDS = 1

def _message_sizes(total: int, chunk_bytes: int) -> list[int]:
    """``total`` bytes as messages of ``chunk_bytes``, the last one what is left (as the federation cuts a payload)."""
    return [min(chunk_bytes, total - i) for i in range(0, total, chunk_bytes)]

def _raw_server(port_q, payload_mb: int, go, stop, result_q, chunk_bytes: int = 1 << 20) -> None:
    import grpc

    from fedrl.wire.rpc import SERVER_OPTIONS
    sizes = _message_sizes(payload_mb << 20, chunk_bytes)
    blocks = {n: b"\x01" * n for n in set(sizes)}  # one message of each size, sent as often as needed
    send = [blocks[n] for n in sizes]

    def down(request, context):
        yield from send

    received = [0]  # bytes of the uploads begun once the clock runs (under the lock)
    lock = threading.Lock()

    def up(request_iterator, context):
        timed = go.is_set()  # warm-up uploads end before it is set; timed ones begin after
        n = sum(len(c) for c in request_iterator)
        if timed:
            with lock:
                received[0] += n
        return n.to_bytes(8, "little")

    handler = grpc.method_handlers_generic_handler("raw.Bytes", {
        "Down": grpc.unary_stream_rpc_method_handler(down, request_deserializer=None, response_serializer=None),
        "Up": grpc.stream_unary_rpc_method_handler(up, request_deserializer=None, response_serializer=None),
    })
    server = grpc.server(futures.ThreadPoolExecutor(32), options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_q.put(port)
    go.wait()
    cpu = time.process_time()
    stop.wait()
    # every thread's CPU while the clients ran, and the bytes uploaded in that time
    result_q.put((time.process_time() - cpu, received[0]))
    server.stop(0)

def _raw_client(port: int, payload_mb: int, rounds: int, ready_q, start, go, result_q,
                chunk_bytes: int = 1 << 20) -> None:
    import grpc

    from fedrl.wire.rpc import CHANNEL_OPTIONS
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    down = ch.unary_stream("/raw.Bytes/Down")
    up = ch.stream_unary("/raw.Bytes/Up")
    upload = [b"\x02" * n for n in _message_sizes(payload_mb << 20, chunk_bytes)]
    buf = bytearray(payload_mb << 20)

    def one_round() -> None:
        got = 0
        for c in down(b""):  # what the agent does: keep the whole payload, in a buffer it reuses
            buf[got:got + len(c)] = c
            got += len(c)
        assert got == payload_mb << 20
        n = int.from_bytes(up(iter(upload)), "little")
        assert n == payload_mb << 20

    grpc.channel_ready_future(ch).result(timeout=60)
    ready_q.put(True)  # imported and connected
    start.wait()
    for _ in range(RAW_WARMUP_ROUNDS):  # first calls: the server's threads, fresh buffers
        one_round()
    ready_q.put(True)
    go.wait()  # the clock starts when every client is warm
    t0, cpu = time.perf_counter(), time.process_time()
    for _ in range(rounds):
        one_round()
    result_q.put((time.perf_counter() - t0, time.process_time() - cpu))
    ch.close()

def raw_grpc(agents: int, payload_mb: int, rounds: int, chunk_bytes: int | None = None) -> dict:
    """Raw gRPC moving ``payload_mb`` MiB down and up per client per round, in messages of the
    federation's chunk size by default (the same message pattern, minus all the federation does)."""
    if chunk_bytes is None:
        from fedrl.wire.codec import CHUNK_BYTES as chunk_bytes
    ctx = mp.get_context("spawn")
    port_q, ready_q, result_q, server_q = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    stop, start, go = ctx.Event(), ctx.Event(), ctx.Event()
    srv = ctx.Process(target=_raw_server, args=(port_q, payload_mb, go, stop, server_q, chunk_bytes))
    srv.start()
    port = port_q.get(timeout=60)
    clients = [ctx.Process(target=_raw_client, args=(port, payload_mb, rounds, ready_q, start, go, result_q,
                                                     chunk_bytes))
               for _ in range(agents)]
    for c in clients:
        c.start()
    # Every client has imported (fedrl.wire.rpc pulls in torch: ~2 s of CPU each, so ten take several
    # seconds on two cores) and connected before the clock starts. Until 2026-11-25 this was a
    # 3 s sleep, and the raw wall time took in the last clients' start-up: raw measured slower
    # than the whole federation moving the same bytes (ratios of 1.4-2.1).
    # Since 2026-11-25 (evening) each client also runs a warm-up round first (the federation's
    # rounds are read after its first, so raw's were the only ones paying for first calls).
    [ready_q.get(timeout=120) for _ in clients]
    start.set()
    [ready_q.get(timeout=600) for _ in clients]
    t0 = time.perf_counter()
    go.set()
    done = [result_q.get(timeout=600) for _ in clients]
    wall = time.perf_counter() - t0
    for c in clients:
        c.join(30)
    stop.set()
    server_cpu, uploaded = server_q.get(timeout=60)
    srv.join(30)
    moved = 2 * agents * rounds * payload_mb * (1 << 20)
    clients_cpu = sum(c for _, c in done)
    return {"seconds": wall, "bytes": moved, "mb_per_s": moved / wall / 1e6, "bytes_uploaded_timed": uploaded,
            "cpu_ms_per_round": {"server": round(server_cpu / rounds * 1e3, 1),
                                 "clients_total": round(clients_cpu / rounds * 1e3, 1)}}
