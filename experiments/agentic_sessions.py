#!/usr/bin/env python3
"""Writes dflash_gguf/data/workloads/agentic.jsonl: agentic coding sessions at depth
(issue 86 item 5), a file under edit with tool results over several turns, whose context
reaches about 8K and 24K tokens (the published Qwen2.5-Coder's tokenizer) by the last
turn, as an agent's or an editor's requests do.

Every session is made from the Python standard library of the interpreter that runs this
(3.11.7 here), so that it is the same text on every machine with that Python:

  1. the agent reads the file under edit (a read_file tool result: the whole module) and
     is asked to rename a local variable of one of its functions, returning the function;
  2. it greps for the function, reads a second module, and is asked to add type hints to
     one of that module's functions;
  3. (the 24K session) it reads a third module and renames a parameter of one of its
     functions, updating its uses;
  4. the tests' tool result says they pass, and it is asked to add a one-line docstring
     to the first function, keeping the rename: the reply copies what it wrote before.

The functions are chosen by ast: 20-70 lines, with a local variable assigned and read at
least three times (its name not a parameter's), the first such function in the file.

    .venv/bin/python experiments/agentic_sessions.py [--out dflash_gguf/data/workloads/agentic.jsonl]
    dflash-bench workload dflash_gguf/data/workloads/agentic.jsonl -m qwen2.5-coder-1.5b.gguf ...
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
OUT = Path(__file__).resolve().parents[1] / "dflash_gguf" / "data" / "workloads" / "agentic.jsonl"
SYSTEM = ("You are a coding agent working in a checkout of the Python {version} standard library. You call tools; "
          "their results come back in the user's messages, each after a line 'Tool result (COMMAND):'. When asked "
          "for code, answer with the code only, in one ```python block.")
# (name, modules: the file under edit first)
SESSIONS = [("agentic-8k-textwrap", ["textwrap.py", "shlex.py"]),
            ("agentic-24k-configparser", ["configparser.py", "csv.py", "gettext.py"])]


def functions(source: str):
    """(node, source lines) of every function and method, in file order."""
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield node, lines[start - 1:node.end_lineno]


def params(node) -> list:
    a = node.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + \
        [x.arg for x in (a.vararg, a.kwarg) if x is not None]


def local_variable(node):
    """A local variable assigned and read at least three times, not a parameter."""
    assigned = [t.id for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)]
    reads = [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    for name in dict.fromkeys(assigned):
        if len(name) >= 3 and name not in params(node) and reads.count(name) >= 3:
            return name
    return None


def pick(source: str, want_variable: bool = True, want_param: bool = False):
    """The first function of 20-70 lines with what the task needs."""
    for node, body in functions(source):
        if not 20 <= len(body) <= 70:
            continue
        var = local_variable(node) if want_variable else None
        named = [p for p in params(node) if p not in ("self", "cls") and len(p) >= 3]
        if want_variable and var is None or want_param and not named:
            continue
        return node.name, "\n".join(body), var, (named[0] if named else None)
    raise SystemExit("no function fits")


def dedent(text: str) -> str:
    lines = text.splitlines()
    cut = min(len(x) - len(x.lstrip()) for x in lines if x.strip())
    return "\n".join(x[cut:] for x in lines)


def read_file(name: str, source: str) -> str:
    return f"Tool result (read_file Lib/{name}):\n```python\n{source}```"


def budget(code: str, extra: int = 96) -> int:
    """A reply's max_tokens: the function's tokens (about 3.2 characters each) and room."""
    return len(code) // 3 + extra


def session(name: str, modules: list) -> dict:
    sources = [(m, (STDLIB / m).read_text(encoding="utf-8")) for m in modules]
    (edit, edit_src), (second, second_src) = sources[0], sources[1]
    func, body, var, _ = pick(edit_src)
    body = dedent(body)
    hint_func, hint_body, _, _ = pick(second_src, want_variable=False)
    turns = [{"user": f"Task: in Lib/{edit}, rename the local variable `{var}` of `{func}` to `{var}_value` and "
                      f"return the whole updated function.\n\n{read_file(edit, edit_src)}",
              "max_tokens": budget(body)},
             {"user": f"Tool result (grep -rn '{func}' Lib/{edit}):\n" +
                      "\n".join(f"Lib/{edit}:{i}:{line}" for i, line in enumerate(edit_src.splitlines(), 1)
                                if func in line) +
                      f"\n\n{read_file(second, second_src)}\n\nNext, add type hints to `{hint_func}` in Lib/{second} "
                      f"and return the whole function.",
              "max_tokens": budget(dedent(hint_body))}]
    for third, third_src in sources[2:]:
        p_func, p_body, _, param = pick(third_src, want_variable=False, want_param=True)
        turns.append({"user": f"{read_file(third, third_src)}\n\nIn Lib/{third}, rename the parameter `{param}` of "
                              f"`{p_func}` to `{param}_arg`, updating its uses in the function, and return the "
                              f"whole function.",
                      "max_tokens": budget(dedent(p_body))})
    turns.append({"user": f"Tool result (python -m test test_{edit[:-3]}):\nOK\n\nThe tests pass. Now add a one-line "
                          f"docstring to `{func}` in Lib/{edit}, keeping the rename, and return the whole function.",
                  "max_tokens": budget(body, 160)})
    return {"name": name, "kind": "agentic", "system": SYSTEM.format(version=sys.version.split()[0]),
            "turns": turns}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    args.out.write_text("".join(json.dumps(session(name, modules)) + "\n" for name, modules in SESSIONS))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
