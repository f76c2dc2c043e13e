"""Weightless drafts priced against plain decoding (dflash_gguf/speculation/pricing.py): the size
with the most expected tokens per second, nothing when no size beats the last token
alone, the hazard by run that discounts deep drafts, and the walk that says how
many of a tree's nodes the target's tokens keep."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf.speculation.pricing import RequestHazard, RunHazard, best_size, tree_probs, walk_depth
from dflash_gguf.speculation.suffix import continuation_tree


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


def test_the_hazard_counts_walks_and_breaks_by_run_and_fades():
    h = RunHazard()
    fresh = h.survival(12, [1, 8, 40])
    # the prior: a run of r goes one further with chance about (r + 1) / (r + 2)
    assert fresh[0] == pytest.approx(1 - 1 / (1.5 * 8 - 0.5 + 2))
    assert list(fresh) == sorted(fresh, reverse=True)
    assert h.survival(200, [1])[0] > h.survival(2, [1])[0]  # a long run is likelier to go on
    h.observe(run=12, walked=8, deepest=8)  # the target went through the whole chain
    assert h.breaks.sum() == pytest.approx(RunHazard.PRIOR * RunHazard.BUCKETS)
    assert h.survival(12, [8])[0] > fresh[1]
    h.observe(run=12, walked=0, deepest=8)  # it broke off at the first draft
    assert h.survival(12, [1])[0] < fresh[0]
    for _ in range(400):
        h.observe(run=12, walked=0, deepest=4)
    assert h.trials.max() == pytest.approx(RunHazard.WEIGHT)
    assert h.survival(12, [1])[0] < 0.1  # old walks fade: a text that stopped repeating is followed
    assert h.survival(1000, [1])[0] == RunHazard().survival(1000, [1])[0]  # other runs' buckets untouched


def test_a_request_prices_by_the_keys_hazard_shrunk_and_its_own_outcomes():
    key = RunHazard()
    for _ in range(400):  # the key's earlier requests: runs of 12 went on
        key.observe(run=12, walked=8, deepest=8)
    request = RequestHazard(key)
    assert request.survival(12, [1, 8]) == pytest.approx(key.survival(12, [1, 8]))  # nothing seen yet
    for _ in range(8):  # this request's drafts from runs of 12 break at once
        request.observe(run=12, walked=0, deepest=4)
    mine = request.survival(12, [1])[0]
    assert key.survival(12, [1])[0] > 0.9  # the key's 256 trials hardly move
    assert mine < 0.85  # the request's 8 weigh against the key's 32 at most
    # what the request saw went into the key's too, and a new request starts from the key's
    assert key.breaks.sum() > RunHazard.PRIOR * RunHazard.BUCKETS
    assert RequestHazard(key).survival(12, [1])[0] == pytest.approx(key.survival(12, [1])[0])


def test_tree_probs_are_counts_over_occurrences_times_the_survival_by_depth():
    tree = continuation_tree(7, [[1, 2, 3], [1, 2, 4], [1, 5, 6], [9, 9, 9]], budget=8, min_prob=0.1)
    h = RunHazard()
    probs = tree_probs(tree, h, 6)
    depths = np.array([tree.depths[i] for i in tree.pick_order])
    assert probs == pytest.approx(np.array([np.exp(tree.scores[i]) for i in tree.pick_order])
                                  * h.survival(6, depths))
    assert probs[0] == pytest.approx(0.75 * h.survival(6, [1])[0])  # token 1 follows three of the four


def test_one_earlier_occurrence_prices_a_long_chain_by_its_match():
    """A 40-token chain from one occurrence: certain, pricing verifies all of it on a
    CPU-like cost; from a match of 2 tokens a few drafts, from a match of 64 more."""
    tree = continuation_tree(7, [list(range(100, 140))], budget=48, min_prob=0.1)
    cost = linear(1.0, 0.15)
    h = RunHazard()
    assert best_size(np.exp([tree.scores[i] for i in tree.pick_order]), cost) == 40
    short = best_size(tree_probs(tree, h, 2), cost)
    assert 1 <= short <= 6 < best_size(tree_probs(tree, h, 64), cost)


def test_walk_depth_follows_the_targets_tokens_down_the_tree():
    tree = continuation_tree(7, [[1, 2, 3], [1, 5, 6]], budget=8, min_prob=0.1)
    assert walk_depth(tree, [1, 5, 6, 0]) == 3
    assert walk_depth(tree, [1, 2, 8]) == 2
    assert walk_depth(tree, [4]) == 0
