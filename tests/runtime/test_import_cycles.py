"""dflash_gguf (with convert/, installed as dflash_gguf.convert) and the tests' helpers
(tests/helpers) have no import cycle: every module's imports (at module level and inside
functions alike: a function-level import hides a cycle, it does not break it) form an
acyclic graph, read from the sources with ast. The tests keep to their layout: test
modules in tests/<layer>/, the helpers in the package tests/helpers, imported as
`helpers.<module>`; a test module imports helpers, never another test module."""
from __future__ import annotations

import ast

import pytest

from helpers.import_graph import find_cycle, helper_modules, import_graph, imported
from helpers.paths import TESTS

def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "dflash_gguf.decoding.step" in graph and "dflash_gguf.decoding.requests" in graph["dflash_gguf.decoding.step"]
    assert "dflash_gguf.convert.vocab.common" in graph["dflash_gguf.convert.vocab.load"]
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
