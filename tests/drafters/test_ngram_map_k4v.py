"""ngram-map-k4v (llama.cpp's --spec-type ngram-map-k4v): its lookup against hand-computed
cases of llama.cpp's semantics (common/ngram-map.cpp: up to four m-grams counted per key,
the commonest drafted when it followed the key at least twice as often as the others
together), then the kind from each entry point on the demo target."""
from __future__ import annotations

from dflash_gguf.speculation.kinds.ngram_map_k4v import NgramMapK4v, NgramMapK4vOptions

from helpers import weightless_kinds as checks

FLAGS = ("--spec-ngram-map-k4v-size-n", "3", "--spec-ngram-map-k4v-size-m", "4")


def test_the_dominant_m_gram_is_drafted():
    # after (1, 2): (3, 4) twice, (5, 5) once: 2 >= 2 x 1, (3, 4) is drafted
    assert NgramMapK4v(2, 2, 1).draft([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 5, 1, 2], 8) == ([3, 4], 2)
    # (3, 4) once, (5, 5) once: none dominates, no draft
    assert NgramMapK4v(2, 2, 1).draft([1, 2, 3, 4, 1, 2, 5, 5, 1, 2], 8) == ([], 0)
    # (3, 4) once, then (5, 5) twice: the latest continuation wins only by its count
    assert NgramMapK4v(2, 2, 1).draft([1, 2, 3, 4, 1, 2, 5, 5, 1, 2, 5, 5, 1, 2], 8)[0] == [5, 5]
    # min_hits counts the key's occurrences
    assert NgramMapK4v(2, 2, 3).draft([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 8) == ([], 0)


def test_only_four_m_grams_are_counted_per_key():
    history = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2, 7, 1, 2, 7, 1, 2, 7, 1, 2]
    source = NgramMapK4v(2, 1, 1)
    source.catch_up(history)
    # 7 came fifth: not counted, so 3, 4, 5, 6 once each and none dominates
    assert sorted(source.keys[(1, 2)].values) == [(3,), (4,), (5,), (6,)]
    assert source.draft(history, 8) == ([], 0)


def test_its_options_are_llama_cpps():
    assert NgramMapK4vOptions() == NgramMapK4vOptions(size_n=12, size_m=48, min_hits=1)


def test_greedy_equals_plain_and_drafts_are_kept(monkeypatch):
    checks.greedy_equals_plain(monkeypatch, "ngram-map-k4v", spec_ngram_map_k4v_size_n=3,
                               spec_ngram_map_k4v_size_m=4)


def test_dflash_run_takes_it():
    checks.the_cli_runs_it("ngram-map-k4v", *FLAGS)


def test_dflash_server_takes_it(tmp_path):
    checks.the_server_runs_it(tmp_path, "ngram-map-k4v", *FLAGS)


def test_dflash_bench_arms_it(tmp_path):
    checks.the_bench_runs_it(tmp_path, "ngram-map-k4v")
