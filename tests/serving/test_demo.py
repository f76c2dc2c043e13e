"""The bundled demo pair (dflash_gguf/data, trained by training/train_demo.py): it ships,
it runs by default, and it accepts: chain speculation beats one token per target pass and
a DDTree beats the chain, with the output still equal to plain greedy decoding."""
from __future__ import annotations

import numpy as np
import pytest

from helpers.cli_run import run
from helpers.loops import greedy_generate, speculative_generate, tree_generate
from helpers.parity import Parity

from dflash_gguf.runtime.demo import DATA, demo_paths
from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.runtime.target import Target, TargetConfig
from dflash_gguf.runtime.tokenizer import Tokenizer

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    '<|im_start|>user\nWrite a function that reverses a list.<|im_end|>\n<|im_start|>assistant\n',
]
N_TOKENS = 96


@pytest.fixture(scope="module")
def demo():
    target_path, draft_path = demo_paths()
    meta = read_draft_metadata(draft_path)
    # matrices in file layout: one rounding for one row and for many (docs/exactness.md)
    target = Target(target_path, TargetConfig(n_ctx=1024, n_verify=17, feature_layers=meta["target_layers"],
                                              repack=False))
    draft = Draft(draft_path, target, DraftConfig(top_k=8))
    return target, draft, Tokenizer(target_path)


def test_demo_pair_ships_in_the_package():
    target, draft = demo_paths()
    assert target.startswith(str(DATA)) and draft.startswith(str(DATA))
    assert (DATA / "README.md").exists()
    meta = read_draft_metadata(draft)
    assert meta["block_size"] >= 4


def test_tree_accepts_more_than_chain_and_both_are_lossless(demo):
    target, draft, tok = demo
    rows = []
    with Parity(target) as parity:
        for text in PROMPTS:
            prompt = tok.encode(text)
            ar, _ = greedy_generate(target, prompt, N_TOKENS)
            chain, chain_stats = speculative_generate(target, draft, prompt, N_TOKENS)
            tree, tree_stats = tree_generate(target, draft, prompt, N_TOKENS, budget=16)
            parity.check(prompt, ar, chain)
            parity.check(prompt, ar, tree)
            rows.append((text, chain_stats.mean_accepted, tree_stats.mean_accepted))
    print("\nprompt | chain AL | tree(16) AL")
    for text, c, t in rows:
        print(f"{text[:40]!r} | {c:.2f} | {t:.2f}")
    chain_al = np.mean([c for _, c, _ in rows])
    tree_al = np.mean([t for _, _, t in rows])
    assert chain_al > 1.5, rows
    assert tree_al > chain_al, rows


def test_dflash_run_defaults_to_the_demo_pair():
    res = run("-n", "48")
    assert res.returncode == 0, res.stderr
    assert "bundled demo" in res.stderr and "accepted  mean" in res.stderr
    assert len(res.stdout) > 20


@pytest.mark.parametrize("cfg,message", [
    (dict(top_k=65), "top_k 65 is outside 0..64"),
    (dict(block_size=-1), "block size -1 is outside"),
    (dict(window=-1), "drafter window -1 is negative"),
    (dict(n_threads=-1), "drafter n_threads -1 is negative"),
])
def test_the_drafter_refuses_a_bad_setting_instead_of_replacing_it(demo, cfg, message):
    """Settings that reach the C library unchecked (Python's own checks bypassed, as a C
    caller would) are refused with what was wrong, never replaced by a default."""
    from dflash_gguf.runtime.native import DflashError
    target, _, _ = demo
    with pytest.raises(DflashError, match=message):
        Draft(demo_paths()[1], target, DraftConfig(**cfg))
