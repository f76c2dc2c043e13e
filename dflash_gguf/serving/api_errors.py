"""The error a request handler raises for a request the server refuses, and the reading
of a request body into its pydantic model (openai_models, anthropic_models), whose
ValidationError becomes a BadRequest in words: the field by its path in the body
(messages[0].content), then what is wrong with it."""
from __future__ import annotations

import json
from typing import Any, List, Optional, Type, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

M = TypeVar("M", bound=BaseModel)


class BadRequest(Exception):
    """The request is refused with `status` (400 unless said otherwise); `param` names
    the field at fault, when one is; `kind` is the error's type (llama-server's:
    invalid_request_error, exceed_context_size_error, not_supported_error) and `extra`
    further fields of the error object (n_prompt_tokens and n_ctx of a context overflow)."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 kind: str = "invalid_request_error", extra: Optional[dict] = None):
        super().__init__(message)
        self.param = param
        self.status = status
        self.kind = kind
        self.extra = extra or {}


def validated(model: Type[M], body: Any) -> M:
    """`body` read into `model`, or a BadRequest naming the first field at fault."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise bad_request(e, body) from None


def refusal(kind: str, message: str, **ctx) -> PydanticCustomError:
    """A request model's validator's error, told as written: `message` follows the
    field's path, or is the whole sentence for a check of the request as a whole (`param`
    in ctx then names the field at fault). `message` is a template: {name} is ctx's
    name, and text with braces of its own goes in through ctx."""
    return PydanticCustomError(OURS + kind, message, ctx or None)


OURS = "dflash_"  # the error types of refusal()
# what a value must be, by pydantic's error type (strict types: JSON's own)
NOUNS = {"string_type": "a string", "string_too_short": "a non-empty string", "list_type": "a list",
         "too_short": "a non-empty list", "dict_type": "an object", "model_type": "an object",
         "model_attributes_type": "an object", "int_type": "an integer", "int_from_float": "an integer",
         "float_type": "a number", "bool_type": "true or false", "none_required": "null"}
BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
          "less_than": ("<", "lt")}


def bad_request(error: ValidationError, body: Any) -> BadRequest:
    errors = error.errors(include_url=False)
    paths = [_path(e, body) for e in errors]
    # a value that matches no member of a union gets an error per member: the member that
    # got furthest into the value is the one the client meant, and of those that fail at
    # the value itself, one whose type it has (a list too long); if it has none of their
    # types, they are told together ("a string or a list")
    deepest = max(len(p) for p in paths)
    path = next(p for p in paths if len(p) == deepest)
    same = [e for e, p in zip(errors, paths) if p == path]
    typed = [e for e in same if not (e["type"].endswith("_type") or e["type"] == "literal_error")]
    first = (typed or same)[0]
    where = _where(path)
    if len(same) > 1 and not typed:
        message = f"{where} must be " + " or ".join(_noun(e) for e in same)
    else:
        message = _sentence(where, path, first)
    param = path[0] if path and isinstance(path[0], str) else (first.get("ctx") or {}).get("param")
    return BadRequest(message, param)


def _path(error: dict, body: Any) -> List:
    """The error's place in the body. pydantic's loc also names the union member it
    tried ('str', 'list[int]', a content block's tag), which is not in the body: the loc
    is walked along the body, each part taken into the body where it is there or passed
    over, and of the ways through, the one that ends at the value in error is it (a tag
    can also be a key: {"type": "text", "text": ...}). A value a validator made itself
    (arguments read from JSON text) is not in the body: then every part that is there
    is taken."""
    loc, target = error["loc"], error.get("input")
    missing = error["type"] == "missing"  # its input is the object that lacks the field

    def walk(node: Any, i: int) -> Optional[List]:
        if i == len(loc) or (missing and i == len(loc) - 1):
            return list(loc[i:]) if node is target else None
        part = loc[i]
        if _has(node, part):
            rest = walk(node[part], i + 1)
            if rest is not None:
                return [part, *rest]
        return walk(node, i + 1)

    found = walk(body, 0)
    if found is not None:
        return found
    path, node = [], body
    for i, part in enumerate(loc):
        if _has(node, part) or (missing and i == len(loc) - 1):
            path.append(part)
            node = node[part] if _has(node, part) else None
    return path


def _has(node: Any, part) -> bool:
    if isinstance(node, dict):
        return isinstance(part, str) and part in node
    return isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)


def _where(path: List) -> str:
    """A top-level field quoted ('max_tokens'), a deeper one as its path (tools[0].function.name)."""
    if len(path) == 1:
        return f"'{path[0]}'"
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _number(value) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _got(value: Any) -> str:
    """The value given, when it is short enough to quote."""
    if isinstance(value, (dict, list)):
        return ""
    text = json.dumps(value)
    return f", got {text}" if len(text) <= 40 else ""


def _noun(error: dict) -> str:
    if error["type"] == "literal_error":
        return f"one of {error['ctx']['expected']}"
    return NOUNS.get(error["type"]) or error["msg"].removeprefix("Input should be ")


def _sentence(where: str, path: List, error: dict) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "missing":
        return f"{where} is required" if len(path) == 1 else f"{_where(path[:-1])} needs '{path[-1]}'"
    if kind in NOUNS:
        return f"{where} must be {NOUNS[kind]}{_got(value)}"
    if kind in BOUNDS:
        sign, key = BOUNDS[kind]
        return f"{where} must be {sign} {_number(ctx[key])}{_got(value)}"
    if kind == "finite_number":
        return f"{where} must be finite"
    if kind == "too_long":
        return f"{where} takes at most {ctx['max_length']} items"
    if kind == "literal_error":
        return f"{where}: {value!r} is not one of {ctx['expected']}"
    if kind == "union_tag_invalid":
        tags = ctx["expected_tags"].rsplit(", ", 1)
        return f"{where} must be of {ctx['discriminator'].strip(chr(39))} {' or '.join(tags)} (got {ctx['tag']!r})"
    if kind == "union_tag_not_found":
        return f"{where} needs {ctx['discriminator']}"
    if kind.startswith(OURS):  # a sentence, or what follows the field
        return f"{where} {error['msg']}" if path else error["msg"]
    return f"{where}: {error['msg'][0].lower()}{error['msg'][1:]}"
