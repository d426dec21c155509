"""Bounded streams: no caller, authenticated or not, can hold every worker thread of a server.

Python's gRPC holds a worker for each open stream (and each long poll). :class:`StreamGuard`
caps them in all and per caller, and ends a stream that keeps the server waiting for its next
message; :func:`add_stream_args` makes the limits command-line options of the aggregator and
the evaluator. :func:`fedrl.wire.rpc.create_server` installs the guard on every server.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time

import grpc

log = logging.getLogger("fedrl.wire.rpc")


# Streams may hold at most this share of a server's workers: the rest answer unary calls (health,
# Control, Join) however many streams are open (an open stream holds a worker in Python's gRPC).
RESERVED_WORKERS = 8
STREAM_IDLE_SECONDS = 60.0  # a stream whose server has waited this long for its next message is ended
STREAMS_PER_IDENTITY = 8  # open streams per token, or per connection without tokens


def add_stream_args(p, workers: str = "--max-workers") -> None:
    """A server's stream limits as command-line options (aggregator and evaluator); ``workers``
    names what bounds the server's worker threads (a flag, or the fixed number)."""
    from fedrl.common import argtypes

    p.add_argument("--stream-idle-seconds", type=argtypes.positive_seconds, default=STREAM_IDLE_SECONDS,
                   help="end a stream that keeps the server waiting this long for its next message "
                        "(agents report progress while they train, every 10 s)")
    p.add_argument("--streams-per-caller", type=argtypes.at_least(1), default=STREAMS_PER_IDENTITY,
                   help="open streams one caller may hold (per token; per connection without tokens); "
                        f"all streams together may hold {workers} minus {RESERVED_WORKERS} workers")


def stream_limits(a) -> dict:
    """create_server's keyword arguments from :func:`add_stream_args`' options."""
    return {"stream_idle_seconds": a.stream_idle_seconds, "streams_per_identity": a.streams_per_caller}


def _end_call(context, code: grpc.StatusCode, details: str) -> bool:
    """End ``context``'s call now, from any thread: its status is sent and a read the handler is
    blocked in returns. grpc's ``context.abort`` only works from the handler's own thread (it
    raises there); this uses the server's internal abort (grpcio 1.85; checked by
    tests/service/test_stream_guard.py). False if this grpc lacks it."""
    try:
        from grpc import _server
        from grpc._cython import cygrpc

        state, call = context._state, context._rpc_event.call
        cy_code = getattr(cygrpc.StatusCode, code.name.lower())
        with state.condition:
            if state.client is _server._CANCELLED or state.statused:
                return True
            _server._abort(state, call, cy_code, details.encode())
            state.condition.notify_all()
        return True
    except Exception:  # another grpc: the stream then ends only with its client
        log.exception("cannot end an idle stream with this grpc version")
        return False


class _IdleWatch:
    """One thread for all of a server's streams: ends a call whose handler has waited more than
    ``limit`` seconds for the next request message."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self._waiting: dict[int, tuple[float, object, str]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _ensure(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stream-idle-watch", daemon=True)
            self._thread.start()

    def reading(self, context, method: str) -> int:
        key = id(context)
        with self._lock:
            self._ensure()
            self._waiting[key] = (time.monotonic(), context, method)
        return key

    def read(self, key: int) -> None:
        with self._lock:
            self._waiting.pop(key, None)

    def _run(self) -> None:
        tick = min(1.0, self.limit / 4)
        while True:
            time.sleep(tick)
            now = time.monotonic()
            with self._lock:
                late = [(k, c, m) for k, (t, c, m) in self._waiting.items() if now - t > self.limit]
                for k, _, _ in late:
                    self._waiting.pop(k, None)
            for _, context, method in late:
                try:  # one call's trouble (its peer gone, say) ends no other's watch
                    log.warning("%s: no message for %.0fs from %s; stream ended", method, self.limit, context.peer())
                    context._fedrl_idle = True
                    _end_call(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"{method}: no message for {self.limit:g}s; the stream was ended")
                except Exception:  # noqa: BLE001 - the watch must go on for every other stream
                    log.exception("%s: ending an idle stream raised; the watch goes on", method)


class StreamGuard(grpc.ServerInterceptor):
    """Bounds what streams can hold, in a server where each open stream holds a worker thread.

    - at most ``total`` streams (either direction) and long polls (the unary methods named in
      ``long_polls``) open at once, and ``per_identity`` per caller (its bearer token where
      ``tokens_checked``, else its connection: a header a caller makes up for free identifies
      nothing): past them a new one is refused at once with ``RESOURCE_EXHAUSTED`` and holds
      nothing; other unary calls are not counted, so health checks, Control and Join keep their
      workers;
    - a request stream whose handler waits more than ``idle`` seconds for its next message is ended
      with ``DEADLINE_EXCEEDED`` (agents send progress while they train; see federation.proto)."""

    def __init__(self, total: int, per_identity: int, idle: float, long_polls: frozenset[str] = frozenset(),
                 tokens_checked: bool = False) -> None:
        if total < 1 or per_identity < 1 or not idle > 0:
            raise ValueError(f"stream limits must be positive (total {total}, per identity {per_identity}, "
                             f"idle {idle}s)")
        self.total, self.per_identity = total, per_identity
        self.long_polls, self.tokens_checked = long_polls, tokens_checked
        self.watch = _IdleWatch(idle)
        self._lock = threading.Lock()
        self._none_open = threading.Condition(self._lock)
        self._open = 0
        self._by_identity: dict[str, int] = {}

    def _identity(self, context) -> str:
        if self.tokens_checked:  # the token was verified before the call got here
            for k, v in context.invocation_metadata() or ():
                if k == "authorization":
                    return "token:" + hashlib.sha256(str(v).encode()).hexdigest()[:16]
        return "peer:" + context.peer()

    def _enter(self, context, method: str) -> str | None:
        who = self._identity(context)
        with self._lock:
            if self._open >= self.total:
                why = f"{self._open} streams are open, the most this server takes"
            elif self._by_identity.get(who, 0) >= self.per_identity:
                why = f"this caller has {self.per_identity} streams open, the most one caller may"
            else:
                self._open += 1
                self._by_identity[who] = self._by_identity.get(who, 0) + 1
                return who
        log.warning("%s refused for %s: %s", method, context.peer(), why)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: {why}; retry later")
        return None  # not reached

    @property
    def open_streams(self) -> int:
        """Streams counted now (each until its handler returns)."""
        with self._lock:
            return self._open

    def drained(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every counted call's handler to return (its last
        log line written); whether they all did."""
        with self._none_open:
            return self._none_open.wait_for(lambda: self._open == 0, timeout)

    def _leave(self, who: str) -> None:
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self._none_open.notify_all()
            n = self._by_identity.get(who, 1) - 1
            if n:
                self._by_identity[who] = n
            else:
                self._by_identity.pop(who, None)

    def _watched(self, requests, context, method: str):
        it = iter(requests)
        while True:
            key = self.watch.reading(context, method)
            try:
                m = next(it)
            except StopIteration:
                break
            finally:
                self.watch.read(key)
            yield m
        if getattr(context, "_fedrl_idle", False):  # ended by the watch: stop the handler too
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method}: no message; the stream was ended")

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        guard = self
        if handler is not None and handler.unary_unary and method in self.long_polls:
            inner_uu = handler.unary_unary

            def long_poll(request, context):
                who = guard._enter(context, method)
                try:
                    return inner_uu(request, context)
                finally:
                    guard._leave(who)
            return handler._replace(unary_unary=long_poll)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler

        if handler.stream_unary or handler.stream_stream:
            inner = handler.stream_unary or handler.stream_stream
            if handler.stream_unary:
                def behaviour(requests, context):
                    who = guard._enter(context, method)
                    try:
                        return inner(guard._watched(requests, context, method), context)
                    finally:
                        guard._leave(who)
                return handler._replace(stream_unary=behaviour)

            def stream_behaviour(requests, context):
                who = guard._enter(context, method)
                try:
                    yield from inner(guard._watched(requests, context, method), context)
                finally:
                    guard._leave(who)
            return handler._replace(stream_stream=stream_behaviour)

        inner_us = handler.unary_stream

        def server_stream(request, context):
            who = guard._enter(context, method)
            try:
                yield from inner_us(request, context)
            finally:
                guard._leave(who)
        return handler._replace(unary_stream=server_stream)
