"""The layout tells the architecture: the core imports no service; the promised folders exist."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("aggregator_service", "agent_service", "evaluator_service")


def imported_modules(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_core_imports_no_service():
    for f in (ROOT / "fedrl").rglob("*.py"):
        for mod in imported_modules(f):
            assert mod.split(".")[0] not in SERVICES, f"{f} imports {mod}"


def test_services_do_not_import_each_other():
    for svc in SERVICES:
        for f in (ROOT / svc).rglob("*.py"):
            for mod in imported_modules(f):
                top = mod.split(".")[0]
                assert top == svc or top not in SERVICES, f"{f} imports {mod}"


def test_promised_top_level_layout_exists():
    for name in ("pyproject.toml", "README.md", "protos", "deploy", "tests", "fedrl", *SERVICES):
        assert (ROOT / name).exists(), name


def test_weights_never_pickled():
    for f in (ROOT / "fedrl").rglob("*.py"):
        src = f.read_text()
        assert "import pickle" not in src and "torch.load(" not in src, f
