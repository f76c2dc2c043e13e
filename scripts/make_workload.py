"""Write the bundled multi-turn workload (dflash_gguf/data/workloads/stdlib.jsonl) from the
Python standard library of the interpreter that runs this script.

    python scripts/make_workload.py                 # rewrites the bundled file
    python scripts/make_workload.py -o my.jsonl

Deterministic: the same standard library gives the same bytes (the functions are picked
by module and qualified name, their source cut by the ast's line numbers). The sessions
are the tasks where drafts from text the session already holds should pay, and one
where they should not:

  rename        rename variables across a function and return it whole, three times over
  type-hints    add type hints to a function and return it whole, then a second one
  fix-bug       a function with one planted bug: find it, return the function fixed
  tool-loop     an agent's loop: every turn repeats the tools' JSON schema and adds a tool result
  quote         quote passages of a module's docstring verbatim and summarise them
  prose         open questions on unrelated topics: nothing to copy

The interpreter's version is named in every code session's system prompt, where a replay
sees it too.
"""
from __future__ import annotations

import argparse
import ast
import json
import platform
import sys
import sysconfig
from pathlib import Path

from dflash_gguf.bench.serving.workload import Session, Turn, dump_jsonl

ROOT = Path(__file__).resolve().parent.parent

OUT = ROOT / "dflash_gguf" / "data" / "workloads" / "stdlib.jsonl"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SYSTEM = (f"You are a careful Python programmer. The code below is from the Python {platform.python_version()} "
          "standard library. When asked for code, answer with the code only, in one ```python block.")
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "description": "relative to the root"},
                                          "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
                                          "required": ["path"]}}},
    {"type": "function", "function": {"name": "grep", "description": "Search the repository for a regex.",
                                      "parameters": {"type": "object", "properties": {
                                          "pattern": {"type": "string"}, "path": {"type": "string"}},
                                          "required": ["pattern"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the tests of a module.",
                                      "parameters": {"type": "object", "properties": {
                                          "module": {"type": "string"}}, "required": ["module"]}}},
]


def lines_of(module: str, qualname: str) -> tuple:
    """(first line, last line) of a function of a standard-library module (`module` a path
    under the library, without .py), found by its qualified name."""
    node = ast.parse((STDLIB / f"{module}.py").read_text(encoding="utf-8"))
    for part in qualname.split("."):
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    return min([d.lineno for d in node.decorator_list] + [node.lineno]), node.end_lineno


def source_of(module: str, qualname: str) -> str:
    """The source of that function, dedented to column 0."""
    start, end = lines_of(module, qualname)
    lines = (STDLIB / f"{module}.py").read_text(encoding="utf-8").splitlines()[start - 1:end]
    indent = len(lines[0]) - len(lines[0].lstrip())
    return "\n".join(line[indent:] for line in lines) + "\n"


def module_doc(module: str) -> str:
    return ast.get_docstring(ast.parse((STDLIB / f"{module}.py").read_text(encoding="utf-8")))


def budget(code: str) -> int:
    """max_tokens for a reply that returns `code` whole: a token per 3 characters (code
    tokenizes densely), room for the fences, in steps of 64."""
    return min(2048, (len(code) // 3 + 64 + 63) // 64 * 64)


def block(code: str) -> str:
    return f"```python\n{code}```"


def planted(code: str, old: str, new: str) -> str:
    """`code` with its one `old` replaced by `new`: the planted bug."""
    if code.count(old) != 1:
        raise SystemExit(f"the bug's text {old!r} is not in the function exactly once: another Python's stdlib?")
    return code.replace(old, new)


def rename() -> Session:
    code = source_of("textwrap", "TextWrapper._wrap_chunks")
    return Session("rename-wrap-chunks", "rename", (
        Turn(f"Rename the variable `cur_line` to `current_line` everywhere in this method and return the whole "
             f"method.\n\n{block(code)}", budget(code)),
        Turn("Now also rename `cur_len` to `current_length`, and return the whole method again.", budget(code)),
        Turn("Finally rename `chunks` to `pieces` (the parameter too) and return the whole method once more.",
             budget(code))), SYSTEM)


def type_hints() -> Session:
    first = source_of("difflib", "unified_diff")
    second = source_of("heapq", "nsmallest")
    return Session("type-hints-unified-diff", "type-hints", (
        Turn(f"Add type hints to every parameter and the return value of this function (use the typing module "
             f"where needed) and return the whole function.\n\n{block(first)}", budget(first)),
        Turn("Keep the hints, and add a short comment above each `yield`. Return the whole function.", budget(first)),
        Turn(f"Do the same for this function: type hints, then the whole function.\n\n{block(second)}",
             budget(second))), SYSTEM)


def fix_bug() -> Session:
    code = planted(source_of("difflib", "SequenceMatcher.get_opcodes"), "if i < ai and j < bj:", "if i < ai or j < bj:")
    return Session("fix-bug-get-opcodes", "fix-bug", (
        Turn(f"This method has one bug: for some inputs it reports 'replace' where it should report 'delete' or "
             f"'insert'. Find it and return the whole method fixed.\n\n{block(code)}", budget(code)),
        Turn("Explain in two sentences what the bug did, then return the fixed method again with a comment on the "
             "line you changed.", budget(code) + 64),
        Turn("Add a doctest to the method's docstring that would have caught the bug. Return the whole method.",
             budget(code) + 128)), SYSTEM)


def tool_loop() -> Session:
    schema = json.dumps(TOOLS, indent=1)
    relpath, expandvars = lines_of("posixpath", "relpath"), lines_of("posixpath", "expandvars")
    # a made-up failure: the loop's point is the schema and the results it repeats
    steps = [("grep", {"pattern": "def relpath", "path": "Lib/posixpath.py"},
              f"Lib/posixpath.py:{relpath[0]}:def relpath(path, start=None):"),
             ("read_file", {"path": "Lib/posixpath.py", "start_line": relpath[0], "end_line": relpath[1]},
              source_of("posixpath", "relpath")),
             ("run_tests", {"module": "test.test_posixpath"},
              "FAILED (failures=1)\nFAIL: test_relpath_bytes (test.test_posixpath.PosixPathTest.test_relpath_bytes)"),
             ("read_file", {"path": "Lib/posixpath.py", "start_line": expandvars[0], "end_line": expandvars[1]},
              source_of("posixpath", "expandvars"))]
    task = "Find out why test_relpath_bytes fails in posixpath and propose a fix."
    turns = []
    for i, (name, arguments, result) in enumerate(steps):
        ask = task if i == 0 else "Continue the task."
        turns.append(Turn(f"You can call these tools:\n{schema}\n\nTask: {task}\n\n"
                          f"Your last call: {json.dumps({'name': name, 'arguments': arguments})}\n"
                          f"Its result:\n{result}\n\n{ask} Answer with the next tool call as one JSON object "
                          '{"name": ..., "arguments": {...}}, or with the final answer if you have it.', 192))
    return Session("tool-loop-relpath", "tool-loop", tuple(turns), SYSTEM)


def quote() -> Session:
    doc = module_doc("heapq")
    return Session("quote-heapq-doc", "quote", (
        Turn(f"Here is the docstring of the heapq module.\n\n\"\"\"{doc}\"\"\"\n\nQuote its first paragraph "
             "verbatim, then summarise it in one sentence.", 384),
        Turn("Quote verbatim the passage about tournaments, then summarise it in two sentences.", 512),
        Turn("Quote verbatim the passage about disk sorts and tapes, then say in one sentence whether it still "
             "matters today.", 512)), SYSTEM)


def prose() -> Session:
    return Session("prose-open-questions", "prose", (
        Turn("What made the printing press spread so fast across Europe in the fifteenth century?", 256),
        Turn("Unrelated: how do migrating birds find their way over thousands of kilometres?", 256),
        Turn("Another topic: what are the trade-offs of living in a big city rather than a village?", 256),
        Turn("Last one: why does bread go stale, and how can one slow it down?", 256)))


SESSIONS = (rename, type_hints, fix_bug, tool_loop, quote, prose)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--output", type=Path, default=OUT, help=f"where to write it (default {OUT.relative_to(ROOT)})")
    args = p.parse_args(argv)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    text = dump_jsonl(make() for make in SESSIONS)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output} ({len(text.encode()) // 1024} KiB, {len(SESSIONS)} sessions) from {STDLIB}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
