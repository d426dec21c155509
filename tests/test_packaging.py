"""The installed distribution, as the container image builds it: what the Dockerfile copies,
built into a wheel (not the editable install the tests otherwise run from), installed alone
into a folder of its own and used from outside the source tree. A module, checkpoint or stub
left out of the wheel only shows there (no image can be built on this machine). The wheel is
built without network (setuptools comes with the test extras)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fedrl.behavior.shipped import SHIPPED_DIR, shipped_envs

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("aggregator_service", "agent_service", "evaluator_service")
SCRIPTS = ("fedrl", "fedrl-aggregator", "fedrl-agent", "fedrl-evaluator")


def dockerfile_sources() -> list[str]:
    """The paths the Dockerfile's build stage copies from the build context."""
    out = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            out += words[1:-1]
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(run, scripts dir, wheel path): the built wheel installed alone into a folder of its own,
    which ``run`` puts first on the import path (the dependencies come from this interpreter's
    environment, whatever virtualenv that is)."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    for name in dockerfile_sources():
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(p, src / name)
    site = tmp / "site"

    def run(*cmd, cwd=tmp):
        env = {**os.environ, "PYTHONPATH": str(site)}
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{cmd}: {r.stdout}\n{r.stderr}"
        return r.stdout

    pip = (sys.executable, "-m", "pip")
    run(*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(src))
    (wheel,) = (tmp / "dist").glob("fedrl-*.whl")
    run(*pip, "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel))
    return run, site, wheel


def test_the_dockerfile_copies_every_package_the_project_declares():
    declared = {"fedrl", *SERVICES}
    assert declared <= set(dockerfile_sources()), f"the Dockerfile copies {dockerfile_sources()}"


def test_the_wheel_holds_every_shipped_behaviour_file_and_the_typed_stubs(installed):
    _, _, wheel = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    assert shipped_envs(), "no behaviour set is shipped at all"
    for env in shipped_envs():
        manifest = json.loads((SHIPPED_DIR / env / "manifest.json").read_text())
        files = [manifest[q]["file"] for q in ("expert", "medium") if manifest.get(q)]
        files += [c["file"] for c in manifest["medium_replay"]["checkpoints"]]
        for f in ["manifest.json", *files]:
            assert f"fedrl/behavior/checkpoints/{env}/{f}" in names, f"{env}/{f} is not in the wheel"
    stubs = {p.name for p in (ROOT / "fedrl" / "proto" / "v1").glob("*_pb2*.py*")}
    assert stubs and all(f"fedrl/proto/v1/{s}" in names for s in stubs)
    for pkg in SERVICES:
        assert f"{pkg}/__main__.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


@pytest.mark.slow(reason="builds and installs the wheel into a new virtualenv")
def test_the_installed_wheel_runs_from_outside_the_source_tree(installed, tmp_path):
    run, site, _ = installed
    where = run(sys.executable, "-c", "import fedrl, aggregator_service, agent_service, evaluator_service as e;"
                "print(fedrl.__file__); print(e.__file__)", cwd=tmp_path)
    assert all(line.startswith(str(site)) for line in where.split()), where  # not the checkout
    for script in SCRIPTS:
        assert "usage" in run(str(site / "bin" / script), "--help", cwd=tmp_path).lower()
    for env in shipped_envs():  # each shipped behaviour set loads from the installed package
        gym_id = json.loads((SHIPPED_DIR / env / "manifest.json").read_text())["env_id"]
        out = tmp_path / f"{env}.hdf5"
        made = json.loads(run(str(site / "bin" / "fedrl"), "data", "make", "--env", gym_id, "--quality",
                              "medium", "--episodes", "1", "--seed", "0", "--out", str(out), cwd=tmp_path))
        assert made["episodes"] == 1 and made["transitions"] > 0 and out.exists()
