"""The speculation kinds, as `--spec-type` names them (llama.cpp's names), in one registry:
the drafter kinds (drafters.py: the C registry's, csrc/models/drafters.def, and
draft-simple), then the weightless kinds, one module of this folder each, found at import
(every module that declares `KIND = kind.Kind(...)`). A new weightless kind is its module,
its test and its docs: dflash-run's and dflash-server's flags, the Engine's keywords and
dflash-bench's arms follow from what it declares."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Dict, Tuple

from ...runtime.errors import ConfigError
from .drafters import (AUTOREGRESSIVE, CHAIN_RULES, DEFAULT_CHAIN_RULE, DEFAULT_MTP_DRAFTS, DEFAULT_SIMPLE_N_MAX,
                       DEFAULT_SIMPLE_N_MIN, DEFAULT_SIMPLE_P_MIN, DRAFTER_KINDS, FILE_KIND_NAMES, FILE_KINDS, SIMPLE,
                       TARGET_KINDS, check_chain_rule, check_p_min)
from .kind import Kind

__all__ = ["AUTOREGRESSIVE", "CHAIN_RULES", "DEFAULT_CHAIN_RULE", "DEFAULT_MTP_DRAFTS", "DEFAULT_SIMPLE_N_MAX",
           "DEFAULT_SIMPLE_N_MIN", "DEFAULT_SIMPLE_P_MIN", "DEFAULT_SPEC_DRAFT_N_MAX", "DRAFTER_KINDS",
           "FILE_KIND_NAMES", "FILE_KINDS", "SIMPLE", "SPEC_TYPES", "TARGET_KINDS", "WEIGHTLESS", "Kind",
           "check_chain_rule", "check_p_min", "parse_spec_types"]

# the weightless kinds' longest draft when --spec-draft-n-max is left out: llama.cpp's
# ngram-simple default (--spec-ngram-simple-size-m); each step verifies the length its
# price says pays (speculation/pricing.py), so a long copy goes in few steps and an unsure
# guess in none
DEFAULT_SPEC_DRAFT_N_MAX = 48


def _weightless() -> Dict[str, Kind]:
    """Every weightless kind this folder declares, by name, in the order of their modules'
    names (the order --help lists them and ties between their drafts go)."""
    found = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        kind = getattr(importlib.import_module(f"{__name__}.{module}"), "KIND", None)
        if kind is not None:
            found[kind.name] = kind
    return found


WEIGHTLESS: Dict[str, Kind] = _weightless()
SPEC_TYPES: Tuple[str, ...] = DRAFTER_KINDS + tuple(WEIGHTLESS)


def parse_spec_types(spec_type) -> tuple:
    """--spec-type as a tuple of kinds (a comma list, or a sequence of names), checked."""
    names = spec_type.split(",") if isinstance(spec_type, str) else list(spec_type)
    kinds = tuple(dict.fromkeys(n.strip() for n in names))
    if not kinds or any(k not in SPEC_TYPES for k in kinds):
        bad = [k for k in kinds if k not in SPEC_TYPES] or [spec_type]
        raise ConfigError("spec_type", f"unknown kind {bad[0]!r}; choose from {', '.join(SPEC_TYPES)} "
                                       "(a comma list runs several)")
    return kinds
