"""dflash_gguf (with convert/, installed as dflash_gguf.convert) and the tests' helpers
(tests/helpers) have no import cycle: every module's imports (at module level and inside
functions alike: a function-level import hides a cycle, it does not break it) form an
acyclic graph, read from the sources with ast. The tests keep to their layout: test
modules in tests/<layer>/, the helpers in the package tests/helpers, imported as
`helpers.<module>`; a test module imports helpers, never another test module."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers.paths import HELPERS, ROOT, TESTS

PACKAGE = ROOT / "dflash_gguf"


def modules() -> dict:
    """Module name -> source file, for every module of the package, the top-level convert/
    folder as the dflash_gguf.convert it is installed as (pyproject.toml)."""
    out = {}
    for folder, prefix in ((PACKAGE, ["dflash_gguf"]), (ROOT / "convert", ["dflash_gguf", "convert"])):
        for path in folder.rglob("*.py"):
            parts = prefix + list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported(name: str, path: Path, known: dict) -> set:
    """The package's modules that module `name` imports, anywhere in its source."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            prefix = ".".join(base + (node.module.split(".") if node.module else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod
            targets = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in known else prefix
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def helper_modules() -> dict:
    """Module name -> source file, for the package tests/helpers."""
    return {"helpers" if p.stem == "__init__" else f"helpers.{p.stem}": p for p in HELPERS.glob("*.py")}


def find_cycle(graph: dict):
    """One cycle of the graph as a list of modules (first == last), or None."""
    state: dict = {}  # 1: on the current path, 2: done
    path: list = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "dflash_gguf.decoding" in graph and "dflash_gguf.generate" in graph["dflash_gguf.decoding"]
    assert "dflash_gguf.convert.vocab_common" in graph["dflash_gguf.convert.vocab"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_helpers_have_no_import_cycle():
    known = helper_modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert "helpers.loops" in graph["helpers.arch_checks"] and "helpers.fixtures" in graph["helpers.draft_fixtures"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("sources, cycle", [
    # a function-level import closes a cycle as a module-level one does
    ({"a": "from . import b\n", "b": "def f():\n    from .a import x\n"}, True),
    ({"a": "from .b import y\n", "b": "import dflash_gguf.c\n", "c": "from dflash_gguf import a\n"}, True),
    ({"a": "from .b import y\n", "b": "import os\n"}, False),
])
def test_the_check_finds_cycles(tmp_path, sources, cycle):
    files = {}
    for name, text in sources.items():
        files[f"dflash_gguf.{name}"] = tmp_path / f"{name}.py"
        files[f"dflash_gguf.{name}"].write_text(text)
    graph = {name: imported(name, path, files) for name, path in files.items()}
    assert (find_cycle(graph) is not None) == cycle


LAYERS = {"convert", "runtime", "drafters", "serving", "bench"}


def test_test_modules_sit_in_their_layer_and_import_helpers_only():
    loose = sorted(p.name for p in TESTS.glob("*.py") if p.name != "conftest.py")
    assert not loose, f"modules outside a layer folder or tests/helpers: {loose}"
    folders = {p.parent.name for p in TESTS.rglob("test_*.py") if p.parent != TESTS / "data"}
    assert folders == LAYERS, folders
    helpers = {name.rpartition(".")[2] for name in helper_modules()} - {"helpers"}
    assert {"fixtures", "paths", "parity", "target_workers"} <= helpers, helpers
    found, bare = [], []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(TESTS)}: {n}" for n in names if n.split(".")[0].startswith("test_")]
            bare += [f"{path.relative_to(TESTS)}: {n}" for n in names if n.split(".")[0] in helpers]
    # a test module imported by another is collected under two names, and its import
    # depends on the order pytest visits the folders
    assert not found, "test modules importing test modules: " + ", ".join(found)
    # a helper imported as `fixtures` beside `helpers.fixtures` would be two modules
    assert not bare, "helpers imported without their package (helpers.<module>): " + ", ".join(bare)
