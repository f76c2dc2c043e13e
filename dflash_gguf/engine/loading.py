"""What an Engine decodes with, loaded once: the setup its options settle to within the
devices' memory (memory.settle), then the target, its tokenizer and the drafter (a
DFlash-family model or the target's own MTP layer, or draft-simple's small model)."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..runtime.drafter import Draft
from ..runtime.errors import ConfigError
from ..runtime.exactness import MODES, Exactness, exactness
from ..runtime.target import INVARIANT_STEP_ROWS, Target
from ..runtime.tokenizer import Tokenizer
from ..speculation.draft_simple import SimpleDraft, corpus_counts, kept_tokens
from ..speculation.drafting import default_p_min
from .memory import refusal, settle
from .options import EngineOptions


class LoadedModels:
    """The target, its tokenizer and its drafter (`draft` or `simple_draft`, or neither)
    as one settled setup loads them, with that setup's memory plan, the p_min that cuts
    the drafter's chains, and the vocabulary as grammars see it (built when first asked)."""

    def __init__(self, model: str, draft: Optional[str], options: EngineOptions, memory_limit_mib: Optional[int],
                 exact: str = "report"):
        # planned from metadata before anything is allocated: "auto" options are chosen
        # to fit, and a configuration that does not fit the device (or memory_limit_mib)
        # is refused with what would fit
        setup, self.memory_plan, over = settle(model, draft, options, memory_limit_mib)
        if over:
            raise refusal(model, draft, setup, self.memory_plan, over, memory_limit_mib)
        self.setup = setup
        draft_config = setup.draft_config
        # the runtime validates the file (architecture, shapes) before llama.cpp reads its vocabulary
        self.target = Target(model, setup.target_config)
        try:
            self.exact = self._exactness(model, exact)
        except BaseException:
            self.target.close()
            raise
        self.draft_p_min = default_p_min(self.target) if setup.drafting.draft_p_min is None else setup.drafting.draft_p_min
        if draft_config is not None and setup.drafting.tree_budget is None and self.draft_p_min == 0 \
                and not setup.weightless.kinds:
            # a chain that is never cut reads no probabilities: its proposes rank nothing
            draft_config = replace(draft_config, top_k=0)
        try:
            self.tokenizer = Tokenizer(model)
            if setup.draft_vocab:
                draft_config = replace(draft_config, head_tokens=self._kept_tokens(setup.draft_vocab,
                                                                                    setup.draft_vocab_from))
            self.draft = Draft(setup.draft_path, self.target, draft_config) if setup.draft_path else None
            # draft-simple: a second model of the target's kind, with its own memory (speculation/draft_simple.py)
            self.simple_draft = self._simple_draft(setup.simple) if setup.simple else None
            if setup.drafting.spec_draft_conf_min > 0 and not self.draft.has_confidence:
                self.draft.close()
                raise ConfigError("spec_draft_conf_min", f"{setup.draft_path} has no confidence head: leave "
                                                         "draft conf-min at 0")
        except BaseException:
            self.target.close()
            raise
        self._grammar_vocab = None  # grammar_vocab()'s

    def _exactness(self, model: str, mode: str) -> Exactness:
        """Whether this engine's greedy speculation is exact where its target runs: the
        target's devices (its device, and the CPU for layers or weights kept there),
        asked for the rows a step may hold (one sequence: its verify's; several: a step
        of the batch, a joining prompt's chunk beside the verifies)."""
        if mode not in MODES:
            raise ConfigError("exact", f"exact must be one of {', '.join(MODES)}, got {mode!r}")
        info, setup = self.target.info(), self.setup
        devices = [info["device"] or "CPU"]
        if info["n_gpu_layers"] < info["n_layer"] or info["host_layer_weights"]:
            devices.append("CPU")
        speculative = setup.draft_path is not None or setup.simple is not None or bool(setup.weightless.kinds)
        if info["n_seq"] > 1:
            max_rows = min(INVARIANT_STEP_ROWS, info["n_ubatch"])
        else:
            max_rows = info["n_verify"] if speculative else 1
        answer = exactness(model, devices, max_rows, info["n_threads"] or 2, mode,
                           (setup.target_config.kv_type, setup.target_config.kv_type_v))
        if mode == "require" and answer.exact != "yes":
            raise ConfigError("exact", f"greedy speculation would not be bit-identical to plain decoding here: "
                                       f"exact: {answer}. Run on the CPU (--device CPU), with fewer rows a step "
                                       f"(-np 1, a smaller --tree-budget), or leave out --exact require")
        return answer

    def _simple_draft(self, simple) -> SimpleDraft:
        """draft-simple's drafter, its head cut to the commonest tokens of the corpus named
        (--spec-draft-vocab-from), tokenized as the target tokenizes."""
        return SimpleDraft(simple.path, simple.config, self.target, simple.draft_vocab,
                           self._corpus_counts(simple.draft_vocab_from))

    def _corpus_counts(self, paths):
        """Each token's count in those files' text (None: no files, the lowest ids are kept)."""
        return corpus_counts(self.tokenizer, paths, self.target.n_vocab) if paths else None

    def _kept_tokens(self, n: int, paths) -> tuple:
        """A DFlash drafter's kept set (--spec-draft-vocab): it shares the target's head,
        so the target's vocabulary is the one cut."""
        return kept_tokens(self.target.path, n, self._corpus_counts(paths))

    def grammar_vocab(self):
        """The vocabulary as the constraints' grammars see it (built on first use: about a
        second for a large vocabulary)."""
        if self._grammar_vocab is None:
            from ..decoding.constraints import GrammarVocab

            self._grammar_vocab = GrammarVocab(self.tokenizer, self.target.n_vocab)
        return self._grammar_vocab

    def close(self) -> None:
        """Free the drafters, then the target they were loaded against."""
        if self.simple_draft is not None:
            self.simple_draft.close()
            self.simple_draft = None
        if self.draft is not None:
            self.draft.close()
            self.draft = None
        self.target.close()
