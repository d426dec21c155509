"""benchmarks.system.version_write: each way of writing a version is timed, and every file it wrote is the payload."""

import json

import aggregator_service.store as store_mod
from benchmarks.system import version_write


def test_each_way_of_writing_a_version_is_timed_and_the_store_setting_is_restored(tmp_path, capsys, monkeypatch):
    written = []
    real = store_mod.Store._write_bytes

    def spy(self, path, data, keep_cached=True):
        real(self, path, data, keep_cached)
        if path.suffix == ".safetensors":  # not the run's config
            written.append((path.read_bytes(), b"".join(bytes(p) for p in data), store_mod.WRITE_SLICE,
                            keep_cached))

    monkeypatch.setattr(store_mod.Store, "_write_bytes", spy)
    assert version_write.main(["--mb", "3", "--versions", "2", "--dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["cpu_ms_each"]) == {"whole, kept", "slices, kept", "whole, dropped", "slices, dropped (the store)"}
    assert all(len(v) == 2 and all(x >= 0 for x in v) for v in out["cpu_ms_each"].values())
    assert len(written) == 8 and all(disk == payload for disk, payload, _, _ in written)
    assert {(s, k) for _, _, s, k in written} == {(1 << 40, True), (1 << 20, True), (1 << 40, False), (1 << 20, False)}
    assert store_mod.WRITE_SLICE == 1 << 20  # put back
