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
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np


@dataclass
class DraftTree:
    """Parents before children (build_tree orders nodes by depth); node 0 is the root
    (the bonus token)."""

    tokens: List[int]
    parents: List[int]
    depths: List[int]
    scores: List[float] = None  # path log-probability under the drafter (root: 0)
    pick_order: List[int] = None  # non-root nodes in best-first order
    dummy: List[bool] = None  # padding leaves (see padded_to): verified, never accepted

    def best(self, budget: int) -> "DraftTree":
        """The tree of the `budget` best nodes (the tree build_tree gives for that budget)."""
        keep = sorted(self.pick_order[:budget])
        index = {0: 0}
        tokens, parents, depths, scores = [self.tokens[0]], [-1], [0], [0.0]
        for i in keep:
            index[i] = len(tokens)
            tokens.append(self.tokens[i])
            parents.append(index[self.parents[i]])
            depths.append(self.depths[i])
            scores.append(self.scores[i])
        order = [index[i] for i in self.pick_order[:budget]]
        return DraftTree(tokens, parents, depths, scores, order)

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> List[dict]:
        kids: List[dict] = [dict() for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            if not (self.dummy and self.dummy[i]):
                kids[self.parents[i]].setdefault(self.tokens[i], i)
        return kids

    def padded_to(self, n: int) -> "DraftTree":
        """This tree with dummy leaves under the root until it has n nodes: the target's
        verify graph depends only on the node count, so padding every tree of a budget
        to one size lets consecutive steps reuse it. A dummy repeats the root token;
        nothing attends to it and no walk enters it."""
        if n < len(self):
            raise ValueError(f"cannot pad a tree of {len(self)} nodes to {n}")
        extra = n - len(self)
        dummy = list(self.dummy) if self.dummy else [False] * len(self)
        return DraftTree(self.tokens + [self.tokens[0]] * extra, self.parents + [0] * extra,
                         self.depths + [1] * extra, (self.scores or [0.0] * len(self)) + [float("-inf")] * extra,
                         self.pick_order, dummy + [True] * extra)

    def paths(self) -> List[List[int]]:
        """Per node, the tokens from the root's child down to it (the root's: none)."""
        out: List[List[int]] = [[]]
        for i in range(1, len(self.tokens)):
            out.append(out[self.parents[i]] + [self.tokens[i]])
        return out

    def ancestor_mask(self) -> np.ndarray:
        """mask[i, j]: node j is node i or one of its ancestors."""
        n = len(self.tokens)
        mask = np.zeros((n, n), dtype=bool)
        for i in range(n):
            if i:
                mask[i] = mask[self.parents[i]]
            mask[i, i] = True
        return mask


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


def chain_tree(root: int, drafts: Sequence[int]) -> DraftTree:
    """A chain as a tree: one child per node."""
    n = len(drafts) + 1
    return DraftTree([int(root)] + [int(t) for t in drafts], list(range(-1, n - 1)), list(range(n)),
                     [0.0] * n, list(range(1, n)))


def accept_path(tree: DraftTree, target_choice) -> List[int]:
    """Walk from the root while the target's choice at a node is one of its children;
    returns the accepted node path (root first)."""
    kids = tree.children()
    path = [0]
    while True:
        nxt = kids[path[-1]].get(int(target_choice[path[-1]]))
        if nxt is None:
            return path
        path.append(nxt)
