"""Speculative decoding's proposers for a request, its options checked: the drafter
proposes, the target verifies in one pass, the part the target agrees with is kept. Chain: one drafted block. Tree: a DDTree of the
drafter's top candidates. Greedy output equals plain greedy decoding token for token;
with sampling, the output is distributed exactly as the target's own sampling."""
from __future__ import annotations

from typing import Optional, Union

from ..decoding.sampling import SamplingParams
from ..decoding.tree import accepted_prefix
from ..runtime.drafter import Draft
from ..runtime.target import Target
from .auto import AutoBudget
from .kinds import CHAIN_RULES, DEFAULT_CHAIN_RULE, check_chain_rule, check_p_min
from .proposers import AutoProposer, ChainProposer, TreeProposer, chain_length

__all__ = ["accepted_prefix", "chain_length", "chain_proposer", "check_chain_rule", "check_p_min", "default_p_min",
           "tree_proposer", "CHAIN_RULES", "DEFAULT_CHAIN_RULE", "DEFAULT_DRAFT_P_MIN"]


# the greedy chain's confidence cut (chain_length) where the target computes on the CPU:
# the best of a sweep on this project's CPU benchmark pairs (dflash-bench --draft-p-min with several values)
DEFAULT_DRAFT_P_MIN = 0.3


def default_p_min(target: Target) -> float:
    """The cut for a loaded target: DEFAULT_DRAFT_P_MIN where it computes on the CPU,
    wholly or in part (a verify's cost grows with its rows there: layers kept on the CPU,
    or weights placed in host memory by name, such as routed experts); none where an
    accelerator holds all its layers' weights (a verify is bound by reading the weights,
    and the whole block costs about what two rows do)."""
    info = target.info()
    on_device = info["device"] != "CPU" and info["n_gpu_layers"] >= info["n_layer"] \
        and info["host_layer_weights"] == 0
    return 0.0 if on_device else DEFAULT_DRAFT_P_MIN


def chain_proposer(target: Target, draft: Draft, block_size: Optional[int], sampling: Optional[SamplingParams],
                   p_min: float = 0.0, chain_rule: str = "argmax", conf_min: float = 0.0) -> ChainProposer:
    """The chain's proposer for a request, its options checked. The drafter's block goes
    to the target on the device and every row's token is chosen there
    (proposers.ChainProposer). With sampling, chain_rule "argmax" drafts the drafter's
    argmax and keeps each draft while the target's draw equals it; "reject" draws the
    drafts from the drafter's distribution and keeps them by speculative rejection
    sampling (with top_k > 0, whose candidates carry both distributions to the host;
    without, the argmax rule runs). With p_min > 0 (the drafter loaded with top_k >= 1),
    each pass verifies the chain_length of its block."""
    B = draft.block_size if block_size is None else int(block_size)
    if not 1 <= B <= draft.block_size:
        raise ValueError(f"block size {B} is outside 1..{draft.block_size} (the drafter's trained block size)")
    if B > target.n_verify:
        raise ValueError(f"block size {B} exceeds the target's n_verify ({target.n_verify})")
    check_p_min(p_min)
    if p_min > 0 and draft.top_k < 1:
        raise ValueError("a chain with p_min > 0 needs a drafter loaded with top_k >= 1")
    params = sampling or SamplingParams()
    # a drafter that drafts its own choices (DFlash2's selector, MTP's passes) has no
    # distribution to draw from: its drafts are fixed in advance, kept by the argmax rule
    rejection = check_chain_rule(chain_rule) == "reject" and not params.greedy and params.top_k > 0 \
        and not draft.greedy_only
    if conf_min > 0 and not draft.has_confidence:
        raise ValueError(f"the {draft.kind} drafter has no confidence head: conf_min must be 0")
    return ChainProposer(draft, B, p_min, params.top_k if rejection else 0, conf_min)


def tree_proposer(target: Target, draft: Draft, budget: int, block_size: Optional[int],
                  auto: Optional[AutoBudget] = None) -> Union[TreeProposer, AutoProposer]:
    """The tree's proposer for a request, its options checked. DDTree speculative
    decoding (proposers.TreeProposer): the drafter's per-position
    top-K candidates become a best-first tree of `budget` nodes below the bonus token,
    the target verifies all of them in one pass, and the longest path the target agrees
    with is kept; with `auto` (the sequence's budget.AutoBudget, `budget` its largest
    tree) every step runs the arm it chooses: plain decoding, the chain cut where its
    cost model says, or a tree of one of a few sizes.

    With sampling, every node's token is drawn on the device from the target's own
    distribution there (a uniform of its own per node), and the walk moves on while the
    draw is a child: every emitted token is a draw from the target's conditional, so the
    output is distributed exactly as plain sampling, whatever the tree. (Recursive
    rejection over siblings would accept more often; this rule needs no drafter
    probabilities to stay exact.) auto's chain arm keeps its drafts by the same rule."""
    B = draft.block_size if block_size is None else int(block_size)
    if not 2 <= B <= draft.block_size:
        raise ValueError(f"block size {B} is outside 2..{draft.block_size} (the drafter's trained block size)")
    if draft.top_k < 1:
        raise ValueError("tree decoding needs a drafter loaded with top_k >= 1")
    if not 1 <= budget or budget + 1 > target.n_verify:
        raise ValueError(f"tree budget {budget} needs n_verify >= {budget + 1} (target has {target.n_verify})")
    if auto is not None and auto.largest != budget:
        raise ValueError(f"the auto budget's largest tree ({auto.largest}) is not the tree budget ({budget})")
    return TreeProposer(draft, budget, B) if auto is None else AutoProposer(draft, B, auto)
