"""What writing a global version costs the aggregator, by how it is written.

    python -m benchmarks.system.version_write [--mb 30] [--versions 8] [--dir DIR]

Writes ``--versions`` new version files of a ~``--mb`` MB model into a fresh directory under
``--dir`` (default: the system's temporary directory; give the aggregator's ``--state-dir`` disk
to measure that one), each fsynced, four ways, alternating: one write() per tensor or 1 MiB
slices, and the file's pages kept in the page cache or dropped once on disk (what
``aggregator_service.store.Store.save_version`` does now: slices, dropped). Prints the CPU
seconds of each write (write + fsync) in ms, and the medians.

Found with it (2026-11-27, Linux 6.18, ext4): a 30 MB version written whole into new page-cache
pages cost ~70 ms of CPU in the kernel's copy, in 1 MiB slices ~6 ms; in the aggregator, where
every round adds a new version, slices alone did not help (its writes kept taking new pages:
72 ms), slices with the pages dropped did (13.7 ms, ``benchmarks.system.inplace --model 30mb``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=30)
    p.add_argument("--versions", type=int, default=8)
    p.add_argument("--dir", default=None)
    a = p.parse_args(argv)
    import torch

    import aggregator_service.store as store_mod
    from aggregator_service.store import Store
    from fedrl.wire.codec import encode

    h = int((a.mb * 1e6 / 4) ** 0.5)
    enc = encode({"w": torch.randn(h, h), "b": torch.randn(h)}, "bench", 1, 1)
    ways = {"whole, kept": (1 << 40, True), "slices, kept": (1 << 20, True),
            "whole, dropped": (1 << 40, False), "slices, dropped (the store)": (1 << 20, False)}
    ms: dict[str, list[float]] = {k: [] for k in ways}
    saved = store_mod.WRITE_SLICE
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        store = Store(Path(d))
        store.create_run("bench", "{}")
        try:
            for v in range(a.versions):
                for i, (name, (piece, dropped)) in enumerate(ways.items()):
                    store_mod.WRITE_SLICE = piece
                    path = store.version_path("bench", v * len(ways) + i)
                    c = time.process_time()
                    store._write_bytes(path, enc.pieces(), keep_cached=not dropped)
                    ms[name].append(round((time.process_time() - c) * 1e3, 1))
        finally:
            store_mod.WRITE_SLICE = saved
    out = {"model_mb": enc.manifest.total_bytes / 1e6, "versions": a.versions, "cpu_ms_each": ms,
           "cpu_ms_median": {k: statistics.median(v) for k, v in ms.items()}}
    for k, v in ms.items():
        print(f"{k:30s} median {statistics.median(v):6.1f} ms CPU   {v}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
