"""Quantized attention caches at a 4K context: greedy decoding of the demo target with a
q8_0 or q4_0 KV cache follows the f16 cache's tokens until a near-tie (a top-2 margin of
the f16 logits within twice the cache's logit error), and the logit error stays small.
The prompt is Python source (the standard library's os.py), what the demo was trained on.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from dflash_gguf.runtime.demo import demo_paths
from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig
from dflash_gguf.runtime.tokenizer import Tokenizer

N_CTX, N_PROMPT, N_GEN = 4096, 4000, 40


@pytest.fixture(scope="module")
def runs():
    path = str(demo_paths()[0])
    prompt = Tokenizer(path).encode(Path(os.__file__).read_text() * 4)[:N_PROMPT]
    assert len(prompt) == N_PROMPT
    out = {}
    for kv in ("f16", "q8_0", "q4_0"):
        with Target(path, TargetConfig(n_ctx=N_CTX, n_ubatch=512, kv_type=kv, n_threads=2)) as t:
            t.prefill(prompt, LOGITS_LAST)
            rows, tokens = [t.logits(0, 1)[0].copy()], []
            for _ in range(N_GEN):
                tokens.append(int(np.argmax(rows[-1])))
                t.decode(tokens[-1:], LOGITS_LAST)
                rows.append(t.logits(0, 1)[0].copy())
        out[kv] = (tokens, np.array(rows))
    return out


def compare(runs, kv):
    """(first step where the tokens differ or None, max |logit - f16 logit| over the
    steps both made from the same tokens)."""
    ref_tokens, ref = runs["f16"]
    tokens, rows = runs[kv]
    first = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
    same = N_GEN + 1 if first is None else first + 1
    return first, float(np.abs(rows[:same] - ref[:same]).max())


@pytest.mark.parametrize("kv,bound", [("q8_0", 0.3), ("q4_0", 1.0)])
def test_quantized_kv_greedy_follows_f16_up_to_ties(runs, kv, bound):
    first, err = compare(runs, kv)
    print(f"{kv} KV at {N_PROMPT}+{N_GEN} positions: max logit error {err:.3f} against f16, "
          f"first differing token {first}")
    assert 0 < err < bound
    if first is not None:
        top2 = np.sort(runs["f16"][1][first])[-2:]
        assert top2[1] - top2[0] <= 2 * err, f"{kv} left f16's greedy path at step {first} without a near-tie"


def test_q4_0_errs_more_than_q8_0(runs):
    assert compare(runs, "q8_0")[1] < compare(runs, "q4_0")[1]
