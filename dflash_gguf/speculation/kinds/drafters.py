"""The drafter kinds as `--spec-type` spells them (llama.cpp's names): the C registry's
(csrc/models/drafters.def) and draft-simple, their tables, defaults and the checks of the
drafter's chain options."""
from __future__ import annotations

from ...runtime.drafter_kinds import DRAFTERS
from ...runtime.errors import ConfigError

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
# llama.cpp's --spec-type names of the drafter kinds (the C registry's, csrc/models/drafters.def,
# then draft-simple)
DRAFTER_KINDS = tuple(k.spec_type for k in DRAFTERS) + (SIMPLE,)
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
# an autoregressive drafter's (MTP's, EAGLE3's) drafts per step when --spec-draft-n-max is
# left out: each costs a pass
# of the layer and its LM head, and a one-layer head's later drafts are right less often
# (the demo head: 0.82, 0.70, 0.61 for drafts 1..3 all right, dflash_gguf/data/README.md)
DEFAULT_MTP_DRAFTS = 3
