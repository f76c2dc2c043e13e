"""Load a target (and optionally a DFlash drafter) once, generate many times."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Union

from .budget import AutoBudget, VerifyCost
from .checkpoints import PrefillSaver, PrefixCheckpoints
from .draft import Draft, DraftConfig, read_draft_metadata
from .generate import GenerationStats, autoregressive_steps, check_request, collect
from .memory import refusal, settle
from .sampling import SamplingParams
from .speculative import DEFAULT_CHAIN_RULE, check_chain_rule, check_p_min, default_p_min, speculative_steps, tree_steps
from .target import Target, TargetConfig
from .tokenizer import Tokenizer

Prompt = Union[str, Sequence[int]]


@dataclass
class Result:
    text: str
    tokens: List[int]
    stats: GenerationStats


@dataclass
class EngineSetup:
    """What an Engine loads, derived and checked from its options before anything is
    loaded (also what the memory plan is made of)."""

    block_size: Optional[int]
    tree_budget: Optional[int]
    auto_budget: bool
    target_config: TargetConfig
    draft_config: Optional[DraftConfig]
    n_threads: int
    draft_p_min: Optional[float] = None  # None: speculative.default_p_min of the loaded target
    chain_rule: str = DEFAULT_CHAIN_RULE  # a sampled chain's accept rule (speculative.speculative_steps)

    @classmethod
    def of(cls, model: str, draft: Optional[str] = None, *, n_ctx: int = 4096, n_ubatch: int = 512,
           n_threads: int = 0, kv_type: str = "f16", kv_type_v: Optional[str] = None,
           block_size: Optional[int] = None, tree_budget: Union[int, str, None] = None,
           draft_top_k: int = 8, device: Optional[str] = None, repack: bool = True,
           n_gpu_layers: int = -1, draft_window: int = 0,
           draft_p_min: Optional[float] = None, chain_rule: str = DEFAULT_CHAIN_RULE) -> "EngineSetup":
        meta = read_draft_metadata(draft) if draft else None
        if meta and block_size is not None and not 1 <= block_size <= meta["block_size"]:
            raise ValueError(f"block size {block_size} is outside 1..{meta['block_size']} (the drafter's trained size)")
        block = (block_size or meta["block_size"]) if meta else None
        auto = tree_budget == "auto"
        if tree_budget is not None and not auto:
            if isinstance(tree_budget, str) or not 1 <= int(tree_budget) <= 63:
                raise ValueError(f"tree budget must be 1..63 or 'auto', got {tree_budget!r}")
        budget = (Engine.AUTO_MAX_BUDGET if auto else tree_budget) if meta else None
        if draft_window < 0:
            raise ValueError(f"draft window must be >= 0 (0: the whole context), got {draft_window}")
        if budget is not None and not 1 <= draft_top_k <= 64:
            raise ValueError(f"draft top-k must be 1..64, got {draft_top_k}")
        if draft_p_min is not None:
            check_p_min(draft_p_min)
        check_chain_rule(chain_rule)
        n_verify = max(block or 1, (budget or 0) + 1)
        target_config = TargetConfig(
            n_ctx=n_ctx, n_ubatch=n_ubatch, n_verify=n_verify, n_threads=n_threads, kv_type=kv_type,
            kv_type_v=kv_type_v, feature_layers=meta["target_layers"] if meta else (), device=device,
            repack=repack, n_gpu_layers=n_gpu_layers)
        # a chain cut by p_min reads its drafts' probabilities: the drafter ranks one candidate
        top_k = draft_top_k if budget else (0 if draft_p_min == 0 else 1)
        draft_config = DraftConfig(n_threads=n_threads, top_k=top_k, window=draft_window) if draft else None
        return cls(block, budget, auto, target_config, draft_config, n_threads, draft_p_min, chain_rule)


class Engine:
    """A target model, its tokenizer and an optional drafter.

    With a drafter, generation is speculative: a chain of the drafter's block size (or
    `block_size`), or with `tree_budget` a DDTree of that many nodes ("auto": sized
    every step for the best expected speed, up to AUTO_MAX_BUDGET). A greedy chain
    (also auto's) stops before the first draft the drafter gives less than
    `draft_p_min` (speculative.chain_length; 0: the whole block; None: as
    speculative.default_p_min chooses for the device). Without a drafter, plain
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

    AUTO_MAX_BUDGET = 32

    def __init__(self, model: str, draft: Optional[str] = None, *, memory_limit_mib: Optional[int] = None,
                 **options):
        """`options` are EngineSetup's: n_ctx, n_ubatch, n_threads, kv_type, kv_type_v,
        block_size, tree_budget, draft_top_k, device, repack, n_gpu_layers, draft_window,
        draft_p_min, chain_rule;
        kv_type and draft_window default to "auto" (see memory.settle)."""
        # planned from metadata before anything is allocated: "auto" options are chosen
        # to fit, and a configuration that does not fit the device (or memory_limit_mib)
        # is refused with what would fit
        setup, self.memory_plan, over = settle(model, draft, options, memory_limit_mib)
        if over:
            raise refusal(model, draft, setup, self.memory_plan, over, memory_limit_mib)
        self.setup = setup
        self.block_size, self.tree_budget, self.auto_budget = setup.block_size, setup.tree_budget, setup.auto_budget
        target_config, draft_config, n_threads = setup.target_config, setup.draft_config, setup.n_threads
        # the runtime validates the file (architecture, shapes) before llama.cpp reads its vocabulary
        self.target = Target(model, target_config)
        self.draft_p_min = default_p_min(self.target) if setup.draft_p_min is None else setup.draft_p_min
        if draft_config is not None and self.tree_budget is None and self.draft_p_min == 0:
            # a chain that is never cut reads no probabilities: its proposes rank nothing
            draft_config = replace(draft_config, top_k=0)
        try:
            self.tokenizer = Tokenizer(model)
            self.draft = Draft(draft, self.target, draft_config) if draft else None
        except BaseException:
            self.target.close()
            raise
        self.n_threads = n_threads
        self.chain_rule = setup.chain_rule
        # what `auto` learnt, kept across requests: per sampling setting, whose acceptance
        # (and step cost) differ from greedy's
        self._autos: Dict[Optional[tuple], AutoBudget] = {}
        self.last_tokens: List[int] = []  # every token the last call generated
        self._context: List[int] = []  # tokens the target (and drafter) context holds
        self._context_mode: Optional[bool] = None  # speculative or not, when it was filled
        self.stage_hook: Optional[Callable[[str], None]] = None
        self.checkpoints: Optional[PrefixCheckpoints] = None
        self._chat_template = None  # set_chat_template's
        self._gguf_templates: dict = {}  # compiled on first use

    # -- lifetime -------------------------------------------------------------------
    def close(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.clear()
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
        from .chat import DEFAULT, ChatTemplate, gguf_templates

        if self._chat_template is not None:
            return self._chat_template
        found = gguf_templates(self.tokenizer)
        name = "tool_use" if tools and "tool_use" in found else DEFAULT
        if name not in found:
            raise ValueError("the model has no chat template (tokenizer.chat_template); give one "
                             "(dflash-run / dflash-server --chat-template-file)")
        if name not in self._gguf_templates:
            self._gguf_templates[name] = ChatTemplate.of_tokenizer(self.tokenizer, found[name], name)
        return self._gguf_templates[name]

    def set_chat_template(self, source: str, name: str = "custom") -> None:
        """Render chats with this template (Jinja source) instead of the GGUF's."""
        from .chat import ChatTemplate

        self._chat_template = ChatTemplate.of_tokenizer(self.tokenizer, source, name)

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
        check_request(self.target, tokens, max_tokens, lookahead, context_full)
        return tokens

    # -- generation ---------------------------------------------------------------------
    def _stops(self, stop_tokens: Optional[Iterable[int]]) -> set:
        return self.tokenizer.eog_ids if stop_tokens is None else set(stop_tokens)

    def _text_tokens(self, tokens: List[int], stops: set) -> List[int]:
        """The tokens whose text is the reply: a stop token ends it without being part of it."""
        return tokens[:-1] if tokens and tokens[-1] in stops else tokens

    def _steps(self, tokens, max_tokens, stop_tokens, speculative, sampling, stats, context_full):
        stops = self._stops(stop_tokens)
        hook = self.stage_hook
        use_draft = speculative and self.draft is not None
        n = len(self._context)
        reused = n if (self._context_mode == use_draft and 0 < n < len(tokens) and tokens[:n] == self._context) else 0
        self._context, self._context_mode = [], None  # unknown until the run ends
        auto = None
        if use_draft and self.tree_budget and self.auto_budget:
            key = _sampling_regime(sampling)
            if key not in self._autos:
                cost = next(iter(self._autos.values())).cost if self._autos else None
                if cost is None:
                    cost = VerifyCost(self.target, self.n_threads)
                    reused = 0  # measuring the cost used the target
                self._autos[key] = AutoBudget(cost, self.tree_budget, self.block_size or self.draft.block_size)
            auto = self._autos[key]
        saver = None
        if self.checkpoints is not None and tokens:
            reused = self._resume(tokens, reused, use_draft, stats)
            saver = self._saver(tokens, reused, use_draft)
        if use_draft and self.tree_budget:
            return tree_steps(self.target, self.draft, tokens, max_tokens, stops, self.tree_budget, self.block_size,
                              stats, auto, sampling, reused, context_full, hook, saver,
                              self.draft_p_min), use_draft
        if use_draft:
            return speculative_steps(self.target, self.draft, tokens, max_tokens, stops, self.block_size, stats,
                                     sampling, reused, context_full, hook, saver, self.draft_p_min,
                                     self.chain_rule), use_draft
        return autoregressive_steps(self.target, tokens, max_tokens, stops, stats, sampling, reused, context_full,
                                    hook, saver), use_draft

    def _resume(self, tokens: List[int], reused: int, use_draft: bool, stats: GenerationStats) -> int:
        """Restore the longest checkpointed prefix of `tokens` that beats the context
        already held (at least one prompt token is left to compute: the first new
        token comes from its logits); returns the prompt tokens now in context."""
        draft = self.draft if use_draft else None
        found = self.checkpoints.lookup(tokens, len(tokens) - 1, use_draft, above=reused)
        if found is None:
            return reused
        found.restore(self.target, draft)
        device, host = self.checkpoints.chain_bytes(found)
        stats.checkpoint = {"position": found.n_past, "device_bytes": device, "host_bytes": host}
        return found.n_past

    def _saver(self, tokens: List[int], start: int, use_draft: bool) -> PrefillSaver:
        draft = self.draft if use_draft else None
        return PrefillSaver(self.checkpoints.positions(len(tokens), start),
                            lambda n: self.checkpoints.save(tokens[:n], self.target, draft))

    def _finish(self, tokens: List[int], out: List[int], use_draft: bool, failed: bool) -> None:
        self.last_tokens = list(out)
        if failed:
            # the step may have stopped anywhere (a verify not committed, drafter rows not
            # appended): the context stays unknown, so the next call resets it
            return
        # every emitted token but the last is in context, unless a stop cut a pass short
        context = tokens + out[:-1]
        if out and self.target.n_past == len(context):
            self._context, self._context_mode = context, use_draft

    def stream(self, prompt: Prompt, max_tokens: int = 128, *, stop_tokens: Optional[Iterable[int]] = None,
               stop: Sequence[str] = (), speculative: bool = True, sampling: Optional[SamplingParams] = None,
               stats: Optional[GenerationStats] = None, context_full: str = "error") -> Iterator[str]:
        """Yield text pieces as tokens are committed, never splitting a UTF-8 character.
        Generation ends at max_tokens, at a stop token (default: the model's
        end-of-generation tokens; it ends the tokens, its text is not part of the reply), or at a stop string (excluded;
        text that could begin one is held back until it is decided). Pass a
        GenerationStats to read the statistics afterwards.

        context_full: "error" (default) refuses upfront a request whose prompt plus
        max_tokens could overflow the context; "stop" generates until the context is
        full and ends there with stats.stop_reason "context"."""
        stats = GenerationStats() if stats is None else stats
        return self._stream(prompt, max_tokens, stop_tokens, stop, speculative, sampling, stats, [], context_full)

    def _stream(self, prompt, max_tokens, stop_tokens, stop, speculative, sampling, stats, out: List[int],
                context_full="error"):
        tokens = self.encode(prompt)
        steps, use_draft = self._steps(tokens, max_tokens, stop_tokens, speculative, sampling, stats, context_full)
        stops = self._stops(stop_tokens)
        decoder = self.tokenizer.stream_decoder()
        pending = ""
        failed = False
        try:
            for new in steps:
                out.extend(new)
                pending += decoder.push(self._text_tokens(new, stops))
                cut = _find_stop(pending, stop)
                if cut is not None:
                    if pending[:cut]:
                        yield pending[:cut]
                    stats.stop_reason, stats.stop_string = "stop string", _stop_at(pending, cut, stop)
                    return
                keep = _stop_prefix_len(pending, stop)
                if len(pending) > keep:
                    yield pending[:len(pending) - keep]
                    pending = pending[len(pending) - keep:]
            pending += decoder.flush()
            cut = _find_stop(pending, stop)
            if cut is not None:
                stats.stop_reason, stats.stop_string = "stop string", _stop_at(pending, cut, stop)
                pending = pending[:cut]
            if pending:
                yield pending
        except GeneratorExit:  # the consumer stopped at a yield, between steps
            raise
        except BaseException:
            failed = True
            raise
        finally:
            steps.close()
            self._finish(tokens, out, use_draft, failed)

    def generate(self, prompt: Prompt, max_tokens: int = 128, *, stop_tokens: Optional[Iterable[int]] = None,
                 stop: Sequence[str] = (), speculative: bool = True, sampling: Optional[SamplingParams] = None,
                 on_tokens: Optional[Callable[[List[int]], None]] = None, context_full: str = "error") -> Result:
        """Continuation of `prompt` (text or token ids): greedy, or sampled with
        `sampling` (SamplingParams(temperature, top_k, top_p, min_p, seed)). Ends as
        stream() does (context_full too); the result's text stops before a stop string."""
        stats = GenerationStats()
        if stop:
            out: List[int] = []
            text = "".join(self._stream(prompt, max_tokens, stop_tokens, stop, speculative, sampling, stats, out,
                                        context_full))
            return Result(text, out, stats)
        tokens = self.encode(prompt)
        steps, use_draft = self._steps(tokens, max_tokens, stop_tokens, speculative, sampling, stats, context_full)
        out: List[int] = []
        failed = True
        try:
            out = collect(steps, on_tokens)
            failed = False
        finally:
            steps.close()
            self._finish(tokens, out, use_draft, failed)
        return Result(self.tokenizer.decode(self._text_tokens(out, self._stops(stop_tokens))), out, stats)


def _sampling_regime(sampling: Optional[SamplingParams]) -> Optional[tuple]:
    """What `auto`'s expectations depend on in a request's sampling: greedy (None), or
    the filters and temperature that shape the target's draws."""
    if sampling is None or sampling.greedy:
        return None
    return (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)


def _find_stop(text: str, stops: Sequence[str]) -> Optional[int]:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def _stop_at(text: str, cut: int, stops: Sequence[str]) -> str:
    """The stop string found at text[cut:] (the longest, when several start there)."""
    return max((s for s in stops if s and text.startswith(s, cut)), key=len)


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
