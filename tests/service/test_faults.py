"""Faults on a real aggregator in this process: a dropped upload, a state directory that
cannot be written."""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time

import grpc
import pytest
import torch

from fedrl.proto.v1 import federation_pb2
from fedrl.wire.codec import encode
from fedrl.wire.serde import manifest_to_proto
from tests.service import test_federation
from tests.service.test_federation import RPC_BOUND, assert_untouched, status, submit, wait_for

open_round = test_federation.open_round  # the fixture, shared with test_federation's bad-input tests


def ticks_pass(coord, n: int) -> None:
    """Wait until the coordinator's clock has ticked ``n`` more times (however loaded the machine:
    a fixed sleep saw fewer ticks on a busy one, and a negative check then checked less)."""
    start = coord.ticker.ticks
    wait_for(lambda: coord.ticker.ticks >= start + n, what=f"{n} ticks of the aggregator's clock")


def test_a_dropped_upload_is_never_aggregated_and_can_be_retried(open_round):
    agg, run_id, g, digest = open_round
    enc = encode(g, run_id, 1, 0, 100, chunk_bytes=1000)
    chunks = list(enc.chunks())
    assert len(chunks) > 3
    sent_half = threading.Event()
    never = threading.Event()

    def parts():
        yield federation_pb2.UpdatePart(header=federation_pb2.UpdateHeader(
            agent_id="a0", weights=manifest_to_proto(enc.manifest)))
        for c in chunks[: len(chunks) // 2]:
            yield federation_pb2.UpdatePart(chunk=c)
        sent_half.set()
        never.wait(30)  # the connection "drops" here: the client cancels the call

    call = agg.fed.SubmitUpdate.future(parts(), timeout=30)
    assert sent_half.wait(10)
    wait_for(lambda: agg.metrics.registry.get_sample_value("fedrl_aggregator_weights_received_bytes_total")
             >= 1000 * (len(chunks) // 2), 10, "the first half to arrive")
    call.cancel()
    never.set()
    assert call.cancelled() or call.exception() is not None
    # the server ends the upload either as CANCELLED or, when its reader saw the stream end
    # first, as DATA_LOSS ("received N of M declared bytes"): refused cleanly either way
    def refused_uploads():
        return sum(m.value for fam in agg.metrics.registry.collect() if fam.name == "grpc_server_handled"
                   for m in fam.samples if m.name == "grpc_server_handled_total"
                   and m.labels["grpc_method"] == "SubmitUpdate" and m.labels["grpc_code"] != "OK")

    wait_for(refused_uploads, RPC_BOUND, "the server to see the upload end")
    assert agg.coord.run.submissions == {}
    assert_untouched(agg, run_id, g, digest)
    # the same agent retries the whole upload: taken (not "already submitted")
    assert submit(agg, "a0", g, run_id).accepted
    assert list(agg.coord.run.submissions) == ["a0"]


def test_an_unwritable_state_directory_keeps_the_round_open_until_it_heals(open_round):
    """The run directory is replaced by a plain file (every write fails with ENOTDIR, a real OS
    error, as with a full or read-only disk): both updates arrive, but no version 1 is announced
    or served; once the directory is back the round closes by itself."""
    agg, run_id, g, digest = open_round
    run_dir = agg.store.run_dir(run_id)
    aside = run_dir.with_name(run_id + ".aside")
    run_dir.rename(aside)
    run_dir.write_text("not a directory")
    try:
        assert submit(agg, "a0", g, run_id).accepted
        assert submit(agg, "a1", {k: v + 1 for k, v in g.items()}, run_id).accepted
        st = wait_for(lambda: (s := status(agg))["message"] and s, RPC_BOUND, "the failure to be reported")
        assert "cannot persist version 1" in st["message"] and "round 1 stays open" in st["message"]
        assert st["global_version"] == 0 and st["round"] == 1 and st["state"] == "running"
        assert not any(e["kind"] == "ROUND_CLOSED" for e in agg.coord.run.events)
        assert set(agg.coord.run.encoded) == {0}  # nothing but version 0 can be fetched
    finally:
        run_dir.unlink()
        aside.rename(run_dir)
    st = wait_for(lambda: (s := status(agg))["global_version"] == 1 and s, RPC_BOUND, "the round to close after healing")
    assert st["message"] == "" and st["round"] == 2
    v1 = agg.store.load_version(run_id, 1)
    assert all(torch.allclose(v1[k], g[k] + 0.5, atol=1e-5) for k in g)  # the mean of g and g + 1
    assert hashlib.sha256(agg.store.version_path(run_id, 0).read_bytes()).hexdigest() == digest


def _agent(agent_id, index):
    import numpy as np

    from aggregator_service.records import AgentRecord
    from fedrl.data.normalize import ObsStats

    return AgentRecord(agent_id, index, 100, 11, 3, "Hopper-v5", ObsStats(100, np.ones(11), 2 * np.ones(11)))


def test_restart_before_the_run_began_waits_for_its_agents_again(tmp_path):
    from aggregator_service.coordinator import Coordinator
    from aggregator_service.store import Store
    from tests.service.test_federation import run_config

    first = Coordinator(Store(tmp_path / "state"), tick=0.02)
    run_id = first.start_run(run_config())["run_id"]
    first.join(_agent("a0", 0))
    first.close()  # "killed" while waiting for the second agent
    second = Coordinator(Store(tmp_path / "state"), tick=0.02, resume=True)
    try:
        st = second.status()
        assert st["run_id"] == run_id and st["state"] == "waiting_for_agents"
        assert [e["kind"] for e in second.run.events][-1] == "RUN_RESUMED"
        second.join(_agent("a0", 0))
        second.join(_agent("a1", 1))
        assert second.status()["state"] == "running" and second.status()["round"] == 1
    finally:
        second.close()


def _run_rounds(tmp_path, rounds: int, done: int):
    """A run of ``rounds`` rounds with agents a0 and a1, ``done`` of them completed (each agent
    sending the global policy back), its coordinator closed as if killed: (store, run_id, g)."""
    from aggregator_service.coordinator import Coordinator
    from aggregator_service.store import Store
    from tests.service.test_federation import run_config

    store = Store(tmp_path / "state")
    first = Coordinator(store, tick=0.02)
    run_id = first.start_run(run_config(rounds=rounds))["run_id"]
    first.join(_agent("a0", 0))
    first.join(_agent("a1", 1))
    g = first.run.global_state
    for r in range(1, done + 1):
        m = encode(g, run_id, r, r - 1, 100).manifest
        for a in ("a0", "a1"):
            first.submit(a, m, g, {}, 0.0)
    assert store.versions(run_id) == list(range(done + 1))
    first.close()
    return store, run_id, g


def test_restart_skips_an_unreadable_newest_version(tmp_path):
    from aggregator_service.coordinator import Coordinator
    from aggregator_service.store import Store

    store, run_id, g = _run_rounds(tmp_path, rounds=3, done=1)
    store.version_path(run_id, 1).write_bytes(b"not a safetensors file")  # a damaged disk
    second = Coordinator(Store(tmp_path / "state"), tick=0.02, resume=True)
    try:
        st = second.status()
        assert st["state"] == "running" and st["global_version"] == 0 and st["round"] == 1
        assert all(torch.equal(second.run.global_state[k], g[k]) for k in g)
    finally:
        second.close()


def test_a_restarted_aggregator_clips_to_the_norm_adaptive_clipping_had_reached(tmp_path):
    """Adaptive clipping's norm is in each ROUND_CLOSED: a restart after round 1 continues from
    the norm round 1 moved it to, not from the run's first."""
    from aggregator_service.coordinator import Coordinator
    from aggregator_service.store import Store
    from tests.service.test_federation import run_config

    first = Coordinator(Store(tmp_path / "state"), tick=0.02)
    run_id = first.start_run(run_config(algo="fed-bc", rounds=3, dp_clip=1e-3, dp_clip_quantile=0.5,
                                        dp_clip_lr=0.5))["run_id"]
    first.join(_agent("a0", 0))
    first.join(_agent("a1", 1))
    g = first.run.global_state
    far = {k: v + 1.0 if v.is_floating_point() and not k.endswith(("obs_mean", "obs_std")) else v for k, v in g.items()}
    m = encode(far, run_id, 1, 0, 100).manifest
    for a in ("a0", "a1"):
        first.submit(a, m, far, {}, 0.0)
    wait_for(lambda: first.status()["global_version"] == 1, what="round 1 to close")
    grown = first.run.machine.clip
    assert grown == pytest.approx(1e-3 * math.exp(0.25))  # no update within 1e-3: the norm grew
    first.close()
    second = Coordinator(Store(tmp_path / "state"), tick=0.02, resume=True)
    try:
        assert second.run.machine.clip == grown and second.status()["privacy"]["clip"] == grown
    finally:
        second.close()


def test_a_restarted_aggregator_remembers_whose_updates_its_stored_versions_took(tmp_path):
    """Rejoining agents keep their count of accepted rounds and learn their last accepted round
    (how an agent whose update was taken just before the crash counts it); a round whose version
    could not be read runs again, so it does not count."""
    from aggregator_service.coordinator import Coordinator
    from aggregator_service.store import Store

    store, run_id, _ = _run_rounds(tmp_path, rounds=4, done=2)

    def rejoined(damage: bool):
        if damage:
            store.version_path(run_id, 2).write_bytes(b"not a safetensors file")
        c = Coordinator(Store(tmp_path / "state"), tick=0.02, resume=True)
        try:
            assert c.registry.last_accepted_round("a0", run_id) == 0  # not rejoined yet
            c.join(_agent("a0", 0))
            c.join(_agent("a1", 1))
            done = {a["agent_id"]: a["rounds_submitted"] for a in c.status()["agents"]}
            return c.registry.last_accepted_round("a0", run_id), c.registry.last_accepted_round("a1", "another-run"), done
        finally:
            c.close()

    assert rejoined(False) == (2, 0, {"a0": 2, "a1": 2})
    assert rejoined(True) == (1, 0, {"a0": 1, "a1": 1})


def test_a_close_is_journaled_before_its_version_and_a_restart_drops_one_never_written(tmp_path):
    """Round 2's version cannot be written (its path is a directory: a real OS error): its close
    is in the journal once however often the ticker retries, not announced, and a restart runs
    round 2 again without counting it; once written, a second restart counts it exactly once."""
    import json

    from aggregator_service.coordinator import Coordinator
    from aggregator_service.store import Store

    store, run_id, g = _run_rounds(tmp_path, rounds=3, done=1)
    journal = store.run_dir(run_id) / "events.jsonl"

    def closes():
        return [e["round"] for e in map(json.loads, journal.read_text().splitlines()) if e["kind"] == "ROUND_CLOSED"]

    def resumed():
        c = Coordinator(Store(tmp_path / "state"), tick=0.02, resume=True)
        c.join(_agent("a0", 0))
        c.join(_agent("a1", 1))
        return c

    def round_2(c):
        m = encode(g, run_id, 2, 1, 100).manifest
        for a in ("a0", "a1"):
            c.submit(a, m, g, {}, 0.0)

    store.version_path(run_id, 2).mkdir()
    c = resumed()
    try:
        round_2(c)
        wait_for(lambda: "cannot persist version 2" in c.status()["message"], RPC_BOUND, "the failed write")
        ticks_pass(c, 10)  # each retries the close
        assert c.status()["global_version"] == 1 and closes() == [1, 2]
        assert [e["round"] for e in c.run.events if e["kind"] == "ROUND_CLOSED"] == [1]
    finally:
        c.close()  # killed before the disk healed
    store.version_path(run_id, 2).rmdir()
    c = resumed()
    try:
        st = c.status()
        assert st["global_version"] == 1 and st["round"] == 2
        assert [e["round"] for e in c.run.events if e["kind"] == "ROUND_CLOSED"] == [1]
        assert {a["agent_id"]: a["rounds_submitted"] for a in st["agents"]} == {"a0": 1, "a1": 1}
        round_2(c)
        assert c.status()["global_version"] == 2
    finally:
        c.close()
    assert closes() == [1, 2, 2]
    c = resumed()
    try:
        assert [e["round"] for e in c.run.events if e["kind"] == "ROUND_CLOSED"] == [1, 2]
        assert {a["agent_id"]: a["rounds_submitted"] for a in c.status()["agents"]} == {"a0": 2, "a1": 2}
        assert c.registry.last_accepted_round("a0", run_id) == 2
    finally:
        c.close()


def test_a_close_is_on_the_disk_before_its_version_is_written(tmp_path, monkeypatch):
    """A power cut cannot be staged here, so the order that survives one is checked instead: every
    fsync the aggregator makes is recorded (and really made); the journal holding round 2's close
    is fsynced before the first byte of version 2 is."""
    import json
    import os

    from aggregator_service.coordinator import Coordinator
    from aggregator_service.store import Store

    store, run_id, g = _run_rounds(tmp_path, rounds=3, done=1)
    synced: list[tuple[str, str]] = []  # (file name, its text when fsynced, for the journal)
    real_fsync = os.fsync

    def recording_fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        text = open(path).read() if path.endswith("events.jsonl") else ""
        synced.append((os.path.basename(path), text))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    c = Coordinator(Store(tmp_path / "state"), tick=0.02, resume=True)
    try:
        c.join(_agent("a0", 0))
        c.join(_agent("a1", 1))
        m = encode(g, run_id, 2, 1, 100).manifest
        for a in ("a0", "a1"):
            c.submit(a, m, g, {}, 0.0)
        wait_for(lambda: c.status()["global_version"] == 2, RPC_BOUND, "round 2 to close")
    finally:
        c.close()
    names = [n for n, _ in synced]
    assert "v000002.safetensors.tmp" in names, names
    before = synced[: names.index("v000002.safetensors.tmp")]
    journal = [t for n, t in before if n == "events.jsonl"]
    assert journal, f"the journal was not fsynced before version 2: {names}"
    closes = [e for e in map(json.loads, journal[-1].splitlines()) if e["kind"] == "ROUND_CLOSED"]
    assert closes[-1]["version"] == 2 and closes[-1]["agents"] == ["a0", "a1"]


def test_the_journal_replays_the_history_that_the_stored_versions_hold():
    from aggregator_service.records import replay_journal

    def ev(kind, version, tag=""):
        return {"kind": kind, "version": version, "tag": tag}

    first = [ev("ROUND_OPENED", 0), ev("ROUND_CLOSED", 1), ev("EVALUATED", 1), ev("ROUND_OPENED", 1),
             ev("ROUND_CLOSED", 2), ev("EVALUATED", 2), ev("ROUND_OPENED", 2), ev("ROUND_CLOSED", 3)]
    assert replay_journal(first, 3) == first
    assert replay_journal(first, 2) == first[:-1]  # version 3 never reached the disk
    # version 2 was unreadable at a restart: round 2 ran again from version 1 and closed anew
    again = [ev("RUN_RESUMED", 1), ev("ROUND_OPENED", 1, "again"), ev("ROUND_CLOSED", 2, "again"),
             ev("EVALUATED", 2, "again")]
    assert replay_journal(first + again, 2) == first[:4] + again


@pytest.mark.parametrize("part", ["accountant", "memory"])
def test_the_clocks_upkeep_raising_stops_neither_the_clock_nor_its_runs(tmp_path, monkeypatch, caplog, part):
    """Outside the lock the clock computes private runs' accountant values ahead of their close,
    and keeps or frees the runs' memory; an exception there ended the clock's thread (no join
    timeout, round deadline or secure step deadline fired again, for any run). Now it is logged
    (the accountant's once per run), and the clock goes on: a run's join timeout still fails it."""
    import logging

    from aggregator_service import ticker as ticker_mod
    from aggregator_service.coordinator import Coordinator
    from aggregator_service.store import Store
    from tests.service.test_federation import run_config

    def broken(*a, **k):
        raise RuntimeError("the upkeep broke")

    monkeypatch.setattr(ticker_mod, "warm_epsilon" if part == "accountant" else "release_free_memory", broken)
    coord = Coordinator(Store(tmp_path / "state"), tick=0.02)
    try:
        with caplog.at_level(logging.ERROR, logger="fedrl.aggregator"):
            dp = {"dp_clip": 0.5, "dp_noise": 1.0} if part == "accountant" else {}
            run_id = coord.start_run(run_config(rounds=1, join_timeout=0.3, **dp))["run_id"]
            st = wait_for(lambda: (s := coord.status())["state"] == "failed" and s, what="the join timeout")
            assert run_id == st["run_id"] and "connected within 0.3s" in st["message"], st["message"]
            ticks_pass(coord, 10)  # the memory, freed once no run is active: the clock goes on after it too
        said = "could not be computed" if part == "accountant" else "keeping or freeing the runs' memory raised"
        assert caplog.text.count(said) == 1, caplog.text
    finally:
        coord.close()


def test_a_runs_memory_is_kept_for_its_rounds_and_handed_back_when_it_ends(tmp_path, monkeypatch):
    """While a run is active the aggregator keeps a receive buffer per agent and its heap (given
    back each round, both were touched afresh the next: page faults that were a quarter of its
    CPU in 30 MB rounds). Once the run ends, the ticker (not a thread holding the coordinator's
    lock) unmaps the buffers and asks the C library to release free pages, once."""
    from aggregator_service import ticker as ticker_mod
    from aggregator_service.coordinator import Coordinator
    from aggregator_service.store import Store
    from tests.service.test_federation import run_config

    trims: list[tuple[str, bool]] = []
    coord = None

    def trim() -> bool:
        free = []  # can another thread take the coordinator's lock while the trim runs?

        def probe() -> None:
            if coord.cond.acquire(timeout=2):
                coord.cond.release()
                free.append(True)
        p = threading.Thread(target=probe)
        p.start()
        p.join()
        trims.append((threading.current_thread().name, bool(free)))
        return True

    monkeypatch.setattr(ticker_mod, "release_free_memory", trim)
    coord = Coordinator(Store(tmp_path / "state"), tick=0.02)
    try:
        run_id = coord.start_run(run_config(rounds=2))["run_id"]
        wait_for(lambda: coord.buffers.keep == 2, RPC_BOUND, "a buffer kept per agent of the run")
        coord.join(_agent("a0", 0))
        coord.join(_agent("a1", 1))
        g = coord.run.global_state
        for a in ("a0", "a1"):
            coord.submit(a, encode(g, run_id, 1, 0, 100).manifest, g, {}, 0.0)
        held = [coord.buffers.take(1000) for _ in range(2)]  # as the servicer takes them
        del held
        assert coord.buffers.free_buffers() == 2
        ticks_pass(coord, 10)  # after a round: no trim, buffers kept
        assert trims == [] and coord.buffers.free_buffers() == 2
        for a in ("a0", "a1"):
            coord.submit(a, encode(g, run_id, 2, 1, 100).manifest, g, {}, 0.0)
        assert coord.status()["state"] == "finished"
        wait_for(lambda: trims, RPC_BOUND, "a trim once the run ended")
        ticks_pass(coord, 10)  # and no second one
        assert trims == [("aggregator-ticker", True)]
        assert coord.buffers.keep == 0 and coord.buffers.free_buffers() == 0
    finally:
        coord.close()


def test_a_state_directory_that_cannot_be_made_is_named(tmp_path):
    import pytest

    from aggregator_service.store import Store

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match=f"state directory {blocker}: cannot create {blocker / 'runs'} "
                                      r"\(Not a directory\)"):
        Store(blocker)


def test_start_run_on_a_full_or_unwritable_state_directory_is_refused_and_leaves_nothing(aggregator, monkeypatch):
    """StartRun when the run cannot be stored: a specific status (RESOURCE_EXHAUSTED for a full
    disk, FAILED_PRECONDITION for one that cannot be written), no run folder left behind, no run
    started; with the disk healthy again the same request starts a run."""
    import errno
    import os

    import grpc
    import pytest

    from fedrl.proto.v1 import control_pb2

    runs = aggregator.store.root / "runs"
    cfg = test_federation.run_config()

    def start():
        with pytest.raises(grpc.RpcError) as ei:
            aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=cfg), timeout=RPC_BOUND)
        return ei.value

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:  # the disk fills while the run's config is written
        m.setattr(os, "fsync", no_space)
        err = start()
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "full" in err.details(), err.details()
    assert list(runs.iterdir()) == [] and not status(aggregator)["run_id"]
    runs.rmdir()
    runs.write_text("not a directory")  # a state directory whose runs/ cannot hold anything: a real OS error
    try:
        err = start()
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "not writable" in err.details(), err.details()
        assert not status(aggregator)["run_id"]
    finally:
        runs.unlink()
        runs.mkdir()
    st = aggregator.control.StartRun(control_pb2.StartRunRequest(config_json=cfg), timeout=RPC_BOUND)
    assert st.run_id and len(list(runs.iterdir())) == 1


def test_a_version_written_from_its_tensors_is_the_payload_served(tmp_path):
    """The aggregator writes each new version from the encoded pieces (header, then each
    tensor's bytes) without joining them first: the file must be the payload byte for byte,
    across several tensors and dtypes, and read back as the same tensors."""
    from safetensors.torch import load_file

    from aggregator_service.store import Store
    from fedrl.wire.codec import checksum

    state = {"pi.w": torch.randn(300, 200), "pi.b": torch.randn(200).double(), "n": torch.arange(5)}
    enc = encode(state, "run", 3, 3, 0, metadata={"version": "3"})
    store = Store(tmp_path / "state")
    store.create_run("run", "{}")
    path = store.save_version("run", 3, enc.pieces())
    assert checksum(path.read_bytes()) == enc.manifest.checksum
    assert path.read_bytes() == enc.payload  # joined only now, for the comparison
    assert all(torch.equal(v, state[k]) for k, v in load_file(str(path)).items())
    assert store.save_version("run", 4, enc.payload).read_bytes() == path.read_bytes()  # whole, as before


def test_a_version_is_written_in_slices_and_leaves_the_page_cache_once_on_disk(tmp_path, monkeypatch):
    """Versions are written a slice at a time (large single writes cost the kernel ~10x the CPU
    here) and their pages are dropped from the page cache once fsynced (new pages for every
    version cost more than the ones the last version left): the bytes on disk are still the
    payload's, wherever the slices cut, and the run's config stays cached."""
    import shutil
    import subprocess

    import aggregator_service.store as store_mod
    from aggregator_service.store import Store

    if shutil.which("fincore") is None:
        pytest.skip("util-linux fincore is not installed")

    def resident(path) -> int:
        out = subprocess.run(["fincore", "-b", "-n", "-r", "-o", "RES", str(path)], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        return int(out.split()[0])

    state = {"w": torch.randn(700, 1000), "b": torch.randn(333)}  # ~2.8 MB
    enc = encode(state, "run", 1, 1, 0)
    store = Store(tmp_path / "state")
    store.create_run("run", "{}")
    control = store.run_dir("run") / "control.bin"
    store._write_bytes(control, enc.payload)  # kept cached, as the config and participants are
    if resident(control) < len(enc.payload):
        pytest.skip("this filesystem does not keep written pages in the page cache")
    probe = store.run_dir("run") / "probe.bin"
    probe.write_bytes(enc.payload)
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if resident(probe) > len(enc.payload) // 10:
        pytest.skip("this filesystem keeps pages it is asked to drop (tmpfs)")
    path = store.save_version("run", 1, enc.pieces())
    assert resident(path) < len(enc.payload) // 10, resident(path)  # before anything reads it back
    assert path.read_bytes() == enc.payload
    monkeypatch.setattr(store_mod, "WRITE_SLICE", 1000)  # slices that cut the header and the tensors
    assert store.save_version("run", 2, enc.pieces()).read_bytes() == enc.payload


def _rewrite_tensor_bytes(path, edit) -> None:
    """A stored version whose tensor bytes ``edit(bytearray)`` changes in place, its safetensors
    structure intact (a flipped bit on disk; a NaN written by a faulty writer)."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    edit(raw, 8 + n)  # where the tensors' bytes start
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["flipped-byte", "nan"])
def test_restart_skips_a_newest_version_whose_bytes_are_not_those_written(tmp_path, caplog, damage):
    """A version file still parses but holds other bytes (a flipped byte) or a NaN: a restart used
    to resume it (the agents then refused the NaN model and the run wedged); now its checksum gives
    it away, the run resumes from the version before, and the log says why."""
    import struct

    from aggregator_service.coordinator import Coordinator
    from aggregator_service.store import Store

    store, run_id, g = _run_rounds(tmp_path, rounds=3, done=2)

    def edit(raw, start):
        if damage == "nan":
            raw[start:start + 4] = struct.pack("<f", float("nan"))
        else:
            raw[start + 5] ^= 0x01

    _rewrite_tensor_bytes(store.version_path(run_id, 2), edit)
    with caplog.at_level("ERROR"):
        second = Coordinator(Store(tmp_path / "state"), tick=0.02, resume=True)
    try:
        st = second.status()
        assert st["global_version"] == 1 and st["round"] == 2, st
        assert all(torch.isfinite(v).all() for v in second.run.global_state.values())
        assert any("version 2" in r.getMessage() and "damaged on disk" in r.getMessage() for r in caplog.records)
    finally:
        second.close()


def test_a_damaged_stored_version_is_refused_not_served_and_ctl_fetch_fails(tmp_path):
    """An older version whose tensor bytes changed on disk used to be served under a fresh, valid
    checksum, and `ctl fetch --run` exited 0; now FetchGlobal says DATA_LOSS and ctl exits 1."""
    import subprocess
    import sys

    from .conftest import Aggregator

    store, run_id, g = _run_rounds(tmp_path, rounds=2, done=2)  # finished: every version from disk
    _rewrite_tensor_bytes(store.version_path(run_id, 1), lambda raw, start: raw.__setitem__(start + 9, raw[start + 9] ^ 4))
    agg = Aggregator(tmp_path / "state")
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(agg.fed.FetchGlobal(federation_pb2.FetchRequest(run_id=run_id, version=1), timeout=RPC_BOUND))
        assert e.value.code() == grpc.StatusCode.DATA_LOSS and "damaged on disk" in e.value.details()
        list(agg.fed.FetchGlobal(federation_pb2.FetchRequest(run_id=run_id, version=2), timeout=RPC_BOUND))  # intact
        p = subprocess.run([sys.executable, "-m", "fedrl.cli", "ctl", "--target", agg.target, "fetch", "--run",
                            run_id, "--version", "1", "--out", str(tmp_path / "p.safetensors")],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 1 and "DATA_LOSS" in p.stderr and not (tmp_path / "p.safetensors").exists()
    finally:
        agg.close()


def test_an_agent_with_no_aggregator_says_connection_refused(stand_dataset, caplog):
    """Nothing listens at the agent's target: it used to log DEADLINE_EXCEEDED every few seconds;
    it says the connection is refused, and keeps retrying."""
    import socket

    from .conftest import AgentThreads

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free a moment ago: nothing listens there
    agents = AgentThreads()
    try:
        with caplog.at_level("WARNING"):
            agents.start(f"127.0.0.1:{port}", str(stand_dataset), 1, 2, seed=1, connect_timeout=0.5)
            end = time.monotonic() + 20
            while not any("connection refused" in r.getMessage() for r in caplog.records) and time.monotonic() < end:
                time.sleep(0.05)
        said = [r.getMessage() for r in caplog.records if r.name == "fedrl.agent"]
        assert any(f"no aggregator at 127.0.0.1:{port} (connection refused)" in m for m in said), said
        assert not any("DEADLINE_EXCEEDED" in m for m in said) and agents.threads[0].is_alive()
    finally:
        agents.stop()


def test_restart_while_the_moments_are_summed_gathers_them_again(tmp_path):
    """A secure run killed in round 0 (its agents' moments under secure aggregation, no version
    made) resumes waiting for its agents, and gathers their moments again from the start."""
    from aggregator_service.coordinator import Coordinator
    from aggregator_service.store import Store
    from tests.service.test_federation import run_config

    first = Coordinator(Store(tmp_path / "state"), tick=0.02)
    run_id = first.start_run(run_config(secagg_threshold=2))["run_id"]
    first.join(_agent("a0", 0))
    first.join(_agent("a1", 1))
    assert (first.run.state, first.run.round) == ("running", 0) and first.run.machine.secure is not None
    assert first.tasks.next_task("a0", 0.0)["kind"] == "MOMENTS"
    first.close()  # "killed" before any agent's keys came
    second = Coordinator(Store(tmp_path / "state"), tick=0.02, resume=True)
    try:
        assert Store(tmp_path / "state").versions(run_id) == []
        st = second.status()
        assert st["run_id"] == run_id and st["state"] == "waiting_for_agents"
        second.join(_agent("a0", 0))
        second.join(_agent("a1", 1))
        assert (second.run.state, second.run.round) == ("running", 0)
        task = second.tasks.next_task("a1", 0.0)
        assert (task["kind"], task["run_id"], task["round"]) == ("MOMENTS", run_id, 0)
    finally:
        second.close()


@pytest.mark.parametrize("damage", ["missing", "directory"])
def test_a_stored_version_without_a_readable_checksum_is_damage_served_as_data_loss(tmp_path, caplog, damage):
    """A version whose .xxh3 is missing (a crash between the two writes) or is a directory was
    served and resumed unchecked, or answered UNKNOWN: it is damage now. FetchGlobal says
    DATA_LOSS; a restart resumes from the version before, saying why."""
    import shutil

    from aggregator_service.coordinator import Coordinator
    from aggregator_service.store import Store

    from .conftest import Aggregator

    store, run_id, g = _run_rounds(tmp_path, rounds=3, done=2)
    for v in (1, 2):
        p = store.checksum_path(run_id, v)
        p.unlink()
        if damage == "directory":
            p.mkdir()
    with caplog.at_level("ERROR"):
        second = Coordinator(Store(tmp_path / "state"), tick=0.02, resume=True)
    try:
        st = second.status()
        assert st["global_version"] == 0 and st["round"] == 1, st  # neither 2 nor 1 can be verified
        assert any("version 2" in r.getMessage() and "checksum" in r.getMessage() for r in caplog.records)
    finally:
        second.close()
    agg = Aggregator(tmp_path / "state2")
    try:
        shutil.copytree(store.run_dir(run_id), agg.store.run_dir(run_id))
        with pytest.raises(grpc.RpcError) as e:
            list(agg.fed.FetchGlobal(federation_pb2.FetchRequest(run_id=run_id, version=1), timeout=RPC_BOUND))
        assert e.value.code() == grpc.StatusCode.DATA_LOSS and "checksum" in e.value.details(), e.value.details()
    finally:
        agg.close()


def test_a_run_stored_before_checksums_were_kept_is_read_as_it_is(tmp_path):
    """A run folder with no FORMAT file predates checksums: its versions have none, and are read."""
    from aggregator_service.store import Store

    store, run_id, g = _run_rounds(tmp_path, rounds=2, done=2)
    (store.run_dir(run_id) / "FORMAT").unlink()
    for v in store.versions(run_id):
        store.checksum_path(run_id, v).unlink()
    assert Store(tmp_path / "state").load_version(run_id, 2).keys()
