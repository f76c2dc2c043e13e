"""llama-server's `timings` of a request's statistics (decoding.requests.GenerationStats) at
some moment: while its prompt goes in (a stream's progress), as it generates, or at its end."""
from __future__ import annotations

from ..decoding.requests import GenerationStats


def timings_of(s: GenerationStats, speculative: bool) -> dict:
    """The prompt's timings (prompt_n: the tokens computed, so far while it goes in;
    cache_n: those resumed) and the generation's, whose rate leaves out the first token (it
    comes from the prompt's last batch, as llama-server counts it); with `speculative`,
    draft_n and draft_n_accepted."""
    going_in = s.generated_tokens == 0 and s.prompt_in_slot < s.prompt_tokens
    prompt_n = (s.prompt_in_slot if going_in else s.prompt_tokens) - s.reused_tokens
    prompt_ms = s.prefill_seconds * 1e3
    n = s.generated_tokens
    predicted_ms = s.decode_seconds * 1e3
    steps = max(n - 1, 0)
    out = {"cache_n": s.reused_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
           "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
           "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_n and prompt_ms > 0 else 0.0,
           "predicted_n": n, "predicted_ms": predicted_ms,
           "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
           "predicted_per_second": 1e3 / predicted_ms * steps if steps and predicted_ms > 0 else 0.0}
    if speculative:
        out["draft_n"] = sum(s.drafts.drafted.values())
        out["draft_n_accepted"] = sum(s.drafts.accepted.values())
    return out
