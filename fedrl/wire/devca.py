"""A throwaway certificate authority for trying TLS and mutual TLS (``fedrl certs dev-ca``).

Writes, in the layout of Kubernetes TLS Secrets (``tls.crt``, ``tls.key``, ``ca.crt``), one
directory per role, each certificate good for its role only:

    <out>/ca.crt, ca.key        the CA (keep ca.key away from the services)
    <out>/aggregator/           serves only (server usage): the aggregator's names, localhost,
                                127.0.0.1 and the --host names
    <out>/evaluator/            serves and calls the aggregator (both usages): the evaluator's
                                names and the --evaluator-host names only
    <out>/<client>/             calls only (client usage, no host names): one per agent, admin;
                                with metrics.crt/metrics.key beside it to serve the process's
                                metrics endpoint (server usage, named only ``fedrl-metrics-<role>``)

Every certificate names its role in its subject's OU (``aggregator``, ``evaluator``, ``agent``,
``admin``) and its identity in its CN (the agent id, ``admin``): under mutual TLS the aggregator
refuses a call whose token's role or agent id disagrees with them (an agent certificate named
``fedrl-agent``, ``--client fedrl-agent``, is one a StatefulSet's agents share: any agent's token
goes with it). A client only takes a server whose certificate carries that service's name
(``fedrl-aggregator``, also when it dials an IP).

For development and tests only: real deployments use their own PKI (cert-manager, a corporate CA).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

# Names every server certificate carries (for clients on the same machine) and each service's own.
DEFAULT_HOSTS = ("localhost", "127.0.0.1")
SERVICE_NAMES = {
    "aggregator": ("fedrl-aggregator", "fedrl-aggregator.fedrl.svc", "fedrl-aggregator.fedrl.svc.cluster.local"),
    "evaluator": ("fedrl-evaluator", "fedrl-evaluator.fedrl.svc", "fedrl-evaluator.fedrl.svc.cluster.local"),
}


def metrics_name(role: str) -> str:
    """The name every certificate that serves a ``role``'s metrics carries (``fedrl-metrics-agent``):
    a scraper dialling pod IPs verifies it, so an agent's certificate is never taken for the
    aggregator's metrics; no gRPC client takes it for a service (they verify fedrl-aggregator /
    fedrl-evaluator)."""
    return f"fedrl-metrics-{role}"


def client_role(name: str) -> str:
    """The role a client certificate of this name is for."""
    if name == "admin":
        return "admin"
    if name == "evaluator":
        return "evaluator"
    return "agent"


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, secret: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if secret:
        os.chmod(path, 0o600)


def make_dev_ca(out: str | os.PathLike, hosts: Sequence[str] = DEFAULT_HOSTS,
                clients: Sequence[str] = ("admin", "agent-0", "agent-1", "agent-2"),
                days: int = 30, evaluator_hosts: Sequence[str] = ()) -> Path:
    """Write the CA and one certificate per role (see the module's docstring); ``hosts`` are
    extra names (or IPs) the aggregator's certificate carries beside its service names,
    ``evaluator_hosts`` the evaluator's: a certificate carries only the names of its own role, so
    none can pose as another service, even to a client that checks only the dialled host;
    ``clients`` the client identities (``evaluator`` among them is ignored: the evaluator has its
    own directory)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(out)
    now = dt.datetime.now(dt.timezone.utc)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedrl dev CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    _write(out / "ca.crt", ca_pem)
    _write(out / "ca.key", _pem_key(ca_key), secret=True)
    server, client = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH

    def leaf(cn: str, role: str, sans: Sequence[str], usage) -> tuple[bytes, bytes]:
        key = _key()
        alt = []
        for h in dict.fromkeys(sans):
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                alt.append(x509.DNSName(h))
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn),
                             x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role)])
        b = (x509.CertificateBuilder().subject_name(subject)
             .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(start).not_valid_after(end)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage(usage), critical=True))
        if alt:
            b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    def write(d: Path, pair: tuple[bytes, bytes], prefix: str = "tls") -> None:
        _write(d / f"{prefix}.crt", pair[0])
        _write(d / f"{prefix}.key", pair[1], secret=True)
        _write(d / "ca.crt", ca_pem)

    for role in ("aggregator", "evaluator"):
        if role in clients and role == "aggregator":
            raise ValueError("a client may not be called 'aggregator'")
        usage = [server] if role == "aggregator" else [server, client]  # the evaluator also calls
        extra = hosts if role == "aggregator" else evaluator_hosts
        write(out / role, leaf(SERVICE_NAMES[role][0], role, (*SERVICE_NAMES[role], metrics_name(role), *extra), usage))
    for name in clients:
        if name == "evaluator":
            continue
        role = client_role(name)
        write(out / name, leaf(name, role, (), [client]))
        # a metrics endpoint's certificate names only fedrl-metrics-<role> (scrapers verify that
        # name), never an address a gRPC client could dial and take it for a service's
        write(out / name, leaf(name, "metrics", (metrics_name(role),), [server]), prefix="metrics")
    return out
