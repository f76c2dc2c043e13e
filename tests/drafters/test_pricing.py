"""Weightless drafts priced against plain decoding (dflash_gguf/pricing.py): the size
with the most expected tokens per second, nothing when no size beats the last token
alone, the calibration that lowers overconfident estimates, and the walk that says how
many of a tree's nodes the target's tokens keep."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf.pricing import Calibration, best_size, tree_probs, walk_depth
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


def test_calibration_only_ever_lowers_and_starts_trusting():
    c = Calibration()
    assert c.factor == 1.0
    c.observe(expected=4.0, kept=0)
    assert c.factor == pytest.approx(1 / 5)
    c.observe(expected=1.0, kept=6)
    assert c.factor == 1.0  # kept more than expected: estimates are not raised past themselves


def test_tree_probs_are_counts_over_occurrences_in_best_first_order():
    tree = continuation_tree(7, [[1, 2, 3], [1, 2, 4], [1, 5, 6], [9, 9, 9]], budget=8, min_prob=0.1)
    probs = tree_probs(tree, 1.0)
    assert probs[0] == pytest.approx(0.75)  # token 1 follows three of the four occurrences
    assert list(probs) == sorted(probs, reverse=True)
    assert tree_probs(tree, 0.5) == pytest.approx(probs / 2)


def test_walk_depth_follows_the_targets_tokens_down_the_tree():
    tree = continuation_tree(7, [[1, 2, 3], [1, 5, 6]], budget=8, min_prob=0.1)
    assert walk_depth(tree, [1, 5, 6, 0]) == 3
    assert walk_depth(tree, [1, 2, 8]) == 2
    assert walk_depth(tree, [4]) == 0
