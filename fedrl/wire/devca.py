"""A throwaway certificate authority for trying TLS and mutual TLS (``fedrl certs dev-ca``).

Writes, in the layout of Kubernetes TLS Secrets (``tls.crt``, ``tls.key``, ``ca.crt``):

    <out>/ca.crt, ca.key        the CA (keep ca.key away from the services)
    <out>/server/               the servers' certificate: aggregator and evaluator
    <out>/<client>/             one client certificate per name (agents, evaluator, admin)

For development and tests only: real deployments use their own PKI (cert-manager, a corporate CA).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "fedrl-aggregator", "fedrl-evaluator",
                 "fedrl-aggregator.fedrl.svc", "fedrl-evaluator.fedrl.svc",
                 "fedrl-aggregator.fedrl.svc.cluster.local", "fedrl-evaluator.fedrl.svc.cluster.local")


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
                clients: Sequence[str] = ("admin", "evaluator", "agent-0", "agent-1", "agent-2"),
                days: int = 30) -> Path:
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

    def leaf(name: str, sans: Sequence[str], usage) -> tuple[bytes, bytes]:
        key = _key()
        alt = []
        for h in sans:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                alt.append(x509.DNSName(h))
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
             .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(start).not_valid_after(end)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage(usage), critical=False))
        if alt:
            b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    if "server" in clients:
        raise ValueError("a client may not be called 'server'")
    # Every certificate may serve and authenticate (server and client usage, the listed host
    # names): each process here is both, e.g. an agent's metrics endpoint is scraped over TLS.
    both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    for name in ("server", *clients):
        cert, key = leaf(name if name != "server" else hosts[0], hosts, both)
        _write(out / name / "tls.crt", cert)
        _write(out / name / "tls.key", key, secret=True)
        _write(out / name / "ca.crt", ca_pem)
    return out
