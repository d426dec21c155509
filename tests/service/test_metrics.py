"""The gRPC interceptor and the aggregator's own metrics, read back from their registry
after real RPCs on loopback."""

from __future__ import annotations

import time

import grpc
import pytest

from fedrl.proto.v1 import control_pb2, federation_pb2
from tests.service.test_federation import (
    assert_refused,
    join,
    run_config,
    submit,
    wait_for,
)
from tests.service.test_federation import RPC_BOUND


def value(agg, name: str, **labels) -> float:
    v = agg.metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def handled(agg, method: str, typ: str, code: str, service: str) -> float:
    return value(agg, "grpc_server_handled_total", grpc_type=typ, grpc_service=service,
                 grpc_method=method, grpc_code=code)


CONTROL, FED = "fedrl.v1.Control", "fedrl.v1.Federation"


def test_interceptor_counts_unary_and_streaming_rpcs_with_their_codes(aggregator):
    agg = aggregator
    agg.control.GetStatus(control_pb2.StatusRequest(), timeout=RPC_BOUND)
    agg.control.GetStatus(control_pb2.StatusRequest(), timeout=RPC_BOUND)
    assert value(agg, "grpc_server_started_total", grpc_type="unary", grpc_service=CONTROL,
                 grpc_method="GetStatus") == 2
    assert handled(agg, "GetStatus", "unary", "OK", CONTROL) == 2
    assert value(agg, "grpc_server_handling_seconds_count", grpc_type="unary", grpc_service=CONTROL,
                 grpc_method="GetStatus") == 2

    # unary refused: the code the servicer aborted with
    assert_refused(lambda: agg.fed.NextTask(federation_pb2.TaskRequest(agent_id="nobody"), timeout=RPC_BOUND),
                   grpc.StatusCode.NOT_FOUND, "unknown agent")
    assert handled(agg, "NextTask", "unary", "NOT_FOUND", FED) == 1

    # server stream refused before its first message (no run to watch)
    assert_refused(lambda: list(agg.control.WatchRounds(control_pb2.WatchRequest(), timeout=RPC_BOUND)),
                   grpc.StatusCode.FAILED_PRECONDITION, "no run")
    assert handled(agg, "WatchRounds", "server_stream", "FAILED_PRECONDITION", CONTROL) == 1

    # server stream that completes: messages sent are counted
    join(agg, "a0", 0)
    join(agg, "a1", 1)
    st = agg.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(rounds=3)), timeout=RPC_BOUND)
    parts = list(agg.fed.FetchGlobal(federation_pb2.FetchRequest(run_id=st.run_id, version=0), timeout=RPC_BOUND))
    assert handled(agg, "FetchGlobal", "server_stream", "OK", FED) == 1
    assert value(agg, "grpc_server_msg_sent_total", grpc_type="server_stream", grpc_service=FED,
                 grpc_method="FetchGlobal") == len(parts) >= 2

    # client stream refused mid-way; every message it read is counted
    assert_refused(lambda: agg.fed.SubmitUpdate(iter([federation_pb2.UpdatePart(chunk=b"x")]), timeout=RPC_BOUND),
                   grpc.StatusCode.INVALID_ARGUMENT, "must start with its header")
    assert handled(agg, "SubmitUpdate", "client_stream", "INVALID_ARGUMENT", FED) == 1
    assert value(agg, "grpc_server_msg_received_total", grpc_type="client_stream", grpc_service=FED,
                 grpc_method="SubmitUpdate") == 1

    # a watch the client cancels while the server is still streaming ends CANCELLED
    stream = agg.control.WatchRounds(control_pb2.WatchRequest(after_version=-1))
    next(stream)
    stream.cancel()
    wait_for(lambda: handled(agg, "WatchRounds", "server_stream", "CANCELLED", CONTROL) == 1, 10,
             "the cancelled watch to be recorded")
    assert value(agg, "grpc_server_started_total", grpc_type="server_stream", grpc_service=CONTROL,
                 grpc_method="WatchRounds") == 2


def test_aggregator_metrics_follow_rounds_updates_and_refusals(aggregator):
    from fedrl.wire.codec import assemble
    from fedrl.wire.serde import read_weight_parts

    agg = aggregator
    assert value(agg, "fedrl_aggregator_runs_active") == 0
    assert value(agg, "fedrl_aggregator_updates_rejected_total", reason="non_finite") == 0  # pre-made
    join(agg, "a0", 0)
    join(agg, "a1", 1)
    assert value(agg, "fedrl_aggregator_agents_connected") == 2
    st = agg.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(rounds=2)), timeout=RPC_BOUND)
    run = {"run": st.run_id}  # each run's state, a series per run held
    assert value(agg, "fedrl_aggregator_runs_active") == 1
    assert value(agg, "fedrl_aggregator_run_active", **run) == 1
    assert value(agg, "fedrl_aggregator_agents_expected", **run) == 2
    assert value(agg, "fedrl_aggregator_round", **run) == 1
    assert value(agg, "fedrl_aggregator_round_deadline_timestamp_seconds", **run) > 0
    sent0 = value(agg, "fedrl_aggregator_weights_sent_bytes_total")
    manifest, chunks = read_weight_parts(agg.fed.FetchGlobal(
        federation_pb2.FetchRequest(run_id=st.run_id, version=0), timeout=RPC_BOUND))
    assert value(agg, "fedrl_aggregator_weights_sent_bytes_total") - sent0 == manifest.total_bytes
    g = assemble(manifest, chunks)

    bad = {k: v.clone() for k, v in g.items()}
    next(iter(bad.values())).view(-1)[0] = float("nan")
    assert_refused(lambda: submit(agg, "a0", bad, st.run_id), grpc.StatusCode.INVALID_ARGUMENT, "NaN")
    assert_refused(lambda: submit(agg, "zz", g, st.run_id), grpc.StatusCode.NOT_FOUND, "unknown agent")
    assert value(agg, "fedrl_aggregator_updates_rejected_total", reason="non_finite") == 1
    assert value(agg, "fedrl_aggregator_updates_rejected_total", reason="unknown_agent") == 1
    assert value(agg, "fedrl_aggregator_updates_accepted_total") == 0

    for r in (1, 2):
        submit(agg, "a0", g, st.run_id, round=r, base=r - 1)
        submit(agg, "a1", g, st.run_id, round=r, base=r - 1)
    assert value(agg, "fedrl_aggregator_updates_accepted_total") == 4
    assert value(agg, "fedrl_aggregator_rounds_completed_total", **run) == 2
    assert value(agg, "fedrl_aggregator_round_duration_seconds_count") == 2
    assert value(agg, "fedrl_aggregator_global_version", **run) == 2
    assert value(agg, "fedrl_aggregator_run_active", **run) == 0
    assert value(agg, "fedrl_aggregator_runs_active") == 0
    assert value(agg, "fedrl_aggregator_last_round_closed_timestamp_seconds") > 0
    assert value(agg, "fedrl_aggregator_weights_received_bytes_total") >= 4 * manifest.total_bytes
    assert_refused(lambda: submit(agg, "a0", g, st.run_id, round=2, base=1), grpc.StatusCode.FAILED_PRECONDITION,
                   "no round is open")
    assert value(agg, "fedrl_aggregator_updates_rejected_total", reason="closed_round") == 1


def test_agent_metrics_record_local_training(aggregator, agent_threads, stand_dataset):
    agg = aggregator
    agents = agent_threads.start(agg.target, str(stand_dataset), 2, 2, 7)
    agg.control.StartRun(control_pb2.StartRunRequest(config_json=run_config(rounds=2, local_steps=3)), timeout=RPC_BOUND)
    wait_for(lambda: all(a.rounds_done == 2 for a in agents), 120, "two rounds")
    for a in agents:
        reg, aid = a.metrics.registry, a.cfg.agent_id
        assert reg.get_sample_value("fedrl_agent_local_steps_total", {"agent": aid}) == 6
        assert reg.get_sample_value("fedrl_agent_rounds_completed_total", {"agent": aid}) == 2
        assert reg.get_sample_value("fedrl_agent_local_update_seconds_count", {"agent": aid}) == 2
        for term in ("critic", "cql_penalty", "actor", "reg_data", "reg_global"):
            v = reg.get_sample_value("fedrl_agent_loss", {"agent": aid, "term": term})
            assert v is not None and v == v, term  # present and not NaN
        assert reg.get_sample_value("fedrl_agent_info", {"agent": aid, "device": "cpu"}) == 1


@pytest.mark.parametrize("reason", ["whatever", "duplicate"])
def test_unknown_rejection_reasons_fold_into_other(reason):
    from fedrl.ops.metrics import AggregatorMetrics

    m = AggregatorMetrics()
    m.reject(reason)
    label = reason if reason == "duplicate" else "other"
    assert m.registry.get_sample_value("fedrl_aggregator_updates_rejected_total", {"reason": label}) == 1


def test_every_service_exports_its_process_memory_and_cpu():
    """What the dashboard's memory and CPU panels read, as any Prometheus client's default
    registry has it; a registry handed in by the caller is left as it is."""
    from prometheus_client import CollectorRegistry

    from fedrl.ops.metrics import AgentMetrics, AggregatorMetrics, EvaluatorMetrics

    for m in (AggregatorMetrics(), AgentMetrics("agent-0"), EvaluatorMetrics()):
        assert m.registry.get_sample_value("process_resident_memory_bytes") > 10e6
        assert m.registry.get_sample_value("process_cpu_seconds_total") > 0
    own = CollectorRegistry()
    AggregatorMetrics(own)
    assert own.get_sample_value("process_resident_memory_bytes") is None


@pytest.mark.parametrize("secure", [True, False])
def test_metrics_endpoints_answer_while_silent_connections_are_open(tmp_path, secure):
    """A client that connects and never sends (nor starts its TLS handshake) must not hold up
    scrapes: prometheus_client's own server ran the handshake in its accepting loop."""
    import socket
    import ssl
    import urllib.request

    from prometheus_client import CollectorRegistry, Counter

    from fedrl.ops.endpoint import serve_metrics
    from fedrl.wire.devca import make_dev_ca
    from fedrl.wire.security import TLSFiles

    reg = CollectorRegistry()
    Counter("probe_total", "a counter", registry=reg).inc()
    ctx = None
    if secure:
        make_dev_ca(tmp_path / "ca")
        port = serve_metrics(reg, "127.0.0.1", 0, TLSFiles.from_dir(tmp_path / "ca" / "aggregator"))
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca" / "ca.crt"))
        ctx.load_cert_chain(str(tmp_path / "ca" / "admin" / "tls.crt"), str(tmp_path / "ca" / "admin" / "tls.key"))
    else:
        port = serve_metrics(reg, "127.0.0.1", 0)
    url = f"{'https' if secure else 'http'}://127.0.0.1:{port}/metrics"
    # from another client address (127.0.0.2, loopback too): one client's connections count against
    # its own share (PER_CLIENT), not against the scraper's
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.2", 0))
              for _ in range(10)]
    try:
        for _ in range(3):
            body = urllib.request.urlopen(url, context=ctx, timeout=RPC_BOUND).read().decode()
            assert "probe_total 1.0" in body
        # served beside them, not after the server cut them off (its TIMEOUT, 10 s): all still open
        for s in silent:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1, socket.MSG_PEEK)  # b"" (or a reset) once the server has closed it
        if secure:  # still wants a client certificate
            bare = ssl.create_default_context(cafile=str(tmp_path / "ca" / "ca.crt"))
            with pytest.raises((ssl.SSLError, OSError)):
                urllib.request.urlopen(url, context=bare, timeout=5).read()
    finally:
        for s in silent:
            s.close()


def test_one_clients_silent_or_trickling_connections_leave_the_others_scrapes_alone(monkeypatch):
    """200 silent connections from one client address (127.0.0.2: another client on loopback)
    took every slot of a metrics endpoint and scrapes failed in bursts; now a client holds at most
    PER_CLIENT of them. And a connection trickling a byte a second lives at most TIMEOUT in all."""
    import socket
    import urllib.request

    from prometheus_client import CollectorRegistry, Counter

    from fedrl.ops import endpoint as m

    monkeypatch.setattr(m._MetricsServer, "TIMEOUT", 2.0)
    reg = CollectorRegistry()
    Counter("probe_total", "a counter", registry=reg).inc()
    port = m.serve_metrics(reg, "127.0.0.1", 0)
    flood = []
    try:
        for _ in range(200):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            try:
                s.connect(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            flood.append(s)
        ok = 0
        for _ in range(30):
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                ok += "probe_total 1.0" in body
            except OSError:
                pass
        assert ok == 30, f"{ok} of 30 scrapes answered beside one client's 200 silent connections"
        # a slowloris: one byte a second, never a whole request; cut off within TIMEOUT (2 s)
        t = socket.create_connection(("127.0.0.1", port), timeout=10)
        start = time.monotonic()
        closed = False
        for ch in b"GET /metrics HTTP/1.1\r\nHost: x\r\n":
            try:
                t.send(bytes([ch]))
                time.sleep(0.5)
                t.settimeout(0.01)
                if t.recv(1) == b"":
                    closed = True
                    break
            except socket.timeout:
                continue
            except OSError:
                closed = True
                break
        assert closed and time.monotonic() - start < 4.0, "a trickling connection was not cut off"
        t.close()
    finally:
        for s in flood:
            s.close()


class _Holders:
    """Idle connections to a metrics port, ``per_address`` from each of ``addresses``, each
    reopened within ~20 ms of being closed: the issue-63 flood, kept up for as long as it runs."""

    def __init__(self, port: int, addresses, per_address: int) -> None:
        import threading

        self.port, self.slots = port, [a for a in addresses for _ in range(per_address)]
        self.socks: list = [None] * len(self.slots)
        self.stop = threading.Event()
        self.reopened = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self, i: int) -> None:
        import errno
        import socket

        s = socket.socket()
        s.bind((self.slots[i], 0))
        s.setblocking(False)  # a connect that waits on the listen queue holds up no other slot
        if s.connect_ex(("127.0.0.1", self.port)) in (0, errno.EINPROGRESS):
            self.socks[i] = s
        else:
            s.close()
            self.socks[i] = None

    def _run(self) -> None:
        import socket

        while not self.stop.wait(0.02):
            for i, s in enumerate(self.socks):
                alive = s is not None
                if alive:
                    try:
                        alive = s.recv(1) != b""
                    except (BlockingIOError, socket.timeout):
                        pass
                    except OSError:
                        alive = False
                if not alive:
                    if s is not None:
                        s.close()
                        self.reopened += 1
                    self._open(i)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for s in self.socks:
            if s is not None:
                s.close()


@pytest.mark.parametrize("flood", ["own address", "nine addresses"])
@pytest.mark.parametrize("credential", ["token", "certificate"])
def test_the_scrapers_credential_gets_its_scrapes_through_any_flood(tmp_path, credential, flood):
    """Issue 63, finding 5: connections held by others, from the scraper's own address (8), or
    from it and 8 other loopback addresses (8 each), reopened as soon as they close, left 1-3 of
    30 scrapes working. A scrape with the scraper's credential (the metrics token, or the admin's
    certificate under mutual TLS) now gets a spare slot kept for it: 30 of 30 get through."""
    import ssl
    import urllib.request

    from prometheus_client import CollectorRegistry, Counter

    from fedrl.ops.endpoint import serve_metrics
    from fedrl.wire.devca import make_dev_ca
    from fedrl.wire.security import TLSFiles

    reg = CollectorRegistry()
    Counter("probe_total", "a counter", registry=reg).inc()
    token = "s" * 32
    ctx = None
    if credential == "certificate":
        make_dev_ca(tmp_path / "ca")
        port = serve_metrics(reg, "127.0.0.1", 0, TLSFiles.from_dir(tmp_path / "ca" / "aggregator"))
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca" / "ca.crt"))
        ctx.check_hostname = False
        ctx.load_cert_chain(str(tmp_path / "ca" / "admin" / "tls.crt"), str(tmp_path / "ca" / "admin" / "tls.key"))
        url, headers = f"https://127.0.0.1:{port}/metrics", {}
    else:
        port = serve_metrics(reg, "127.0.0.1", 0, token=token)
        url, headers = f"http://127.0.0.1:{port}/metrics", {"Authorization": f"Bearer {token}"}
    others = [f"127.0.0.{i}" for i in range(2, 10)] if flood == "nine addresses" else []
    holders = _Holders(port, ["127.0.0.1", *others], 8)
    try:
        time.sleep(1.0)  # every slot held
        ok = 0
        for _ in range(30):
            try:
                req = urllib.request.Request(url, headers=headers)
                ok += "probe_total 1.0" in urllib.request.urlopen(req, context=ctx, timeout=5).read().decode()
            except OSError:
                pass
            time.sleep(0.1)
        assert ok == 30, f"{ok} of 30 scrapes with the credential answered beside the flood"
        if others:
            assert holders.reopened >= 1  # the 8 past the 64 slots were cut off and came back
    finally:
        holders.close()


def test_a_scrape_without_the_credential_gets_no_priority(tmp_path):
    """The control: the same flood from the scraper's own address, and a wrong token: the scrape
    gets a spare slot, shows no credential, and is turned away (503)."""
    import urllib.request

    from prometheus_client import CollectorRegistry

    from fedrl.ops import endpoint as m

    import urllib.error

    port = m.serve_metrics(CollectorRegistry(), "127.0.0.1", 0, token="s" * 32)

    def scrape() -> int | None:
        try:
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer " + "x" * 32}),
                timeout=RPC_BOUND).read()
            return 200
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None  # cut before an answer

    assert scrape() == 200  # unflooded, a scrape needs no credential: it only gives priority
    flood = _Holders(port, ["127.0.0.1"], 8)
    try:  # served while the flood fills the address's slots, then turned away
        wait_for(lambda: scrape() == 503, 60, "the flooded server to turn the scrape away")
    finally:
        flood.close()


def test_the_evaluator_exports_no_return_before_its_first_evaluation():
    """Before a run's first evaluation its return, score and version have no series, not a 0
    that reads as a real return of 0; each run evaluated has its own (label ``run``), and the
    oldest go past EVALUATED_RUNS_KEPT."""
    from fedrl.ops.metrics import EVALUATED_RUNS_KEPT, EvaluatorMetrics

    m = EvaluatorMetrics()
    names = ("fedrl_evaluator_return", "fedrl_evaluator_return_std", "fedrl_evaluator_normalized_score",
             "fedrl_evaluator_evaluated_version")
    assert all(m.registry.get_sample_value(n, {"run": "r0"}) is None for n in names)
    m.latest({"run_id": "r0", "return_mean": 0.0, "return_std": 0.0, "score_mean": -1.0, "version": 1})
    m.latest({"run_id": "r1", "return_mean": 5.0, "return_std": 1.0, "score_mean": 3.0, "version": 2})
    assert [m.registry.get_sample_value(n, {"run": "r0"}) for n in names] == [0.0, 0.0, -1.0, 1.0]
    assert [m.registry.get_sample_value(n, {"run": "r1"}) for n in names] == [5.0, 1.0, 3.0, 2.0]
    for i in range(2, EVALUATED_RUNS_KEPT + 1):
        m.latest({"run_id": f"r{i}", "return_mean": 0.0, "return_std": 0.0, "score_mean": 0.0, "version": 1})
    assert m.registry.get_sample_value(names[0], {"run": "r0"}) is None
    assert m.registry.get_sample_value(names[0], {"run": "r1"}) == 5.0
    import json
    from pathlib import Path

    board = (Path(__file__).resolve().parents[2] / "deploy/components/monitoring/dashboards/fedrl.json").read_text()
    exprs = [t["expr"] for p in json.loads(board)["panels"] for t in p.get("targets", [])]
    shown = [e for e in exprs if any(n in e for n in names)]
    assert len(shown) == 5 and all('{run=~"$run"}' in e for e in shown), shown  # the run selector picks them
