"""The layout tells the architecture: the core's packages are layers that import only downwards,
the core imports no service, services never import each other, protobuf stays at the edge."""

import ast
from pathlib import Path

from tests import source

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("aggregator_service", "agent_service", "evaluator_service")
# The core's packages, bottom to top; each may import its own layer and the ones before it.
LAYERS = (("common",), ("algos",), ("envs",), ("behavior",), ("data",), ("wire", "proto"), ("ops",),
          ("federation",), ("cli",))
LAYER = {pkg: i for i, names in enumerate(LAYERS) for pkg in names}


def imported_modules(path: Path, top_level_only: bool = False):
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "fedrl":  # from fedrl import x
                yield from (f"fedrl.{a.name}" for a in node.names)
            else:
                yield node.module
                yield from (f"{node.module}.{a.name}" for a in node.names)  # from pkg import module


def core_package(path: Path) -> str:
    """The layer package a core module belongs to (``fedrl/__init__.py``: the bottom layer's)."""
    parts = path.relative_to(ROOT / "fedrl").parts
    return parts[0] if len(parts) > 1 else LAYERS[0][0]


def test_every_core_module_sits_in_a_layer_package():
    loose = [f.name for f in (ROOT / "fedrl").glob("*.py") if f.name != "__init__.py"]
    assert not loose, f"modules outside the layer packages: {loose}"
    pkgs = {p.name for p in (ROOT / "fedrl").iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert pkgs == set(LAYER), f"packages without a layer (or layers without a package): {pkgs ^ set(LAYER)}"
    for pkg in pkgs:  # each says what it holds and what it may import
        doc = ast.get_docstring(ast.parse((ROOT / "fedrl" / pkg / "__init__.py").read_text()))
        assert doc and "may import" in doc or pkg == "proto", f"fedrl/{pkg}/__init__.py: say what it may import"


def test_no_core_module_imports_upwards():
    for f in source.files("fedrl"):
        own = LAYER[core_package(f)]
        for mod in imported_modules(f):
            parts = mod.split(".")
            if parts[0] == "fedrl" and len(parts) > 1:
                assert LAYER[parts[1]] <= own, f"{f.relative_to(ROOT)} (layer {own}) imports {mod} (layer {LAYER[parts[1]]})"


def our_modules(f: Path) -> bool:
    """Our code: not a benchmark's own virtualenv, nor Flower's apps (they run in Flower's)."""
    return not any(p.startswith(".venv") or p in ("flower_app", "flower_secagg_app") for p in f.parts)


def test_import_graph_has_no_cycle():
    """Imports between the modules of the core, the services and the benchmarks (those inside
    functions included) form no cycle."""
    mods = {".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f
            for top in ("fedrl", *SERVICES, "benchmarks") for f in source.files(top) if our_modules(f)}
    # (a module's own parent package is loaded before it anyway: ``from pkg import sibling`` is no cycle)
    graph = {m: sorted({i for i in imported_modules(f) if i in mods and i != m and not m.startswith(i + ".")})
             for m, f in mods.items()}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in graph[m]:
            assert state.get(n) != 1, f"import cycle: {' -> '.join(path[path.index(n):] + [n])}"
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [m])


# What each benchmarks package may import of the others (common.py and mutants.py are no package):
# the system's renderer writes the paper's table into the README; nothing else crosses.
BENCHMARK_PACKAGES = {"paper": {"paper"}, "studies": {"studies"}, "system": {"system", "paper"}}


def test_benchmark_packages_share_only_through_common():
    for f in source.files("benchmarks"):
        rel = f.relative_to(ROOT / "benchmarks").parts
        if not our_modules(f) or len(rel) < 2:
            continue
        for i in imported_modules(f):
            parts = i.split(".")
            if parts[0] == "benchmarks" and len(parts) > 1 and parts[1] in BENCHMARK_PACKAGES:
                assert parts[1] in BENCHMARK_PACKAGES[rel[0]], f"benchmarks/{'/'.join(rel)} imports {i}"


def test_behavior_does_not_import_data():
    """Datasets are made from behaviour policies, so data sits above behavior, never the reverse
    (``data.make`` and ``behavior.shipped`` used to import each other)."""
    for f in source.files("fedrl/behavior"):
        assert not any(m.startswith("fedrl.data") for m in imported_modules(f)), f


def test_protobuf_types_only_in_the_wire_and_the_servicers():
    for f in source.files("fedrl"):
        if core_package(f) in ("wire", "proto"):
            continue
        for mod in imported_modules(f):
            assert not mod.startswith(("fedrl.proto", "google.protobuf")), f"{f.relative_to(ROOT)} imports {mod}"


def test_core_imports_no_service():
    for f in source.files("fedrl"):
        for mod in imported_modules(f):
            assert mod.split(".")[0] not in SERVICES, f"{f} imports {mod}"


def test_services_do_not_import_each_other():
    for svc in SERVICES:
        for f in source.files(svc):
            for mod in imported_modules(f):
                top = mod.split(".")[0]
                assert top == svc or top not in SERVICES, f"{f} imports {mod}"


def test_promised_top_level_layout_exists():
    for name in ("pyproject.toml", "README.md", "protos", "deploy", "tests", "fedrl", *SERVICES):
        assert (ROOT / name).exists(), name


def test_weights_never_pickled():
    for f in source.files("fedrl"):
        src = f.read_text()
        assert "import pickle" not in src and "torch.load(" not in src, f


def test_documented_layout_names_every_module_with_what_it_is():
    """docs/reference/layout.md is generated from the tree (tools/make_reference.py; test_docs checks
    it is current): every module of the core, the services and the benchmarks is on it, each with
    the first sentence of a docstring it must have."""
    import ast

    text = (ROOT / "docs" / "reference" / "layout.md").read_text()
    for top in ("fedrl", "aggregator_service", "agent_service", "evaluator_service", "benchmarks"):
        for f in sorted(source.files(top)):
            # Flower's apps run in Flower's environment, not ours; a benchmark's own virtualenv is ignored by git
            if (f.name.endswith(("_pb2.py", "_pb2_grpc.py")) or {"flower_app", "flower_secagg_app"} & set(f.parts)
                    or any(part.startswith(".venv") for part in f.parts)):
                continue
            assert ast.get_docstring(ast.parse(f.read_text())), f"{f.relative_to(ROOT)} has no docstring"
            if f.name != "__init__.py":
                assert f"`{f.name}`: " in text, f"docs/reference/layout.md does not list {f.relative_to(ROOT)}"
