"""The container image the manifests run: built from the real Dockerfile here, checked against
every name ``deploy/`` uses, and a tiny federation run inside it (``benchmarks/system/image.py`` says how
it is built where Docker Hub and torch's index cannot be reached). Needs root, buildah and
debootstrap; about 3 minutes on 2 cores."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from benchmarks.system import image as img
from tests.conftest import require_tool

pytestmark = pytest.mark.slow(reason="builds the container image from the Dockerfile (buildah, debootstrap): minutes")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
USER = "10001:10001"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    exe = require_tool("buildah")
    require_tool("debootstrap")
    if os.geteuid() != 0:
        msg = "building the image needs root (buildah --isolation chroot)"
        if os.environ.get("FEDRL_REQUIRE_TOOLS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    work = tmp_path_factory.mktemp("image")
    b = img.Buildah(work, exe)
    try:
        img.build_base(b, work)
        img.build_image(b, img.torch_wheels())
        yield b
    finally:
        b("rm", "--all", check=False)
        b("rmi", "--all", "--force", check=False)
        subprocess.run(["rm", "-rf", str(work)], check=False)


def containers() -> list[tuple[str, dict]]:
    """Every container and init container of every manifest under deploy/ (base, overlays,
    components), named by its file."""
    out = []

    def walk(node, where):
        if isinstance(node, dict):
            for key in ("containers", "initContainers"):
                for c in node.get(key) or []:
                    out.append((where, c))
            for v in node.values():
                walk(v, where)
        elif isinstance(node, list):
            for v in node:
                walk(v, where)

    for f in sorted(DEPLOY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            walk(doc, str(f.relative_to(DEPLOY)))
    return out


def pod_users() -> set[tuple[int, int]]:
    users = set()

    def walk(node):
        if isinstance(node, dict):
            sc = node.get("securityContext")
            if isinstance(sc, dict) and "runAsUser" in sc:
                users.add((sc["runAsUser"], sc.get("runAsGroup")))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for f in sorted(DEPLOY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            walk(doc)
    return users


def test_the_manifests_are_read():
    """The name checks below mean something only if they find the manifests' containers."""
    cs = containers()
    commands = {c["command"][0] for _, c in cs if c.get("command")}
    assert {"fedrl-aggregator", "fedrl-agent", "fedrl-evaluator", "fedrl"} <= commands, commands
    assert pod_users() == {(10001, 10001)}


def test_the_image_is_the_one_the_manifests_name():
    kust = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    (entry,) = [i for i in kust["images"] if i["name"] == "fedrl"]
    assert f"{entry['newName']}:{entry['newTag']}" == img.tag().split("/")[-1]
    assert f"-t fedrl:{img.version()} ." in (DEPLOY.parent / "Dockerfile").read_text()


def test_image_runs_as_the_manifests_user_with_their_environment(built):
    cfg = built.image_config(img.tag())
    assert cfg["User"] == USER
    assert {f"{u}:{g}" for u, g in pod_users()} == {cfg["User"]}
    env = dict(e.split("=", 1) for e in cfg["Env"])
    assert env["PATH"].split(":")[0] == "/opt/fedrl/bin"
    assert env["HOME"] == "/tmp" and env["FEDRL_CACHE_DIR"] == "/data/cache"
    for where, c in containers():  # what a manifest sets must agree with the image
        for e in c.get("env") or []:
            if e.get("name") in ("HOME", "FEDRL_CACHE_DIR") and "value" in e:
                assert e["value"] == env[e["name"]], (where, e)
    # every port a manifest opens is one the image exposes, and the reverse
    exposed = {int(p.split("/")[0]) for p in cfg["ExposedPorts"]}
    ports = {p["containerPort"] for _, c in containers() for p in c.get("ports") or []}
    assert ports == exposed, (sorted(ports), sorted(exposed))


def test_every_command_and_writable_mount_exists_in_the_image(built):
    commands = sorted({c["command"][0] for _, c in containers() if c.get("command")})
    writable = sorted({m["mountPath"] for _, c in containers() for m in c.get("volumeMounts") or []
                       if not m.get("readOnly")})
    assert "/state" in writable and "/data" in writable and "/tmp" in writable
    script = ("id -u; id -g; " + "; ".join(f"command -v {c} >/dev/null || echo 'MISSING command {c}'" for c in commands)
              + "; " + "; ".join(f"test -d {d} && test -w {d} || echo 'NOT WRITABLE {d}'" for d in writable))
    p = img.run_in_image(built, "sh", "-c", script)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.split()
    assert lines[:2] == ["10001", "10001"], p.stdout
    assert "MISSING" not in p.stdout and "NOT WRITABLE" not in p.stdout, p.stdout


def test_a_tiny_run_inside_the_image(built):
    """Aggregator, one agent and the evaluator, started inside the image with the manifests'
    flags, finish a 2-round run driven by ``fedrl ctl`` and write only to the mounted paths."""
    p, seconds = img.smoke(built)
    assert "IMAGE-SMOKE OK" in p.stdout, f"{p.stdout[-4000:]}\n{p.stderr[-2000:]}"
    assert "run finished" in p.stdout
