"""The metrics endpoint: a service's Prometheus registry served over HTTP(S), and the options
that start it.

Under TLS it serves HTTPS, and requires a client certificate where the service's directory has
a CA, as the gRPC port does. Each connection is bounded in time and the connections open at once
are capped, with spare slots kept for the scraper (an admin certificate, or the bearer token in
``FEDRL_METRICS_TOKEN``), so no other client can keep the scrapes out.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import ssl
import threading
import time
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from fedrl.common import argtypes


# The environment variable holding the metrics credential's token (at least 16 characters):
# a scrape that sends ``Authorization: Bearer <it>`` is the scraper's.
METRICS_TOKEN_ENV = "FEDRL_METRICS_TOKEN"
# Under mutual TLS, a client certificate whose subject OU names one of these roles is the
# scraper's (the monitors in deploy/ present the admin's certificate).
SCRAPER_CERT_ROLES = frozenset({"admin"})


def serve_metrics(registry: CollectorRegistry, host: str, port: int, tls=None, token: str | None = None) -> int:
    """Serve ``registry`` at ``http(s)://host:port/metrics`` in a daemon thread; returns the port.

    With ``tls`` (a :class:`fedrl.wire.security.TLSFiles` read from a directory) the endpoint is
    HTTPS with the service's certificate, and requires a client certificate from the same CA
    when the directory has ``ca.crt``, like the gRPC port. The scraper's credential, ``token``
    as a bearer token or (under mutual TLS) a certificate of a role in ``SCRAPER_CERT_ROLES``,
    puts its scrapes ahead of every other client's connections (see :class:`_MetricsServer`).
    """
    if token is not None and len(token) < 16:
        raise ValueError(f"the metrics token (${METRICS_TOKEN_ENV}) is shorter than 16 characters")
    ctx = None
    files = tls.metrics_files() if tls is not None else None
    if files is not None:  # a trust-only directory cannot serve TLS
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(files[0]), str(files[1]))
        if tls.ca is not None:
            ctx.load_verify_locations(str(Path(tls.source) / "ca.crt"))
            ctx.verify_mode = ssl.CERT_REQUIRED
    httpd = _MetricsServer((host, port), _QuietHandler, ctx, token)
    httpd.set_app(make_wsgi_app(registry))
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return int(httpd.server_port)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.server.is_scraper_token(self.headers.get("Authorization", "")):
            self.server.mark_scraper()
        elif self.server.waiting():  # in a spare slot without the scraper's credential
            self.send_error(503, "Busy", "every metrics connection is taken; this one was kept for the scraper")
            return False
        return True


def _cut_off(sock: socket.socket) -> None:
    """End a connection from another thread: its blocked reads and writes return at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Conn:
    """One open connection: its socket (the TLS one once wrapped), client address, arrival,
    whether it holds a spare slot, showed the scraper's credential, was cut off."""

    __slots__ = ("sock", "who", "since", "spare", "scraper", "cut")

    def __init__(self, sock: socket.socket, who: str, spare: bool) -> None:
        self.sock, self.who, self.since, self.spare, self.scraper, self.cut = (
            sock, who, time.monotonic(), spare, False, False)


def _cut(conn: _Conn) -> None:
    conn.cut = True
    _cut_off(conn.sock)


class _MetricsServer(ThreadingMixIn, WSGIServer):
    """The metrics endpoint: each connection in its own thread, its TLS handshake there too (not in
    the accepting loop, where one client that connects and never starts its handshake stopped
    every scrape: prometheus_client wraps the listening socket); every connection lives at most
    ``TIMEOUT`` seconds in all (a client trickling a byte at a time is cut off too).

    ``MAX_CONNECTIONS`` connections are served as they come, at most ``PER_CLIENT`` from one client
    address. Past either bound a connection gets one of ``SPARE`` spare slots, kept for the scraper:
    it must show the scraper's credential (its client certificate at the handshake, or its bearer
    token in its request) within ``SPARE_SECONDS``, else it is cut off (a request without it gets
    503). When every spare slot is waiting, a newcomer takes the oldest one's. A credential is
    shown within milliseconds of connecting, so whatever other clients hold or keep reopening,
    from any address, the scraper's scrapes get through; a client would have to open ``SPARE``
    connections within one scrape's handshake to cut one off."""

    daemon_threads = True
    allow_reuse_address = True
    TIMEOUT = 10.0
    MAX_CONNECTIONS = 64
    PER_CLIENT = 8
    SPARE = 16
    SPARE_SECONDS = 2.0
    MAX_SCRAPER = 16  # the scraper's own connections in spare slots
    request_queue_size = 128  # the listen backlog (socketserver's 5 dropped SYNs under a flood)

    def __init__(self, address, handler, ctx: ssl.SSLContext | None, token: str | None = None) -> None:
        self.ctx = ctx
        self._token = hashlib.sha256(token.encode()).digest() if token else None
        self._conns: dict[int, _Conn] = {}  # by id(raw socket)
        self._lock = threading.Lock()
        self._local = threading.local()  # the connection a handler thread serves
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def get_request(self):
        conn, addr = self.socket.accept()
        conn.settimeout(self.TIMEOUT)
        return conn, addr

    def process_request(self, request, client_address):
        who, cut = client_address[0], None
        with self._lock:
            conns = self._conns.values()
            served = [c for c in conns if not c.spare]
            if (len(served) < self.MAX_CONNECTIONS
                    and sum(1 for c in served if c.who == who) < self.PER_CLIENT):
                conn = _Conn(request, who, spare=False)
            elif sum(1 for c in conns if c.spare and c.scraper) >= self.MAX_SCRAPER:
                conn = None
            else:
                waiting = [c for c in conns if c.spare and not c.scraper]
                if len(waiting) >= self.SPARE:
                    cut = min(waiting, key=lambda c: c.since)
                    del self._conns[id(cut.sock)]
                conn = _Conn(request, who, spare=True)
            if conn is not None:
                self._conns[id(request)] = conn
        if cut is not None:
            _cut(cut)
        if conn is None:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        raw = request
        conn = self._local.conn = self._conns.get(id(raw))
        if conn is None:  # its slot was taken before its thread started
            raw.close()
            return
        timers = [threading.Timer(self.TIMEOUT, _cut, (conn,))]  # the connection's whole life, bounded
        if conn.spare:
            timers.append(threading.Timer(self.SPARE_SECONDS, self._cut_unless_scraper, (conn,)))
        for t in timers:
            t.daemon = True
            t.start()
        try:
            if self.ctx is not None:
                try:
                    # wrapping moves the descriptor to a new socket object: a cut from now on must
                    # shut that one down, so the handshake runs only once conn holds it
                    request = conn.sock = self.ctx.wrap_socket(raw, server_side=True,
                                                               do_handshake_on_connect=False)
                    if conn.cut:
                        raise OSError("cut off")
                    request.do_handshake()
                except (OSError, ValueError):
                    request.close()
                    return
                if _cert_role(request.getpeercert()) in SCRAPER_CERT_ROLES:
                    self.mark_scraper()
                elif self.waiting():
                    request.close()
                    return
            super().process_request_thread(request, client_address)
        finally:
            for t in timers:
                t.cancel()
            with self._lock:
                if self._conns.get(id(raw)) is conn:
                    del self._conns[id(raw)]
            self._local.conn = None

    def _cut_unless_scraper(self, conn: _Conn) -> None:
        if not conn.scraper:
            _cut(conn)

    def is_scraper_token(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        return (self._token is not None and scheme.lower() == "bearer"
                and hmac.compare_digest(hashlib.sha256(token.strip().encode()).digest(), self._token))

    def mark_scraper(self) -> None:
        """The connection this thread serves showed the scraper's credential."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            with self._lock:
                conn.scraper = True

    def waiting(self) -> bool:
        """Whether this thread's connection holds a spare slot without the scraper's credential."""
        conn = getattr(self._local, "conn", None)
        return conn is None or (conn.spare and not conn.scraper)

    def handle_error(self, request, client_address):  # a client gone mid-answer is not news
        pass


def _cert_role(cert: dict | None) -> str:
    """The subject OU of a peer certificate as ``ssl`` gives it, or ''."""
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "organizationalUnitName":
                return value
    return ""


def add_metrics_args(p) -> None:
    """``--metrics-port``/``--metrics-port-file``, the same on every service's command line."""
    p.add_argument("--metrics-port", type=argtypes.port, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port; "
                        "default: no metrics endpoint). A scrape with 'Authorization: Bearer "
                        f"${METRICS_TOKEN_ENV}' (or, under mutual TLS, the admin's certificate) "
                        "gets through whatever other clients hold")
    p.add_argument("--metrics-port-file", default=None, help="write the bound metrics port here")


def start_metrics_from_args(a, registry: CollectorRegistry, tls=None) -> int | None:
    """Start the endpoint the parsed ``a`` asks for (on ``a.host``); returns its port or None."""
    if a.metrics_port is None:
        return None
    from fedrl.wire.rpc import announce_port

    port = serve_metrics(registry, a.host, a.metrics_port, tls, os.environ.get(METRICS_TOKEN_ENV) or None)
    announce_port(a.metrics_port_file, port)
    return port


def start_side_endpoints(a, registry: CollectorRegistry, log, interceptors=(), tls=None):
    """The health-only gRPC port (``--health-port``) and the metrics port (``--metrics-port``)
    a service's parsed args ask for, each logged; returns the health server (or None) to stop."""
    from fedrl.wire.rpc import create_health_server

    health = None
    if getattr(a, "health_port", None) is not None:
        health = create_health_server(a.host, a.health_port, interceptors=interceptors)
        log.info("health checking on %s:%d", a.host, health.port)
    mport = start_metrics_from_args(a, registry, tls)
    if mport is not None:
        log.info("metrics on %s://%s:%d/metrics", "https" if tls and tls.cert else "http", a.host, mport)
    return health
