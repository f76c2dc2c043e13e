"""Checks every target architecture passes, shared by the per-architecture test files
(test_architectures.py, test_gemma4.py): each takes a loaded target and drafter and the
architecture's own tokens."""
from __future__ import annotations

import numpy as np

from helpers.fixtures import llama_greedy, read_gguf
from helpers.loops import greedy_generate, speculative_generate, tree_generate

from dflash_gguf.runtime.target import LOGITS_ALL, Target, TargetConfig


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def assert_same_gguf(ours, ref, approx=()):
    """Two GGUFs (ours, llama.cpp's converter's) have the same keys and values (but the
    name), tensor names, types, shapes and bytes; tensors whose names end with one of
    `approx` agree to 1e-6 relative instead. Returns both as read_gguf reads them."""
    ours_kv, ours_t = read_gguf(ours)
    ref_kv, ref_t = read_gguf(ref)
    assert set(ours_kv) == set(ref_kv)
    for key in set(ref_kv) - {"general.name", "general.size_label"}:
        assert ours_kv[key] == ref_kv[key], key
    assert set(ours_t) == set(ref_t)
    for name, (rtype, rshape, rdata) in ref_t.items():
        otype, oshape, odata = ours_t[name]
        assert (otype, oshape) == (rtype, rshape), name
        if name.endswith(tuple(approx)):
            np.testing.assert_allclose(odata, rdata, rtol=1e-6, atol=0, err_msg=name)
        else:
            assert np.array_equal(odata.view(np.uint8), rdata.view(np.uint8)), name
    return (ours_kv, ours_t), (ref_kv, ref_t)


def our_logits(path, tokens):
    """Every row's logits of one plain decode of `tokens` on a fresh target."""
    target = Target(str(path), TargetConfig(n_ctx=256, n_ubatch=128, kv_type="f32"))
    target.decode(tokens, LOGITS_ALL)
    return target.logits(0, len(tokens))


def one_row_logits(target, prompt, tokens):
    """The logits of decoding `tokens` one row at a time after `prompt` (put in as `target`'s
    own prefill puts it), on a fresh target of `target`'s file and settings: what a
    verify's rows must equal bit for bit (docs/exactness.md)."""
    fresh = Target(target.path, target.config)
    try:
        fresh.prefill(prompt, LOGITS_ALL)
        rows = []
        for t in tokens:
            fresh.decode([t], LOGITS_ALL)
            rows.append(np.array(fresh.logits(0, 1)[0]))
        return np.array(rows)
    finally:
        fresh.close()


def assert_tree_verify_matches_each_path(target, target_path, prompt, tokens, after):
    """A 7-node tree over `tokens`: every leaf's path has, bit for bit, the logits of
    decoding that path one row at a time; committing the path 0-2-4 and decoding `after`
    gives the logits of decoding it all so. (A single pass of the whole text is no oracle:
    its many-row kernels round differently from one-row decoding's, by 1e-4 relative on
    an AVX2 CPU with f32 weights.)"""
    parents = [-1, 0, 0, 1, 2, 3, 1]
    target.prefill(prompt, LOGITS_ALL)
    target.verify_tree(tokens, parents)
    tree_logits = target.logits(0, len(tokens))
    for leaf in (4, 5, 6):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        want = one_row_logits(target, prompt, [tokens[i] for i in path])
        assert np.array_equal(tree_logits[path], want), (leaf, float(np.abs(tree_logits[path] - want).max()))
    target.commit_path([0, 2, 4])
    target.decode(after, LOGITS_ALL)
    want = one_row_logits(target, prompt, [tokens[0], tokens[2], tokens[4], *after])[-len(after):]
    got = target.logits(0, len(after))
    assert np.array_equal(got, want), float(np.abs(got - want).max())


def assert_greedy_equals_llama_cpp(target_path, prompts, n_new=24):
    """Our plain greedy continuation of each prompt is llama.cpp's on the same file."""
    target = Target(str(target_path), TargetConfig(n_ctx=256, kv_type="f32"))
    for prompt in prompts:
        ours, _ = greedy_generate(target, prompt, n_new)
        assert llama_greedy(target_path, prompt, n_new) == ours


def assert_chain_and_tree_lossless(target, draft, prompts, n_new=48, budgets=(4, 8)):
    for prompt in prompts:
        ar, _ = greedy_generate(target, prompt, n_new)
        chain, _ = speculative_generate(target, draft, prompt, n_new)
        assert chain == ar
        for budget in budgets:
            tree, _ = tree_generate(target, draft, prompt, n_new, budget)
            assert tree == ar
