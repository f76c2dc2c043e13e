"""Which proposer drafts for a request's sequence (engine.Engine.sequence), and what the
choices priced by the target's verify cost have learnt across requests: the verify cost
table (measured once per engine, cached per model file) and, per sampling regime, what
`auto` learnt from the last sequence, which the next ones start from."""
from __future__ import annotations

from typing import Dict, Optional

from ..decoding.requests import Request
from ..decoding.sampling import RULES, SamplingParams
from . import auto_store
from .auto import AutoBudget, AutoMemory
from .draft_simple import SimpleProposer, SimpleWeightlessProposer
from .drafting import chain_proposer, tree_proposer
from .pricing import RunHazards
from .proposers import DrafterWeightlessProposer, PlainProposer, WeightlessProposer
from .verify_cost import VerifyCost
from .weightless import WeightlessKinds


class ProposerChoice:
    """The engine's drafting parts (its setup, target, drafter or draft-simple model,
    suffix corpora) and the proposer each request gets from them."""

    def __init__(self, engine):
        self.setup, self.target, self.draft = engine.setup, engine.target, engine.draft
        self.simple_draft, self.suffix_corpora = engine.simple_draft, engine.suffix_corpora
        self.n_threads, self.draft_p_min = engine.n_threads, engine.draft_p_min
        self.verify_cost: Optional[VerifyCost] = None
        self.draft_prices: Dict[str, float] = {}  # the draft-simple model's work, priced at load (auto's parts)
        self.autos: Dict[Optional[tuple], AutoMemory] = {}
        self.hazards = RunHazards()  # every corpus key's, for the weightless kinds

    @property
    def block(self) -> int:
        """The DFlash-family drafter's block: --block-size's, else its file's."""
        return self.setup.drafting.block_size or self.draft.block_size

    def wants_auto(self) -> bool:
        """Whether a speculative request runs `--tree-budget auto`: a DFlash-family
        drafter's trees, or draft-simple's plain-or-chain choice."""
        if self.simple_draft is not None:
            return self.setup.simple.auto
        return self.draft is not None and bool(self.setup.drafting.tree_budget and self.setup.drafting.auto_budget)

    def weightless(self) -> bool:
        """Whether speculative requests draft without a drafter model: the n-gram kinds or
        suffix alone, each step priced against plain decoding (speculation/pricing.py)."""
        return self.draft is None and self.simple_draft is None and bool(self.setup.weightless.kinds)

    def wants_cost(self) -> bool:
        """Whether speculative requests price their steps by the verify cost table."""
        return self.wants_auto() or self.weightless()

    def measure(self) -> bool:
        """Measure the verify cost table now if the choices need it and it is not yet
        measured, and under `auto` what the draft-simple model's work costs (its catching
        up a token and a drafted step's drafting, SimpleDraft.prices: they price a cold
        chooser's first steps, AutoBudget.cold_window and its first decision); True when
        it measured (measuring runs graphs on the target and the drafter, which empties
        every slot)."""
        if self.wants_cost() and self.verify_cost is None:
            self.verify_cost = VerifyCost(self.target, self.n_threads)
            if self.simple_draft is not None and self.wants_auto():
                self.draft_prices = self.simple_draft.prices(self.setup.simple.n_max)
            return True
        return False

    def auto_for(self, sampling: Optional[SamplingParams]) -> Optional[AutoBudget]:
        """A sequence's own `auto` chooser, starting from what the engine learnt at the
        request's sampling setting (None when the tree budget is fixed); measure() has
        measured the verify cost."""
        if not self.wants_auto():
            return None
        key = sampling_regime(sampling)
        if key not in self.autos:
            if self.simple_draft is not None:  # no trees: plain decoding and the chain of up to n-max drafts
                largest, block = 0, self.setup.simple.n_max + 1
                drafting = (auto_store.file_identity(self.simple_draft.path), self.setup.simple)
            else:
                largest, block = self.setup.drafting.tree_budget, self.block
                drafting = (auto_store.file_identity(self.draft.path), block, self.draft_p_min,
                            self.setup.drafting.chain_rule)
            # what an earlier process learnt on these files, settings, machine and sampling
            entry = auto_store.key(self.verify_cost.key, drafting, largest, key)
            self.autos[key] = AutoMemory(self.verify_cost, largest, block, auto_store.load(entry),
                                         lambda state: auto_store.save(entry, state), self.draft_prices)
        return self.autos[key].chooser()

    def lookahead(self, speculative: bool) -> int:
        """The verify lookahead generate.check_request keeps room for past a request's
        tokens: the most positions a step of what drafts for it verifies (0 when not
        speculative)."""
        setup, lookahead = self.setup, 0
        if speculative and self.draft is not None:
            lookahead = setup.drafting.tree_budget + 1 if setup.drafting.tree_budget else self.block
        if speculative and setup.weightless.kinds:
            lookahead = max(lookahead, setup.weightless.spec_draft_n_max + 1)
        if speculative and self.simple_draft is not None:
            lookahead = max(lookahead, setup.simple.lookahead)
        return lookahead

    def proposer(self, request: Request, speculative: bool):
        """The request's proposer: plain decoding when not speculative, else by what the
        engine drafts with (the weightless kinds, suffix and the n-gram kinds, beside the
        drafter, beside draft-simple or alone; draft-simple; the drafter's tree or
        chain)."""
        setup, sampling = self.setup, request.sampling
        drafting, simple = setup.drafting, setup.simple
        kinds = self.weightless_kinds(request) if speculative else None
        if kinds is not None:
            if self.draft is not None:
                return DrafterWeightlessProposer(self.draft, self.block, self.draft_p_min, kinds)
            if self.simple_draft is not None:
                return SimpleWeightlessProposer(self.simple_draft, simple.n_max, simple.n_min, simple.p_min,
                                                simple.tree, self.auto_for(sampling), kinds, self.verify_cost)
            return WeightlessProposer(kinds, self.verify_cost)
        if speculative and self.simple_draft is not None:
            return SimpleProposer(self.simple_draft, simple.n_max, simple.n_min, simple.p_min, simple.tree,
                                  self.auto_for(sampling))
        if not speculative or self.draft is None:
            return PlainProposer()
        if drafting.tree_budget:
            return tree_proposer(self.target, self.draft, drafting.tree_budget, drafting.block_size,
                                 self.auto_for(sampling))
        return chain_proposer(self.target, self.draft, drafting.block_size, sampling, self.draft_p_min,
                              drafting.chain_rule, drafting.spec_draft_conf_min)

    def weightless_kinds(self, request: Request) -> Optional[WeightlessKinds]:
        """The weightless kinds the request drafts with (None: none): each sequence's own
        chain sources (the n-gram family's), the suffix corpora under the request's key."""
        weightless = self.setup.weightless
        if not weightless.kinds:
            return None
        return WeightlessKinds(weightless.sources if weightless.chains else None, self.suffix_corpora,
                               request.corpus, weightless.spec_draft_n_max, self.hazards)

    def flush(self) -> None:
        """Store what `auto` learnt (auto_store), for the next process on these files."""
        for memory in self.autos.values():
            memory.flush()


def sampling_regime(sampling: Optional[SamplingParams]) -> Optional[tuple]:
    """What `auto`'s expectations depend on in a request's sampling: greedy (None), or
    the filters and temperature that shape the target's draws."""
    if sampling is None or sampling.greedy:
        return None
    return tuple(getattr(sampling, rule.field) for rule in RULES if not rule.penalty)
