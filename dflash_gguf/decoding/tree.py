"""The tree a verify runs: draft nodes with their parents (DraftTree; a chain is a tree
with one child per node), and the accept walk over the target's choices at its nodes.
Who grows a tree is speculation's business (speculation/ddtree.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np

from ..runtime.native import ffi, lib


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


def accepted_prefix(block: List[int], target_choice) -> int:
    """How many drafts (block[1:]) agree with the target's choice after each position
    (dfl_agreed_drafts: the rule the fused chain step keeps by)."""
    block = np.asarray(block, dtype=np.int32)
    choice = np.ascontiguousarray(target_choice, dtype=np.int32)
    b = min(len(block), len(choice) + 1)
    return lib.dfl_agreed_drafts(ffi.from_buffer("int32_t[]", block), ffi.from_buffer("int32_t[]", choice), b)
