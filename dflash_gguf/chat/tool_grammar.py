"""Grammars that make tool calls parse: a call in the model's own format (toolcalls.SYNTAX)
whose arguments match the tool's schema, for tools given with `strict: true` and for
tool_choice "required" or a named function.

As llama-server's tool grammars, the grammar is lazy when calls are optional (tool_choice
auto with strict tools): text before a call is free, and from the call's opening on the
grammar holds. When a call is required, the prompt already ends with the call's opening
(assistant.prepare_turn primes it) and the grammar holds from the first token, the
primed text consumed first. A call's arguments follow its tool's parameter schema, with
`strict` or without, as in llama-server's grammars (no schema: any JSON object).

Formats: hermes (and the generic one of templates that cannot show tools), whose call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, and qwen-xml, whose
call is `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
</function>\\n</tool_call>` (string values as raw text without '<', other values as
JSON). gemma4's calls quote strings in a syntax of its own: they are left unconstrained."""
from __future__ import annotations

import json
from typing import Callable, List, Optional, Sequence

from ..decoding.constraints import JSON_LAYOUT, Constraint
from .toolcalls import SYNTAX

FORMATS = ("hermes", "generic", "qwen-xml")


def wanted(tools: Sequence[dict], tool_choice) -> bool:
    """A call grammar applies: some tool is strict, or a call is required."""
    return tool_choice == "required" or isinstance(tool_choice, dict) or any(
        t["function"].get("strict") is True for t in tools)


def call_constraint(fmt: Optional[str], tools: Sequence[dict], tool_choice, parallel: bool, primed: str,
                    special: Callable[[str], Optional[int]] = lambda text: None) -> Optional[Constraint]:
    """The Constraint for a turn's tool calls (None: none applies, or the format is not
    one of FORMATS). special(text): the id of a special token that is exactly `text` (a
    call's opening may be one), written as that token in the grammar."""
    if fmt not in FORMATS or not tools or tool_choice == "none" or not wanted(tools, tool_choice):
        return None
    if isinstance(tool_choice, dict):
        tools = [t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]
    syntax = SYNTAX[fmt]
    rules: List[str] = []
    if fmt == "qwen-xml":
        call = _qwen_xml_call(tools, rules)
    else:
        call = _hermes_call(tools, rules)
    open_, close = _marker(syntax.open, special), _marker(syntax.close, special)
    rules.insert(0, f"call: {open_} {call} {close}")
    # more than one call when they may come in parallel, separated by whitespace
    rules.insert(0, "start: call (WS call)*" if parallel else "start: call")
    rules.append('WS: /[ \\t\\n]*/')
    lark = "\n".join(rules)
    if primed:
        return Constraint("lark", lark, prefix=primed)
    return Constraint("lark", lark, lazy_from=syntax.open)


def _marker(text: str, special: Callable[[str], Optional[int]]) -> str:
    token = special(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def _schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT})


def _hermes_call(tools: Sequence[dict], rules: List[str]) -> str:
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "arguments": _schema(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    rules.append(f"body: {_json(calls[0] if len(calls) == 1 else {'anyOf': calls})}")
    return '"\\n" body "\\n"'


def _qwen_xml_call(tools: Sequence[dict], rules: List[str]) -> str:
    names = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        head = json.dumps(f"{fn['name']}>\n")
        schema = fn.get("parameters") or {}
        props = schema.get("properties") or {}
        if not props:  # no parameters named: any, each as text
            rules.append(f'fn_{i}: {head} ("<parameter=" /[^>\\n]+/ ">\\n" TEXT "\\n</parameter>\\n")*')
        else:
            required = set(schema.get("required") or [])
            parts = []
            for j, (key, sub) in enumerate(props.items()):
                value = _xml_value(sub if isinstance(sub, dict) else {})
                rules.append(f"p_{i}_{j}: {json.dumps(f'<parameter={key}>' + chr(10))} {value} "
                             f"{json.dumps(chr(10) + '</parameter>' + chr(10))}")
                parts.append(f"p_{i}_{j}" + ("" if key in required else "?"))
            rules.append(f"fn_{i}: {head} {' '.join(parts)}".rstrip())
        names.append(f"fn_{i}")
    rules.append("TEXT: /[^<]*/")
    rules.append(f"function: {' | '.join(names)}")
    return '"\\n<function=" function "</function>\\n"'


def _xml_value(schema: dict) -> str:
    """A parameter's value as the template writes it: a string as its raw text (one of
    its enum or its const as written), anything else as JSON."""
    if schema.get("type") != "string":
        return _json(schema)
    if "const" in schema:
        return json.dumps(str(schema["const"]))
    if "enum" in schema:
        return "(" + " | ".join(json.dumps(str(v)) for v in schema["enum"]) + ")"
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if isinstance(lo, int) or isinstance(hi, int):  # the text's length in characters
        return f"/[^<]{{{lo if isinstance(lo, int) else 0},{hi if isinstance(hi, int) else ''}}}/"
    return "TEXT"
