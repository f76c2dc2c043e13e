"""The package's import graph read from its sources with ast (tests/runtime/test_import_cycles.py
and test_layers.py): module name -> the package's modules it imports, anywhere in its
source (a function-level import is an import too)."""
from __future__ import annotations

import ast
from pathlib import Path

from helpers.paths import HELPERS, ROOT

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
