"""gRPC plumbing shared by every service: servers, channels, limits, health, reflection."""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fedrl.wire.manifest import MAX_MESSAGE_BYTES
from fedrl.wire.security import TLSFiles, TokenClientInterceptor
from fedrl.wire.streams import RESERVED_WORKERS, STREAM_IDLE_SECONDS, STREAMS_PER_IDENTITY, StreamGuard

log = logging.getLogger(__name__)


# Explicit limits on both sides: a chunk (1 MiB) plus headroom, never the 4 MiB default by accident.
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
CHANNEL_OPTIONS = MESSAGE_OPTIONS + [
    # each channel its own connection: servers count streams per connection when a caller sends
    # no token (StreamGuard), and agents run as threads of one process share nothing that way
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = MESSAGE_OPTIONS + [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.so_reuseport", 0),
]


class Server:
    """A started gRPC server with health checking and reflection; ``port`` is the bound port."""

    def __init__(self, server: grpc.Server, port: int, health_servicer: health.HealthServicer,
                 services: Sequence[str]) -> None:
        self.server, self.port, self.health, self.services = server, port, health_servicer, services

    def set_serving(self, serving: bool = True) -> None:
        st = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *self.services):
            self.health.set(name, st)

    def stop(self, grace: float = 1.0) -> None:
        self.set_serving(False)
        self.server.stop(grace).wait(grace + 1.0)

    def drain(self, timeout: float = 2.0) -> bool:
        """After :meth:`stop` (and once whatever its handlers wait on is closed): wait up to
        ``timeout`` seconds for the streams' handlers to return, so that a process logs its
        last line after theirs. Whether they all did."""
        guard = getattr(self, "guard", None)
        return guard is None or guard.drained(timeout)


# Metadata an evaluator's WatchRounds carries: the aggregator then knows an evaluator follows the
# run (a hint for how long a watch waits for evaluations, not a credential: it grants nothing)
EVALUATOR_HEADER = "x-fedrl-evaluator"
DEFAULT_MAX_WORKERS = 64  # a server's worker threads unless told (the evaluator's; the aggregator's --max-workers)


def create_server(
    registrations: Sequence[tuple[Callable[[object, grpc.Server], None], object, str]],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = DEFAULT_MAX_WORKERS,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    tls: TLSFiles | None = None,
    stream_idle_seconds: float = STREAM_IDLE_SECONDS,
    streams_per_identity: int = STREAMS_PER_IDENTITY,
) -> Server:
    """Start a server on ``host:port`` (0: a free port) serving ``(add_fn, servicer, full_name)``;
    TLS (mutual when ``tls`` has a CA) when ``tls`` is given, plaintext otherwise.

    A servicer whose methods answer with bytes they serialised themselves lists those methods in
    ``PRESERIALIZED`` (full names); their replies are sent as given. Methods listed in
    ``RAW_REQUESTS`` get their requests as the bytes received, to parse themselves.

    Streams, and the unary calls a servicer lists in ``LONG_POLLS`` (they hold a worker while they
    wait), are bounded (:class:`StreamGuard`): at most ``max_workers - RESERVED_WORKERS`` (half
    the workers on a small server) at once, ``streams_per_identity`` per caller (its token where
    tokens are checked, else its connection), and a stream whose next message keeps the server
    waiting ``stream_idle_seconds`` is ended."""
    replies = frozenset(m for _, sv, _ in registrations for m in getattr(sv, "PRESERIALIZED", ()))
    requests = frozenset(m for _, sv, _ in registrations for m in getattr(sv, "RAW_REQUESTS", ()))
    # ParseRequests innermost: identity and metrics interceptors see the call first (an
    # unauthenticated caller is refused before its bytes are parsed; a refused parse is counted)
    reserve = min(RESERVED_WORKERS, max_workers // 2)
    # a token identifies a caller only where tokens are checked (else any caller could make one up)
    checked = any(getattr(getattr(i, "auth", None), "enabled", False) for i in interceptors)
    long_polls = frozenset(m for _, sv, _ in registrations for m in getattr(sv, "LONG_POLLS", ()))
    guard = StreamGuard(max(1, max_workers - reserve), streams_per_identity, stream_idle_seconds,
                        long_polls=long_polls, tokens_checked=checked)
    interceptors = [*([RawMessages(replies, requests)] if replies or requests else []), *interceptors,
                    guard, ParseRequests(requests)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
                         options=SERVER_OPTIONS, interceptors=interceptors)
    names = []
    for add, servicer, name in registrations:
        add(servicer, server)
        names.append(name)
    hs = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    if tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", tls.server_credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    server.start()
    s = Server(server, bound, hs, names)
    s.guard = guard
    s.set_serving(True)
    return s


class HealthServicer(health.HealthServicer):
    """grpc's health service with ``List`` answered (grpc's raises NotImplementedError: a
    traceback in the log for each ``grpcurl ... grpc.health.v1.Health/List``)."""

    def List(self, request, context):
        with self._lock:
            return health_pb2.HealthListResponse(statuses={
                name: health_pb2.HealthCheckResponse(status=st) for name, st in self._server_status.items()})


def _unimplemented_to_status(f, method: str):
    """A handler call that raises NotImplementedError (a servicer base class's stub) ends with
    UNIMPLEMENTED and one WARNING line, not grpc's ERROR traceback."""
    def call(request, context):
        try:
            return f(request, context)
        except NotImplementedError:
            log.warning("%s is not implemented here (from %s)", method, context.peer())
            context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented by this server")
    return call


class ParseRequests(grpc.ServerInterceptor):
    """Parses each request itself, so that bytes which are not a valid message end the call with
    ``INVALID_ARGUMENT`` naming the method, and no log line; grpc's own parser answers
    ``INTERNAL`` ("Exception deserializing request!") and logs a traceback per message, which a
    client sending garbage turns into a flood. Methods whose requests are read as bytes
    (``RAW_REQUESTS``, passed as ``raw``) parse, and refuse, them themselves."""

    def __init__(self, raw: frozenset[str] = frozenset()) -> None:
        self.raw = raw

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler_call_details.method in self.raw:
            return handler
        parse, method = handler.request_deserializer, handler_call_details.method
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            if getattr(handler, kind):
                handler = handler._replace(**{kind: _unimplemented_to_status(getattr(handler, kind), method)})

        def parsed(data, context):
            try:
                return parse(data)
            except Exception:  # DecodeError, or anything a message's parser raises on bad bytes
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request is not a valid message")

        def each(requests, context):
            for data in requests:
                yield parsed(data, context)

        if handler.unary_unary:
            f = handler.unary_unary
            return handler._replace(request_deserializer=None, unary_unary=lambda r, c: f(parsed(r, c), c))
        if handler.unary_stream:
            f = handler.unary_stream
            return handler._replace(request_deserializer=None, unary_stream=lambda r, c: f(parsed(r, c), c))
        if handler.stream_unary:
            f = handler.stream_unary
            return handler._replace(request_deserializer=None, stream_unary=lambda r, c: f(each(r, c), c))
        f = handler.stream_stream
        return handler._replace(request_deserializer=None, stream_stream=lambda r, c: f(each(r, c), c))


class RawMessages(grpc.ServerInterceptor):
    """Sends the replies of ``replies`` as the bytes their handlers return (no serializer) and
    hands the requests of ``requests`` to their handlers as the bytes received (no parser).

    For a reply that carries the same large field to many callers: serialised once, not once
    per call (see ``FederationServicer.SubmitUpdateInline`` and ``FetchGlobal``); for a request
    that is mostly one large bytes field, read in place instead of copied out of a parsed
    message (see ``FederationServicer.SubmitUpdate``)."""

    def __init__(self, replies: frozenset[str], requests: frozenset[str] = frozenset()) -> None:
        self.replies, self.requests = replies, requests

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is not None and handler_call_details.method in self.replies:
            handler = handler._replace(response_serializer=None)
        if handler is not None and handler_call_details.method in self.requests:
            handler = handler._replace(request_deserializer=None)
        return handler


def weights_calls(channel: grpc.Channel) -> tuple[Callable, Callable]:
    """``FetchGlobal`` and ``SubmitUpdate`` on ``channel`` with their weights messages as bytes:
    the fetch's replies unparsed (read them with ``fedrl.wire.serde.read_weight_messages``), the
    submission's requests already serialised (``fedrl.wire.serde.update_messages``). A chunk then
    costs one copy each way instead of three (a message built, serialised, parsed, its field
    copied out); the aggregator does the same on its side (``RawMessages``)."""
    from fedrl.proto.v1 import federation_pb2

    fetch = channel.unary_stream("/fedrl.v1.Federation/FetchGlobal",
                                 request_serializer=federation_pb2.FetchRequest.SerializeToString,
                                 response_deserializer=None)
    submit = channel.stream_unary("/fedrl.v1.Federation/SubmitUpdate", request_serializer=None,
                                  response_deserializer=federation_pb2.SubmitReply.FromString)
    return fetch, submit


def announce_port(port_file: str | None, port: int) -> None:
    """Write the bound port to ``port_file`` atomically (how launchers learn a ``--port 0``)."""
    if port_file:
        tmp = Path(port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(port_file)


class StopFlag:
    """A stop request that a signal handler may set.

    Setting it takes no lock. A handler that sets a ``threading.Event`` takes the Event's lock,
    and a second signal arriving while it holds that lock re-enters the handler in the same
    thread, which then waits forever for itself (seen: a service that never stopped after a
    burst of SIGTERMs). :meth:`wait` sleeps in short slices instead of on a lock."""

    POLL_SECONDS = 0.1

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True  # one store: atomic, and visible to every thread

    def is_set(self) -> bool:
        return self._set

    def wait(self, seconds: float = math.inf) -> bool:
        """Sleep up to ``seconds`` (default: until set), returning within POLL_SECONDS of being
        set; the flag."""
        end = time.monotonic() + seconds
        while not self._set:
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(self.POLL_SECONDS, left))
        return True


class StopSignals:
    """SIGTERM and SIGINT caught from the moment this is made (main thread only).

    Make it before the service binds its ports: a launcher or supervisor that stops a service as
    soon as it announces its port (or while it still starts) then gets a logged, clean stop, never
    the default handler's silent death in between. :meth:`wait` blocks until one arrives (at
    once if one already has) and names it."""

    def __init__(self) -> None:
        self._flag, self._got = StopFlag(), []
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self._got.append(signal.Signals(signum).name)
        self._flag.set()

    def wait(self) -> str:
        self._flag.wait()
        return self._got[0] if self._got else "a stop"


def create_health_server(host: str, port: int, interceptors: Sequence[grpc.ServerInterceptor] = ()) -> Server:
    """A plaintext server with gRPC health checking only: for probes when the main port wants
    TLS or tokens. It opens nothing else."""
    return create_server([], host, port, max_workers=4, interceptors=interceptors)


def expected_server_name(target: str, service: str = "aggregator") -> str | None:
    """The name a TLS server at ``target`` must carry in its certificate, when it is not the
    dialled host: ``fedrl-<service>`` for an IP address or localhost (where any server
    certificate of the CA naming 127.0.0.1, such as an agent's metrics certificate, would
    otherwise pass); ``$FEDRL_TLS_SERVER_NAME`` sets it (``-``: the dialled host, always)."""
    env = os.environ.get("FEDRL_TLS_SERVER_NAME")
    if env:
        return None if env == "-" else env
    host = target.rsplit(":", 1)[0] if not target.startswith("[") else target[1:].split("]")[0]
    host = host.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return f"fedrl-{service}" if host == "localhost" else None
    return f"fedrl-{service}"


def create_channel(target: str, tls: TLSFiles | None = None, token: str | None = None,
                   service: str = "aggregator") -> grpc.Channel:
    """A channel with the project's message limits and keepalives; TLS when ``tls`` is given
    (presenting its client certificate if it has one, and taking only a server whose certificate
    names ``service``: :func:`expected_server_name`), a bearer token on every call when ``token``."""
    if tls is not None:
        name = expected_server_name(target, service)
        opts = CHANNEL_OPTIONS + ([("grpc.ssl_target_name_override", name)] if name else [])
        channel = grpc.secure_channel(target, tls.channel_credentials(), options=opts)
    else:
        channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    if token:
        channel = grpc.intercept_channel(channel, TokenClientInterceptor(token))
    return channel


def wait_ready(channel: grpc.Channel, timeout: float) -> None:
    """Block until ``channel`` connects; raises ``grpc.FutureTimeoutError``."""
    grpc.channel_ready_future(channel).result(timeout=timeout)


# Codec refusals -> status codes: corruption is DATA_LOSS, an overlong stream OUT_OF_RANGE,
# everything else (bad manifest, dtype, names, shapes, NaN) INVALID_ARGUMENT.
_CODEC_STATUS = {"checksum_mismatch": grpc.StatusCode.DATA_LOSS, "truncated": grpc.StatusCode.DATA_LOSS,
                 "oversize": grpc.StatusCode.OUT_OF_RANGE, "old_contract": grpc.StatusCode.FAILED_PRECONDITION}


def codec_status(reason: str) -> grpc.StatusCode:
    """The status a :class:`fedrl.wire.codec.CodecError` with ``reason`` is answered with."""
    return _CODEC_STATUS.get(reason, grpc.StatusCode.INVALID_ARGUMENT)


STATUS_DETAILS_MAX = 1000  # characters of a refusal's message


def status_details(message: str) -> str:
    """A refusal's message, cut to :data:`STATUS_DETAILS_MAX` characters: it travels in a
    trailer, and one that echoed a caller's long string whole (an id, a tensor name) passed
    gRPC's 16 KiB of metadata, and the caller got RESOURCE_EXHAUSTED instead of the refusal."""
    if len(message) <= STATUS_DETAILS_MAX:
        return message
    return f"{message[:STATUS_DETAILS_MAX]}... (cut from {len(message)} characters)"


class ServiceError(Exception):
    """A refusal with a specific gRPC status; servicers turn it into ``context.abort``."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.code, self.message, self.reason = code, message, reason or code.name.lower()


def nothing_listens(target: str, timeout: float = 2.0) -> bool:
    """Whether ``HOST:PORT`` refuses a TCP connection outright (no server there). A name that does
    not resolve, a filtered port or a slow network are not refusals: gRPC's own wait reports those."""
    import socket

    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
    return False
