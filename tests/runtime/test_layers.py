"""dflash_gguf's folders are its layers, and imports run one way: down. Each subpackage
(and each top-level module) has a floor; a module may import only from its own folder or
from folders on lower floors, at module level or inside a function alike (read from the
sources with ast, as test_import_cycles does). A folder holds about fifteen modules at
most, so that its listing fits in a head.

The floors, lowest first (docs/design.md "Where things are" says what each holds):

    runtime, convert     the C library's binding, models, devices; the converters
    decoding             requests, sampling, the verify's tree and the step
    speculation, chat    who proposes drafts and how many; chat formats
    engine               options settled, models loaded, the Engine
    serving, train       dflash-server; dflash-train
    tools                parity, near ties, llama.cpp's tree, the published models
    bench, cli, the package's face (__init__)
"""
from __future__ import annotations

import pytest

from helpers.import_graph import import_graph

FLOORS = {
    "runtime": 0, "convert": 0,
    "decoding": 1,
    "speculation": 2, "chat": 2,
    "engine": 3,
    "serving": 4, "train": 4,
    "tools": 5,
    "bench": 6, "cli": 6, "__init__": 6,
}
MOST_MODULES = 16


def folder(module: str) -> str:
    """The folder (layer) of a module: dflash_gguf.decoding.step -> decoding;
    dflash_gguf.cli -> cli; dflash_gguf -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(graph: dict, floors: dict) -> list:
    """(importer, imported) pairs whose imported module sits on a higher floor, and
    (module, None) for a module in a folder that has no floor."""
    bad = []
    for name, deps in sorted(graph.items()):
        mine = floors.get(folder(name))
        if mine is None:
            bad.append((name, None))
            continue
        bad += [(name, dep) for dep in sorted(deps)
                if folder(dep) != folder(name) and floors.get(folder(dep), mine + 1) > mine]
    return bad


def test_imports_run_down_the_floors():
    graph = import_graph()
    assert "dflash_gguf.runtime.target" in graph["dflash_gguf.decoding.verify"]
    bad = upward_imports(graph, FLOORS)
    assert not bad, "imports from a higher floor (or a folder without one): " + \
        "; ".join(f"{a} -> {b}" for a, b in bad)


def test_every_folder_fits_in_a_head():
    counts: dict = {}
    for name in import_graph():
        parts = name.split(".")
        if len(parts) > 2:  # a module inside a folder (packages count as modules of their parent)
            counts[".".join(parts[:-1])] = counts.get(".".join(parts[:-1]), 0) + 1
    over = {k: v for k, v in counts.items() if v > MOST_MODULES}
    assert not over, f"folders over {MOST_MODULES} modules: {over}"


@pytest.mark.parametrize("graph, floors, bad", [
    ({"dflash_gguf.runtime.a": {"dflash_gguf.decoding.b"}, "dflash_gguf.decoding.b": set()},
     {"runtime": 0, "decoding": 1}, [("dflash_gguf.runtime.a", "dflash_gguf.decoding.b")]),
    ({"dflash_gguf.decoding.b": {"dflash_gguf.runtime.a"}, "dflash_gguf.runtime.a": set()},
     {"runtime": 0, "decoding": 1}, []),
    ({"dflash_gguf.newfolder.x": set()}, {"runtime": 0}, [("dflash_gguf.newfolder.x", None)]),
    ({"dflash_gguf.runtime.a": {"dflash_gguf.newfolder.x"}}, {"runtime": 0},
     [("dflash_gguf.runtime.a", "dflash_gguf.newfolder.x")]),
    ({"dflash_gguf.speculation.a": {"dflash_gguf.chat.b"}}, {"speculation": 2, "chat": 2}, []),
])
def test_the_rule_catches_an_upward_import(graph, floors, bad):
    assert upward_imports(graph, floors) == bad
