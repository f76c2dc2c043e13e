"""Load a target (and optionally a DFlash drafter) once, generate many times."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Union

from .draft import Draft, DraftConfig, read_draft_metadata
from .generate import GenerationStats, autoregressive_steps, collect
from .sampling import SamplingParams
from .budget import VerifyCost
from .speculative import speculative_steps, tree_steps
from .target import Target, TargetConfig
from .tokenizer import Tokenizer


@dataclass
class Result:
    text: str
    tokens: List[int]
    stats: GenerationStats


class Engine:
    """A target model, its tokenizer and an optional drafter.

    With a drafter, generation is speculative: a chain of the drafter's block size (or
    `block_size`), or with `tree_budget` a DDTree of that many nodes ("auto": sized
    every step for the best expected speed, up to AUTO_MAX_BUDGET). Without one, plain
    autoregressive decoding. All are greedy and produce the same tokens.
    """

    AUTO_MAX_BUDGET = 32

    def __init__(self, model: str, draft: Optional[str] = None, *, n_ctx: int = 4096, n_ubatch: int = 512,
                 n_threads: int = 0, kv_type: str = "f16", block_size: Optional[int] = None,
                 tree_budget: Union[int, str, None] = None, draft_top_k: int = 8,
                 device: Optional[str] = None, repack: bool = True):
        meta = read_draft_metadata(draft) if draft else None
        if meta and block_size is not None and not 1 <= block_size <= meta["block_size"]:
            raise ValueError(f"block size {block_size} is outside 1..{meta['block_size']} (the drafter's trained size)")
        self.block_size = (block_size or meta["block_size"]) if meta else None
        self.auto_budget = tree_budget == "auto"
        if tree_budget is not None and not self.auto_budget:
            if isinstance(tree_budget, str) or not 1 <= int(tree_budget) <= 63:
                raise ValueError(f"tree budget must be 1..63 or 'auto', got {tree_budget!r}")
        self.tree_budget = (self.AUTO_MAX_BUDGET if self.auto_budget else tree_budget) if meta else None
        if self.tree_budget is not None and not 1 <= draft_top_k <= 64:
            raise ValueError(f"draft top-k must be 1..64, got {draft_top_k}")
        n_verify = max(self.block_size or 1, (self.tree_budget or 0) + 1)
        # the runtime validates the file (architecture, shapes) before llama.cpp reads its vocabulary
        self.target = Target(model, TargetConfig(
            n_ctx=n_ctx, n_ubatch=n_ubatch, n_verify=n_verify, n_threads=n_threads, kv_type=kv_type,
            feature_layers=meta["target_layers"] if meta else (), device=device, repack=repack))
        self.tokenizer = Tokenizer(model)
        try:
            top_k = draft_top_k if self.tree_budget else 0
            self.draft = Draft(draft, self.target, DraftConfig(n_threads=n_threads, top_k=top_k)) if draft else None
        except BaseException:
            self.target.close()
            raise
        self.n_threads = n_threads
        self._cost = None

    # -- lifetime -------------------------------------------------------------------
    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
            self.draft = None
        self.target.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- generation -------------------------------------------------------------------
    def encode(self, prompt: Union[str, Sequence[int]]) -> List[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]

    def chat_prompt(self, user: str, system: Optional[str] = None) -> str:
        """`user` (and `system`) rendered with the model's chat template, ready to generate."""
        from .chat import render_chat

        return render_chat(self.tokenizer.chat_template, user, system)

    def _steps(self, prompt, max_tokens, stop_tokens, speculative, sampling, stats):
        tokens = self.encode(prompt)
        stops = self.tokenizer.eog_ids if stop_tokens is None else set(stop_tokens)
        if speculative and self.draft is not None and self.tree_budget:
            if self.auto_budget and self._cost is None:
                self._cost = VerifyCost(self.target, self.n_threads)
            return tree_steps(self.target, self.draft, tokens, max_tokens, stops, self.tree_budget, self.block_size,
                              stats, self._cost, sampling)
        if speculative and self.draft is not None:
            return speculative_steps(self.target, self.draft, tokens, max_tokens, stops, self.block_size, stats,
                                     sampling)
        return autoregressive_steps(self.target, tokens, max_tokens, stops, stats, sampling)

    def generate(self, prompt: Union[str, Sequence[int]], max_tokens: int = 128, *,
                 stop_tokens: Optional[Iterable[int]] = None, speculative: bool = True,
                 sampling: Optional[SamplingParams] = None,
                 on_tokens: Optional[Callable[[List[int]], None]] = None) -> Result:
        """Continuation of `prompt` (text or token ids): greedy, or sampled with
        `sampling` (SamplingParams(temperature, top_k, top_p, min_p, seed)). Generation
        ends at max_tokens or at a stop token (default: the model's end-of-generation
        tokens), which is included in the result."""
        stats = GenerationStats()
        out = collect(self._steps(prompt, max_tokens, stop_tokens, speculative, sampling, stats), on_tokens)
        return Result(self.tokenizer.decode(out), out, stats)

    def stream(self, prompt: Union[str, Sequence[int]], max_tokens: int = 128, *,
               stop_tokens: Optional[Iterable[int]] = None, speculative: bool = True,
               sampling: Optional[SamplingParams] = None,
               stats: Optional[GenerationStats] = None) -> Iterator[str]:
        """Yield text pieces as tokens are committed, never splitting a UTF-8 character.
        Pass a GenerationStats to read the statistics afterwards."""
        stats = GenerationStats() if stats is None else stats
        decoder = self.tokenizer.stream_decoder()
        for new in self._steps(prompt, max_tokens, stop_tokens, speculative, sampling, stats):
            piece = decoder.push(new)
            if piece:
                yield piece
        tail = decoder.flush()
        if tail:
            yield tail
