"""What the weights manifest's checksum costs: MB/s of sha256, XXH3-128 and BLAKE3 over a payload.

    python -m benchmarks.checksum [--mb 30] [--repeats 5] [--out FILE]

Best of ``--repeats`` passes each over the same random bytes (one thread; BLAKE3 also with its
own threads). Why the wire contract v2 uses XXH3-128: docs/performance.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time


def rates(mb: float = 30.0, repeats: int = 5) -> dict[str, float]:
    import blake3
    import xxhash

    data = os.urandom(int(mb * (1 << 20)))
    fns = {"sha256": lambda: hashlib.sha256(data).hexdigest(),
           "xxh3_128": lambda: xxhash.xxh3_128_hexdigest(data),
           "blake3_1_thread": lambda: blake3.blake3(data).hexdigest(),
           "blake3_auto_threads": lambda: blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()}
    out = {}
    for name, f in fns.items():
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t)
        out[name] = len(data) / best / 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=30.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    r = {"mb": a.mb, "cores": os.cpu_count(), "mb_per_s": rates(a.mb, a.repeats)}
    print(json.dumps(r, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
