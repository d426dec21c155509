"""The container image the Kubernetes manifests run, built from the real Dockerfile with buildah.

    python -m benchmarks.system.image measure     build the base and the image, start the tiny run inside,
                                           write benchmarks/results/image.json
    python -m benchmarks.system.image render      write deploy/README.md's generated block from that file

Where Docker Hub and torch's index cannot be reached (these machines reach PyPI and Debian only),
the Dockerfile is built with nothing but its build arguments changed:

- ``PYTHON_IMAGE``: a local base, ``localhost/fedrl-python:3.11-bookworm``: a Debian bookworm root
  filesystem from ``debootstrap --variant=minbase`` with python3.11 and venv (``python`` on PATH,
  as the official image has it). It also carries this machine's CA bundle and points ``PIP_CERT``
  at it, for machines whose way to PyPI re-signs TLS.
- ``TORCH_WHEELS=/wheels`` with ``--volume DIR:/wheels:ro``: torch from a wheel on disk (pip's
  ``find-links`` folder, or ``FEDRL_TORCH_WHEELS``); its dependencies come from PyPI. Without a
  wheel the Dockerfile's ``TORCH_INDEX`` is used.

Builds run as root with ``--isolation chroot`` (``podman run`` cannot set rlimits here), in a
private storage root, so nothing touches the machine's own images. The tiny run is
``tests/deploy/image_smoke.sh``, inside the built image as its own user; the test that drives all
this is ``tests/deploy/test_image.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "image.json"
DEPLOY_README = ROOT / "deploy" / "README.md"
SMOKE = ROOT / "tests" / "deploy" / "image_smoke.sh"
BASE = "localhost/fedrl-python:3.11-bookworm"
MIRROR = os.environ.get("FEDRL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def version() -> str:
    m = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert m, "pyproject.toml names no version"
    return m.group(1)


def tag() -> str:
    """The image the manifests name (``images: fedrl`` at the package's version)."""
    return f"localhost/fedrl:{version()}"


def dockerfile_arg(name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S*)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert m, f"the Dockerfile has no ARG {name}"
    return m.group(1)


def torch_wheels() -> Path | None:
    """A folder holding the torch wheel the Dockerfile pins (``FEDRL_TORCH_WHEELS``, else pip's
    find-links), or ``None``."""
    want = dockerfile_arg("TORCH_VERSION")
    dirs = [os.environ.get("FEDRL_TORCH_WHEELS", "")]
    dirs += os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60).stdout
        dirs += [w for line in out.splitlines() if "find-links" in line
                 for w in line.split("=", 1)[1].strip("'\" ").split()]
    except (OSError, subprocess.SubprocessError):
        pass
    for d in dirs:
        if d and Path(d).is_dir() and any(Path(d).glob(f"torch-{want}*-cp311-*.whl")):
            return Path(d)
    return None


class Buildah:
    """buildah with a private storage root (``root``)."""

    def __init__(self, root: Path, exe: str = "buildah") -> None:
        self.exe, self.root = exe, Path(root)

    def __call__(self, *args: str, timeout: float = 1800, check: bool = True, **kw) -> subprocess.CompletedProcess:
        cmd = [self.exe, "--root", str(self.root / "storage"), "--runroot", str(self.root / "run"), *args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        return p

    def image_config(self, image: str) -> dict:
        return json.loads(self("inspect", "--type", "image", image).stdout)["OCIv1"]["config"]

    def size(self, image: str) -> int:
        """The image's bytes: the sum of its (uncompressed) layers, as ``buildah images`` counts it."""
        doc = json.loads(self("inspect", "--type", "image", image).stdout)
        return sum(int(layer["size"]) for layer in json.loads(doc["Manifest"])["layers"])


def build_base(b: Buildah, work: Path) -> float:
    """The local stand-in for ``python:3.11-slim-bookworm``; returns the seconds it took."""
    t0 = time.monotonic()
    rootfs = work / "rootfs"
    p = subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,python-is-python3,ca-certificates",
                        "bookworm", str(rootfs), MIRROR], capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"debootstrap failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    if CA_BUNDLE.exists():
        shutil.copy2(CA_BUNDLE, rootfs / "etc/ssl/certs/ca-certificates.crt")
    shutil.rmtree(rootfs / "var/lib/apt/lists", ignore_errors=True)
    for deb in (rootfs / "var/cache/apt/archives").glob("*.deb"):
        deb.unlink()
    ctr = b("from", "scratch").stdout.strip()
    try:
        mnt = b("mount", ctr).stdout.strip()
        subprocess.run(["cp", "-a", f"{rootfs}/.", mnt], check=True, timeout=600)
        b("umount", ctr)
        b("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
          "--env", f"PIP_CERT={CA_BUNDLE}", "--cmd", "python", ctr)
        b("commit", "--quiet", ctr, BASE)
    finally:
        b("rm", ctr, check=False)
    shutil.rmtree(rootfs, ignore_errors=True)
    return time.monotonic() - t0


def build_command(wheels: Path | None) -> list[str]:
    cmd = ["build", "--isolation", "chroot", "--build-arg", f"PYTHON_IMAGE={BASE}", "-t", tag()]
    if wheels is not None:
        cmd += ["--build-arg", "TORCH_WHEELS=/wheels", "--volume", f"{wheels}:/wheels:ro"]
    return cmd + [str(ROOT)]


def build_image(b: Buildah, wheels: Path | None) -> float:
    t0 = time.monotonic()
    b(*build_command(wheels), timeout=3600)
    return time.monotonic() - t0


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_in_image(b: Buildah, *cmd: str, volume: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``cmd`` in a fresh container of the image, as the image's user; the container is removed."""
    ctr = b("from", tag()).stdout.strip()
    try:
        vol = ["--volume", volume] if volume else []
        return b("run", "--isolation", "chroot", *vol, ctr, "--", *cmd, timeout=timeout, check=False)
    finally:
        b("rm", ctr, check=False)


def smoke(b: Buildah, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    """The tiny federation inside the image (``tests/deploy/image_smoke.sh``)."""
    t0 = time.monotonic()
    p = run_in_image(b, "sh", "/smoke/image_smoke.sh", *map(str, free_ports(6)),
                     volume=f"{SMOKE.parent}:/smoke:ro", timeout=timeout)
    return p, time.monotonic() - t0


def cmd_measure(a) -> int:
    work = Path(tempfile.mkdtemp(prefix="fedrl-image-"))
    b = Buildah(work)
    try:
        wheels = torch_wheels()
        base_s = build_base(b, work)
        build_s = build_image(b, wheels)
        size = b.size(tag())
        p, smoke_s = smoke(b)
        if "IMAGE-SMOKE OK" not in p.stdout:
            raise SystemExit(f"the tiny run inside the image failed:\n{p.stdout[-3000:]}\n{p.stderr[-2000:]}")
        res = {"image": tag(), "size_bytes": size, "base_seconds": round(base_s, 1), "build_seconds": round(build_s, 1),
               "smoke_seconds": round(smoke_s, 1), "torch_wheels": str(wheels) if wheels else None,
               "command": "buildah " + " ".join(build_command(wheels)).replace(str(ROOT), "."),
               "cpus": os.cpu_count(), "loadavg_1min": round(os.getloadavg()[0], 2),
               "date": time.strftime("%Y-%m-%d %H:%M")}
        RESULTS.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(res, indent=1))
    finally:
        Buildah(work)("rm", "--all", check=False)
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0


def block(results: Path = RESULTS) -> str:
    r = json.loads(results.read_text())
    return (f"Measured {r['date'][:10]} on this project's {r['cpus']}-core build machine (load {r['loadavg_1min']}): "
            f"the image `{r['image'].split('/')[-1]}` is **{r['size_bytes'] / 1e9:.2f} GB** (uncompressed layers); "
            f"the base took {r['base_seconds']:.0f} s, the image {r['build_seconds']:.0f} s "
            f"(torch from a local wheel, the rest from PyPI), and the tiny run inside it "
            f"{r['smoke_seconds']:.0f} s. Command: `python -m benchmarks.system.image measure`.")


def cmd_render(a) -> int:
    from benchmarks.common import replace_blocks

    DEPLOY_README.write_text(replace_blocks(DEPLOY_README.read_text(), {"image": block()}))
    print(f"wrote {DEPLOY_README}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.system.image", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("measure").set_defaults(func=cmd_measure)
    sub.add_parser("render").set_defaults(func=cmd_render)
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
