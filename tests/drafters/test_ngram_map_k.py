"""ngram-map-k (llama.cpp's --spec-type ngram-map-k): its lookup against hand-computed
cases of llama.cpp's semantics (common/ngram-map.cpp, docs/speculative.md), then the
kind from each entry point on the demo target (helpers/weightless_kinds.py)."""
from __future__ import annotations

from dflash_gguf.speculation.kinds.ngram_map_k import NgramMap, NgramMapKOptions

from helpers import weightless_kinds as checks

FLAGS = ("--spec-ngram-map-k-size-n", "3", "--spec-ngram-map-k-size-m", "8")


def test_the_key_drafts_the_m_gram_after_its_latest_occurrence():
    history = [1, 2, 3, 4, 1, 2, 5, 6, 7, 1, 2]
    # (1, 2) occurred at 0 and 4, each followed by a whole 2-gram: the latest's is drafted
    assert NgramMap(2, 2, 1).draft(history, 8) == ([5, 6], 2)
    assert NgramMap(2, 2, 1).draft(history, 1) == ([5], 2)  # cut to the longest draft
    assert NgramMap(2, 6, 1).draft(history, 8) == ([3, 4, 1, 2, 5, 6], 2)  # 6 whole tokens after 0 only
    assert NgramMap(2, 2, 2).draft(history, 8) == ([5, 6], 2)  # two hits: enough
    assert NgramMap(2, 2, 3).draft(history, 8) == ([], 0)  # a third is wanted
    assert NgramMap(2, 2, 1).draft(history + [9], 8) == ([], 0)  # (2, 9) never occurred


def test_a_refuted_draft_limits_its_keys_next_drafts():
    """llama.cpp stores, per key, the tokens the target accepted of its last draft."""
    source, history = NgramMap(2, 4, 1), [1, 2, 3, 4, 5, 6, 0, 1, 2]
    drafts, _ = source.draft(history, 8)
    assert drafts == [3, 4, 5, 6]
    source.heard(drafts[:2], 2)  # the step's tokens reached two drafts, both kept: nothing refuted
    assert source.draft(history, 8)[0] == [3, 4, 5, 6]
    source.heard([3, 4, 5], 2)  # the third was refuted
    assert source.draft(history, 8)[0] == [3, 4]


def test_its_options_are_llama_cpps():
    assert NgramMapKOptions() == NgramMapKOptions(size_n=12, size_m=48, min_hits=1)


def test_greedy_equals_plain_and_drafts_are_kept(monkeypatch):
    checks.greedy_equals_plain(monkeypatch, "ngram-map-k", spec_ngram_map_k_size_n=3, spec_ngram_map_k_size_m=8)


def test_dflash_run_takes_it():
    checks.the_cli_runs_it("ngram-map-k", *FLAGS)


def test_dflash_server_takes_it(tmp_path):
    checks.the_server_runs_it(tmp_path, "ngram-map-k", *FLAGS)


def test_dflash_bench_arms_it(tmp_path):
    checks.the_bench_runs_it(tmp_path, "ngram-map-k")
