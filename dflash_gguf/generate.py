"""Plain autoregressive greedy decoding on the target: the baseline every speculative
mode must reproduce token for token."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional

from .target import LOGITS_LAST, Target


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = ""
    accepted_lengths: List[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    commit_seconds: float = 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean tokens produced per target pass (AL)."""
        n = self.accepted_lengths
        return sum(n) / len(n) if n else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


def greedy_generate(target: Target, prompt: List[int], max_tokens: int, stop_tokens: Iterable[int] = (),
                    on_tokens: Optional[Callable[[List[int]], None]] = None):
    """Greedy tokens after `prompt` (the target is reset first). Returns (tokens, stats);
    a stop token ends generation and is included in the result."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if max_tokens < 0:
        raise ValueError("max_tokens must be >= 0")
    stops = set(stop_tokens)
    stats = GenerationStats(prompt_tokens=len(prompt))
    if len(prompt) + max_tokens > target.n_ctx:
        raise ValueError(f"prompt ({len(prompt)}) + max tokens ({max_tokens}) exceed the context size "
                         f"({target.n_ctx}); raise n_ctx or generate fewer tokens")
    target.reset()
    t0 = time.perf_counter()
    target.prefill(prompt, LOGITS_LAST)
    stats.prefill_seconds = time.perf_counter() - t0

    out: List[int] = []
    t0 = time.perf_counter()
    stats.stop_reason = "length"
    while len(out) < max_tokens:
        tok = int(target.argmax(0, 1)[0])
        out.append(tok)
        if on_tokens is not None:
            on_tokens([tok])
        if tok in stops:
            stats.stop_reason = "stop"
            break
        if len(out) == max_tokens:
            break
        target.decode([tok], LOGITS_LAST)
    stats.decode_seconds = time.perf_counter() - t0
    stats.generated_tokens = len(out)
    return out, stats
