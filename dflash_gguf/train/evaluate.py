"""Acceptance in the loop: our engine decodes held-out prompts greedily with the drafter
as trained so far (written as the GGUF it will ship as) and reports the mean accepted
length per target pass, chain drafting: the number that matters, beside the loss."""
from __future__ import annotations

import numpy as np

from ..decoding.step import Sequence, sequence_steps
from ..runtime.drafter import Draft, DraftConfig
from ..decoding.requests import GenerationStats, Request, collect
from ..speculation.drafting import chain_proposer
from ..runtime.target import Target, TargetConfig


class AcceptanceProbe:
    def __init__(self, target_path: str, layer_ids: list[int], block_size: int, prompts: list[np.ndarray],
                 prompt_len: int, n_tokens: int, threads: int, device: str | None = None):
        self.prompts = [p[:prompt_len].tolist() for p in prompts if len(p) >= 2]
        self.n_tokens, self.block_size = n_tokens, block_size
        self.target = Target(target_path, TargetConfig(
            n_ctx=prompt_len + n_tokens + 2 * block_size + 16, n_verify=block_size, n_threads=threads,
            feature_layers=[i + 1 for i in layer_ids], device=device))

    def measure(self, draft_path: str) -> dict:
        """{"al": mean accepted length (tokens per target pass, the bonus included),
        "steps": target passes, "tokens": tokens decoded} over the held-out prompts."""
        lengths = []
        draft = Draft(draft_path, self.target, DraftConfig(kv_type="f32", n_threads=self.target.config.n_threads))
        try:
            for prompt in self.prompts:
                self.target.reset()
                draft.reset()
                stats = GenerationStats()
                proposer = chain_proposer(self.target, draft, self.block_size, None)
                collect(sequence_steps(Sequence(self.target, draft, proposer, Request(prompt, self.n_tokens, ()),
                                                stats)))
                lengths += stats.accepted_lengths
        finally:
            draft.close()
        al = float(np.mean(lengths)) if lengths else 0.0
        return {"al": al, "steps": len(lengths), "tokens": int(np.sum(lengths)) if lengths else 0}

    def close(self) -> None:
        self.target.close()
