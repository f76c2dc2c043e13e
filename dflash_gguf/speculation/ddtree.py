"""DDTree: the best-first draft tree over a block drafter's per-position candidates.

A drafted block gives, for every depth d, candidate tokens with log-probabilities that
do not depend on the path. A tree node is a prefix of candidate ranks (r_1, ..., r_d);
its score is the sum of the log-probabilities along it. Scores only fall from a
prefix to its first child or to its next sibling, so popping the best prefix from a
max-heap and pushing those two successors yields the `budget` best prefixes in order
of score: the tree that maximises the expected number of accepted tokens under the
drafter's own marginals.
"""
from __future__ import annotations

import heapq
from typing import Callable, List, Optional, Sequence

from ..decoding.tree import DraftTree


def build_tree(root: int, cand_tokens: Sequence[Sequence[int]], cand_logprobs: Sequence[Sequence[float]],
               budget: int, max_depth: int | None = None,
               valid: Optional[Callable[[List[int]], bool]] = None,
               forced: Optional[Callable[[List[int]], Optional[int]]] = None) -> DraftTree:
    """The best-first tree of at most `budget` nodes below `root`.

    cand_tokens[d][r] / cand_logprobs[d][r]: the rank-r candidate for depth d+1, best
    first. Ties in score are broken by depth, then by rank sequence, so the result is
    deterministic.

    A grammar shapes the tree through two tests of a path of tokens below the root:
    valid(path): a prefix it rejects, and so everything below it, takes no place in the
    tree (its next sibling still competes), so that the budget goes to paths the target
    can accept; forced(path): the token the grammar forces after it, or None; a forced
    token is the node's only child (rank -1), certain (log-probability 0), whatever the
    drafter guessed at that depth.
    """
    depth_limit = len(cand_tokens) if max_depth is None else min(max_depth, len(cand_tokens))
    k = len(cand_tokens[0]) if depth_limit else 0
    picked: List[tuple] = []  # (depth, order, ranks, score)
    forced_at: dict = {}  # ranks ending in -1 -> the forced token

    def token(ranks: tuple) -> int:
        r = ranks[-1]
        return forced_at[ranks] if r < 0 else int(cand_tokens[len(ranks) - 1][r])

    def path(ranks: tuple) -> List[int]:
        return [token(ranks[:i + 1]) for i in range(len(ranks))]

    def first_child(ranks: tuple, score: float) -> tuple:
        t = forced(path(ranks)) if forced is not None else None
        if t is not None:
            forced_at[ranks + (-1,)] = int(t)
            return -float(score), len(ranks) + 1, ranks + (-1,)
        return -float(score + cand_logprobs[len(ranks)][0]), len(ranks) + 1, ranks + (0,)

    if depth_limit and k and budget > 0:
        heap = [first_child((), 0.0)]
        while heap and len(picked) < budget:
            neg, depth, ranks = heapq.heappop(heap)
            score = -neg
            last = ranks[-1]
            allowed = last < 0 or valid is None or valid(path(ranks))
            if allowed:
                picked.append((depth, len(picked), ranks, score))
            if 0 <= last and last + 1 < k:  # next sibling
                sib = score - cand_logprobs[depth - 1][last] + cand_logprobs[depth - 1][last + 1]
                heapq.heappush(heap, (-float(sib), depth, ranks[:-1] + (last + 1,)))
            if allowed and depth < depth_limit:  # first child
                heapq.heappush(heap, first_child(ranks, score))
    by_depth = sorted(picked, key=lambda p: (p[0], p[1]))  # parents keep preceding children
    index = {(): 0}
    node_of_pick = [0] * len(picked)
    tokens, parents, depths, scores = [int(root)], [-1], [0], [0.0]
    for depth, order, ranks, score in by_depth:
        index[ranks] = len(tokens)
        node_of_pick[order] = len(tokens)
        tokens.append(token(ranks))
        parents.append(index[ranks[:-1]])
        depths.append(depth)
        scores.append(score)
    return DraftTree(tokens, parents, depths, scores, node_of_pick)
