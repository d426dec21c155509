"""Identity on the wire: TLS / mutual TLS credentials and bearer tokens with roles.

**TLS.** A service given a TLS directory (``--tls-dir``, or ``$FEDRL_TLS_DIR``) in the layout of
a Kubernetes TLS Secret (``tls.crt``, ``tls.key``, optional ``ca.crt``) serves TLS; with
``ca.crt`` present it also requires and verifies client certificates (mutual TLS). A client
given a directory trusts its ``ca.crt`` and presents its ``tls.crt``/``tls.key`` when present.
``fedrl certs dev-ca`` makes such directories for trying it (never for production).

**Tokens.** The aggregator knows one token per agent (``$FEDRL_AGENT_TOKENS`` =
``agent-0=t0,agent-1=t1`` or ``--agent-tokens-file``), one evaluator token and one admin token
(``$FEDRL_EVALUATOR_TOKEN``, ``$FEDRL_ADMIN_TOKEN``). Clients send ``authorization: Bearer <token>``.
With any token configured, every RPC except health checking needs one:

    no or unknown token                         -> UNAUTHENTICATED
    a known token calling outside its role      -> PERMISSION_DENIED  (e.g. an agent calling Control)
    an agent's token used for another agent id  -> PERMISSION_DENIED

Roles: agents may Join, NextTask, Session, FetchGlobal, SubmitUpdate[Inline] (as themselves); the evaluator may
watch, read status, report evaluations and fetch global versions; the admin may do all of
that except act as an agent. Tokens are looked up by their SHA-256 (the same work per RPC for
any number of agents). Without TLS they travel in clear text: use both outside a trusted network.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

AGENT, EVALUATOR, ADMIN = "agent", "evaluator", "admin"
OPEN = "open"  # no token needed

# "/service/Method" -> roles allowed; "service/*" covers a whole service.
POLICY: dict[str, frozenset[str]] = {
    "/fedrl.v1.Federation/Join": frozenset({AGENT}),
    "/fedrl.v1.Federation/NextTask": frozenset({AGENT}),
    "/fedrl.v1.Federation/SubmitUpdate": frozenset({AGENT}),
    "/fedrl.v1.Federation/SubmitUpdateInline": frozenset({AGENT}),
    "/fedrl.v1.Federation/Session": frozenset({AGENT}),
    "/fedrl.v1.Federation/SecureAggregation": frozenset({AGENT}),
    "/fedrl.v1.Federation/FetchGlobal": frozenset({AGENT, EVALUATOR, ADMIN}),
    "/fedrl.v1.Control/StartRun": frozenset({ADMIN}),
    "/fedrl.v1.Control/StopRun": frozenset({ADMIN}),
    "/fedrl.v1.Control/GetStatus": frozenset({ADMIN, EVALUATOR}),
    "/fedrl.v1.Control/WatchRounds": frozenset({ADMIN, EVALUATOR}),
    "/fedrl.v1.Control/ReportEvaluation": frozenset({ADMIN, EVALUATOR}),
    "/fedrl.v1.Control/ListRuns": frozenset({ADMIN, EVALUATOR}),
    "/fedrl.v1.Control/ListVersions": frozenset({ADMIN, EVALUATOR}),
    "/fedrl.v1.Evaluator/*": frozenset({ADMIN, EVALUATOR}),
    "/grpc.health.v1.Health/*": frozenset({OPEN}),
    "/grpc.reflection.v1alpha.ServerReflection/*": frozenset({AGENT, EVALUATOR, ADMIN}),
    "/grpc.reflection.v1.ServerReflection/*": frozenset({AGENT, EVALUATOR, ADMIN}),
}


class SecurityConfigError(ValueError):
    pass


# --------------------------------------------------------------------------------------------
# TLS
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TLSFiles:
    cert: bytes | None
    key: bytes | None
    ca: bytes | None
    source: str = ""
    # metrics.crt/metrics.key: what a client-only process (an agent) serves its metrics with
    metrics_cert: bytes | None = None
    metrics_key: bytes | None = None

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> "TLSFiles":
        d = Path(directory)
        if not d.is_dir():
            raise SecurityConfigError(f"TLS directory {d} does not exist")

        def read(name: str) -> bytes | None:
            p = d / name
            return p.read_bytes() if p.exists() else None

        files = cls(read("tls.crt"), read("tls.key"), read("ca.crt"), str(d), read("metrics.crt"), read("metrics.key"))
        if (files.cert is None) != (files.key is None):
            raise SecurityConfigError(f"{d}: tls.crt and tls.key go together (found only one)")
        if (files.metrics_cert is None) != (files.metrics_key is None):
            raise SecurityConfigError(f"{d}: metrics.crt and metrics.key go together (found only one)")
        if files.cert is None and files.ca is None:
            raise SecurityConfigError(f"{d}: neither tls.crt/tls.key nor ca.crt found")
        return files

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise SecurityConfigError(f"{self.source}: a server needs tls.crt and tls.key")
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.ca is not None)

    def metrics_files(self) -> tuple[Path, Path] | None:
        """(certificate, key) files the metrics endpoint serves with: metrics.* when present
        (a client certificate may not serve), else tls.*; None when there is neither."""
        d = Path(self.source)
        if self.metrics_cert is not None:
            return d / "metrics.crt", d / "metrics.key"
        if self.cert is not None:
            return d / "tls.crt", d / "tls.key"
        return None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def tls_from_args(tls_dir: str | None) -> TLSFiles | None:
    d = tls_dir or os.environ.get("FEDRL_TLS_DIR")
    return TLSFiles.from_dir(d) if d else None


# --------------------------------------------------------------------------------------------
# Tokens
# --------------------------------------------------------------------------------------------
def parse_agent_tokens(text: str, source: str = "agent tokens") -> dict[str, str]:
    """``id=token`` pairs separated by commas or new lines -> {agent_id: token}."""
    out: dict[str, str] = {}
    for item in text.replace("\n", ",").split(","):
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        agent_id, sep, token = item.partition("=")
        agent_id, token = agent_id.strip(), token.strip()
        if not sep or not agent_id or not token:
            raise SecurityConfigError(f"{source}: expected AGENT_ID=TOKEN, got {item.split('=')[0]!r}=...")
        if agent_id in out:
            raise SecurityConfigError(f"{source}: agent {agent_id!r} listed twice")
        out[agent_id] = token
    return out


class Authenticator:
    """Maps bearer tokens to (role, identity); disabled when no token is configured."""

    def __init__(self, admin_token: str | None = None, evaluator_token: str | None = None,
                 agent_tokens: Mapping[str, str] | None = None) -> None:
        # Keyed by the token's SHA-256: one lookup per RPC whatever the number of agents, and
        # no byte-by-byte comparison of a secret an attacker could time.
        self._by_digest: dict[bytes, tuple[str, str]] = {}
        for token, role, ident in ([(admin_token, ADMIN, "admin"), (evaluator_token, EVALUATOR, "evaluator")]
                                   + [(t, AGENT, a) for a, t in (agent_tokens or {}).items()]):
            if token:
                if len(token) < 16:
                    raise SecurityConfigError(f"the {role} token for {ident} is shorter than 16 characters")
                digest = hashlib.sha256(token.encode()).digest()
                if digest in self._by_digest:
                    raise SecurityConfigError("two identities share one token")
                self._by_digest[digest] = (role, ident)
        self.enabled = bool(self._by_digest)

    @classmethod
    def from_env(cls, agent_tokens_file: str | None = None) -> "Authenticator":
        agents = {}
        if agent_tokens_file:
            agents = parse_agent_tokens(Path(agent_tokens_file).read_text(), agent_tokens_file)
        elif os.environ.get("FEDRL_AGENT_TOKENS"):
            agents = parse_agent_tokens(os.environ["FEDRL_AGENT_TOKENS"], "$FEDRL_AGENT_TOKENS")
        return cls(os.environ.get("FEDRL_ADMIN_TOKEN"), os.environ.get("FEDRL_EVALUATOR_TOKEN"), agents)

    def identify(self, metadata) -> tuple[str, str] | None:
        """(role, identity) of the bearer token in ``metadata``, or None."""
        value = ""
        for k, v in metadata or ():
            if k == "authorization":
                value = v
                break
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        return self._by_digest.get(hashlib.sha256(token.strip().encode()).digest())

    def check_agent(self, context: grpc.ServicerContext, agent_id: str) -> None:
        """Abort with PERMISSION_DENIED unless the caller's token is ``agent_id``'s own."""
        if not self.enabled:
            return
        who = self.identify(context.invocation_metadata())
        if who is None or who[0] != AGENT or who[1] != agent_id:
            ident = who[1] if who else "nobody"
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"this token belongs to {ident}, which may not act as agent {agent_id[:80]!r}")


def allowed_roles(method: str) -> frozenset[str]:
    if method in POLICY:
        return POLICY[method]
    return POLICY.get(method.rpartition("/")[0] + "/*", frozenset())


def _deny(handler, code: grpc.StatusCode, message: str):
    def abort(request, context):
        context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses RPCs whose bearer token is missing, unknown, or outside the method's roles."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not self.auth.enabled:
            return handler
        roles = allowed_roles(handler_call_details.method)
        if OPEN in roles:
            return handler
        who = self.auth.identify(handler_call_details.invocation_metadata)
        if who is None:
            return _deny(handler, grpc.StatusCode.UNAUTHENTICATED,
                         "missing or unknown bearer token (metadata 'authorization: Bearer <token>')")
        if who[0] not in roles:
            return _deny(handler, grpc.StatusCode.PERMISSION_DENIED,
                         f"{who[1]} ({who[0]}) may not call {handler_call_details.method}")
        return _checking_certificate(handler, who)


# The roles a certificate's subject OU may name (fedrl certs dev-ca writes them): a call under
# mutual TLS whose certificate names one must carry a token of that role, and of the agent the
# certificate names (unless it names the shared ``fedrl-agent``). Certificates without such an OU
# (another PKI) leave the decision to the tokens.
CERT_ROLES = frozenset({AGENT, EVALUATOR, ADMIN, "aggregator", "metrics"})
SHARED_AGENT_CN = "fedrl-agent"


def certificate_identity(context) -> tuple[str, str] | None:
    """(role, common name) from the peer's client certificate when its subject names a fedrl role."""
    try:
        ac = context.auth_context()
    except Exception:
        return None
    subject = b"".join(ac.get("x509_subject", [])).decode(errors="replace")
    parts = dict(p.split("=", 1) for p in subject.split(",") if "=" in p)
    role = parts.get("OU", "")
    if role not in CERT_ROLES:
        return None
    return role, parts.get("CN", "")


def certificate_disagrees(context, who: tuple[str, str]) -> str | None:
    """Why the peer's certificate does not match its token ``who`` = (role, identity), or None."""
    cert = certificate_identity(context)
    if cert is None:
        return None
    role, cn = cert
    if role != who[0]:
        return f"the token of {who[1]} ({who[0]}) came with the certificate of {cn} ({role})"
    if role == AGENT and cn != SHARED_AGENT_CN and cn != who[1]:
        return f"the token of agent {who[1]!r} came with the certificate of agent {cn!r}"
    return None


def _checking_certificate(handler, who: tuple[str, str]):
    """``handler``, refusing (PERMISSION_DENIED) a call whose client certificate disagrees with ``who``."""
    def check(context):
        why = certificate_disagrees(context, who)
        if why is not None:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    def answer(f):  # a handler that returns its reply
        def call(request, context):
            check(context)
            return f(request, context)
        return call

    def stream(f):  # a handler that yields its replies
        def call(request, context):
            check(context)
            yield from f(request, context)
        return call

    for kind, wrap in (("unary_unary", answer), ("stream_unary", answer), ("unary_stream", stream),
                       ("stream_stream", stream)):
        f = getattr(handler, kind)
        if f is not None:
            return handler._replace(**{kind: wrap(f)})
    return handler


class TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, d):
        md = [*(d.metadata or ()), self.header]
        return _CallDetails(d.method, d.timeout, md, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, d, request):
        return continuation(self._details(d), request)

    def intercept_unary_stream(self, continuation, d, request):
        return continuation(self._details(d), request)

    def intercept_stream_unary(self, continuation, d, request_iterator):
        return continuation(self._details(d), request_iterator)

    def intercept_stream_stream(self, continuation, d, request_iterator):
        return continuation(self._details(d), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def add_tls_arg(p, default=None) -> None:
    p.add_argument("--tls-dir", default=default, metavar="DIR",
                   help="TLS files in Kubernetes Secret layout: tls.crt + tls.key (serve or present), "
                        "ca.crt (trust; on a server: require client certificates). Default $FEDRL_TLS_DIR; "
                        "none: plaintext")
