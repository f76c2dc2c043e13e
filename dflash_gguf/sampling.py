"""Sampling the target's distribution, and the speculative rules that keep it exact.

The distribution of a logits row: keep the top_k largest logits (0: all), divide by the
temperature, softmax, keep the smallest set of most likely tokens whose mass reaches
top_p, drop tokens below min_p times the most likely one, renormalise. Temperature 0 is
greedy decoding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities (float64) of each row of `logits` under `params` (not greedy)."""
    x = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    if 0 < params.top_k < x.shape[1]:
        kth = np.partition(x, -params.top_k, axis=1)[:, -params.top_k][:, None]
        x = np.where(x >= kth, x, -np.inf)
    x = x / params.temperature
    x = x - x.max(axis=1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(axis=1, keepdims=True)
    if params.top_p < 1:
        order = np.argsort(-p, axis=1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=1)
        keep_sorted = np.cumsum(sorted_p, axis=1) - sorted_p < params.top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=1)
        p = np.where(keep, p, 0.0)
    if params.min_p > 0:
        p = np.where(p >= params.min_p * p.max(axis=1, keepdims=True), p, 0.0)
    return p / p.sum(axis=1, keepdims=True)


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def draw(self, p: np.ndarray) -> int:
        """A token from the probability vector p."""
        return int(np.searchsorted(np.cumsum(p), self.rng.random() * p.sum(), side="right").clip(0, len(p) - 1))

    def chain_accept(self, drafts: Sequence[int], q: np.ndarray, p: np.ndarray) -> Tuple[int, int]:
        """Speculative rejection sampling of a drafted chain: drafts[i] was drawn from
        q[i]; p[i] is the target's distribution at that position and p[len(drafts)]
        after the last draft. Accept drafts[i] with probability min(1, p/q); at the
        first rejection draw from the normalised residual max(0, p - q) instead.
        Returns (accepted count, the token that follows them); the result is
        distributed exactly as the target's own sampling."""
        for i, tok in enumerate(drafts):
            pi, qi = p[i][tok], q[i][tok]
            if qi > 0 and self.rng.random() * qi < pi:
                continue
            residual = np.maximum(p[i] - q[i], 0.0)
            mass = residual.sum()
            return i, self.draw(residual if mass > 0 else p[i])
        return len(drafts), self.draw(p[len(drafts)])
