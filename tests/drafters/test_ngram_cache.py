"""ngram-cache (llama.cpp's --spec-type ngram-cache, its lookup decoding): its drafts against
hand-computed cases of llama.cpp's semantics (common/ngram-cache.cpp: the commonest follower
of the longest of the last 4..1 tokens that passes its thresholds, token by token, at most 8),
then the kind from each entry point on the demo target."""
from __future__ import annotations

from dflash_gguf.speculation.kinds.ngram_cache import NgramCache

from helpers import weightless_kinds as checks


def test_each_token_is_the_longest_passing_n_grams_commonest_follower():
    # (1, 2, 3, 1) -> 2 twice; the last four (2, 3, 1, 2) were followed once (by 3): a
    # 4-gram needs one sample at 50%, so 3, then the drafts extend the n-grams
    assert NgramCache().draft([1, 2, 3, 1, 2, 3, 1, 2], 8) == ([3, 1, 2, 3, 1, 2, 3, 1], 4)
    assert NgramCache().draft([1, 2, 3, 1, 2, 3, 1, 2], 3) == ([3, 1, 2], 4)


def test_a_one_gram_needs_two_agreeing_samples():
    # 5 was followed once (by 6): the 1-gram needs two samples, and no longer n-gram occurred
    assert NgramCache().draft([5, 6, 7, 5], 8) == ([], 0)
    # 5 followed by 6 twice and 7 once: 2/3 = 66.7% >= 66%, drafted
    assert NgramCache().draft([5, 6, 5, 6, 5, 7, 9, 5], 1) == ([6], 1)
    # 5 followed by 6 once and 7 once: 50% < 66%, not drafted
    assert NgramCache().draft([5, 6, 5, 7, 9, 5], 1) == ([], 0)


def test_a_draft_ends_after_eight_tokens():
    cycle = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert len(NgramCache().draft(cycle * 3, 48)[0]) == 8


def test_greedy_equals_plain_and_drafts_are_kept(monkeypatch):
    checks.greedy_equals_plain(monkeypatch, "ngram-cache")


def test_dflash_run_takes_it():
    checks.the_cli_runs_it("ngram-cache")


def test_dflash_server_takes_it(tmp_path):
    checks.the_server_runs_it(tmp_path, "ngram-cache")


def test_dflash_bench_arms_it(tmp_path):
    checks.the_bench_runs_it(tmp_path, "ngram-cache")
