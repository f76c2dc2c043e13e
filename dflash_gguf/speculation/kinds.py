"""The speculation kinds as `--spec-type` spells them (llama.cpp's names), and the settings
they share: the drafters' (the C registry's, csrc/models/drafters.def, and draft-simple), the
weightless n-gram and suffix kinds, their defaults and the checks of their options."""
from __future__ import annotations

from dataclasses import dataclass

from ..runtime.drafter_kinds import DRAFTERS
from ..runtime.errors import ConfigError

# a sampled chain's accept rules (proposers.ChainProposer)
CHAIN_RULES = ("argmax", "reject")
DEFAULT_CHAIN_RULE = "argmax"


def check_chain_rule(rule: str) -> str:
    """The chain's accept rule when sampling (see speculative.chain_proposer), checked."""
    if rule not in CHAIN_RULES:
        raise ConfigError("chain_rule", f"chain rule must be one of {', '.join(CHAIN_RULES)}, got {rule!r}")
    return rule


def check_p_min(p_min: float) -> None:
    if isinstance(p_min, bool) or not isinstance(p_min, (int, float)) or not 0 <= p_min < 1:
        raise ConfigError("draft_p_min", f"draft p-min must be at least 0 and below 1, got {p_min}")


# draft-simple: a smaller model of the target's vocabulary (any GGUF that is not one of the
# drafter kinds) drafts autoregressively, loaded as a second target (speculation/draft_simple.py)
SIMPLE = "draft-simple"
# llama.cpp's --spec-type names: the drafter kinds (the C registry's, csrc/models/drafters.def,
# then draft-simple), then the weightless n-gram kinds
DRAFTER_KINDS = tuple(k.spec_type for k in DRAFTERS) + (SIMPLE,)
NGRAM_KINDS = ("ngram-simple", "ngram-mod")
# SuffixDecoding (speculation/suffix.py): weightless trees from the request's text and earlier requests'
SUFFIX = "suffix"
SPEC_TYPES = DRAFTER_KINDS + NGRAM_KINDS + (SUFFIX,)
# the suffix corpora's bound when --spec-suffix-cache-mb is left out, in MiB
DEFAULT_SUFFIX_CACHE_MB = 64
# the kinds that draft with a drafter GGUF (-md), by the kind its file says it is
# (read_draft_metadata's: a dflash GGUF with a Markov head is a DSpark drafter)
FILE_KINDS = {k.spec_type: k.name for k in DRAFTERS if not k.in_target}
FILE_KIND_NAMES = {k.name: k.what for k in DRAFTERS if not k.in_target}
# the kinds that draft with layers of the model's own GGUF (-m): draft-mtp
TARGET_KINDS = {k.spec_type: k for k in DRAFTERS if k.in_target}
# draft-simple's defaults: llama.cpp's common_params_speculative_draft (common/common.h)
DEFAULT_SIMPLE_N_MAX = 3
DEFAULT_SIMPLE_N_MIN = 0
DEFAULT_SIMPLE_P_MIN = 0.0


# drafters whose block is their drafts per step (one pass each), not a trained block size
AUTOREGRESSIVE = tuple(k.name for k in DRAFTERS if k.autoregressive)
# the weightless kinds' (n-gram, suffix) longest draft when --spec-draft-n-max is left out:
# llama.cpp's ngram-simple default (--spec-ngram-simple-size-m); each step verifies the
# length its price says pays (speculation/pricing.py), so a long copy goes in few steps and an unsure
# guess in none
DEFAULT_SPEC_DRAFT_N_MAX = 48
# an autoregressive drafter's (MTP's, EAGLE3's) drafts per step when --spec-draft-n-max is
# left out: each costs a pass
# of the layer and its LM head, and a one-layer head's later drafts are right less often
# (the demo head: 0.82, 0.70, 0.61 for drafts 1..3 all right, dflash_gguf/data/README.md)
DEFAULT_MTP_DRAFTS = 3


@dataclass(frozen=True)
class NgramConfig:
    """The n-gram kinds' settings (llama.cpp's defaults): ngram-simple looks up the last
    `size_n` tokens; ngram-mod keys its map on `n_match` tokens and proposes no draft
    shorter than `n_min` (capped at the draft's length)."""

    size_n: int = 12
    n_match: int = 24
    n_min: int = 48


def parse_spec_types(spec_type) -> tuple:
    """--spec-type as a tuple of kinds (a comma list, or a sequence of names), checked."""
    names = spec_type.split(",") if isinstance(spec_type, str) else list(spec_type)
    kinds = tuple(dict.fromkeys(n.strip() for n in names))
    if not kinds or any(k not in SPEC_TYPES for k in kinds):
        bad = [k for k in kinds if k not in SPEC_TYPES] or [spec_type]
        raise ConfigError("spec_type", f"unknown kind {bad[0]!r}; choose from {', '.join(SPEC_TYPES)} "
                                       "(a comma list runs several)")
    return kinds
