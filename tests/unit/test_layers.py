"""The layers stay as drawn: protos -> client's shared model -> coordinator | nodeagent | client
-> gelastic, and bench/ and examples/ on top, as users.

Parses the imports of every module of the four packages and of bench/ and examples/ (ast only,
nothing is imported) and fails on an arrow that points the wrong way. There is no exception:
what embeds a coordinator and an agent together lives in the top layer. Imports under
`if TYPE_CHECKING:` count too: a type that crosses a layer couples the layers just the same.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("client", "coordinator", "nodeagent", "gelastic")
TOP = "gelastic"
"""What composes a coordinator and node agents (`gelastic run`, `LocalCluster`): it may import the
three packages below it, and none of them imports it."""
USERS = ("bench", "examples")
"""Programs built on gelastic: they may import any package's public modules and the wire, never
another package's private module; no package imports them."""
OURS = (*PACKAGES, "protos")
PURE = (
    "coordinator._cluster",
    "coordinator._cluster_core",
    "coordinator._cluster_drain",
    "coordinator._cluster_exits",
    "coordinator._cluster_failures",
    "coordinator._cluster_nodes",
    "coordinator._cluster_outcome",
    "coordinator._cluster_records",
    "coordinator._cluster_rounds",
    "coordinator._cluster_stacks",
    "coordinator._cluster_views",
    "coordinator._cluster_words",
    "coordinator._placement",
    "coordinator._ranks",
    "coordinator._failure_class",
    "nodeagent._agent_core",
)
"""The decision code of the coordinator and of the node agent: no transport, no event loop, no
generated code."""
IMPURE_ROOTS = ("grpc", "asyncio", "protos")
WORKER_SIDE = (
    "nodeagent._bootstrap",
    "nodeagent._pdeathsig",
    "nodeagent._sentinel",
    "client.errors",
    "client.preempt",
)
"""Modules that run inside a user's worker process: the standard library only."""


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    """The module imported (for `from pkg import name`, `pkg.name` when that is a module)."""
    names: tuple[str, ...]
    """The names taken with `from target import ...`; empty for `import target`."""
    line: int

    def __str__(self) -> str:
        what = f"from {self.target} import {', '.join(self.names)}" if self.names else self.target
        return f"{self.importer}:{self.line}: {what}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in (*PACKAGES, *USERS):
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def _is_module(name: str) -> bool:
    if name in MODULES:
        return True
    return (ROOT / Path(*name.split("."))).with_suffix(".py").exists() or (
        ROOT / Path(*name.split(".")) / "__init__.py"
    ).exists()


def _imports_of(module: str, path: Path) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, (), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = tuple(alias.name for alias in node.names)
            submodules = [n for n in names if _is_module(f"{base}.{n}")]
            for name in submodules:
                yield Import(module, f"{base}.{name}", (), node.lineno)
            rest = tuple(n for n in names if n not in submodules)
            if rest or not submodules:
                yield Import(module, base, rest, node.lineno)


IMPORTS = [imp for module, path in MODULES.items() for imp in _imports_of(module, path)]


def _root(name: str) -> str:
    return name.split(".")[0]


def _has_private_part(name: str) -> bool:
    return any(part.startswith("_") and part != "__init__" for part in name.split("."))


def _ours(imp: Import) -> bool:
    return _root(imp.target) in (*OURS, *USERS)


def test_the_scan_sees_the_imports_it_checks() -> None:
    # The rules below are only as good as the parse: it must find the arrows we know are there.
    edges = {(i.importer, i.target) for i in IMPORTS}
    assert ("coordinator._cluster_rounds", "coordinator._ranks") in edges
    assert ("coordinator._service", "protos.gelastic.v1.gelastic_pb2") in edges
    assert ("gelastic._cli_run", "coordinator.server") in edges  # a lazy import, inside a function
    assert ("gelastic._cli_run", "nodeagent.session") in edges  # under `if TYPE_CHECKING:` too
    assert ("examples.demo", "gelastic.local") in edges
    assert ("bench._common", "gelastic.local") in edges
    assert {_root(m) for m in MODULES} == {*PACKAGES, *USERS}
    assert ("nodeagent._workers", "client.model") in edges
    assert len(MODULES) > 30


def test_coordinator_and_node_agent_never_import_each_other() -> None:
    crossing = [
        str(i)
        for i in IMPORTS
        if {_root(i.importer), _root(i.target)} == {"coordinator", "nodeagent"}
    ]
    assert not crossing, "the coordinator and the node agent share only client's model:\n" + (
        "\n".join(crossing)
    )


def test_only_the_top_layer_composes_a_coordinator_and_an_agent() -> None:
    composers = [
        str(i)
        for i in IMPORTS
        if _root(i.importer) == "client" and _root(i.target) in ("coordinator", "nodeagent")
    ]
    assert not composers, f"what embeds a coordinator or an agent belongs in {TOP}/:\n" + (
        "\n".join(composers)
    )


def test_no_layer_below_the_top_imports_it() -> None:
    upward = [
        str(i)
        for i in IMPORTS
        if _root(i.importer) in PACKAGES and _root(i.importer) != TOP and _root(i.target) == TOP
    ]
    assert not upward, f"{TOP} sits above client, coordinator and nodeagent:\n" + "\n".join(upward)


def test_no_package_imports_bench_or_examples() -> None:
    bad = [str(i) for i in IMPORTS if _root(i.importer) in PACKAGES and _root(i.target) in USERS]
    assert not bad, "\n".join(bad)


def test_no_package_imports_another_packages_private_module() -> None:
    private = [
        str(i)
        for i in IMPORTS
        if _ours(i) and _root(i.target) != _root(i.importer) and _has_private_part(i.target)
    ]
    assert not private, "import the public module instead:\n" + "\n".join(private)


def test_a_public_module_offers_in_its_all_what_others_take_from_it() -> None:
    offered: dict[str, set[str] | None] = {}

    def all_of(module: str) -> set[str] | None:
        if module not in offered:
            path = MODULES.get(module)
            names: set[str] | None = None
            if path is not None:
                for node in ast.parse(path.read_text()).body:
                    if isinstance(node, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
                    ):
                        names = set(ast.literal_eval(node.value))
            offered[module] = names
        return offered[module]

    missing: list[str] = []
    for i in IMPORTS:
        if _root(i.target) not in PACKAGES or _has_private_part(i.target):
            continue
        if _root(i.importer) == _root(i.target) or i.target in PACKAGES:
            continue  # inside its own package a module may share more than it offers
        names = all_of(i.target)
        if names is None:
            missing.append(f"{i.target} has no __all__ (imported at {i})")
        else:
            missing += [f"{i}: {n!r} is not in its __all__" for n in i.names if n not in names]
    # A public module says what it offers even while nobody imports it yet.
    public = [m for m in MODULES if _root(m) in PACKAGES and "." in m and not _has_private_part(m)]
    missing += [f"{m} has no __all__" for m in public if all_of(m) is None]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("module", PURE)
def test_the_decision_code_has_no_transport_no_loop_no_protos(module: str) -> None:
    bad = [str(i) for i in IMPORTS if i.importer == module and _root(i.target) in IMPURE_ROOTS]
    assert not bad, "\n".join(bad)
    # ... and nothing it imports of ours (package __init__ files included) drags them in.
    loaded = _modules_loaded_by(module)
    assert not {m for m in loaded if _root(m) in IMPURE_ROOTS}, sorted(loaded)


def _modules_loaded_by(module: str) -> set[str]:
    """The modules a fresh interpreter holds after importing `module`, less those it started with."""
    probe = (
        "import json, sys; before = set(sys.modules); "
        f"import {module}; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("module", WORKER_SIDE)
def test_worker_side_modules_use_the_standard_library_only(module: str) -> None:
    assert module in MODULES
    outside = [
        str(i)
        for i in IMPORTS
        if i.importer == module
        and i.target != "__future__"
        and _root(i.target) not in sys.stdlib_module_names
    ]
    assert not outside, "\n".join(outside)
    if module != "nodeagent._pdeathsig":  # run by path, never imported as a module
        loaded = _modules_loaded_by(module)
        third_party = {m for m in loaded if _root(m) not in (*sys.stdlib_module_names, *OURS)}
        assert not third_party, sorted(third_party)


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in IMPORTS:
        if i.target in MODULES and i.target != i.importer:
            graph[i.importer].add(i.target)
    # A package's __init__ runs before any of its modules; an arrow into it from inside is not a
    # cycle of our making (Python resolves `from client.x import y` through client/__init__).
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append([*stack[stack.index(n) :], n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
