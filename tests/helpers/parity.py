"""Greedy parity, with no tie allowed.

Speculative (or reference-loop) output must equal plain greedy output token for token:
ggml's CPU kernels are batch-invariant here (dflash_gguf/data/ggml-patches), so a verify's
row computes bit for bit what a one-row decode computes, and no "floating-point tie" can
excuse a difference. Where two runs part, the failure names the token and the target's
top-2 gap there, which tells a near tie (a kernel that is not batch-invariant) from a
logic error.

    with Parity(target) as parity:
        for prompt in prompts:
            parity.check(prompt, greedy, speculative)
"""
from __future__ import annotations

import numpy as np

from dflash_gguf.runtime.target import LOGITS_LAST


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(target, tokens) -> float:
    """The target's top-1 minus top-2 logit after `tokens`."""
    target.reset()
    target.prefill(tokens, LOGITS_LAST)
    top2 = np.sort(target.logits(0, 1)[0])[-2:]
    return float(top2[1] - top2[0])


class Parity:
    """Asserts each compared sequence equal to its reference, and that some were compared."""

    def __init__(self, target):
        self.target = target
        self.checked = 0

    def check(self, prompt, ref, out) -> None:
        """Assert out == ref token for token."""
        self.checked += 1
        i = first_divergence(ref, out)
        if i is None:
            return
        if i >= min(len(ref), len(out)):
            raise AssertionError(f"sequence {self.checked}: lengths differ: {len(ref)} vs {len(out)}")
        gap = top2_gap(self.target, list(prompt) + list(ref[:i]))
        raise AssertionError(f"sequence {self.checked} diverges at token {i}: {ref[i]} expected, {out[i]} "
                             f"produced (the target's top-2 gap there: {gap:.4g})")

    def __enter__(self) -> "Parity":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            assert self.checked > 0, "nothing was compared"
