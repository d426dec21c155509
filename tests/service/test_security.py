"""Identity: mutual TLS and bearer tokens on a real aggregator on loopback. Who may call what,
and the exact status a caller without the right credentials gets."""

from __future__ import annotations


import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedrl.cli.client import ControlClient
from fedrl.proto.v1 import (
    control_pb2,
    control_pb2_grpc,
    federation_pb2,
    federation_pb2_grpc,
)
from fedrl.wire.devca import make_dev_ca
from fedrl.wire.rpc import create_channel, create_health_server
from fedrl.wire.security import (
    Authenticator,
    SecurityConfigError,
    TLSFiles,
    parse_agent_tokens,
)
from tests.service.conftest import Aggregator
from tests.service.test_federation import assert_refused, run_config, wait_for
from tests.service.test_federation import RPC_BOUND

TOKENS = {"agent-0": "agent-0-token-0123456789", "agent-1": "agent-1-token-0123456789"}
ADMIN, EVALUATOR = "admin-token-0123456789abcdef", "evaluator-token-0123456789"


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return make_dev_ca(tmp_path_factory.mktemp("ca"), clients=("admin", "evaluator", "agent-0", "agent-1"))


@pytest.fixture
def secure_aggregator(tmp_path, ca):
    agg = Aggregator(tmp_path / "state", tls=TLSFiles.from_dir(ca / "aggregator"),
                     auth=Authenticator(ADMIN, EVALUATOR, TOKENS))
    yield agg
    agg.close()


def stubs(agg, ca, client: str | None, token: str | None):
    ch = create_channel(agg.target, TLSFiles.from_dir(ca / client) if client else None, token)
    return ch, federation_pb2_grpc.FederationStub(ch), control_pb2_grpc.ControlStub(ch)


def join_req(agent_id: str, index: int = 0):
    return federation_pb2.JoinRequest(agent_id=agent_id, agent_index=index, num_samples=10, obs_dim=11, act_dim=3,
                                      env_id="Hopper-v5", obs_moments=federation_pb2.ObsMoments(
                                          count=10, sum=[1.0] * 11, sum_sq=[2.0] * 11))


def test_a_federation_runs_over_mutual_tls_with_tokens(secure_aggregator, agent_threads, stand_dataset, ca):
    agg = secure_aggregator
    agents = agent_threads.start(agg.target, str(stand_dataset), 2, 2, 7,
                                 tls_for=lambda aid: TLSFiles.from_dir(ca / aid), token_for=TOKENS.get)
    with ControlClient(agg.target, tls=TLSFiles.from_dir(ca / "admin"), token=ADMIN) as c:
        c.start(run_config(rounds=2))
        wait_for(lambda: c.status()["state"] == "finished", 120, "the run to finish")
        assert c.status()["global_version"] == 2
    wait_for(lambda: all(a.rounds_done == 2 for a in agents), what="the agents to see their updates taken")


def test_who_may_call_what(secure_aggregator, ca):
    agg = secure_aggregator
    status = control_pb2.StatusRequest()

    # transport: plaintext to a TLS port, or TLS without a client certificate, never gets in
    ch, _, control = stubs(agg, ca, None, ADMIN)
    assert_refused(lambda: control.GetStatus(status, timeout=RPC_BOUND), grpc.StatusCode.UNAVAILABLE, "")
    ch.close()
    ch = grpc.secure_channel(agg.target, grpc.ssl_channel_credentials((ca / "ca.crt").read_bytes()))
    assert_refused(lambda: control_pb2_grpc.ControlStub(ch).GetStatus(status, timeout=RPC_BOUND),
                   grpc.StatusCode.UNAVAILABLE, "")
    ch.close()

    # credentials: none or unknown -> UNAUTHENTICATED
    for token in (None, "not-a-known-token-at-all"):
        ch, fed, control = stubs(agg, ca, "admin", token)
        assert_refused(lambda: control.GetStatus(status, timeout=RPC_BOUND), grpc.StatusCode.UNAUTHENTICATED, "bearer token")
        assert_refused(lambda: fed.Join(join_req("agent-0"), timeout=RPC_BOUND), grpc.StatusCode.UNAUTHENTICATED, "token")
        ch.close()

    # roles: an agent calling Control, the evaluator starting a run -> PERMISSION_DENIED
    ch, fed, control = stubs(agg, ca, "agent-0", TOKENS["agent-0"])
    assert_refused(lambda: control.StartRun(control_pb2.StartRunRequest(config_json=run_config()), timeout=RPC_BOUND),
                   grpc.StatusCode.PERMISSION_DENIED, "agent-0 (agent) may not call /fedrl.v1.Control/StartRun")
    assert_refused(lambda: control.GetStatus(status, timeout=RPC_BOUND), grpc.StatusCode.PERMISSION_DENIED, "may not call")
    # an agent acting as another: Join, NextTask, a Session and an update's header
    assert_refused(lambda: fed.Join(join_req("agent-1", 1), timeout=RPC_BOUND), grpc.StatusCode.PERMISSION_DENIED,
                   "belongs to agent-0, which may not act as agent 'agent-1'")
    assert_refused(lambda: fed.NextTask(federation_pb2.TaskRequest(agent_id="agent-1"), timeout=RPC_BOUND),
                   grpc.StatusCode.PERMISSION_DENIED, "may not act as agent 'agent-1'")
    hello = federation_pb2.SessionMessage(hello=federation_pb2.TaskRequest(agent_id="agent-1"))
    assert_refused(lambda: list(fed.Session(iter([hello]), timeout=RPC_BOUND)), grpc.StatusCode.PERMISSION_DENIED,
                   "may not act as agent 'agent-1'")
    header = federation_pb2.UpdatePart(header=federation_pb2.UpdateHeader(agent_id="agent-1"))
    assert_refused(lambda: fed.SubmitUpdate(iter([header]), timeout=RPC_BOUND), grpc.StatusCode.PERMISSION_DENIED,
                   "may not act as agent 'agent-1'")
    fed.Join(join_req("agent-0"), timeout=RPC_BOUND)  # as itself: fine
    ch.close()
    ch, fed, control = stubs(agg, ca, "evaluator", EVALUATOR)
    assert_refused(lambda: control.StartRun(control_pb2.StartRunRequest(config_json=run_config()), timeout=RPC_BOUND),
                   grpc.StatusCode.PERMISSION_DENIED, "evaluator (evaluator) may not call")
    assert_refused(lambda: fed.Join(join_req("agent-0"), timeout=RPC_BOUND), grpc.StatusCode.PERMISSION_DENIED, "may not")
    assert control.GetStatus(status, timeout=RPC_BOUND).state == "idle"
    ch.close()
    # the admin may not pose as an agent either
    ch, fed, control = stubs(agg, ca, "admin", ADMIN)
    assert_refused(lambda: fed.Join(join_req("agent-0"), timeout=RPC_BOUND), grpc.StatusCode.PERMISSION_DENIED, "may not")
    ch.close()
    # the refusals never reached the coordinator: only agent-0's own join did
    assert list(agg.coord.agents) == ["agent-0"]
    assert agg.coord.run is None


def test_health_needs_no_token_and_the_health_port_opens_nothing_else(secure_aggregator, ca):
    agg = secure_aggregator
    ch, _, _ = stubs(agg, ca, "agent-0", None)  # TLS client cert, no token
    assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=RPC_BOUND).status == \
        health_pb2.HealthCheckResponse.SERVING
    ch.close()
    hs = create_health_server("127.0.0.1", 0)
    try:
        plain = create_channel(f"127.0.0.1:{hs.port}")
        assert health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=RPC_BOUND).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert_refused(lambda: control_pb2_grpc.ControlStub(plain).GetStatus(control_pb2.StatusRequest(), timeout=RPC_BOUND),
                       grpc.StatusCode.UNIMPLEMENTED, "")
        plain.close()
    finally:
        hs.stop(0.2)


def test_security_configuration_errors_name_the_problem(tmp_path, ca):
    assert parse_agent_tokens("a=1234567890abcdefgh, b=0987654321abcdefgh\n# comment") == \
        {"a": "1234567890abcdefgh", "b": "0987654321abcdefgh"}
    with pytest.raises(SecurityConfigError, match="expected AGENT_ID=TOKEN"):
        parse_agent_tokens("agent-0")
    with pytest.raises(SecurityConfigError, match="listed twice"):
        parse_agent_tokens("a=1234567890abcdefgh,a=0987654321abcdefgh")
    with pytest.raises(SecurityConfigError, match="shorter than 16"):
        Authenticator(admin_token="short")
    with pytest.raises(SecurityConfigError, match="share one token"):
        Authenticator(ADMIN, ADMIN)
    with pytest.raises(SecurityConfigError, match="does not exist"):
        TLSFiles.from_dir(tmp_path / "nope")
    half = tmp_path / "half"
    half.mkdir()
    (half / "tls.crt").write_bytes((ca / "aggregator" / "tls.crt").read_bytes())
    with pytest.raises(SecurityConfigError, match="go together"):
        TLSFiles.from_dir(half)
    a = Authenticator(ADMIN, EVALUATOR, TOKENS)
    assert a.identify([("authorization", f"Bearer {TOKENS['agent-1']}")]) == ("agent", "agent-1")
    assert a.identify([("authorization", f"Basic {ADMIN}")]) is None
    assert not Authenticator().enabled


def test_every_rpc_of_the_contract_has_a_role_entry():
    """Deny-by-default must not silently lock out a method added to protos/: each one is listed."""
    from fedrl.proto.v1 import evaluator_pb2
    from fedrl.wire.security import POLICY

    for module in (federation_pb2, control_pb2, evaluator_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                assert path in POLICY or f"/{service.full_name}/*" in POLICY, f"{path} has no role entry"


def _fake_aggregator(cert: bytes, key: bytes, ca_pem: bytes):
    """A server on 127.0.0.1 posing as the aggregator with someone else's certificate; it records
    every call that reaches it (with the caller's metadata: a token would be in it)."""
    from concurrent import futures

    seen = []

    def join(request, context):
        seen.append(dict(context.invocation_metadata()))
        return federation_pb2.JoinReply(agent_id="fake").SerializeToString()

    srv = grpc.server(futures.ThreadPoolExecutor(2))
    srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "fedrl.v1.Federation", {"Join": grpc.unary_unary_rpc_method_handler(join)})])
    port = srv.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca_pem, require_client_auth=True))
    srv.start()
    return srv, f"127.0.0.1:{port}", seen


@pytest.mark.parametrize("stolen", ["tls", "metrics"])
def test_an_agents_certificate_cannot_pose_as_the_aggregator(ca, stolen):
    """Another agent's certificate (its client one, or the one its metrics endpoint serves with)
    on a server at 127.0.0.1: an agent dialling it completes no TLS handshake and sends no token."""
    d = ca / "agent-1"
    srv, target, seen = _fake_aggregator((d / f"{stolen}.crt").read_bytes(), (d / f"{stolen}.key").read_bytes(),
                                         (ca / "ca.crt").read_bytes())
    try:
        ch, fed, _ = stubs(type("T", (), {"target": target}), ca, "agent-0", TOKENS["agent-0"])
        with pytest.raises(grpc.RpcError) as ei:
            fed.Join(join_req("agent-0"), timeout=RPC_BOUND)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert seen == []  # the token never left the agent
        ch.close()
    finally:
        srv.stop(0)


def test_the_real_aggregators_certificate_is_taken_at_127_0_0_1(ca):
    """The control for the test above: the same fake server with the aggregator's certificate is
    reached (so what refused the others was their certificate, not the set-up)."""
    d = ca / "aggregator"
    srv, target, seen = _fake_aggregator((d / "tls.crt").read_bytes(), (d / "tls.key").read_bytes(),
                                         (ca / "ca.crt").read_bytes())
    try:
        ch, fed, _ = stubs(type("T", (), {"target": target}), ca, "agent-0", TOKENS["agent-0"])
        assert fed.Join(join_req("agent-0"), timeout=RPC_BOUND).agent_id == "fake"
        assert seen and seen[0]["authorization"] == f"Bearer {TOKENS['agent-0']}"
        ch.close()
    finally:
        srv.stop(0)


@pytest.mark.parametrize("cert,token,message", [
    ("agent-0", TOKENS["agent-1"], "the token of agent 'agent-1' came with the certificate of agent 'agent-0'"),
    ("admin", TOKENS["agent-0"], "the token of agent-0 (agent) came with the certificate of admin (admin)"),
    ("agent-0", ADMIN, "the token of admin (admin) came with the certificate of agent-0 (agent)"),
])
def test_a_certificate_must_agree_with_the_token(secure_aggregator, ca, cert, token, message):
    ch, fed, control = stubs(secure_aggregator, ca, cert, token)
    call = ((lambda: control.GetStatus(control_pb2.StatusRequest(), timeout=RPC_BOUND)) if token == ADMIN
            else (lambda: fed.Join(join_req("agent-1" if token == TOKENS["agent-1"] else "agent-0"), timeout=RPC_BOUND)))
    assert_refused(call, grpc.StatusCode.PERMISSION_DENIED, message)
    assert secure_aggregator.coord.status()["agents"] == []  # nobody joined
    ch.close()


def test_server_certificates_cannot_call(secure_aggregator, ca):
    """The aggregator's certificate has server usage only: a client presenting it completes no handshake."""
    ch, fed, _ = stubs(secure_aggregator, ca, "aggregator", TOKENS["agent-0"])
    with pytest.raises(grpc.RpcError) as ei:
        fed.Join(join_req("agent-0"), timeout=RPC_BOUND)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    ch.close()



@pytest.mark.parametrize("stolen", ["evaluator/tls", "agent-1/metrics"])
def test_no_other_certificate_passes_for_the_aggregator_even_by_the_dialled_host(tmp_path, stolen, monkeypatch):
    """``FEDRL_TLS_SERVER_NAME=-`` makes a client check only the host it dials. The evaluator's
    certificate used to carry the aggregator's --host names and 127.0.0.1, and every agent's
    metrics certificate 127.0.0.1: an impostor at 127.0.0.1 serving either took an agent's token.
    Certificates now carry only their own role's names."""
    from cryptography import x509

    ca = make_dev_ca(tmp_path / "ca", hosts=("aggregator.example", "127.0.0.1"),
                     clients=("admin", "agent-0", "agent-1"))
    for path in ("evaluator/tls.crt", "agent-1/metrics.crt"):
        cert = x509.load_pem_x509_certificate((ca / path).read_bytes())
        names = [str(n.value) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value]
        assert "aggregator.example" not in names and "127.0.0.1" not in names, (path, names)
        # a metrics certificate names its role: a scraper checking the aggregator's metrics name
        # takes neither the evaluator's nor an agent's (every one used to say fedrl-metrics)
        own = {"evaluator/tls.crt": "fedrl-metrics-evaluator", "agent-1/metrics.crt": "fedrl-metrics-agent"}[path]
        assert [n for n in names if n.startswith("fedrl-metrics")] == [own], (path, names)
    monkeypatch.setenv("FEDRL_TLS_SERVER_NAME", "-")
    srv, target, seen = _fake_aggregator((ca / f"{stolen}.crt").read_bytes(), (ca / f"{stolen}.key").read_bytes(),
                                         (ca / "ca.crt").read_bytes())
    try:
        ch, fed, _ = stubs(type("T", (), {"target": target}), ca, "agent-0", TOKENS["agent-0"])
        with pytest.raises(grpc.RpcError) as ei:
            fed.Join(join_req("agent-0"), timeout=RPC_BOUND)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and seen == []
        ch.close()
    finally:
        srv.stop(0)
    # the control: the aggregator's own certificate is taken at 127.0.0.1 by the dialled host
    srv, target, seen = _fake_aggregator((ca / "aggregator/tls.crt").read_bytes(),
                                         (ca / "aggregator/tls.key").read_bytes(), (ca / "ca.crt").read_bytes())
    try:
        ch, fed, _ = stubs(type("T", (), {"target": target}), ca, "agent-0", TOKENS["agent-0"])
        assert fed.Join(join_req("agent-0"), timeout=RPC_BOUND).agent_id == "fake"
        ch.close()
    finally:
        srv.stop(0)


def test_only_the_evaluators_token_makes_a_following_evaluator(secure_aggregator, ca):
    """With tokens on, the evaluator header alone counted its sender as a following evaluator (and
    held plain watchers open after a run); now only the evaluator's token does."""
    import threading

    from fedrl.wire.rpc import EVALUATOR_HEADER

    agg = secure_aggregator
    ch0, _, admin = stubs(agg, ca, "admin", ADMIN)
    admin.StartRun(control_pb2.StartRunRequest(config_json=run_config()), timeout=RPC_BOUND)  # a run to watch
    ch0.close()
    calls = []
    for client, token in (("admin", ADMIN), ("evaluator", EVALUATOR)):
        ch, _, control = stubs(agg, ca, client, token)
        call = control.WatchRounds(control_pb2.WatchRequest(after_version=-1), timeout=RPC_BOUND,
                                   metadata=((EVALUATOR_HEADER, "1"),))
        calls.append((ch, call))
        first = threading.Event()  # its first event (RUN_STARTED) comes after it was counted or not

        def drain(c=call, first=first):
            try:
                for _ in c:
                    first.set()
            except grpc.RpcError:
                pass

        threading.Thread(target=drain, daemon=True).start()
        assert first.wait(RPC_BOUND), f"the {client}'s watch brought no event"
        # the admin posing as an evaluator is not one; the evaluator is
        assert agg.coord.evaluators == (0 if token == ADMIN else 1), client
    for ch, call in calls:
        call.cancel()
        ch.close()


def test_an_agent_fetches_only_the_versions_of_runs_that_selected_it(tmp_path):
    """FetchGlobal gave any agent any run's model: on an aggregator serving several runs, an agent
    of one could take another's, trained on other parties' data. An agent's token now fetches
    only runs that selected it, held or stored (PERMISSION_DENIED else); the evaluator's and the
    admin's fetch any."""
    from fedrl.wire.serde import read_weight_parts

    tokens = {**TOKENS, "agent-2": "agent-2-token-0123456789"}
    auth = Authenticator(ADMIN, EVALUATOR, tokens)

    def fetch(agg, token, run_id):
        ch = create_channel(agg.target, None, token)
        try:
            return read_weight_parts(federation_pb2_grpc.FederationStub(ch).FetchGlobal(
                federation_pb2.FetchRequest(run_id=run_id, version=0), timeout=RPC_BOUND))[0]
        finally:
            ch.close()

    agg = Aggregator(tmp_path / "state", auth=auth)
    try:
        for i in (0, 1):
            ch, fed, _ = stubs(agg, None, None, tokens[f"agent-{i}"])
            fed.Join(join_req(f"agent-{i}", i), timeout=RPC_BOUND)
            ch.close()
        ch, _, control = stubs(agg, None, None, ADMIN)
        run_id = control.StartRun(control_pb2.StartRunRequest(config_json=run_config(rounds=2)), timeout=RPC_BOUND).run_id
        ch2, fed2, _ = stubs(agg, None, None, tokens["agent-2"])
        fed2.Join(join_req("agent-2", 2), timeout=RPC_BOUND)  # the same task, after the run selected its agents
        ch2.close()
        assert_refused(lambda: fetch(agg, tokens["agent-2"], run_id), grpc.StatusCode.PERMISSION_DENIED,
                       f"agent 'agent-2' is not a participant of run {run_id}")
        for token in (tokens["agent-0"], EVALUATOR, ADMIN):
            assert fetch(agg, token, run_id).base_version == 0
        control.StopRun(control_pb2.StopRunRequest(reason="enough", run_id=run_id), timeout=RPC_BOUND)
        ch.close()
    finally:
        agg.close()
    agg = Aggregator(tmp_path / "state", auth=auth)  # a restart: the run is only stored now
    try:
        assert_refused(lambda: fetch(agg, tokens["agent-2"], run_id), grpc.StatusCode.PERMISSION_DENIED,
                       f"agent 'agent-2' is not a participant of run {run_id}")
        for token in (tokens["agent-1"], EVALUATOR, ADMIN):
            assert fetch(agg, token, run_id).base_version == 0
    finally:
        agg.close()
