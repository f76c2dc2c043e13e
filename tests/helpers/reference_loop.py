"""Helpers for running z-lab's reference loop (dflash.model.dflash_generate) exactly on a
Qwen3.5 target; used by the tests that compare with the reference loop."""
from __future__ import annotations

from types import SimpleNamespace

import torch


class History:
    """Stands in for the target's cache in the reference loop: the committed tokens."""

    def __init__(self):
        self.tokens = []

    def get_seq_length(self):
        return len(self.tokens)

    def crop(self, n):
        if n < 0:
            del self.tokens[n:]


class RecomputingTarget:
    """The transformers target for z-lab's reference loop, recomputed from the full token
    history at every call. transformers' cache crop does not roll back Gated DeltaNet
    recurrent state (the stock loop leaves plain greedy within a few tokens on a Qwen3.5
    target), so the oracle gets an exact target instead; the loop itself is untouched."""

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.device = torch.device("cpu")
        self.lm_head = model.lm_head

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def __call__(self, input_ids, past_key_values, logits_to_keep=0, output_hidden_states=False, **_):
        new = input_ids[0].tolist()
        past_key_values.tokens.extend(new)
        with torch.no_grad():
            out = self.model(torch.tensor([past_key_values.tokens]), output_hidden_states=output_hidden_states)
        keep = logits_to_keep or len(new)
        hidden = tuple(h[:, -len(new):] for h in out.hidden_states) if output_hidden_states else None
        return SimpleNamespace(logits=out.logits[:, -keep:], hidden_states=hidden)


def exact_reference(ref) -> None:
    """Make `ref` (the dflash.model module) run on CPU with an exact Qwen3.5 target:
    time with perf_counter instead of CUDA events, and give hybrid targets a History
    instead of a transformers cache (wrap the target in RecomputingTarget)."""
    import time

    ref._cuda_time = time.perf_counter
    make_cache = ref._make_cache
    ref._make_cache = lambda cfg: History() if "linear_attention" in (getattr(cfg, "layer_types", None) or []) \
        else make_cache(cfg)

