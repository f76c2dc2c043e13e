"""What a step's proposer plans (Plan) and puts to the target (Proposal), what the
proposer hears of the step after it (VerifiedStep), and the calls every proposer
(proposers.Proposer) takes in a step.

A proposer only proposes, and holds only its configuration and the long-lived things it
drafts with (a drafter, corpora, auto's budget): what it keeps of a sequence from step to
step is the sequence's (start, Sequence.proposing), and what it keeps of a step travels in
the step's Plan, from plan to propose and, in the step's VerifiedStep, to verified. A Plan is
frozen: what propose settles besides (the offer the weightless kinds judge by, auto's
decision with its cut and trees) is a new Plan (dataclasses.replace) that the Proposal
carries (Proposal.plan), and that is the plan verified hears of. Around the
step's two graphs, so that the drafts of every sequence come from one drafter graph and
their verifies from one target graph (decoding.step):
  verified(seq, plan, proposal, path, out, seconds)
                  first, what the sequence's last step kept: the accepted node path, the
                  tokens, the step's seconds; what a proposer learns from (auto, the n-gram
                  sources' acceptance). A step that decoded every sequence plainly is heard
                  of as a proposal of the last token alone
  plan(seq)       the step's Plan, before the drafter's graph: the block to draft for it
                  (0: none), whether the step verifies the last token alone (decodes)
  propose(seq, plan)
                  after it: the Proposal the target verifies
Hearing a step at the next one keeps a step's calls in one direction: from decoding.step
to the proposers, then to the verify (decoding/verify.py), none coming back."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from .tree import DraftTree


@dataclass(slots=True)
class Proposal:
    """What one sequence puts to its target in a step, and the rule that keeps it:
      tokens  the bonus token then its drafts: a chain, or with `tree` the tree's nodes
      n       with tokens None, a chain of the first n tokens of `draft`'s block, which goes
              to the target on the device (read back only where the host needs it)
      reject_top_k  a sampled chain of the drafter's own draws, kept by speculative
              rejection sampling over both models' top-k; otherwise each draft (or tree
              child) is kept while the target's choice before it equals it
      decode  plain decoding's row: the bonus alone, appended, its logits only
      kind    the kind that drafted it (an n-gram kind, suffix, draft-simple): its drafted
              and accepted tokens are counted under that name (GenerationStats.drafts: DraftCounts.count)
      corpus  suffix's drafts came from the corpus of earlier requests, not the
              sequence's own text
      nodes   in tree mode (a tree budget, auto, draft-simple's tree), the nodes below the
              root the step verifies (GenerationStats.trees: TreeSteps.sizes)
      as_chain  a tree-mode step that verifies a chain instead (TreeSteps.chain_steps)
      plan    the step's Plan as propose settled it, where it settled more than plan
              did: what verified hears of the step with (None: the plan as planned)"""

    tokens: Optional[List[int]] = None
    tree: Optional[DraftTree] = None
    draft: Any = None
    n: int = 1
    reject_top_k: int = 0
    decode: bool = False
    kind: Optional[str] = None
    corpus: bool = False
    nodes: Optional[int] = None
    as_chain: bool = False
    plan: Optional["Plan"] = None

    def chain(self, slot: int) -> List[int]:
        """A chain's tokens, the device block read back on first use."""
        if self.tokens is None:
            self.tokens = self.draft.block(self.n, seq=slot)
        return self.tokens


@dataclass(frozen=True, slots=True)
class Plan:
    """One sequence's step as its proposer plans it, carried from plan through propose to
    verified (in the sequence's VerifiedStep); frozen, a changed plan is a new one
    (dataclasses.replace, carried back by Proposal.plan):
      block    the drafter's block to draft for it before the drafter's graph (0: none)
      decodes  the step verifies the last token alone
      depth    how deep its drafts may go (a tree's, auto's chain's)
      auto     auto's decision for the step (speculation.auto.Decision: its arm, whether
               it probes or surveys, and after propose what the step drafted for auto to
               learn from; None: a step auto does not hear of)
      judged   what verified judges the step's drafts by: the n-gram sources' drafts
               (NgramDrafts.best), the suffix tree and its depth (SuffixDrafts.judge)
      fuses    the step may run as one call of the library (verifying.chain_call): a
               greedy chain of the drafter's block, kept by the target's argmax alone,
               cut by the drafter's confidence at p_min (proposers.chain_length)"""

    block: int = 0
    decodes: bool = False
    depth: int = 0
    auto: Any = None
    judged: Any = None
    fuses: bool = False
    p_min: float = 0.0


@dataclass(slots=True)
class VerifiedStep:
    """A step as its sequence's proposer hears of it (Proposer.verified), kept by the
    sequence until its next step or its finish (Sequence.tell_proposer)."""

    plan: Plan
    proposal: Proposal
    path: List[int]
    out: List[int]
    seconds: float
