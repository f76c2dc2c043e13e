"""Lossless by default on the published models: on tie-prone prompts (a numbered list, a
docstring, numbers, repeated list items, the `def fibonacci(n):` that parted from plain
decoding before ggml's kernels were made batch-invariant), every speculative mode's greedy
text equals plain decoding's token for token, no flag needed and no tie allowed: the
Qwen2.5-Coder 1.5B with its 0.5B drafting or an untrained DFlash drafter, and Gemma 3 270M
drafting for itself. CI runs every mode on the 270M and the issue's draft-simple command on the
1.5B, the first prompt at 16 tokens; experiments/near_tie_hunt.py
--e2e runs all 32 at 256 tokens and writes the results on file."""
from __future__ import annotations

import pytest

from helpers.parity import first_divergence

from dflash_gguf.tools import invariance

pytestmark = pytest.mark.real

N_NEW = 16
# target, its small drafter (draft-simple), the tie-prone prompts CI gives it, the modes CI
# runs on it: every mode on the fast 270M; on the slow 1.5B the issue's own command
# (draft-simple on `def fibonacci(n):`), its near ties being the hunter's (test_near_ties)
PAIRS = {"qwen": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", 1, ("draft-simple",)),
         "gemma": ("gemma-3-270m", "gemma-3-270m", 1, tuple(invariance.E2E_MODES))}
CASES = [(name, mode) for name, (*_, modes) in PAIRS.items() for mode in modes]


@pytest.fixture(scope="module")
def pairs(real_path, tmp_path_factory):
    """Each pair's files, prompts and plain texts, made on first use."""
    made = {}

    def get(name):
        if name not in made:
            target, small, n_prompts, modes = PAIRS[name]
            target, small = str(real_path(target)), str(real_path(small))
            drafters = {"small": small}
            # the untrained DFlash drafter only where a mode drafts with it (writing one for
            # the 1.5B is a minute of CI)
            if any(invariance.E2E_MODES[m].get("draft") == "dflash" for m in modes):
                drafters["dflash"] = invariance.untrained_dflash(
                    target, str(tmp_path_factory.mktemp("dflash") / "untrained.gguf"))
            prompts = invariance.TIE_PRONE_PROMPTS[:n_prompts]
            made[name] = {"target": target, "drafters": drafters, "prompts": prompts,
                          "plain": invariance.plain_outputs(target, prompts, N_NEW)}
        return made[name]

    return get


@pytest.mark.parametrize("name,mode", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_every_mode_keeps_plain_greedy_text(pairs, name, mode):
    pair = pairs(name)
    got = invariance.mode_outputs(mode, pair["target"], pair["drafters"], pair["prompts"], N_NEW)
    for prompt, want, out in zip(pair["prompts"], pair["plain"], got):
        assert out == want, f"{mode} on {prompt!r}: parts from plain decoding at token {first_divergence(want, out)}"
