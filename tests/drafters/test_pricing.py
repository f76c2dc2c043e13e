"""Weightless drafts priced against plain decoding (dflash_gguf/pricing.py): the size
with the most expected tokens per second, nothing when no size beats the last token
alone, the continuation rate that discounts deep drafts, and the walk that says how
many of a tree's nodes the target's tokens keep."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf.pricing import ContinuationRate, best_size, tree_probs, walk_depth
from dflash_gguf.suffix import continuation_tree


def linear(base: float, per_row: float):
    return lambda rows: base + per_row * (np.asarray(rows, dtype=float) - 1)


def test_free_rows_verify_every_likely_draft():
    assert best_size([0.9, 0.8, 0.7, 0.1], linear(1.0, 0.0)) == 4


def test_rows_as_dear_as_a_decode_step_verify_nothing_unsure():
    # each row costs a whole step: a draft pays only if it is surely kept
    assert best_size([0.9, 0.8], linear(1.0, 1.0)) == 0
    assert best_size([1.0, 1.0], linear(1.0, 1.0)) == 0  # a tie goes to the fewer rows


def test_the_best_length_is_where_the_rate_peaks():
    probs = [0.95 ** i for i in range(1, 49)]
    cost = linear(1.0, 0.15)
    m = best_size(probs, cost)
    rates = [(1 + sum(probs[:k])) / cost(1 + k) for k in range(49)]
    assert m == int(np.argmax(rates)) and 0 < m < 48


def test_no_drafts_no_rows():
    assert best_size([], linear(1.0, 0.0)) == 0


def test_the_continuation_rate_counts_walks_and_stops_and_fades():
    r = ContinuationRate()
    assert r.rate == pytest.approx(3 / 4)  # the prior: a few drafts, not a whole earlier reply
    r.observe(walked=8, deepest=8)  # the target went through the whole chain
    assert r.rate == pytest.approx(11 / 12)
    r.observe(walked=0, deepest=8)  # it stopped at the first draft
    assert r.rate == pytest.approx(11 / 13)
    for _ in range(200):
        r.observe(walked=0, deepest=4)
    assert r.continues + r.stops == pytest.approx(ContinuationRate.WEIGHT)
    assert r.rate < 0.1  # old walks fade: a text that stopped repeating is followed


def test_tree_probs_are_counts_over_occurrences_times_the_rate_by_depth():
    tree = continuation_tree(7, [[1, 2, 3], [1, 2, 4], [1, 5, 6], [9, 9, 9]], budget=8, min_prob=0.1)
    probs = tree_probs(tree, 1.0)
    assert probs[0] == pytest.approx(0.75)  # token 1 follows three of the four occurrences
    assert list(probs) == sorted(probs, reverse=True)
    depths = np.array([tree.depths[i] for i in tree.pick_order])
    assert tree_probs(tree, 0.5) == pytest.approx(probs * 0.5 ** depths)


def test_one_earlier_occurrence_no_longer_prices_a_long_chain_as_certain():
    """A 40-token chain from one occurrence: at rate 1 pricing verifies all of it on a
    CPU-like cost, at the prior's rate a few drafts."""
    tree = continuation_tree(7, [list(range(100, 140))], budget=48, min_prob=0.1)
    cost = linear(1.0, 0.15)
    assert best_size(tree_probs(tree, 1.0), cost) == 40
    assert 1 <= best_size(tree_probs(tree, ContinuationRate().rate), cost) <= 6


def test_walk_depth_follows_the_targets_tokens_down_the_tree():
    tree = continuation_tree(7, [[1, 2, 3], [1, 5, 6]], budget=8, min_prob=0.1)
    assert walk_depth(tree, [1, 5, 6, 0]) == 3
    assert walk_depth(tree, [1, 2, 8]) == 2
    assert walk_depth(tree, [4]) == 0
