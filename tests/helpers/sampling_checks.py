"""What the sampling tests share: chi-square checks against an exact distribution, the
target's own joint probabilities of a few tokens, and each decoding mode run once."""
from __future__ import annotations

import math
import numpy as np
from dflash_gguf.speculation.auto import AutoBudget
from dflash_gguf.decoding.sampling import SamplingParams, distribution, penalize
from dflash_gguf.runtime.target import LOGITS_LAST

from helpers.loops import greedy_generate
from helpers.loops import speculative_generate, tree_generate


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts: dict, probs: dict, n: int):
    """Chi-square statistic and degrees of freedom of observed `counts` against `probs`
    (which may hold an "other" cell for the mass not enumerated: every observation
    outside `probs` counts there), cells with expected < 5 pooled."""
    cells = sorted(probs, key=lambda c: -probs[c])
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for c in cells:
        e = probs[c] * n
        o = counts.get(c, 0) + (sum(v for k, v in counts.items() if k not in probs) if c == "other" else 0)
        if e >= 5:
            obs.append(o)
            exp.append(e)
        else:
            pool_o += o
            pool_e += e
    if "other" not in probs:
        pool_o += sum(v for k, v in counts.items() if k not in probs)
    if pool_e > 0 or pool_o > 0:
        obs.append(pool_o)
        exp.append(max(pool_e, 1e-9))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return stat, len(obs) - 1


def exact_joint(target, prompt, params, depth, floor=2e-4):
    """P(t1..t_depth) of the target's own sampling after `prompt` (penalties over the
    prompt and the prefix), enumerated down to prefixes of probability `floor`; the mass
    below it is the "other" cell."""
    probs = {"other": 0.0}

    def rec(prefix, prob):
        if len(prefix) == depth:
            probs[tuple(prefix)] = prob
            return
        target.reset()
        target.set_sampling(SamplingParams().native())
        target.prefill(prompt + prefix, LOGITS_LAST)
        seen = prompt + prefix
        window = seen[-params.repeat_last_n:] if params.repeat_last_n > 0 else seen
        p = distribution(penalize(target.logits(0, 1)[0], window, params), params)[0]
        for tok in np.flatnonzero(p > 0):
            if prob * p[tok] < floor:
                probs["other"] += prob * p[tok]
            else:
                rec(prefix + [int(tok)], prob * p[tok])

    rec([], 1.0)
    return probs


def run_mode(target, draft, prompt, mode, params, depth):
    if mode == "plain":
        return greedy_generate(target, prompt, depth, sampling=params)[0]
    if mode in ("chain", "reject"):
        return speculative_generate(target, draft, prompt, depth, sampling=params, chain_rule=
                                    "reject" if mode == "reject" else "argmax", p_min=0.3)[0]
    if mode == "tree":
        return tree_generate(target, draft, prompt, depth, budget=6, sampling=params)[0]
    auto = AutoBudget(_LinearCost(), 16, draft.block_size)
    return tree_generate(target, draft, prompt, depth, budget=16, sampling=params, auto=auto)[0]


SETTINGS = {
    "qwen": SamplingParams(0.6, 20, 0.95),
    "full": SamplingParams(1.0),
    "min_p": SamplingParams(0.9, min_p=0.05),
    "presence": SamplingParams(0.8, 20, presence_penalty=1.5),
    "frequency": SamplingParams(1.0, 40, frequency_penalty=1.0, repeat_last_n=8),
    "repeat": SamplingParams(0.7, 30, 0.9, repeat_penalty=1.5),
}


DEPTH = 3


class _LinearCost:
    def __call__(self, n, depth=0):
        return 1e-3 + 1e-4 * np.asarray(n, dtype=float)

    def chain(self, n, depth=0):
        return self(n)
