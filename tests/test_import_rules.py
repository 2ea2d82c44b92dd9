"""The import rules of docs/ARCHITECTURE.md, enforced by reading every module's imports.

1. ``flwr`` and ``flwr_datasets`` are imported only in ``strategies/``, ``clients/`` and
   ``fedddl/flower/``.
2. ``clients/`` and ``strategies/`` never import each other.
3. The Flower-free core (``fedddl/`` outside ``fedddl/flower/``) imports neither
   ``strategies``, ``clients`` nor ``fedddl.flower``: the command-line entry points are
   the named exception below.
4. ``fedddl/flower/`` imports neither ``strategies`` nor ``clients``, except the
   simulation runner, an entry point that builds both apps.
5. ``fedddl/compression`` is layered: ``backends`` <- ``algorithms`` <- ``codecs`` <- the
   package's own modules (the facade ``__init__`` and ``warmup``). A module imports only
   from its own layer or a lower one, and the package's modules import one another
   without a cycle (lazy and ``TYPE_CHECKING`` imports count).
6. ``simulations/`` (run as ``python -m simulations.NAME``) imports the installed packages
   and its own modules, never ``tests``, and does not edit ``sys.path``.
7. ``fedddl/``, ``strategies/`` and ``clients/`` import one another without a cycle (a
   package's ``__init__`` counts as a module; lazy and ``TYPE_CHECKING`` imports count).

Imports are read from the syntax tree (``import x`` and ``from x import y``, at any depth,
including the ones inside functions), so a violation fails here whatever the code path.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedddl", "strategies", "clients")

#: Core modules allowed to reach the Flower layer.
CORE_EXCEPTIONS = {
    "fedddl/commands": "command-line entry points",
}
FLOWER_ENTRY_POINTS = {"fedddl/flower/simulation.py"}


def _modules() -> list[Path]:
    return sorted(p for pkg in (*PACKAGES, "simulations") for p in (ROOT / pkg).rglob("*.py"))


def imported(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports (``from a.b import c`` gives ``a.b``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _excepted(rel: str) -> bool:
    return any(rel == key or rel.startswith(key + "/") for key in CORE_EXCEPTIONS)


def violations() -> list[str]:
    """Every broken rule, as ``"path: imports name (rule N)"``."""
    found: list[str] = []
    for path in _modules():
        rel = _rel(path)
        top = rel.split("/")[0]
        in_flower = rel.startswith("fedddl/flower/")
        if top == "simulations" and "sys.path" in path.read_text():
            found.append(f"{rel}: edits sys.path (rule 5)")
        for name in sorted(imported(path)):
            flower_package = _under(name, "flwr") or _under(name, "flwr_datasets")
            if flower_package and top == "fedddl" and not in_flower:
                found.append(f"{rel}: imports {name} (rule 1: flwr outside the Flower layer)")
            if top == "clients" and _under(name, "strategies"):
                found.append(f"{rel}: imports {name} (rule 2: clients -> strategies)")
            if top == "strategies" and _under(name, "clients"):
                found.append(f"{rel}: imports {name} (rule 2: strategies -> clients)")
            if top == "fedddl" and not in_flower and not _excepted(rel):
                for banned in ("strategies", "clients", "fedddl.flower"):
                    if _under(name, banned):
                        found.append(f"{rel}: imports {name} (rule 3: core -> {banned})")
            if top == "simulations" and _under(name, "tests"):
                found.append(f"{rel}: imports {name} (rule 5: simulations -> tests)")
            if in_flower and rel not in FLOWER_ENTRY_POINTS:
                for banned in ("strategies", "clients"):
                    if _under(name, banned):
                        found.append(f"{rel}: imports {name} (rule 4: fedddl.flower -> {banned})")
    return found


COMPRESSION = "fedddl.compression"
#: The layers of ``fedddl/compression``, lowest first; its own modules sit above them all.
COMPRESSION_LAYERS = ("backends", "algorithms", "codecs")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(*folders: str) -> dict[str, set[str]]:
    """The modules under ``folders`` and, for each, the ones among them it imports
    (``from a import b`` names module ``a.b`` when that is a module, else ``a``)."""
    modules = {
        _module_name(p): p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    edges.add(full if full in modules else node.module)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def _layer(module: str) -> int:
    """0, 1, 2 for the layers (their packages included), 3 for the package's own modules."""
    parts = module.split(".")
    if len(parts) > 2 and parts[2] in COMPRESSION_LAYERS:
        return COMPRESSION_LAYERS.index(parts[2])
    return len(COMPRESSION_LAYERS)


def compression_graph() -> dict[str, set[str]]:
    """The import graph inside ``fedddl/compression``."""
    return import_graph("fedddl/compression")


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle (strongly connected set of two or more modules), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def compression_violations() -> list[str]:
    """Imports against the layer order, and import cycles, inside ``fedddl/compression``."""
    graph = compression_graph()
    found = [
        f"{module}: imports {target} (rule 5: layer order)"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if _layer(target) > _layer(module)
    ]
    found += [f"import cycle: {' -> '.join(cycle)} (rule 5)" for cycle in import_cycles(graph)]
    return found


def test_every_module_follows_the_import_rules() -> None:
    assert violations() == []


def test_compression_is_layered_without_cycles() -> None:
    graph = compression_graph()
    assert {module.split(".")[2] for module in graph if module.count(".") > 2} == set(
        COMPRESSION_LAYERS
    )
    assert compression_violations() == []


def test_no_import_cycle_in_the_product() -> None:
    """Rule 7: the modules of ``fedddl/``, ``strategies/`` and ``clients/`` (a package's
    ``__init__`` included) import one another without a cycle."""
    assert import_cycles(import_graph(*PACKAGES)) == []


def test_an_import_cycle_in_the_product_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    original = Path.read_text
    target = ROOT / "fedddl/checkpoint_io.py"

    def read_text(self: Path, *args: object, **kwargs: object) -> str:
        text = original(self, *args, **kwargs)  # type: ignore[arg-type]
        return text + "\ndef f():\n    from fedddl.checkpoint import save_checkpoint\n" if (
            self == target
        ) else text

    monkeypatch.setattr(Path, "read_text", read_text)
    cycles = import_cycles(import_graph(*PACKAGES))
    assert any({"fedddl.checkpoint", "fedddl.checkpoint_io"} <= set(c) for c in cycles), cycles


def test_the_exceptions_exist() -> None:
    """An exception for a module that is gone is stale: remove it."""
    for rel in [*CORE_EXCEPTIONS, *FLOWER_ENTRY_POINTS]:
        assert (ROOT / rel).exists(), rel


@pytest.mark.parametrize(
    ("rel", "source", "rule"),
    [
        ("fedddl/partition.py", "import flwr.app\n", "rule 1"),
        ("fedddl/sync/server.py", "def f():\n    from strategies import terngrad\n", "rule 3"),
        ("fedddl/training.py", "from fedddl.flower import records\n", "rule 3"),
        ("clients/shard.py", "from strategies import registry\n", "rule 2"),
        ("strategies/sampling.py", "import clients.state\n", "rule 2"),
        ("fedddl/flower/grid.py", "from clients.client_app import app\n", "rule 4"),
        ("simulations/tool_runners.py", "from tests.support import models\n", "rule 5"),
        ("simulations/attack_table.py", "import sys\nsys.path.insert(0, '.')\n", "rule 5"),
    ],
)
def test_a_violation_is_caught(
    rel: str, source: str, rule: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The checker really reads imports: planting one bad import makes it fail."""
    original = Path.read_text
    target = ROOT / rel

    def read_text(self: Path, *args: object, **kwargs: object) -> str:
        text = original(self, *args, **kwargs)  # type: ignore[arg-type]
        return text + "\n" + source if self == target else text

    monkeypatch.setattr(Path, "read_text", read_text)
    found = violations()
    assert any(v.startswith(rel) and rule in v for v in found), found


@pytest.mark.parametrize(
    ("rel", "source", "expected"),
    [
        (  # a back end reaching up to the wire format
            "fedddl/compression/backends/jit.py",
            "def f():\n    from fedddl.compression.codecs.wire import encode_update\n",
            "backends.jit: imports fedddl.compression.codecs.wire (rule 5: layer order)",
        ),
        (  # an algorithm reaching the facade
            "fedddl/compression/algorithms/memory.py",
            "from fedddl.compression import warm_up\n",
            "algorithms.memory: imports fedddl.compression (rule 5: layer order)",
        ),
        (  # a cycle inside one layer, through a type-only import
            "fedddl/compression/algorithms/base.py",
            "if TYPE_CHECKING:\n    from fedddl.compression.algorithms.identity import X\n",
            "import cycle: fedddl.compression.algorithms.base -> "
            "fedddl.compression.algorithms.identity (rule 5)",
        ),
    ],
)
def test_a_compression_layer_violation_is_caught(
    rel: str, source: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = Path.read_text
    target = ROOT / rel

    def read_text(self: Path, *args: object, **kwargs: object) -> str:
        text = original(self, *args, **kwargs)  # type: ignore[arg-type]
        return text + "\n" + source if self == target else text

    monkeypatch.setattr(Path, "read_text", read_text)
    assert any(expected in v for v in compression_violations()), compression_violations()
