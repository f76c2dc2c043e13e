"""Load a target (and optionally a drafter: DFlash, or the target's own MTP layer) once,
generate many times."""
from __future__ import annotations

import gc
from dataclasses import replace
from operator import attrgetter
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Union

from ..chat.templates import EngineTemplates
from ..decoding.requests import GenerationStats, Request, check_request
from ..decoding.sampling import SamplingParams
from ..decoding.step import Batch, Sequence as Decoding
from ..decoding.streaming import Result, TextStream, reply_tokens, run_tokens, stream_text
from ..runtime.checkpoints import PrefixCheckpoints
from ..speculation.choice import ProposerChoice
from .loading import LoadedModels
from .options import EngineOptions
from .setup import AUTO_MAX_BUDGET, EngineSetup
from .slots import SlotContexts

__all__ = ["Engine", "EngineOptions", "EngineSetup", "Result"]

Prompt = Union[str, Sequence[int]]


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
    completed: "prefill start" when the prompt starts going in (GenerationStats'
    prompt_in_slot counts its tokens in), "prefill chunk" after each chunk of it, "prefilled" after
    the prompt, then per step "drafted", "verified",
    "committed" (speculative) or "decoded" (plain). It is for tests and
    instrumentation: an exception it raises ends the call like any error inside the
    step would.
    """

    AUTO_MAX_BUDGET = AUTO_MAX_BUDGET

    def __init__(self, model: str, draft: Optional[str] = None, *, memory_limit_mib: Optional[int] = None,
                 exact: str = "report", options: Optional[EngineOptions] = None, **keywords):
        """`options`: the typed options (options.EngineOptions), or `keywords`, made into
        them (EngineOptions.of): n_ctx, n_ubatch, n_threads, kv_type, kv_type_v,
        block_size, tree_budget, draft_top_k, device, repack, n_gpu_layers, draft_window,
        draft_p_min, chain_rule, n_seq (sequences held at once, each in a slot of n_ctx
        positions: see sequence()), spec_type (llama.cpp's --spec-type kinds, a comma list
        or a sequence: "draft-dflash", "draft-eagle3" (`draft` an EAGLE3 drafter),
        "draft-mtp" (the MTP layer of `model` itself, no `draft`), "draft-simple" (`draft` a
        smaller model of the target's vocabulary, drafting token by token: speculation/draft_simple.py),
        the weightless kinds (speculation/kinds/: "ngram-simple", "ngram-mod", "suffix"
        (SuffixDecoding: trees from the request's own text and earlier requests'), ...); None:
        the drafter's own kind (draft-simple for a model GGUF), or plain decoding without one),
        spec_draft_n_max (the n-gram kinds' longest draft, MTP's, EAGLE3's and draft-simple's
        drafts per step; the DFlash block when block_size is left out), spec_draft_n_min,
        n_ctx_draft and n_gpu_layers_draft (draft-simple's shortest chain, its context (0: n_ctx)
        and its layers on the device), spec_draft_vocab (draft-simple's or a DFlash
        drafter's head cut to that many tokens, FR-Spec: cheaper drafts, never a token
        outside them; 0: the kept set a DFlash file carries, else all),
        spec_draft_vocab_from (files or directories of text whose commonest tokens the cut
        keeps; default: the lowest ids),
        spec_draft_conf_min, each weightless kind's options under its flag's name
        (spec_ngram_simple_size_n, spec_suffix_cache_mb, ...: speculation/kinds/);
        override_tensor ("PATTERN=DEVICE" strings or (pattern, device) pairs: weights
        whose GGUF name matches on that device, the first match deciding), cpu_moe and
        n_cpu_moe (routed experts of every layer, or of the first n layers, on the CPU),
        and override_tensor_draft, cpu_moe_draft, n_cpu_moe_draft for the drafter
        (runtime/placement.py); kv_type and draft_window default to "auto" (see memory.settle).

        `exact`: whether greedy speculation is bit-identical to plain decoding on the
        devices the target runs on, asked of them at load (runtime/exactness.py) and kept
        as `Engine.exact`: "report" (default) asks and reports, "require" refuses to load
        (ConfigError "exact") unless the answer is yes, "off" does not ask."""
        if options is None:
            options = EngineOptions.of(**keywords)
        elif keywords:
            raise TypeError(f"options given, and keywords besides: {', '.join(sorted(keywords))}")
        self.models = LoadedModels(model, draft, options, memory_limit_mib, exact)
        self.last_tokens: List[int] = []  # every token the last call generated
        self.slots = SlotContexts(self.models, self.target.n_seq)
        self.stage_hook: Optional[Callable[[str], None]] = None
        self.templates = EngineTemplates(self.tokenizer)
        # grammar-aware drafting for constrained requests (constraints.GrammarState.drafting)
        self.grammar_drafting = True
        # suffix: the engine's corpora of earlier requests, one per Request.corpus key
        self.suffix_corpora = self.setup.weightless.corpora()
        # each request's proposer, and what `auto` and the weightless kinds' pricing learn
        # across requests (the verify cost table, per sampling regime the last sequence's)
        self.choice = ProposerChoice(self)

    # -- its parts' attributes, under the engine's names (read-only) ------------------------
    # what it was loaded with (loading.LoadedModels)
    setup = property(attrgetter("models.setup"))
    memory_plan = property(attrgetter("models.memory_plan"))
    target = property(attrgetter("models.target"))
    tokenizer = property(attrgetter("models.tokenizer"))
    draft = property(attrgetter("models.draft"), doc="The DFlash-family drafter (or the target's MTP layer), if any.")
    simple_draft = property(attrgetter("models.simple_draft"), doc="draft-simple's small model, if any.")
    draft_p_min = property(attrgetter("models.draft_p_min"))
    # how its settled setup decodes (config.EngineSetup)
    block_size = property(attrgetter("models.setup.drafting.block_size"))
    tree_budget = property(attrgetter("models.setup.drafting.tree_budget"))
    auto_budget = property(attrgetter("models.setup.drafting.auto_budget"))
    n_threads = property(attrgetter("models.setup.n_threads"))
    chain_rule = property(attrgetter("models.setup.drafting.chain_rule"))
    # runtime/exactness.Exactness: whether greedy speculation is bit-identical to plain
    # decoding where the target runs ("yes", "no (why)", "unverified (why)")
    exact = property(attrgetter("models.exact"))

    @property
    def checkpoints(self) -> Optional[PrefixCheckpoints]:
        """The prefix checkpoints prompts resume from (None: none are kept); settable."""
        return self.slots.checkpoints

    @checkpoints.setter
    def checkpoints(self, store: Optional[PrefixCheckpoints]) -> None:
        self.slots.checkpoints = store

    # -- lifetime -------------------------------------------------------------------
    def close(self) -> None:
        self.choice.flush()
        if self.checkpoints is not None:
            self.checkpoints.clear()
        self.models.close()

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

    def set_chat_template(self, source, name: str = "custom") -> None:
        """Render chats with this template (Jinja source, or a chat.ChatTemplate such as
        one of llama.cpp's built-in ones, chat.builtin.BuiltinTemplate) instead of the GGUF's."""
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
        check_request(self.target, tokens, max_tokens, self.choice.lookahead(speculative), context_full)
        return tokens

    # -- generation ---------------------------------------------------------------------
    def _stops(self, stop_tokens: Optional[Iterable[int]]) -> set:
        return self.tokenizer.eog_ids if stop_tokens is None else set(stop_tokens)

    def prepare_auto(self) -> bool:
        """Measure what `--tree-budget auto` and the weightless kinds' pricing need (the
        verify cost table, cached per model file) now, if not yet: measuring runs graphs
        on the target, which empties every slot. Whether it measured."""
        if not self.choice.measure():
            return False
        self.slots.forget()
        return True

    def held(self, slot: int) -> List[int]:
        """The tokens the slot's context holds (a later prompt extending them continues it)."""
        return self.slots.held(slot)

    def keep_slot(self, slot: int) -> int:
        """Checkpoint the slot's whole context (SlotContexts.keep), before another request
        takes it or while it idles; the tokens kept (0: nothing kept)."""
        return self.slots.keep(slot)

    def sequence(self, request: Request, *, speculative: bool = True, stats: Optional[GenerationStats] = None,
                 slot: int = 0, on_stage: Optional[Callable[[str], None]] = None) -> Decoding:
        """A request (its stop_tokens None: the model's end-of-generation tokens) to decode
        in the given slot of the target's (and drafter's) memory, continuing the context
        the slot holds when the prompt extends it, else resuming the longest checkpointed
        prefix; run it alone (sequence_steps) or with others (decoding.step).
        end_sequence records what it left in the slot."""
        stats = GenerationStats() if stats is None else stats
        use_draft = speculative and self.draft is not None
        self.last_tokens = []
        reused = self.slots.take(slot, request.prompt, use_draft, request.reuse_prefix)
        if speculative and self.prepare_auto():
            reused = 0  # measuring the cost used the target
        placement = self.slots.placement(request, slot, reused, use_draft, stats, on_stage)
        proposer = self.choice.proposer(request, speculative)
        sampling, grammar = request.sampling, None
        if sampling is not None and sampling.constraint is not None:
            grammar = sampling.constraint.state(self.grammar_vocab(), self.grammar_drafting)
        request = replace(request, stop_tokens=self._stops(request.stop_tokens))
        return Decoding(self.target, self.draft if use_draft else None, proposer, request, stats, placement, grammar)

    def grammar_vocab(self):
        """The vocabulary as the constraints' grammars see it (built on first use: about a
        second for a large vocabulary)."""
        return self.models.grammar_vocab()

    def batch(self, n_batch: Optional[int] = None) -> Batch:
        """An empty decoding.Batch over the engine's target and drafter, where sequences
        from sequence(), each in a slot of its own, run together (dflash-server -np);
        n_batch: the tokens a round takes (-b; None: n_ubatch)."""
        return Batch(self.target, self.draft, n_batch)

    def end_sequence(self, seq: Decoding, out: List[int], failed: bool) -> None:
        """A sequence's run ended with `out` emitted: its slot's context is known for the
        next request unless it failed midway (a verify not committed, drafter rows not
        appended: the next request in the slot starts afresh)."""
        self.last_tokens = list(out)
        self.slots.end(seq, out, failed)

    def stream(self, prompt: Prompt, max_tokens: int = 128, *, stop_tokens: Optional[Iterable[int]] = None,
               stop: Sequence[str] = (), speculative: bool = True, sampling: Optional[SamplingParams] = None,
               stats: Optional[GenerationStats] = None, context_full: str = "error",
               corpus: Optional[str] = None, logprobs: Optional[int] = None,
               post_sampling: bool = False) -> Iterator[str]:
        """Yield text pieces as tokens are committed, never splitting a UTF-8 character.
        Generation ends at max_tokens, at a stop token (default: the model's
        end-of-generation tokens; it ends the tokens, its text is not part of the reply), or at a stop string (excluded;
        text that could begin one is held back until it is decided). Pass a
        GenerationStats to read the statistics afterwards.

        context_full: "error" (default) refuses upfront a request whose prompt plus
        max_tokens could overflow the context; "stop" generates until the context is
        full and ends there with stats.stop_reason "context". corpus: the suffix corpus's
        key (Request.corpus); logprobs, post_sampling: as generate()'s, in stats.logprobs
        as tokens come."""
        stats = GenerationStats() if stats is None else stats
        return stream_text(self, Request(self.encode(prompt), max_tokens, stop_tokens, sampling, context_full,
                                         corpus=corpus, logprobs=logprobs, post_sampling=post_sampling),
                           stop, speculative, stats, [])

    def text_stream(self, stop: Sequence[str] = (), stop_tokens: Optional[Iterable[int]] = None) -> TextStream:
        """The text of a request's tokens as they come (see streaming.TextStream)."""
        return TextStream(self.tokenizer.stream_decoder(), stop, self._stops(stop_tokens))

    def generate(self, prompt: Prompt, max_tokens: int = 128, *, stop_tokens: Optional[Iterable[int]] = None,
                 stop: Sequence[str] = (), speculative: bool = True, sampling: Optional[SamplingParams] = None,
                 on_tokens: Optional[Callable[[List[int]], None]] = None, context_full: str = "error",
                 corpus: Optional[str] = None, logprobs: Optional[int] = None,
                 post_sampling: bool = False) -> Result:
        """Continuation of `prompt` (text or token ids): greedy, or sampled with
        `sampling` (SamplingParams(temperature, top_k, top_p, min_p, seed)). Ends as
        stream() does (context_full and corpus too); the result's text stops before a
        stop string. logprobs: the target's log-probability of each token and its
        `logprobs` most likely alternatives, in result.stats.logprobs (decoding/logprobs.py:
        the same under speculation as in plain decoding); post_sampling: those as
        probabilities after the sampling rules instead (logprobs.TokenProb)."""
        stats = GenerationStats()
        request = Request(self.encode(prompt), max_tokens, stop_tokens, sampling, context_full, corpus=corpus,
                          logprobs=logprobs, post_sampling=post_sampling)
        if stop:
            out: List[int] = []
            text = "".join(stream_text(self, request, stop, speculative, stats, out))
            return Result(text, out, stats)
        out = run_tokens(self, request, speculative, stats, on_tokens)
        return Result(self.tokenizer.decode(reply_tokens(out, self._stops(stop_tokens))), out, stats)
