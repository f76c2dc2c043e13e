"""No import cycle among the project's own modules (issue 68).

The module graph is read from the source with `ast`, nothing is imported: a node per
module of dflash_gguf (bench and train included) and of the convert package, which the
wheel maps to dflash_gguf.convert (pyproject.toml, wheel.packages). An edge A -> B is an
import statement in A that names B, wherever it stands (module level, in a function, in
a class, under a condition), absolute or relative:
- `import a.b` and `from a.b import name` name module a.b (or, when a.b is not a module
  of the project, the longest prefix that is);
- `from a import b` names module a.b when b is a submodule of a, else module a (b is
  then a name defined in a's __init__).

The parent packages of a named module are not edges. Importing a.b runs a's __init__
first, but counting that would make every submodule that imports a sibling look cyclic
whenever the __init__ imports its submodules. So a package's __init__ importing its own
submodules is fine, and it is a cycle only when a submodule imports a name of that
__init__ back (`from . import name`, `from a import name`). A module importing itself is
not an edge. Imports by string at run time (importlib.import_module) are not seen."""
from __future__ import annotations

import ast
import os
import textwrap
from collections import deque
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
# package name -> its source folder, as pyproject.toml's wheel.packages installs them
PACKAGES = {"dflash_gguf": ROOT / "dflash_gguf", "dflash_gguf.convert": ROOT / "convert"}


class Source(NamedTuple):
    path: Path
    label: str      # the path from the package folder's parent, for messages
    is_init: bool   # a package's __init__


def module_files(packages: dict[str, Path]) -> dict[str, Source]:
    """Module name -> its source."""
    modules = {}
    for package, folder in packages.items():
        # os.walk does not follow links: a dflash_gguf/convert -> ../convert link in a
        # checkout must not list the convert package twice, under two names
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            parts = Path(dirpath).relative_to(folder).parts
            for filename in filenames:
                if not filename.endswith(".py"):
                    continue
                stem = filename[:-3]
                is_init = stem == "__init__"
                name = ".".join((package, *parts) if is_init else (package, *parts, stem))
                path = Path(dirpath) / filename
                modules[name] = Source(path, path.relative_to(folder.parent).as_posix(), is_init)
    return modules


def _known(name: str, modules) -> str | None:
    """The longest prefix of dotted name `name` that is a module of the project."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in modules:
            return prefix
    return None


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_init: bool, modules) -> list[str]:
    """The project modules one import statement of `module` names (the docstring's rule)."""
    if isinstance(node, ast.Import):
        return [m for alias in node.names if (m := _known(alias.name, modules))]
    base = node.module or ""
    if node.level:
        # a relative import counts from the module's package: the module itself for an
        # __init__, else its parent; each level past the first goes one package up
        package = module.split(".") if is_init else module.split(".")[:-1]
        anchor = ".".join(package[:len(package) - (node.level - 1)])
        base = f"{anchor}.{base}" if base else anchor
    named = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        named.append(submodule if submodule in modules else _known(base, modules))
    return [m for m in named if m]


def _statements(body: list[ast.AST]):
    """Every statement of a body and of the bodies inside it (functions, classes, if, try,
    with, match...): imports are statements, so this sees them all without ast.walk's
    visit of every expression, which would double the test's time."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            yield from _statements(getattr(node, field, ()))


def import_graph(packages: dict[str, Path] = PACKAGES) -> dict[str, dict[str, str]]:
    """Module -> {module it imports: where, 'file:line' of the first such import}."""
    modules = module_files(packages)
    graph = {}
    for module, source in modules.items():
        edges = graph.setdefault(module, {})
        for node in _statements(ast.parse(source.path.read_text(encoding="utf-8"), str(source.path)).body):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(node, module, source.is_init, modules):
                    if target != module:
                        edges.setdefault(target, f"{source.label}:{node.lineno}")
    return graph


def _shortest_cycle(graph: dict[str, dict[str, str]], start: str) -> list[str] | None:
    """The shortest path start -> ... -> start (breadth first), or None."""
    came_from = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in graph.get(node, {}):
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return path[::-1] + [start]
            if target not in came_from:
                came_from[target] = node
                queue.append(target)
    return None


def find_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """A shortest cycle through every module that is on one, each cycle once, written
    from its smallest module name: [a, b, ..., a]."""
    cycles = set()
    for start in graph:
        cycle = _shortest_cycle(graph, start)
        if cycle:
            ring = cycle[:-1]
            i = ring.index(min(ring))
            ring = ring[i:] + ring[:i]
            cycles.add((*ring, ring[0]))
    return [list(c) for c in sorted(cycles)]


def describe(cycle: list[str], graph: dict[str, dict[str, str]]) -> str:
    steps = [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return "\n  ".join(steps)


def test_no_import_cycle():
    graph = import_graph()
    assert {"dflash_gguf.convert.vocab", "dflash_gguf.bench.cli", "dflash_gguf.train.cli"} <= graph.keys()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(f"- {describe(c, graph)}" for c in cycles)


def _write(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_a_cycle_through_a_function_level_relative_import_is_found(tmp_path):
    """The shape issue 68 found in convert/vocab.py: the package's module imports its
    helper inside a function, and the helper imports names back at module level."""
    _write(tmp_path / "pkg", {
        "__init__.py": "",
        "vocab.py": """
            import json

            def load():
                from .vocab_spm import load_spm
                return load_spm()

            def _read():
                return json
            """,
        "vocab_spm.py": "from .vocab import _read\n\ndef load_spm():\n    return _read()\n",
        "other.py": "from pkg import vocab\n",
    })
    graph = import_graph({"pkg": tmp_path / "pkg"})
    assert find_cycles(graph) == [["pkg.vocab", "pkg.vocab_spm", "pkg.vocab"]]
    assert describe(find_cycles(graph)[0], graph) == \
        "pkg.vocab -> pkg.vocab_spm (pkg/vocab.py:5)\n  pkg.vocab_spm -> pkg.vocab (pkg/vocab_spm.py:1)"


def test_an_init_importing_its_submodules_is_a_cycle_only_when_they_import_its_names(tmp_path):
    files = {
        "__init__.py": "from .a import A\nfrom . import b\nVERSION = 1\n",
        "a.py": "import pkg.b\nfrom pkg import b\nA = 1\n",  # siblings through the package: fine
        "b.py": "import os\n",
        "sub/__init__.py": "from ..b import os\n",
        "sub/c.py": "from .. import a\n",
    }
    _write(tmp_path / "pkg", files)
    assert find_cycles(import_graph({"pkg": tmp_path / "pkg"})) == []

    _write(tmp_path / "pkg", {"b.py": "from . import VERSION\n"})  # an __init__ name, back
    cycles = find_cycles(import_graph({"pkg": tmp_path / "pkg"}))
    assert cycles == [["pkg", "pkg.a", "pkg.b", "pkg"], ["pkg", "pkg.b", "pkg"]]  # a imports b too


def test_relative_imports_resolve_from_the_package(tmp_path):
    _write(tmp_path / "pkg", {
        "__init__.py": "from .sub import c\n",
        "x.py": "",
        "sub/__init__.py": "from . import c\n",
        "sub/c.py": "from .. import x\nfrom ..x import name\nimport pkg.sub.c.missing\n",
    })
    graph = import_graph({"pkg": tmp_path / "pkg"})
    assert graph == {"pkg": {"pkg.sub.c": "pkg/__init__.py:1"}, "pkg.x": {},
                     "pkg.sub": {"pkg.sub.c": "pkg/sub/__init__.py:1"}, "pkg.sub.c": {"pkg.x": "pkg/sub/c.py:1"}}
