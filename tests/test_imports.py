"""The project's import rules (DESIGN.md, "Layout"), read from the source with ``ast``.

Every module of comera, loaders, experiments and benchmarks is parsed; every import in it
counts, at module level, inside a function or under ``if TYPE_CHECKING:`` (an import that
runs late, or only for the type checker, still ties the two modules together). Relative
imports are resolved, and ``from pkg import name`` points at ``pkg.name`` when that is a
module. The rules:

- no import cycle between the project's modules;
- no private name (``_x``, not ``__x__``) imported from another module, nor read from an
  imported module (``mod._x``);
- loaders never imports comera; comera never imports experiments or benchmarks;
  experiments never imports benchmarks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("comera", "loaders", "experiments", "benchmarks")
# (importer's package, imported package): imports that must never exist
FORBIDDEN = {
    ("loaders", "comera"): "loaders never imports comera (it serves any trainer)",
    ("comera", "experiments"): "the library never imports the experiments",
    ("comera", "benchmarks"): "the library never imports the benchmarks",
    ("experiments", "benchmarks"): "experiments never import the benchmarks",
}


@dataclass(frozen=True)
class Import:
    """``importer`` imports project module ``target`` at ``line``; ``name`` is the name
    taken from it (``from target import name``), or None for the module itself."""

    importer: str
    target: str
    name: str | None
    line: int

    def where(self) -> str:
        return f"{module_path(self.importer)}:{self.line}"


@cache
def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def module_path(name: str) -> str:
    return modules()[name].relative_to(ROOT).as_posix()


def _known(dotted: str) -> str | None:
    """The project module ``dotted`` names, or its nearest project parent (``comera.x.y``
    where only ``comera.x`` is a module: an attribute of it); None outside the project."""
    while dotted:
        if dotted in modules():
            return dotted
        dotted = dotted.rpartition(".")[0]
    return None


def _base(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from."""
    if not node.level:
        return node.module or ""
    package = importer.split(".")
    if modules()[importer].name != "__init__.py":
        package = package[:-1]  # a plain module's package is its parent
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _imports_of(importer: str, source: str | None = None) -> Iterator[tuple[Import, str | None]]:
    """Every import in ``importer`` (or in ``source`` read as if it were that module), with
    the local name a module was bound to (None when the name bound is not that module)."""
    if source is None:
        source = modules()[importer].read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                target = _known(a.name)
                if target is None:
                    continue
                # `import a.b as c` binds the module a.b; plain `import a.b` binds a
                bound = a.asname or (a.name if "." not in a.name else None)
                yield (
                    Import(importer, target, None, node.lineno),
                    (bound if target == a.name else None),
                )
        elif isinstance(node, ast.ImportFrom):
            base = _base(importer, node)
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in modules():  # from pkg import submodule
                    yield Import(importer, full, None, node.lineno), a.asname or a.name
                elif (target := _known(base)) is not None:
                    yield Import(importer, target, a.name, node.lineno), None


@cache
def all_imports() -> tuple[Import, ...]:
    out = []
    for m in modules():
        out.extend(imp for imp, _ in _imports_of(m) if imp.target != m)
    return tuple(out)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _cycles(imports: tuple[Import, ...]) -> list[list[str]]:
    """One cycle (a list of modules, first repeated last) per strongly connected
    component of the import graph with more than one module."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.importer, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in components:  # the shortest way back to the component's first module
        start = min(comp)
        paths = {start: [start]}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & comp):
                    if w == start:
                        found = [*paths[v], start]
                        break
                    if w not in paths:
                        paths[w] = [*paths[v], w]
                        nxt.append(w)
                if found:
                    break
            frontier = nxt
        cycles.append(found or sorted(comp))
    return sorted(cycles)


def _edge_lines(a: str, b: str) -> str:
    lines = {imp.where() for imp in all_imports() if imp.importer == a and imp.target == b}
    return ", ".join(sorted(lines))


def test_the_walk_resolves_every_kind_of_import():
    """The checks below are only as good as the walk."""
    assert {"comera", "comera.train.loop", "loaders.loader", "experiments.cli"} <= set(modules())
    found = {(i.importer, i.target, i.name) for i in all_imports()}
    assert ("comera.train.loop", "comera.train.sync_free", "SyncFreeStep") in found
    source = """
import torch
import comera.tree
import comera.train.checkpoint as ck
from . import sync_free
from .stages import StageController
from ..tree import iter_tt
from comera.train import logging as log, Trainer


def late():
    from loaders.sources import _private_name
"""
    got = [(i.target, i.name, bound) for i, bound in _imports_of("comera.train.loop", source)]
    assert sorted(got, key=str) == sorted([
        ("comera.tree", None, None),  # `import comera.tree` binds comera, not the module
        ("comera.train.checkpoint", None, "ck"),
        ("comera.train.sync_free", None, "sync_free"),  # relative, and a submodule
        ("comera.train.stages", "StageController", None),
        ("comera.tree", "iter_tt", None),
        ("comera.train.logging", None, "log"),
        ("comera.train", "Trainer", None),
        ("loaders.sources", "_private_name", None),  # inside a function too
    ], key=str)  # fmt: skip
    init = [(i.target, i.name) for i, _ in _imports_of("comera.train", "from .loop import X")]
    assert init == [("comera.train.loop", "X")]  # a package's `.` is the package itself


def test_no_import_cycles():
    planted = [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"), ("e", "d")]
    assert _cycles(tuple(Import(x, y, None, 1) for x, y in planted)) == [
        ["a", "b", "c", "a"],
        ["d", "e", "d"],
    ]
    cycles = _cycles(all_imports())
    described = [
        " -> ".join(c) + "\n    " + "; ".join(_edge_lines(a, b) for a, b in pairwise(c))
        for c in cycles
    ]
    assert not cycles, "import cycles:\n" + "\n".join(described)


def _private_uses(importer: str, source: str | None = None) -> list[str]:
    """Private names ``importer`` takes from other project modules: imported by name,
    read as ``mod._x`` from an imported module, or a private module imported from outside
    its package."""
    if source is None:
        source = modules()[importer].read_text()
    imports = [imp for imp in _imports_of(importer, source) if imp[0].target != importer]
    bad = []
    for imp, _ in imports:
        parent, _, last = imp.target.rpartition(".")
        if imp.name is not None and _private(imp.name):
            bad.append(f"line {imp.line}: {imp.name} from {imp.target}")
        if _private(last) and not importer.startswith(parent + "."):
            bad.append(f"line {imp.line}: private module {imp.target}")
    aliases = {bound: imp.target for imp, bound in imports if bound}
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _private(node.attr)
        ):
            owner = aliases[node.value.id]
            bad.append(f"line {node.lineno}: {node.value.id}.{node.attr} of {owner}")
    return sorted(set(bad))


def test_the_private_check_sees_each_form():
    source = """
import comera.train.checkpoint as ck
from comera.train import checkpoint
from comera.train.sync_free import _scalar, __all__


def f():
    return ck._read_model, checkpoint._atomic, ck.CHECKPOINTS
"""
    assert [b.split(": ", 1)[1] for b in _private_uses("comera.train.loop", source)] == [
        "_scalar from comera.train.sync_free",
        "checkpoint._atomic of comera.train.checkpoint",
        "ck._read_model of comera.train.checkpoint",
    ]
    assert _private_uses("comera.train.loop", "from comera.train.loop import _scalar") == []


def test_no_private_names_across_modules():
    bad = [f"{module_path(m)} {b}" for m in modules() for b in _private_uses(m)]
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def _against_the_flow(imports: tuple[Import, ...]) -> list[str]:
    return [
        f"{imp.where()}: imports {imp.target} ({FORBIDDEN[key]})"
        for imp in imports
        if (key := (imp.importer.split(".")[0], imp.target.split(".")[0])) in FORBIDDEN
    ]


def test_imports_run_one_way():
    planted = [
        Import("loaders.loader", "comera.tree", "iter_tt", 1),
        Import("comera.train.loop", "experiments.malloc", None, 2),
        Import("experiments.cli", "benchmarks.core", "main", 3),
        Import("experiments.cli", "comera.train", "Trainer", 4),  # the allowed way
        Import("benchmarks.core", "experiments.cli", None, 5),
    ]
    assert len(_against_the_flow(tuple(planted))) == 3
    bad = _against_the_flow(all_imports())
    assert not bad, "\n".join(bad)
