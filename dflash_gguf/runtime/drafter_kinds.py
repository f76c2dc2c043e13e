"""The drafter kinds this build runs, read once from the C registry
(csrc/models/drafters.def, through dflash.h's dfl_drafter_kind): --spec-type's drafter
names, their help, and what the kind checks (engine/setup.py) and the command lines know of
each come from these lines, never typed again here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Optional, Tuple

from .native import ffi, lib


@dataclass(frozen=True)
class DrafterKind:
    name: str  # the kind a file is (read_draft_metadata's "kind"): "dflash"
    spec_type: str  # its --spec-type name: "draft-dflash"
    title: str  # its name in prose: "DFlash"
    what: str  # what its file is: "a DFlash drafter"
    help: str  # --spec-type's words for it
    marker: Optional[str]  # the tensor that makes a file of its architectures its own
    archs: Tuple[str, ...]  # general.architecture values of the GGUFs it reads
    autoregressive: bool  # a pass per draft: its block is the drafts per step, not trained
    in_target: bool  # it drafts with layers of the target's own GGUF (-m): no drafter file


def _text(chars) -> Optional[str]:
    return None if chars == ffi.NULL else ffi.string(chars).decode()


def _archs(array) -> Tuple[str, ...]:
    out = []
    while array[len(out)] != ffi.NULL:
        out.append(_text(array[len(out)]))
    return tuple(out)


def _read() -> Tuple[DrafterKind, ...]:
    kinds = (lib.dfl_drafter_kind_at(i) for i in range(lib.dfl_drafter_kind_count()))
    return tuple(DrafterKind(_text(k.name), _text(k.spec_type), _text(k.title), _text(k.what), _text(k.help),
                             _text(k.marker), _archs(k.archs), bool(k.autoregressive), bool(k.in_target))
                 for k in kinds)


# in drafters.def's order, which is --spec-type's
DRAFTERS: Tuple[DrafterKind, ...] = _read()
BY_SPEC_TYPE = {k.spec_type: k for k in DRAFTERS}


def reading(arch: str, tensor_names: Callable[[], Collection[str]]) -> Optional[DrafterKind]:
    """The kind that reads a GGUF of architecture `arch` (None: no kind does), by the
    runtime's rule (dfl_drafter_find): of the kinds reading `arch`, the one whose marker
    tensor the file has, else the one without a marker. `tensor_names` is asked only
    when a marker decides."""
    readers = [k for k in DRAFTERS if arch in k.archs]
    if any(k.marker for k in readers):
        names = tensor_names()
        marked = next((k for k in readers if k.marker and k.marker in names), None)
        if marked is not None:
            return marked
    return next((k for k in readers if not k.marker), None)


def listed(words, last: str = "or") -> str:
    """Words as prose lists them: "a, b or c"."""
    words = list(words)
    return ", ".join(words[:-1]) + f" {last} " + words[-1] if len(words) > 1 else "".join(words)
