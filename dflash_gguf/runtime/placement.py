"""Weights placed by name: llama.cpp's -ot/--override-tensor PATTERN=DEVICE rules and its
--cpu-moe / --n-cpu-moe shorthands for routed experts.

A rule is (pattern, device): the first rule whose regular expression occurs in a
tensor's GGUF name (re.search, as llama.cpp's std::regex_search) decides where that
weight lives; tensors no rule matches stay where -ngl puts them. The rules are resolved
here against the file's tensor names, and the C runtime gets the resulting (name,
device) list (dfl_weight_placement), so the runtime never parses a pattern."""
from __future__ import annotations

import functools
import os
import re
import weakref
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from .native import ffi

Rule = Tuple[str, str]

# llama.cpp's routed-expert tensors (common/common.h, LLM_FFN_EXPS_REGEX): gate, up, their
# fused gate_up and down, of plain and chunked (chexps) experts
EXPERTS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def expert_rules(n_cpu_moe: int = 0, cpu_moe: bool = False) -> Tuple[Rule, ...]:
    """The rules llama.cpp's --cpu-moe (every layer's routed experts on the CPU) and
    --n-cpu-moe N (those of the first N layers) stand for."""
    if cpu_moe:
        return ((EXPERTS, "CPU"),)
    return tuple((rf"blk\.{il}{EXPERTS}", "CPU") for il in range(n_cpu_moe))


def parse_rules(values: Union[str, Iterable[Union[str, Sequence[str]]], None]) -> Tuple[Rule, ...]:
    """-ot values as rules: "PATTERN=DEVICE" strings, each a comma list as llama.cpp
    splits them, or (pattern, device) pairs. ValueError names a malformed entry or a
    pattern that is not a regular expression."""
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    rules: List[Rule] = []
    for value in values:
        if isinstance(value, str):
            pairs = []
            for entry in value.split(","):
                pattern, eq, device = entry.rpartition("=")
                if not eq or not pattern or not device:
                    raise ValueError(f"{entry!r} is not PATTERN=DEVICE")
                pairs.append((pattern, device))
        else:
            pair = tuple(value)
            if len(pair) != 2 or not all(isinstance(x, str) and x for x in pair):
                raise ValueError(f"{value!r} is not a (pattern, device) pair")
            pairs = [pair]
        for pattern, device in pairs:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{pattern!r} is not a regular expression: {e}") from None
            rules.append((pattern, device))
    return tuple(rules)


def check_devices(rules: Sequence[Rule], model_device: Optional[str]) -> None:
    """Every rule's device is in ggml's registry and is one a model on `model_device`
    (None: the default, the first GPU else the CPU) uses: that device or the CPU."""
    from .devices import default_device, list_devices

    if not rules:
        return
    names = [d["name"] for d in list_devices()]
    used = {model_device or default_device(), "CPU"}
    for pattern, device in rules:
        if device not in names:
            raise ValueError(f"{pattern}={device}: unknown device {device!r} (devices: {', '.join(names)})")
        if device not in used:
            raise ValueError(f"{pattern}={device}: the model runs on {' and '.join(sorted(used))}, not {device}")


@functools.lru_cache(maxsize=16)
def _names(path: str, mtime_ns: int, size: int) -> Tuple[str, ...]:
    from .gguf_meta import GGUFMeta

    return GGUFMeta(path).tensor_names()


def tensor_names(path: str) -> Tuple[str, ...]:
    """The GGUF's tensor names, in file order (read once per file version)."""
    st = os.stat(path)
    return _names(str(path), st.st_mtime_ns, st.st_size)


def resolve(rules: Sequence[Rule], path: str) -> List[Rule]:
    """(tensor name, device) of every tensor of the file some rule matches: the first
    one's device."""
    compiled = [(re.compile(p), d) for p, d in rules]
    out = []
    for name in tensor_names(path):
        device = next((d for p, d in compiled if p.search(name)), None)
        if device is not None:
            out.append((name, device))
    return out


# the arrays each params struct points into, alive as long as the struct
_keep: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def attach(params, rules: Sequence[Rule], path: str) -> None:
    """Set params.weight_placements (a dfl_target_params or dfl_draft_params) to the
    rules resolved against the file at `path`."""
    placed = resolve(rules, path) if rules else []
    if not placed:
        return
    strings = [ffi.new("char[]", s.encode()) for pair in placed for s in pair]
    array = ffi.new("dfl_weight_placement[]", len(placed))
    for k in range(len(placed)):
        array[k].name, array[k].device = strings[2 * k], strings[2 * k + 1]
    params.n_weight_placements = len(placed)
    params.weight_placements = array
    _keep[params] = (array, strings)
