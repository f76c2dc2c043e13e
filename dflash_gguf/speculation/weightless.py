"""Drafts that cost no model run (the weightless kinds, speculation/kinds/): the n-gram family's
chains (speculation/ngram.py) over a sequence's own text, and suffix trees (speculation/suffix.py)
over it and its corpus key's earlier requests, each enabled on its own or together
(`--spec-type suffix,ngram-mod`). Each enabled source offers one
draft a step (an Offer), with the chance that each of its nodes is kept:

  alone (proposers.WeightlessProposer)
                               the offer with the most expected tokens per second at the
                               target's verify cost by rows, cut to its best size
                               (pricing.best_size); none, a plain decode, when no offer
                               beats the last token alone
  beside a drafter model       the offer with the most expected kept drafts competes with
                               the model's chain (proposers.DrafterWeightlessProposer,
                               draft_simple.SimpleWeightlessProposer)

Every offer is fixed before the target's draws of its step, so greedy output is the
target's own and sampled output is distributed as its sampling, whichever is verified.
Every source hears how the step went, verified or not (the target's tokens say how far
its draft would have gone), so that a source that is never chosen can earn its place."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, List, Optional, Tuple

import numpy as np

from ..decoding.proposal import Proposal
from ..decoding.tree import DraftTree
from .ngram import NgramDrafts
from .pricing import RunHazards, best_size
from .suffix import SuffixCorpora, SuffixDrafts, is_chain, likeliest_path

SUFFIX_KIND = "suffix"  # what suffix's drafts are counted under (GenerationStats.drafts: DraftCounts.count)
SUFFIX_CORPUS_HAZARD = "suffix corpus"  # the hazard (RunHazards' kind) of suffix's drafts from the corpus


@dataclass(slots=True)
class Offer:
    """One source's draft for a step: an n-gram kind's chain (drafts) or suffix's tree,
    the chance that each of its nodes is kept (best-first: any first m of them make a
    draft), the kind it is counted under, whether it came from the corpus, and the run
    it was drafted from (pricing.RunHazard)."""

    kind: str
    probs: np.ndarray
    drafts: List[int] = field(default_factory=list)
    tree: Optional[DraftTree] = None
    corpus: bool = False
    run: int = 0

    @property
    def expected(self) -> float:
        """Its expected kept drafts, verified whole."""
        return float(self.probs.sum())

    def priced(self, cost, depth: int = 0) -> Tuple[int, float]:
        """(how many of its nodes pay, the expected tokens per second of a step that
        verifies them) at the verify cost by rows (VerifyCost: a chain's, or a tree's)
        after `depth` tokens of context; 0 nodes: the last token alone pays best."""
        table = cost.chain if self.tree is None or is_chain(self.tree) else cost

        def by_rows(rows):
            return table(rows, depth)

        m = best_size(self.probs, by_rows)
        return m, (1.0 + float(self.probs[:m].sum())) / float(np.asarray(by_rows(np.asarray([1 + m])))[0])

    def cut(self, m: int) -> "Offer":
        """The offer of its first m nodes."""
        if m >= len(self.probs):
            return self
        tree = self.tree.best(m) if self.tree is not None else None
        return Offer(self.kind, self.probs[:m], self.drafts[:m], tree, self.corpus, self.run)

    def proposal(self, bonus: int, room: int, grammar=None) -> Proposal:
        """The offer as the target verifies it after `bonus`, in a context with `room`
        rows left, under `grammar` (a constraints.GrammarState; None: unconstrained): a
        chain as it is; a tree of one branch as a chain; a tree of several as it is (not
        padded: on a CPU every row costs, and the sizes a step verifies are few), or,
        where it does not fit the context or a grammar constrains the output, its
        likeliest branch as a chain (cut where the grammar rejects it)."""
        tree = self.tree
        if tree is None:
            return Proposal([bonus] + self.drafts, kind=self.kind)
        if is_chain(tree) or grammar is not None or len(tree) > room:
            drafts = likeliest_path(tree)
            if grammar is not None:
                drafts = grammar.draft_path(drafts)
            return Proposal([bonus] + drafts, kind=self.kind, corpus=self.corpus)
        return Proposal(tree=tree, kind=self.kind, corpus=self.corpus)


@dataclass(slots=True)
class Offers:
    """A step's offers (at most one a source), and every n-gram source's draft of the
    step (NgramDrafts.best), which its acceptance is judged on."""

    offers: List[Offer] = field(default_factory=list)
    ngram: Optional[list] = None

    def likeliest(self) -> Optional[Offer]:
        """The offer with the most expected kept drafts (the first listed on a tie)."""
        return max(self.offers, key=lambda o: o.expected, default=None)

    def cheapest(self, cost, depth: int = 0) -> Tuple[Optional[Offer], float]:
        """The offer with the most expected tokens per second at the verify cost after
        `depth` tokens of context, cut to its best size, and that rate ((None, 0.0): no
        offer beats plain decoding)."""
        best, best_rate = None, 0.0
        for offer in self.offers:
            m, rate = offer.priced(cost, depth)
            if m and rate > best_rate:
                best, best_rate = offer.cut(m), rate
        return best, best_rate

    def judged(self, verified: Optional[Offer]) -> tuple:
        """What the step's outcome is judged on (Weightless.observe): every n-gram
        source's draft, and suffix's tree as far as it was verified, or, when it was not,
        its first level (what the target's next token says of it)."""
        suffix = next((o for o in self.offers if o.tree is not None), None)
        if verified is not None and verified.tree is not None:
            return self.ngram, SuffixDrafts.judge(verified.tree, verified.run, corpus=verified.corpus)
        return self.ngram, None if suffix is None else SuffixDrafts.judge(suffix.tree, suffix.run, 1, suffix.corpus)


class Weightless:
    """A sequence's weightless sources (what the proposer keeps of it from step to step):
    its n-gram kinds with their run hazards, and its suffix drafting (its own
    text's index and its corpus key's), each None when not enabled."""

    __slots__ = ("ngram", "suffix")

    def __init__(self, ngram: Optional[NgramDrafts], suffix: Optional[SuffixDrafts]):
        self.ngram, self.suffix = ngram, suffix

    def offers(self, text: List[int], n_max: int, room: int) -> Offers:
        """Each source's offer for the step after `text` (the sequence's Tokens.text): at
        most n_max drafts, no deeper than `room` (Sequence.draft_room: what the request
        and the context have room for)."""
        step = Offers()
        if not room:
            return step
        if self.ngram is not None:
            drafts, probs, kind, step.ngram = self.ngram.best(text, room)
            if drafts:
                step.offers.append(Offer(kind, probs, drafts=drafts))
        if self.suffix is not None:
            tree, probs, run, corpus = self.suffix.best(text, n_max, room)
            if tree is not None:
                step.offers.append(Offer(SUFFIX_KIND, probs, tree=tree, corpus=corpus, run=run))
        return step

    def observe(self, emitted: List[int], judged: Optional[tuple]) -> None:
        """After the step: the tokens it emitted after the bonus, and what it was judged on
        (Offers.judged; None: nothing was asked of the sources)."""
        if judged is None:
            return
        ngram, suffix = judged
        if self.ngram is not None:
            self.ngram.observe(emitted, ngram)
        if self.suffix is not None:
            self.suffix.observe(emitted, suffix)

    def finish(self, seq) -> None:
        """The sequence ended: its text goes into its corpus key's suffix corpus."""
        if self.suffix is not None:
            self.suffix.finish(seq)


@dataclass(frozen=True)
class WeightlessKinds:
    """The weightless kinds a request drafts with: a maker of a sequence's n-gram sources
    (one per n-gram kind, kinds.Kind.source; None: no such kind), the suffix corpora and the request's
    corpus key (corpora None: no suffix), at most n_max drafts a step, and every key's
    hazards by kind (RunHazards: how long the key's drafts have run)."""

    ngram: Optional[Callable[[], list]]
    corpora: Optional[SuffixCorpora]
    key: Hashable
    n_max: int
    hazards: RunHazards

    def start(self) -> Weightless:
        ngram = suffix = None
        if self.ngram is not None:
            sources = self.ngram()
            ngram = NgramDrafts(sources, [self.hazards.request(self.key, s.kind) for s in sources])
        if self.corpora is not None:
            suffix = SuffixDrafts(self.corpora, self.key, self.hazards.request(self.key, SUFFIX_KIND),
                                  self.hazards.request(self.key, SUFFIX_CORPUS_HAZARD))
        return Weightless(ngram, suffix)
