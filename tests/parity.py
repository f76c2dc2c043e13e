"""Greedy parity with a tie escape, counted.

Speculative (or reference-loop) output must equal plain greedy output token for token.
Where two runs part, the test passes only if the target's top two logits there are a
floating-point tie (the two computations may round the last bit apart), and only on a
few of a test's sequences: at least three in four must be compared equal to the end, so
that "a tie" cannot cover for a real difference.

    with Parity(target) as parity:
        for prompt in prompts:
            parity.check(prompt, greedy, speculative)
"""
from __future__ import annotations

import numpy as np

from dflash_gguf.target import LOGITS_LAST

TIE = 1e-4


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
    """Counts the sequences a test compares and those that part at a tie."""

    def __init__(self, target, tie: float = TIE):
        self.target, self.tie = target, tie
        self.checked, self.ties = 0, []

    def check(self, prompt, ref, out) -> bool:
        """Assert out == ref, or that they part at a tie; True when they are equal."""
        self.checked += 1
        i = first_divergence(ref, out)
        if i is None:
            return True
        assert i < min(len(ref), len(out)), f"lengths differ: {len(ref)} vs {len(out)}"
        gap = top2_gap(self.target, list(prompt) + list(ref[:i]))
        assert gap < self.tie, f"outputs diverge at token {i} without a tie (top-2 gap {gap:.3g})"
        self.ties.append((self.checked, i, gap))
        return False

    def __enter__(self) -> "Parity":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            assert self.checked > 0, "nothing was compared"
            assert len(self.ties) <= self.checked // 4, (
                f"{len(self.ties)} of {self.checked} sequences parted at a tie (sequence, token, gap): {self.ties}; "
                "fewer than three in four were compared to the end")
