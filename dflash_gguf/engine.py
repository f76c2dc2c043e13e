"""Load a target (and optionally a DFlash drafter) once, generate many times."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Union

from .draft import Draft, DraftConfig, read_draft_metadata
from .generate import GenerationStats, collect, greedy_steps
from .speculative import speculative_steps
from .target import Target, TargetConfig
from .tokenizer import Tokenizer


@dataclass
class Result:
    text: str
    tokens: List[int]
    stats: GenerationStats


class Engine:
    """A target model, its tokenizer and an optional drafter.

    With a drafter, generation is chain speculative decoding with the drafter's block
    size (or `block_size`); without one, plain autoregressive decoding. Both are greedy
    and produce the same tokens.
    """

    def __init__(self, model: str, draft: Optional[str] = None, *, n_ctx: int = 4096, n_ubatch: int = 512,
                 n_threads: int = 0, kv_type: str = "f16", block_size: Optional[int] = None,
                 device: Optional[str] = None, repack: bool = True):
        meta = read_draft_metadata(draft) if draft else None
        if meta and block_size is not None and not 1 <= block_size <= meta["block_size"]:
            raise ValueError(f"block size {block_size} is outside 1..{meta['block_size']} (the drafter's trained size)")
        self.block_size = (block_size or meta["block_size"]) if meta else None
        # the runtime validates the file (architecture, shapes) before llama.cpp reads its vocabulary
        self.target = Target(model, TargetConfig(
            n_ctx=n_ctx, n_ubatch=n_ubatch, n_verify=self.block_size or 1, n_threads=n_threads, kv_type=kv_type,
            feature_layers=meta["target_layers"] if meta else (), device=device, repack=repack))
        self.tokenizer = Tokenizer(model)
        self.draft = Draft(draft, self.target, DraftConfig(n_threads=n_threads)) if draft else None

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

    def _steps(self, prompt, max_tokens, stop_tokens, speculative, stats):
        tokens = self.encode(prompt)
        stops = self.tokenizer.eog_ids if stop_tokens is None else set(stop_tokens)
        if speculative and self.draft is not None:
            return speculative_steps(self.target, self.draft, tokens, max_tokens, stops, self.block_size, stats)
        return greedy_steps(self.target, tokens, max_tokens, stops, stats)

    def generate(self, prompt: Union[str, Sequence[int]], max_tokens: int = 128, *,
                 stop_tokens: Optional[Iterable[int]] = None, speculative: bool = True,
                 on_tokens: Optional[Callable[[List[int]], None]] = None) -> Result:
        """Greedy continuation of `prompt` (text or token ids). Generation ends at
        max_tokens or at a stop token (default: the model's end-of-generation tokens),
        which is included in the result."""
        stats = GenerationStats()
        out = collect(self._steps(prompt, max_tokens, stop_tokens, speculative, stats), on_tokens)
        return Result(self.tokenizer.decode(out), out, stats)

    def stream(self, prompt: Union[str, Sequence[int]], max_tokens: int = 128, *,
               stop_tokens: Optional[Iterable[int]] = None, speculative: bool = True,
               stats: Optional[GenerationStats] = None) -> Iterator[str]:
        """Yield text pieces as tokens are committed, never splitting a UTF-8 character.
        Pass a GenerationStats to read the statistics afterwards."""
        stats = GenerationStats() if stats is None else stats
        decoder = self.tokenizer.stream_decoder()
        for new in self._steps(prompt, max_tokens, stop_tokens, speculative, stats):
            piece = decoder.push(new)
            if piece:
                yield piece
        tail = decoder.flush()
        if tail:
            yield tail
