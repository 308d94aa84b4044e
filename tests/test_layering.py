"""The package's layering, read from its imports with `ast` (nothing is imported to check it).

Three rules, as data below, over every .py file of the installed package (the packages listed in
pyproject.toml), module-level and function-level imports alike, relative ones resolved, and
`importlib.import_module("...")` calls that spell their module out:

- the store core (kvstore/), tiering/ and gc/ never load torch or aiohttp, directly or through
  any chain of package-internal imports (a lazy import inside a function is still a path);
- a package behind a seam imports only the seam's modules from the packages it guards (the
  engine sees the store through its protocol, types, hashing, errors and open_store);
- top-level packages never import each other in a cycle (the store and its tiers are one layer).

`if TYPE_CHECKING:` imports load nothing, so the load rule skips them; they still say what a
module knows about, so the seam and cycle rules count them. The last tests run the checker on
tiny synthetic trees, so a rule that can no longer fail is seen.
"""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "kvcache"


@dataclass(frozen=True)
class LoadRule:
    """Modules of `packages` must not load any of `forbidden`, however indirectly."""

    packages: tuple[str, ...]
    forbidden: tuple[str, ...]
    fix: str


@dataclass(frozen=True)
class SeamRule:
    """Modules of `packages` import from `guarded` packages only the modules in `allowed`."""

    packages: tuple[str, ...]
    guarded: tuple[str, ...]
    allowed: tuple[str, ...]
    fix: str


LOAD_RULES = (
    LoadRule(("kvstore", "tiering", "gc", "policy"), ("torch", "aiohttp"),
             "the store core, the tiers and GC stay free of torch and aiohttp: move the code that needs "
             "them to engine/, server/ or client/, or hand the store a callable at construction"),
)
SEAM_RULES = (
    SeamRule(("engine",), ("kvstore", "tiering", "gc", "server", "client"),
             ("kvcache.kvstore.protocol", "kvcache.kvstore.types", "kvcache.kvstore.hashing",
              "kvcache.kvstore.errors", "kvcache.client.open_store"),
             "the engine sees a store only through kvstore.protocol/types/hashing/errors and "
             "client.open_store: add what it needs to the protocol or types instead"),
    SeamRule(("kvstore", "tiering", "gc"), ("engine", "server", "client", "cli", "benchmarks", "kernels"), (),
             "dependencies point toward the leaves: the store, tiers and GC import none of the packages "
             "built on them; pass a callable or a value in instead"),
    SeamRule(("kernels",), ("kvstore", "tiering", "gc", "client", "server", "cli", "engine", "benchmarks"), (),
             "kernels import torch only: take tensors and shapes as arguments"),
    SeamRule(("policy",), ("kvstore", "tiering", "gc", "client", "server", "cli", "engine", "benchmarks",
                           "kernels"), (),
             "an eviction order is a leaf: it sees block keys as opaque hashables, never a tier or a store"),
    SeamRule(("integrations",), ("kvstore", "tiering", "gc", "server", "client", "engine", "kernels"),
             ("kvcache.kvstore.protocol", "kvcache.kvstore.types", "kvcache.kvstore.hashing",
              "kvcache.kvstore.errors", "kvcache.client.open_store", "kvcache.engine.cache.connector",
              "kvcache.engine.config"),
             "a plug-in for another engine sees the store as the engine does (protocol, types, hashing, "
             "errors, open_store) and through the engine's store seam (engine/cache/connector.py)"),
    SeamRule(("kvstore", "tiering", "gc", "policy", "kernels", "engine", "server", "client"), ("integrations",), (),
             "the plug-ins for other engines import vLLM or SGLang: nothing of the product imports them"),
)
# Packages that form one layer for the cycle rule: the store and its tiers call each other.
LAYERS = {"tiering": "kvstore"}
CYCLE_FIX = "break the cycle: pass a callable or a value in, or move the shared piece to the lower package"
# Violations tolerated for now, each with what removes it (a regex matched against the message).
# An entry that matches nothing fails the test too: delete it once its fix has landed.
TOLERATED: dict[str, str] = {}


@dataclass(frozen=True)
class Import:
    source: str       # the importing module, dotted
    target: str       # a module of the package, or an external top-level name
    where: str        # file:line, relative to the scanned root
    typing_only: bool  # under `if TYPE_CHECKING:`
    implied: bool = False  # a parent package, run because a module inside it is imported


@dataclass
class Graph:
    modules: dict[str, Path]
    imports: list[Import]

    def internal(self, target: str) -> bool:
        return target in self.modules


def module_files(root: Path, packages: list[str]) -> dict[str, Path]:
    """Dotted module name -> file, for the .py files directly in each listed package."""
    modules: dict[str, Path] = {}
    for package in packages:
        folder = root.joinpath(*package.split(".")[1:])
        for path in sorted(folder.glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _dynamic_import(node: ast.AST) -> str | None:
    """The module of `importlib.import_module("name")` or `__import__("name")`, if spelled out."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    value = node.args[0].value
    return value if name in ("import_module", "__import__") and isinstance(value, str) else None


def _import_nodes(node: ast.AST, typing_only: bool = False):
    """Every import under `node` (function bodies included; importlib calls naming a module
    too), with its TYPE_CHECKING flag."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, typing_only
        elif _dynamic_import(child):
            yield child, typing_only
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _import_nodes(ast.Module(body=[stmt], type_ignores=[]), True)
            for stmt in child.orelse:
                yield from _import_nodes(ast.Module(body=[stmt], type_ignores=[]), typing_only)
        else:
            yield from _import_nodes(child, typing_only)


def _targets(node: ast.AST, module: str, is_package: bool, modules: dict) -> list[str]:
    """The modules an import names: `from a import b` is a.b when that is a module."""
    if isinstance(node, ast.Call):
        return [name] if not (name := _dynamic_import(node)).startswith(".") else []
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".")[: len(module.split(".")) - (node.level - 1) - (0 if is_package else 1)]
        full = ".".join(base + ([node.module] if node.module else []))
    else:
        full = node.module or ""
    return [f"{full}.{a.name}" if f"{full}.{a.name}" in modules else full for a in node.names]


def _resolve(target: str, modules: dict) -> str:
    """An internal name resolved to the longest prefix that is a module; external: its top name."""
    if target != PACKAGE and not target.startswith(PACKAGE + "."):
        return target.split(".")[0]
    parts = target.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or PACKAGE


def scan(root: Path, packages: list[str]) -> Graph:
    """Every import of every module; importing a.b.c also runs a's and a.b's __init__."""
    modules = module_files(root, packages)
    imports: list[Import] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, typing_only in _import_nodes(tree):
            where = f"{path.relative_to(root)}:{node.lineno}"
            for name in _targets(node, module, path.stem == "__init__", modules):
                target = _resolve(name, modules)
                if target != module:
                    imports.append(Import(module, target, where, typing_only))
                if target in modules:  # its parent packages run first
                    imports += [Import(module, p, where, typing_only, implied=True)
                                for p in _parents(target) if p in modules and p != module]
    return Graph(modules, imports)


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def top_package(module: str) -> str:
    """kvcache.engine.cache.connector -> engine; a module at the root counts as the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return len(module.split(".")) > 1 and module.split(".")[1] in packages


def load_violations(graph: Graph, rule: LoadRule) -> list[str]:
    """One message per forbidden import reachable from the rule's packages, with the shortest path."""
    runtime: dict[str, list[Import]] = {}
    for imp in graph.imports:
        if not imp.typing_only:
            runtime.setdefault(imp.source, []).append(imp)
    starts = [m for m in graph.modules if _in(m, rule.packages)]
    came_from: dict[str, Import | None] = dict.fromkeys(starts)
    queue, found = deque(starts), []
    while queue:
        module = queue.popleft()
        for imp in runtime.get(module, []):
            if imp.target in rule.forbidden:
                found.append(_path_message(came_from, imp, rule.fix))
            elif graph.internal(imp.target) and imp.target not in came_from:
                came_from[imp.target] = imp
                queue.append(imp.target)
    return found


def _path_message(came_from: dict[str, Import | None], last: Import, fix: str) -> str:
    steps, imp = [last], came_from[last.source]
    while imp is not None:
        steps.append(imp)
        imp = came_from[imp.source]
    path = " -> ".join(f"{s.source} ({s.where})" for s in reversed(steps))
    return f"{path} -> {last.target}: {fix}"


def seam_violations(graph: Graph, rule: SeamRule) -> list[str]:
    """Direct imports from a guarded package of a module the seam does not allow."""
    return [f"{imp.where}: {imp.source} imports {imp.target}: {rule.fix}"
            for imp in graph.imports
            if not imp.implied and _in(imp.source, rule.packages) and graph.internal(imp.target)
            and _in(imp.target, rule.guarded) and imp.target not in rule.allowed]


def layer_edges(graph: Graph, layers: dict[str, str]) -> dict[str, dict[str, Import]]:
    """Top-level package -> package it imports -> the first import that says so."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in graph.imports:
        if not graph.internal(imp.target):
            continue
        a, b = (layers.get(top_package(m), top_package(m)) for m in (imp.source, imp.target))
        if a != b:
            edges.setdefault(a, {}).setdefault(b, imp)
    return edges


def cycle_violations(graph: Graph, layers: dict[str, str]) -> list[str]:
    """One message per cycle found, each step naming the import that makes it."""
    edges, found, seen = layer_edges(graph, layers), [], set()
    for start in sorted(edges):
        cycle = _shortest_cycle(edges, start)
        if cycle and frozenset(cycle) not in seen:
            seen.add(frozenset(cycle))
            steps = [edges[a][b] for a, b in zip(cycle, cycle[1:] + cycle[:1])]
            path = " -> ".join(f"{top_package(s.source)} ({s.where}: imports {s.target})" for s in steps)
            found.append(f"cycle {' -> '.join(cycle + cycle[:1])}: {path}: {CYCLE_FIX}")
    return found


def _shortest_cycle(edges: dict[str, dict[str, Import]], start: str) -> list[str]:
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(edges.get(node, {})):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return path[::-1]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    return []


def all_violations(graph: Graph) -> list[str]:
    return ([v for r in LOAD_RULES for v in load_violations(graph, r)]
            + [v for r in SEAM_RULES for v in seam_violations(graph, r)]
            + cycle_violations(graph, LAYERS))


def installed_packages() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["packages"]


@functools.cache
def package_violations() -> tuple[str, ...]:
    return tuple(all_violations(scan(ROOT, installed_packages())))


# --- the package itself ---------------------------------------------------------------------------

def test_the_package_keeps_its_layers():
    violations = [v for v in package_violations() if not any(re.search(t, v) for t in TOLERATED)]
    assert not violations, "layering broken:\n  " + "\n  ".join(violations)


def test_every_tolerated_violation_still_exists():
    gone = [what for t, what in TOLERATED.items() if not any(re.search(t, v) for v in package_violations())]
    assert not gone, f"fixed, so delete their TOLERATED entries: {gone}"


def test_every_folder_of_modules_is_an_installed_package():
    """A folder pyproject does not list is neither installed nor checked above."""
    listed = set(installed_packages())
    found = {".".join([PACKAGE, *p.parent.relative_to(ROOT).parts]) for p in ROOT.rglob("__init__.py")
             if p.parent.relative_to(ROOT).parts[:1] != ("tests",) and ".egg-info" not in str(p)}
    assert found - {PACKAGE} <= listed - {PACKAGE}, f"add to pyproject's packages: {sorted(found - listed)}"


def test_the_seams_name_modules_that_exist():
    modules = module_files(ROOT, installed_packages())
    missing = [m for r in SEAM_RULES for m in r.allowed if m not in modules]
    assert not missing, f"the seam rules allow modules that do not exist: {missing}"


# --- the checker, on synthetic trees --------------------------------------------------------------

def _tree(tmp_path: Path, files: dict[str, str]) -> Graph:
    for name, text in files.items():
        path = tmp_path.joinpath(*name.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    packages = [".".join([PACKAGE, *p.parent.relative_to(tmp_path).parts]).rstrip(".")
                for p in tmp_path.rglob("__init__.py")]
    return scan(tmp_path, packages)


CLEAN = {
    "__init__.py": "",
    "kvstore/__init__.py": "from kvcache.kvstore.types import Tier\n",
    "kvstore/types.py": "Tier = int\n",
    "kvstore/store.py": ("from typing import TYPE_CHECKING\nfrom ..tiering import dram\n"
                         "if TYPE_CHECKING:\n    import torch\n"),
    "tiering/__init__.py": "",
    "tiering/dram.py": "def f():\n    from kvcache.kvstore.store import x\n",
    "engine/__init__.py": "import torch\n",
    "engine/llm.py": "from kvcache.kvstore.types import Tier\nfrom kvcache.kvstore import types\n",
}


def test_a_clean_tree_passes(tmp_path):
    assert all_violations(_tree(tmp_path, CLEAN)) == []


def test_a_lazy_torch_import_through_another_package_is_caught(tmp_path):
    graph = _tree(tmp_path, {**CLEAN, "client/__init__.py": "",
                             "client/remote.py": "def run():\n    importlib.import_module('kvcache.engine.llm')\n",
                             "tiering/dram.py": "def f():\n    from kvcache.client import remote\n"})
    [found] = load_violations(graph, LOAD_RULES[0])
    assert found.startswith("kvcache.tiering.dram (tiering/dram.py:2) -> kvcache.client.remote (client/remote.py:2)")
    assert "kvcache.engine (engine/__init__.py:1) -> torch" in found


def test_an_import_past_the_engine_seam_is_caught(tmp_path):
    graph = _tree(tmp_path, {**CLEAN, "engine/llm.py": ("def f():\n    from kvcache.kvstore.store import BlockStore\n"
                                                        "from kvcache.kvstore import BlockStore\n")})
    assert seam_violations(graph, SEAM_RULES[0]) == [
        f"engine/llm.py:2: kvcache.engine.llm imports kvcache.kvstore.store: {SEAM_RULES[0].fix}",
        f"engine/llm.py:3: kvcache.engine.llm imports kvcache.kvstore: {SEAM_RULES[0].fix}"]


def test_a_package_cycle_is_caught_with_its_path(tmp_path):
    graph = _tree(tmp_path, {**CLEAN, "gc/__init__.py": "", "gc/collector.py": "from kvcache.tiering import dram\n",
                             "kvstore/store.py": "def f():\n    from kvcache.gc.collector import run\n"})
    [found] = cycle_violations(graph, LAYERS)
    assert found.startswith("cycle gc -> kvstore -> gc: gc (gc/collector.py:1: imports kvcache.tiering.dram)")
    assert "kvstore (kvstore/store.py:2: imports kvcache.gc.collector)" in found
    assert cycle_violations(graph, {}) != []  # without the store-and-tiers layer, more cycles


def test_relative_imports_resolve(tmp_path):
    graph = _tree(tmp_path, {**CLEAN, "kvstore/a.py": "from . import types\nfrom .types import Tier\n"
                                                      "from .. import engine\n"})
    targets = {(i.source, i.target) for i in graph.imports if i.source == "kvcache.kvstore.a"}
    assert targets == {("kvcache.kvstore.a", "kvcache.kvstore.types"), ("kvcache.kvstore.a", "kvcache.kvstore"),
                       ("kvcache.kvstore.a", "kvcache.engine"), ("kvcache.kvstore.a", "kvcache")}
