"""The documentation: a site that builds, reference pages generated from the code and current,
numbers rendered from committed results, commands the parsers accept, and a README a newcomer
can read in two minutes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import source

ROOT = Path(__file__).resolve().parents[1]


def test_the_reference_pages_are_generated_from_the_current_code():
    p = subprocess.run([sys.executable, "tools/make_reference.py", "--check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr


def test_the_site_builds_strictly(tmp_path):
    """A broken link, a page missing from the navigation, a bad anchor: each fails the build."""
    pytest.importorskip("mkdocs", reason="mkdocs is a test dependency: pip install -e '.[test]'")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "site" / "index.html").exists()


def test_the_strict_build_notices_a_broken_link(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is a test dependency")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "quickstart.md", "a") as f:
        f.write("\n[gone](no-such-page.md)\n")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "no-such-page.md" in p.stdout + p.stderr


def _block(text: str, name: str) -> str:
    m = re.search(rf"<!-- generated:{re.escape(name)} -->\n(.*?)\n<!-- end:{re.escape(name)} -->", text, re.S)
    assert m, f"no {name} block"
    return m.group(1)


def test_every_rendered_number_matches_its_committed_result():
    from benchmarks.studies import critic_sink, privacy_cost
    from benchmarks.system import image, readme

    for path, blocks in ((readme.README, readme.blocks()), (readme.PERFORMANCE, readme.performance_blocks()),
                         (readme.BENCHMARKS, readme.benchmarks_blocks()),
                         (critic_sink.SINK_MD, {"critic-sink": critic_sink.report_md()}),
                         (image.DEPLOY_README, {"image": image.block()}),
                         (critic_sink.CHOICES_MD, critic_sink.choices_blocks()),
                         (privacy_cost.PRIVACY_MD, privacy_cost.blocks())):
        text = path.read_text()
        for name, body in blocks.items():
            assert _block(text, name) == body, f"{path.name}: block {name} is stale: python -m benchmarks.system.readme render"


def test_the_readme_is_short_and_leads_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 170, len(lines)
    head = "\n".join(lines[:40])
    assert "pip install torch==2.13.0 -e . && fedrl up" in head
    assert 'pip install torch==2.13.0 -e ".[test]" && python -m pytest' in head


def test_ci_runs_the_readmes_test_command_in_a_new_virtualenv():
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install torch==2.13.0 -e ".[test]" && python -m pytest' in ci
    assert "python3 -m venv" in ci and "source" in ci


def test_the_suites_measurement_keeps_pytests_slowest_phases():
    from benchmarks.system.readme import slowest_tests

    report = ["=========== slowest 40 durations ===========", "61.02s call     tests/e2e/test_up.py::test_up",
              "3.10s setup    tests/service/test_a.py::test_b[a b]", "1.50s teardown tests/x.py::test_y",
              "(12 durations < 1s hidden.  Use -vv to show these durations.)", "774 passed in 1173.62s (0:19:33)"]
    assert slowest_tests(report) == [
        {"seconds": 61.02, "phase": "call", "test": "tests/e2e/test_up.py::test_up"},
        {"seconds": 3.1, "phase": "setup", "test": "tests/service/test_a.py::test_b[a b]"},
        {"seconds": 1.5, "phase": "teardown", "test": "tests/x.py::test_y"}]


def _documented_commands() -> list[tuple[str, str, list[str]]]:
    """Every ``fedrl``/service command the documents quote with an option: inline code spans and
    lines of shell blocks, split at ``&&``, ``|`` and ``;`` (the history and the generated
    reference pages left out), each with its words (``FOO=1`` prefixes dropped). Spans that only
    name a command are not invocations."""
    import shlex

    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "deploy" / "README.md",
             *(p for p in source.files("docs", "*.md") if not {"history", "reference"} & set(p.parts))]
    out = []
    for f in files:
        text = f.read_text()
        spans = re.findall(r"`([^`\n]+)`", text)
        spans += [line for b in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S) for line in b.splitlines()]
        for span in spans:
            for part in re.split(r"&&|\|\||;|\|", span.split("  #")[0]):
                try:
                    words = shlex.split(part)
                except ValueError:
                    continue
                while words and re.match(r"^[A-Z_]+=", words[0]):  # FOO=1 fedrl ...
                    words = words[1:]
                if (words and words[0] in ("fedrl", "fedrl-aggregator", "fedrl-agent", "fedrl-evaluator")
                        and any(w.startswith("-") for w in words[1:])
                        and not re.search(r"[<\[{]|\.\.\.", part)):  # placeholders and optional parts
                    out.append((f.relative_to(ROOT).as_posix(), part.strip(), words))
    return out


def test_every_module_a_document_runs_exists():
    """``python -m M`` in a current document names a module there is: a benchmark moved into a
    package or removed leaves a reader a ModuleNotFoundError (the history and the changelog keep
    what was true then)."""
    import importlib.util

    files = [*ROOT.glob("*.md"), *source.files("benchmarks", "*.md"), *source.files("deploy", "*.md"),
             *(p for p in source.files("docs", "*.md") if "history" not in p.parts)]
    found, bad = 0, []
    for f in files:
        if f.name == "CHANGELOG.md":
            continue
        for module in re.findall(r"python3? -m ([A-Za-z_][\w.]*[A-Za-z_\d])", f.read_text()):
            found += 1
            try:
                exists = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:
                exists = False
            if not exists:
                bad.append(f"{f.relative_to(ROOT)}: python -m {module}")
    assert found >= 50, found  # the scan finds the documents' commands
    assert not bad, "\n".join(bad)


def test_every_documented_command_parses_with_the_current_flags():
    """A command a document quotes, with its options, is one the current parsers accept: a
    renamed or removed flag, or a required one left out, fails here and not in a reader's shell."""
    import contextlib
    import io

    from aggregator_service.__main__ import build_parser as aggregator
    from agent_service.__main__ import build_parser as agent
    from evaluator_service.__main__ import build_parser as evaluator
    from fedrl.cli import build_parser as fedrl

    parsers = {"fedrl": fedrl, "fedrl-aggregator": aggregator, "fedrl-agent": agent, "fedrl-evaluator": evaluator}
    commands = _documented_commands()
    assert len(commands) >= 25, len(commands)  # the scan finds the documents' commands (33 when written)
    bad = []
    for where, cmd, words in commands:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                parsers[words[0]]().parse_args(words[1:])
        except SystemExit as e:
            if e.code:
                bad.append(f"{where}: {cmd}: {err.getvalue().strip().splitlines()[-1]}")
    assert not bad, "\n".join(bad)

