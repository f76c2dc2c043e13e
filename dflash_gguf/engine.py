"""Load a target (and optionally a drafter: DFlash, or the target's own MTP layer) once,
generate many times."""
from __future__ import annotations

import gc
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Union

from .chat import EngineTemplates
from .checkpoints import PrefillSaver, PrefixCheckpoints
from .config import AUTO_MAX_BUDGET, ConfigError, EngineSetup
from .decoding import Batch, Sequence as Decoding, sequence_steps
from .draft import Draft
from .draft_simple import SimpleDraft, corpus_counts, kept_tokens
from .generate import GenerationStats, Placement, Request, check_request, collect
from .memory import refusal, settle
from .proposer_choice import ProposerChoice
from .sampling import SamplingParams
from .speculative import default_p_min
from .suffix import SuffixCorpora
from .streamtext import partial_marker
from .target import Target
from .tokenizer import Tokenizer

__all__ = ["Engine", "EngineSetup", "Result"]

Prompt = Union[str, Sequence[int]]


@dataclass
class Result:
    text: str
    tokens: List[int]
    stats: GenerationStats


def freeze_loaded_objects() -> None:
    """Take every Python object alive now (the imported modules, a loaded engine) out of
    the cycle collector's passes, for a process that keeps them to its end (dflash-run,
    dflash-server, dflash-bench). Steps allocate, so collections run every few steps, and
    now and then the oldest generation's pass walks every object tracked: with numpy,
    llguidance and the rest loaded, one such pass was 48 million instructions, a stall of
    a step, and 5% of a 64-token decode of the demo pair that it fell in (callgrind,
    results/gc-freeze-count-2026-11-25.json). Objects freed by reference counting are freed
    as before; only cycles among the frozen objects would outlive their use."""
    gc.freeze()


class Engine:
    """A target model, its tokenizer and an optional drafter.

    With a drafter, generation is speculative: a chain of the drafter's block size (or
    `block_size`), or with `tree_budget` a DDTree of that many nodes ("auto": sized
    every step, per sequence, for the best expected speed: plain decoding, the chain or
    a tree of up to AUTO_MAX_BUDGET nodes). A chain stops before the first draft the
    drafter gives less than `draft_p_min` (speculative.chain_length; 0: the whole
    block; None: as speculative.default_p_min chooses for the device); auto's chain
    is cut where its cost model says instead. Without a drafter, plain
    autoregressive decoding. Greedy output is the same in every mode; sampled output
    has the same distribution.

    Consecutive calls whose prompt extends the previous prompt and output (a chat that
    goes on) continue the context instead of recomputing it. With `checkpoints` set (a
    checkpoints.PrefixCheckpoints), any prompt sharing a prefix with an earlier one
    resumes from the longest checkpoint of that prefix: prompts are checkpointed at
    their end and every `checkpoints.every` tokens. Output is the same as without.

    A call interrupted by an exception or Ctrl-C (KeyboardInterrupt) at any point leaves
    the engine usable: the next call starts from a clean context and gives what a fresh
    engine gives.

    `stage_hook`, when set, is called with the name of each stage of decoding as it is
    completed: "prefill chunk" after each chunk of the prompt, "prefilled" after
    the prompt, then per step "drafted", "verified",
    "committed" (speculative) or "decoded" (plain). It is for tests and
    instrumentation: an exception it raises ends the call like any error inside the
    step would.
    """

    AUTO_MAX_BUDGET = AUTO_MAX_BUDGET

    def __init__(self, model: str, draft: Optional[str] = None, *, memory_limit_mib: Optional[int] = None,
                 **options):
        """`options` are EngineSetup's: n_ctx, n_ubatch, n_threads, kv_type, kv_type_v,
        block_size, tree_budget, draft_top_k, device, repack, n_gpu_layers, draft_window,
        draft_p_min, chain_rule, n_seq (sequences held at once, each in a slot of n_ctx
        positions: see sequence()), spec_type (llama.cpp's --spec-type kinds, a comma list
        or a sequence: "draft-dflash", "draft-eagle3" (`draft` an EAGLE3 drafter),
        "draft-mtp" (the MTP layer of `model` itself, no `draft`), "draft-simple" (`draft` a
        smaller model of the target's vocabulary, drafting token by token: draft_simple.py),
        "ngram-simple", "ngram-mod", "suffix" (SuffixDecoding: trees from the request's
        own text and earlier requests', suffix.py); None: the drafter's own kind
        (draft-simple for a model GGUF), or plain decoding without one),
        spec_suffix_cache_mb (the suffix corpora's bound, all corpus keys together),
        spec_draft_n_max (the n-gram kinds' longest draft, MTP's, EAGLE3's and draft-simple's
        drafts per step; the DFlash block when block_size is left out), spec_draft_n_min,
        n_ctx_draft and n_gpu_layers_draft (draft-simple's shortest chain, its context (0: n_ctx)
        and its layers on the device), spec_draft_vocab (draft-simple's or a DFlash
        drafter's head cut to that many tokens, FR-Spec: cheaper drafts, never a token
        outside them; 0: the kept set a DFlash file carries, else all),
        spec_draft_vocab_from (files or directories of text whose commonest tokens the cut
        keeps; default: the lowest ids),
        spec_draft_conf_min,
        spec_ngram_simple_size_n, spec_ngram_mod_n_match, spec_ngram_mod_n_min;
        override_tensor ("PATTERN=DEVICE" strings or (pattern, device) pairs: weights
        whose GGUF name matches on that device, the first match deciding), cpu_moe and
        n_cpu_moe (routed experts of every layer, or of the first n layers, on the CPU),
        and override_tensor_draft, cpu_moe_draft, n_cpu_moe_draft for the drafter
        (placement.py); kv_type and draft_window default to "auto" (see memory.settle)."""
        # planned from metadata before anything is allocated: "auto" options are chosen
        # to fit, and a configuration that does not fit the device (or memory_limit_mib)
        # is refused with what would fit
        setup, self.memory_plan, over = settle(model, draft, options, memory_limit_mib)
        if over:
            raise refusal(model, draft, setup, self.memory_plan, over, memory_limit_mib)
        self.setup = setup
        drafting = setup.drafting
        self.block_size, self.tree_budget = drafting.block_size, drafting.tree_budget
        self.auto_budget = drafting.auto_budget
        target_config, draft_config, n_threads = setup.target_config, setup.draft_config, setup.n_threads
        # the runtime validates the file (architecture, shapes) before llama.cpp reads its vocabulary
        self.target = Target(model, target_config)
        self.draft_p_min = default_p_min(self.target) if drafting.draft_p_min is None else drafting.draft_p_min
        if draft_config is not None and self.tree_budget is None and self.draft_p_min == 0 \
                and not setup.weightless.ngram_kinds and setup.weightless.suffix is None:
            # a chain that is never cut reads no probabilities: its proposes rank nothing
            draft_config = replace(draft_config, top_k=0)
        try:
            self.tokenizer = Tokenizer(model)
            if setup.draft_vocab:
                draft_config = replace(draft_config, head_tokens=self._kept_tokens(setup.draft_vocab,
                                                                                    setup.draft_vocab_from))
            self.draft = Draft(setup.draft_path, self.target, draft_config) if setup.draft_path else None
            # draft-simple: a second model of the target's kind, with its own memory (draft_simple.py)
            self.simple_draft = self._simple_draft(setup.simple) if setup.simple else None
            if drafting.spec_draft_conf_min > 0 and not self.draft.has_confidence:
                self.draft.close()
                raise ConfigError("spec_draft_conf_min", f"{setup.draft_path} has no confidence head: leave "
                                                         "draft conf-min at 0")
        except BaseException:
            self.target.close()
            raise
        self.n_threads = n_threads
        self.chain_rule = drafting.chain_rule
        self.last_tokens: List[int] = []  # every token the last call generated
        # per slot: the tokens its context holds, and whether it was filled speculatively
        self._contexts: List[tuple] = [([], None) for _ in range(self.target.n_seq)]
        self.stage_hook: Optional[Callable[[str], None]] = None
        self.checkpoints: Optional[PrefixCheckpoints] = None
        self.templates = EngineTemplates(self.tokenizer)
        self._grammar_vocab = None  # grammar_vocab()'s
        # grammar-aware drafting for constrained requests (constraints.GrammarState.drafting)
        self.grammar_drafting = True
        # suffix: the engine's corpora of earlier requests, one per Request.corpus key
        self.suffix_corpora = SuffixCorpora(setup.weightless.suffix) if setup.weightless.suffix is not None else None
        # each request's proposer, and what `auto` and the weightless kinds' pricing learn
        # across requests (the verify cost table, per sampling regime the last sequence's)
        self.choice = ProposerChoice(self)

    # -- lifetime -------------------------------------------------------------------
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

    def close(self) -> None:
        self.choice.flush()
        if self.checkpoints is not None:
            self.checkpoints.clear()
        if self.simple_draft is not None:
            self.simple_draft.close()
            self.simple_draft = None
        if self.draft is not None:
            self.draft.close()
            self.draft = None
        self.target.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- prompts ----------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> List[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]

    def chat_template(self, tools: bool = False):
        """The chat.ChatTemplate prompts are rendered with: the one set with
        set_chat_template, else the GGUF's (its named template tool_use, when it has
        one, for conversations that offer tools). ValueError when there is none."""
        return self.templates.get(tools)

    def set_chat_template(self, source: str, name: str = "custom") -> None:
        """Render chats with this template (Jinja source) instead of the GGUF's."""
        self.templates.set(source, name)

    def chat_prompt(self, user: str, system: Optional[str] = None, history: Sequence[dict] = (),
                    **template_kwargs) -> str:
        """The conversation (`history` of {"role", "content"} messages, then `user`)
        rendered with the chat template, ready for the assistant's reply."""
        messages = ([{"role": "system", "content": system}] if system else []) + list(history) + \
            [{"role": "user", "content": user}]
        return self.render_messages(messages, **template_kwargs)

    def render_messages(self, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None,
                        **template_kwargs) -> str:
        """A whole conversation ({"role", "content"} messages; `tools` as OpenAI function
        schemas) rendered with the chat template for the assistant's reply;
        template_kwargs reach the template (e.g. enable_thinking=False for Qwen3 / Qwen3.5)."""
        return self.chat_template(bool(tools)).render(messages, tools=tools, **template_kwargs)

    def check_request(self, prompt: Prompt, max_tokens: int, *, speculative: bool = True,
                      context_full: str = "error") -> List[int]:
        """The prompt's tokens, or the ValueError generate() would raise for this request
        (an empty prompt, prompt + max_tokens over the context), without running it."""
        tokens = self.encode(prompt)
        lookahead = 0
        if speculative and self.draft is not None:
            lookahead = self.tree_budget + 1 if self.tree_budget else (self.block_size or self.draft.block_size)
        if speculative and (self.setup.weightless.ngram_kinds or self.suffix_corpora is not None):
            lookahead = max(lookahead, self.setup.weightless.spec_draft_n_max + 1)
        if speculative and self.simple_draft is not None:
            lookahead = max(lookahead, self.setup.simple.lookahead)
        check_request(self.target, tokens, max_tokens, lookahead, context_full)
        return tokens

    # -- generation ---------------------------------------------------------------------
    def _stops(self, stop_tokens: Optional[Iterable[int]]) -> set:
        return self.tokenizer.eog_ids if stop_tokens is None else set(stop_tokens)

    def _text_tokens(self, tokens: List[int], stops: set) -> List[int]:
        """The tokens whose text is the reply: a stop token ends it without being part of it."""
        return tokens[:-1] if tokens and tokens[-1] in stops else tokens

    def prepare_auto(self) -> bool:
        """Measure what `--tree-budget auto` and the weightless kinds' pricing need (the
        verify cost table, cached per model file) now, if not yet: measuring runs graphs
        on the target, which empties every slot. Whether it measured."""
        if not self.choice.measure():
            return False
        self._contexts = [([], None) for _ in self._contexts]
        return True

    def held(self, slot: int) -> List[int]:
        """The tokens the slot's context holds (a later prompt extending them continues it)."""
        return self._contexts[slot][0]

    def sequence(self, request: Request, *, speculative: bool = True, stats: Optional[GenerationStats] = None,
                 slot: int = 0, on_stage: Optional[Callable[[str], None]] = None) -> Decoding:
        """A request (its stop_tokens None: the model's end-of-generation tokens) to decode
        in the given slot of the target's (and drafter's) memory, continuing the context
        the slot holds when the prompt extends it, else resuming the longest checkpointed
        prefix; run it alone (sequence_steps) or with others (decoding.step).
        end_sequence records what it left in the slot."""
        stats = GenerationStats() if stats is None else stats
        tokens, sampling = request.prompt, request.sampling
        use_draft = speculative and self.draft is not None
        self.last_tokens = []
        held, mode = self._contexts[slot]
        n = len(held)
        reused = n if (request.reuse_prefix and mode == use_draft and 0 < n < len(tokens) and tokens[:n] == held) \
            else 0
        self._contexts[slot] = ([], None)  # unknown until the run ends
        if speculative and self.prepare_auto():
            reused = 0  # measuring the cost used the target
        saver = None
        if self.checkpoints is not None and tokens:
            if request.reuse_prefix:
                reused = self._resume(tokens, reused, use_draft, stats, slot)
            saver = self._saver(tokens, reused, use_draft, slot)
        proposer = self.choice.proposer(request, speculative)
        grammar = None
        if sampling is not None and sampling.constraint is not None:
            grammar = sampling.constraint.state(self.grammar_vocab(), self.grammar_drafting)
        request = replace(request, stop_tokens=self._stops(request.stop_tokens))
        return Decoding(self.target, self.draft if use_draft else None, proposer, request, stats,
                        Placement(slot, reused, on_stage, saver), grammar)

    def grammar_vocab(self):
        """The vocabulary as the constraints' grammars see it (built on first use: about a
        second for a large vocabulary)."""
        if self._grammar_vocab is None:
            from .constraints import GrammarVocab

            self._grammar_vocab = GrammarVocab(self.tokenizer, self.target.n_vocab)
        return self._grammar_vocab

    def batch(self, n_batch: Optional[int] = None) -> Batch:
        """An empty decoding.Batch over the engine's target and drafter, where sequences
        from sequence(), each in a slot of its own, run together (dflash-server -np);
        n_batch: the tokens a round takes (-b; None: n_ubatch)."""
        return Batch(self.target, self.draft, n_batch)

    def _resume(self, tokens: List[int], reused: int, use_draft: bool, stats: GenerationStats, slot: int) -> int:
        """Restore the longest checkpointed prefix of `tokens` that beats the context
        already held (at least one prompt token is left to compute: the first new
        token comes from its logits) into the slot; returns the prompt tokens now in context."""
        draft = self.draft if use_draft else None
        found = self.checkpoints.lookup(tokens, len(tokens) - 1, use_draft, above=reused)
        if found is None:
            return reused
        found.restore(self.target, draft, slot)
        device, host = self.checkpoints.chain_bytes(found)
        stats.checkpoint = {"position": found.n_past, "device_bytes": device, "host_bytes": host}
        return found.n_past

    def _saver(self, tokens: List[int], start: int, use_draft: bool, slot: int) -> PrefillSaver:
        draft = self.draft if use_draft else None
        return PrefillSaver(self.checkpoints.positions(len(tokens), start),
                            lambda n: self.checkpoints.save(tokens[:n], self.target, draft, slot))

    def end_sequence(self, seq: Decoding, out: List[int], failed: bool) -> None:
        """A sequence's run ended with `out` emitted: its slot's context is known for the
        next request unless it failed midway (a verify not committed, drafter rows not
        appended: the next request in the slot starts afresh)."""
        self.last_tokens = list(out)
        if failed:
            return
        # every emitted token but the last is in context, unless a stop cut a pass short
        context = seq.tokens.prompt + out[:-1]
        if out and self.target.seq_n_past(seq.slot) == len(context):
            self._contexts[seq.slot] = (context, seq.draft is not None)

    def stream(self, prompt: Prompt, max_tokens: int = 128, *, stop_tokens: Optional[Iterable[int]] = None,
               stop: Sequence[str] = (), speculative: bool = True, sampling: Optional[SamplingParams] = None,
               stats: Optional[GenerationStats] = None, context_full: str = "error",
               corpus: Optional[str] = None) -> Iterator[str]:
        """Yield text pieces as tokens are committed, never splitting a UTF-8 character.
        Generation ends at max_tokens, at a stop token (default: the model's
        end-of-generation tokens; it ends the tokens, its text is not part of the reply), or at a stop string (excluded;
        text that could begin one is held back until it is decided). Pass a
        GenerationStats to read the statistics afterwards.

        context_full: "error" (default) refuses upfront a request whose prompt plus
        max_tokens could overflow the context; "stop" generates until the context is
        full and ends there with stats.stop_reason "context". corpus: the suffix corpus's
        key (Request.corpus)."""
        stats = GenerationStats() if stats is None else stats
        return self._stream(Request(self.encode(prompt), max_tokens, stop_tokens, sampling, context_full,
                                    corpus=corpus), stop, speculative, stats, [])

    def text_stream(self, stop: Sequence[str] = (), stop_tokens: Optional[Iterable[int]] = None) -> "TextStream":
        """The text of a request's tokens as they come (see TextStream)."""
        return TextStream(self.tokenizer.stream_decoder(), stop, self._stops(stop_tokens))

    def _stream(self, request: Request, stop: Sequence[str], speculative: bool, stats: GenerationStats,
                out: List[int]):
        seq = self.sequence(request, speculative=speculative, stats=stats, on_stage=self.stage_hook)
        steps = sequence_steps(seq)
        text = self.text_stream(stop, request.stop_tokens)
        failed = False
        try:
            for new in steps:
                out.extend(new)
                piece = text.push(new)
                if piece:
                    yield piece
                if text.stopped:
                    break
            piece = text.end()
            if piece:
                yield piece
            if text.stop_string is not None:
                stats.stop_reason, stats.stop_string = "stop string", text.stop_string
        except GeneratorExit:  # the consumer stopped at a yield, between steps
            raise
        except BaseException:
            failed = True
            raise
        finally:
            steps.close()
            self.end_sequence(seq, out, failed)

    def generate(self, prompt: Prompt, max_tokens: int = 128, *, stop_tokens: Optional[Iterable[int]] = None,
                 stop: Sequence[str] = (), speculative: bool = True, sampling: Optional[SamplingParams] = None,
                 on_tokens: Optional[Callable[[List[int]], None]] = None, context_full: str = "error",
                 corpus: Optional[str] = None) -> Result:
        """Continuation of `prompt` (text or token ids): greedy, or sampled with
        `sampling` (SamplingParams(temperature, top_k, top_p, min_p, seed)). Ends as
        stream() does (context_full and corpus too); the result's text stops before a
        stop string."""
        stats = GenerationStats()
        request = Request(self.encode(prompt), max_tokens, stop_tokens, sampling, context_full, corpus=corpus)
        if stop:
            out: List[int] = []
            text = "".join(self._stream(request, stop, speculative, stats, out))
            return Result(text, out, stats)
        seq = self.sequence(request, speculative=speculative, stats=stats, on_stage=self.stage_hook)
        steps = sequence_steps(seq)
        out: List[int] = []
        failed = True
        try:
            out = collect(steps, on_tokens)
            failed = False
        finally:
            steps.close()
            self.end_sequence(seq, out, failed)
        return Result(self.tokenizer.decode(self._text_tokens(out, self._stops(stop_tokens))), out, stats)


class TextStream:
    """The text of a request's tokens as they come, never splitting a UTF-8 character: a
    stop token ends the tokens (its text is not part of the reply), a stop string ends
    the text (excluded), and text that could begin a stop string is held back until it
    is decided."""

    def __init__(self, decoder, stop: Sequence[str], stop_tokens: set):
        self.decoder, self.stop, self.stop_tokens = decoder, stop, stop_tokens
        self.pending = ""
        self.stop_string: Optional[str] = None  # the stop string that ended it

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def push(self, tokens: List[int]) -> str:
        """The text the tokens complete that is sure to be part of the reply."""
        if self.stopped:
            return ""
        if tokens and tokens[-1] in self.stop_tokens:
            tokens = tokens[:-1]
        self.pending += self.decoder.push(tokens)
        cut = _find_stop(self.pending, self.stop)
        if cut is not None:
            self.stop_string = _stop_at(self.pending, cut, self.stop)
            out, self.pending = self.pending[:cut], ""
            return out
        keep = partial_marker(self.pending, self.stop)
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out

    def end(self) -> str:
        """The rest, once the tokens have ended."""
        if self.stopped:
            return ""
        self.pending += self.decoder.flush()
        cut = _find_stop(self.pending, self.stop)
        if cut is not None:
            self.stop_string = _stop_at(self.pending, cut, self.stop)
            self.pending = self.pending[:cut]
        out, self.pending = self.pending, ""
        return out


def _find_stop(text: str, stops: Sequence[str]) -> Optional[int]:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def _stop_at(text: str, cut: int, stops: Sequence[str]) -> str:
    """The stop string found at text[cut:] (the longest, when several start there)."""
    return max((s for s in stops if s and text.startswith(s, cut)), key=len)
