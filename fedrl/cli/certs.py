"""``fedrl certs ...``: certificates for trying TLS and mutual TLS."""

from __future__ import annotations

import argparse

from fedrl.common import argtypes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("certs", help="certificates for trying TLS / mutual TLS")
    csub = p.add_subparsers(dest="certs_cmd", required=True)
    d = csub.add_parser("dev-ca", help="a throwaway CA and one certificate per role: the aggregator's and "
                                       "the evaluator's (servers), the agents' and the admin's (clients) "
                                       "(development and tests only)")
    d.add_argument("--out", required=True,
                   help="directory to write (ca.crt, aggregator/, evaluator/, <client>/)")
    d.add_argument("--host", action="append", default=None,
                   help="extra name or IP the aggregator's certificate carries beside its service name "
                        "fedrl-aggregator (repeatable; default localhost and 127.0.0.1)")
    d.add_argument("--evaluator-host", action="append", default=None,
                   help="extra name or IP the evaluator's certificate carries beside fedrl-evaluator "
                        "(repeatable; default none: a certificate carries only its own role's names)")
    d.add_argument("--client", action="append", default=None,
                   help="client certificate to make, named by its identity: admin, or an agent id "
                        "(repeatable; default admin, agent-0, agent-1, agent-2)")
    d.add_argument("--days", type=argtypes.integer, default=30)
    p.set_defaults(func=_cmd_certs)


def _cmd_certs(a: argparse.Namespace) -> int:
    from fedrl.wire.devca import DEFAULT_HOSTS, make_dev_ca

    kw = {"days": a.days, "hosts": tuple(a.host or DEFAULT_HOSTS), "evaluator_hosts": tuple(a.evaluator_host or ())}
    if a.client:
        kw["clients"] = tuple(a.client)
    out = make_dev_ca(a.out, **kw)
    print(f"wrote a development CA to {out}: aggregator/ and evaluator/ for their --tls-dir, one "
          f"directory per client (agents, admin) for their --tls-dir and fedrl ctl's")
    return 0
