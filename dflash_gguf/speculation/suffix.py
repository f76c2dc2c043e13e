"""SuffixDecoding (`--spec-type suffix`): weightless draft trees from text seen before, the
request's own prompt and output and a corpus of earlier requests and their responses
(after Oliaro et al., 2025). Where an agent or a chat repeats itself (tool loops,
rewrites, the same questions), the text that followed the longest earlier match of the
context's tail is a good guess of what follows now, and several earlier continuations
make a tree rather than a chain.

The index (SuffixIndex) is not a literal suffix tree: every k-gram (k = min_match) of its
documents maps to the positions it ends at, in a dict of ordered dicts. A lookup
takes the context's last k tokens, walks their most recent occurrences (at most
max_occurrences) and extends each match backwards, token by token, up to max_match;
the occurrences that reach the longest match are the match's. That gives the suffix
tree's answer for the suffixes that matter here (min_match..max_match tokens) at the cost
of one dict lookup and a bounded backward walk per step, and appending tokens indexes
only the new positions. Removing a document removes its positions one by one, which
a bounded LRU corpus needs and a suffix tree makes hard.

From the occurrences, the continuation tree (continuation_tree): the tokens that followed
each, merged into a trie whose node counts how many occurrences pass through it. A
child's probability is its count over its parent's, so a node's (the product along its
path) is its count over the occurrences: the best-first tree of a budget is the nodes of
highest count, parents first, none below min_prob; its depth follows the match's length
(a longer match is likelier to go on as before)."""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from ..decoding.tree import DraftTree
from .edits import CopyCursor
from .ngram import agreeing_before
from .pricing import RequestHazard, tree_probs, walk_depth

# Host memory an indexed token costs, for --spec-suffix-cache-mb: an estimate, measured
# with tracemalloc over documents of random tokens (about 420 bytes at k = 2, with 1k or
# 100k distinct tokens: the token's list slot and int, its k-gram's tuple, the k-gram's
# dict entry and its position's (document, end) entry), rounded up. Repetitive text
# shares k-grams and costs less.
BYTES_PER_TOKEN = 512


@dataclass(frozen=True)
class SuffixConfig:
    """How suffix drafts are found:
      min_match       the shortest match that drafts (the k-gram the index is keyed on)
      max_match       matches are extended backwards up to this many tokens
      max_occurrences the most recent occurrences of the context's last k tokens examined
      depth_factor    a tree is at most depth_factor x the match's length deep
      min_prob        a node less likely than this (its count over the occurrences) is dropped
      cache_mb        the corpora's bound (all keys together), in MiB of estimated memory"""

    min_match: int = 2
    max_match: int = 64
    max_occurrences: int = 64
    depth_factor: float = 2.0
    min_prob: float = 0.1
    cache_mb: int = 64

    @property
    def cache_bytes(self) -> int:
        return self.cache_mb << 20


@dataclass
class Match:
    """The longest match of a context's tail: its length and where in the documents the
    text after it starts ((document, position) pairs, most recent first)."""

    length: int
    at: List[Tuple[Hashable, int]]


class SuffixIndex:
    """Documents of tokens, their k-grams indexed as they grow (see the module's doc)."""

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"the shortest suffix match must be at least 1 token, got {k}")
        self.k = k
        self.docs: Dict[Hashable, List[int]] = {}
        self._followed: Dict[Hashable, int] = {}  # a followed document's length when last indexed
        # k-gram -> {(document, end): None}: it ends at `end`, and doc[end] follows it
        self._ends: Dict[Tuple[int, ...], Dict[Tuple[Hashable, int], None]] = {}

    def __len__(self) -> int:
        """Indexed tokens, over all documents."""
        return sum(len(d) for d in self.docs.values())

    def extend(self, doc: Hashable, tokens: Sequence[int]) -> None:
        """Append tokens to a document (a new one when unknown), indexing the new ends: a
        k-gram is indexed once a token follows it."""
        h = self.docs.setdefault(doc, [])
        first = max(len(h), self.k)
        h.extend(int(t) for t in tokens)
        self._index(doc, h, first)

    def follow(self, doc: Hashable, tokens: List[int]) -> None:
        """A document that is the caller's list (a sequence's history, which grows at its
        end), read where it is and never copied: index the ends it gained since the last
        call."""
        first = max(self._followed.get(doc, 0), self.k)
        self.docs[doc] = tokens
        self._index(doc, tokens, first)
        self._followed[doc] = len(tokens)

    def _index(self, doc: Hashable, h: List[int], first: int) -> None:
        for end in range(first, len(h)):
            self._ends.setdefault(tuple(h[end - self.k:end]), {})[(doc, end)] = None

    def remove(self, doc: Hashable) -> None:
        h = self.docs.pop(doc)
        for end in range(self.k, len(h)):
            key = tuple(h[end - self.k:end])
            ends = self._ends[key]
            del ends[(doc, end)]
            if not ends:
                del self._ends[key]

    def match(self, context: Sequence[int], max_match: int, max_occurrences: int) -> Optional[Match]:
        """The longest match (at least k tokens, at most max_match) of the context's tail
        among the most recent max_occurrences occurrences of its last k tokens; None
        when those never occurred with a token after them."""
        k = self.k
        if len(context) < k:
            return None
        ends = self._ends.get(tuple(context[-k:]))
        if not ends:
            return None
        best, at = 0, []
        for doc, end in islice(reversed(ends), max_occurrences):
            n = agreeing_before(self.docs[doc], end, context, len(context), max_match)
            if n > best:
                best, at = n, [(doc, end)]
            elif n == best:
                at.append((doc, end))
        return Match(best, at)

    def continuations(self, match: Match, depth: int) -> List[List[int]]:
        """The tokens after each of the match's occurrences, up to `depth`."""
        return [self.docs[doc][end:end + depth] for doc, end in match.at]


def continuation_tree(root: int, continuations: Sequence[Sequence[int]], budget: int,
                      min_prob: float) -> Optional[DraftTree]:
    """The best-first tree of at most `budget` nodes below `root` over the continuations'
    trie (see the module's doc): scores are log-probabilities, count over occurrences;
    ties go to the shallower node, then to the continuation seen first (the most recent).
    None when no node is likely enough."""
    n = len(continuations)
    if n == 0 or budget < 1:
        return None
    tokens, parents, depths, counts = [int(root)], [-1], [0], [n]
    children: List[Dict[int, int]] = [{}]
    for cont in continuations:
        node = 0
        for t in cont:
            child = children[node].get(t)
            if child is None:
                child = len(tokens)
                children[node][t] = child
                tokens.append(int(t))
                parents.append(node)
                depths.append(depths[node] + 1)
                counts.append(0)
                children.append({})
            counts[child] += 1
            node = child
    # a child's count is at most its parent's and its depth larger: this order puts every
    # parent before its children, so any prefix of it is a tree
    likely = [i for i in range(1, len(tokens)) if counts[i] >= min_prob * n]
    picked = sorted(likely, key=lambda i: (-counts[i], depths[i], i))[:budget]
    if not picked:
        return None
    by_depth = sorted(picked, key=lambda i: (depths[i], i))
    index = {0: 0}
    tree = DraftTree([tokens[0]], [-1], [0], [0.0], [])
    for i in by_depth:
        index[i] = len(tree.tokens)
        tree.tokens.append(tokens[i])
        tree.parents.append(index[parents[i]])
        tree.depths.append(depths[i])
        tree.scores.append(math.log(counts[i] / n))
    tree.pick_order = [index[i] for i in picked]
    return tree


def is_chain(tree: DraftTree) -> bool:
    """Every node has one child at most (nodes by depth: node i is at depth i)."""
    return all(d == i for i, d in enumerate(tree.depths))


def draft_tree(index: SuffixIndex, context: Sequence[int], budget: int, max_depth: int,
               config: SuffixConfig) -> Tuple[Optional[DraftTree], Optional[Match]]:
    """The continuation tree of the context's longest match in the index (root: the
    context's last token), at most max_depth deep and depth_factor x the match's length;
    with the match (None: none)."""
    match = index.match(context, config.max_match, config.max_occurrences)
    if match is None:
        return None, None
    depth = min(max_depth, math.ceil(config.depth_factor * match.length))
    return continuation_tree(context[-1], index.continuations(match, depth), budget, config.min_prob), match


class SuffixCorpora:
    """Earlier requests' prompts and responses, one index per corpus key (a hashed API key,
    or None), bounded together by config.cache_bytes of estimated memory
    (BYTES_PER_TOKEN per indexed token): the least recently used documents go first.
    A document is used when it is added and when a step's suffix tree comes from it
    (whether or not a drafter's chain is verified instead). A document larger than the
    whole bound is not kept."""

    def __init__(self, config: SuffixConfig):
        self.config = config
        self._indexes: Dict[Hashable, SuffixIndex] = {}
        self._lru: "OrderedDict[Tuple[Hashable, int], int]" = OrderedDict()  # (key, document) -> its tokens
        self._next_doc = 0
        self.tokens = 0  # indexed tokens, all keys
        self.evicted = 0  # documents dropped to stay in the bound

    @property
    def nbytes(self) -> int:
        return self.tokens * BYTES_PER_TOKEN

    def index(self, key: Hashable) -> Optional[SuffixIndex]:
        return self._indexes.get(key)

    def add(self, key: Hashable, tokens: Sequence[int]) -> None:
        """A finished request's prompt and response, under its corpus key."""
        size = len(tokens)
        if size <= self.config.min_match or size * BYTES_PER_TOKEN > self.config.cache_bytes:
            return
        while self.tokens + size > self.config.cache_bytes // BYTES_PER_TOKEN:
            self._evict()
        doc = self._next_doc
        self._next_doc += 1
        self._indexes.setdefault(key, SuffixIndex(self.config.min_match)).extend(doc, tokens)
        self._lru[(key, doc)] = size
        self.tokens += size

    def used(self, key: Hashable, docs) -> None:
        """Drafts came from these documents of the key's: they are the last to go."""
        for doc in docs:
            if (key, doc) in self._lru:
                self._lru.move_to_end((key, doc))

    def _evict(self) -> None:
        (key, doc), size = self._lru.popitem(last=False)
        index = self._indexes[key]
        index.remove(doc)
        if not index.docs:
            del self._indexes[key]
        self.tokens -= size
        self.evicted += 1


def likeliest_path(tree: DraftTree) -> List[int]:
    """The tokens of the tree's likeliest branch: from the root, the likeliest child each
    time (the first in best-first order)."""
    first_child: Dict[int, int] = {}
    for i in tree.pick_order:
        first_child.setdefault(tree.parents[i], i)
    out, node = [], 0
    while node in first_child:
        node = first_child[node]
        out.append(tree.tokens[node])
    return out


OWN = "own"  # a sequence's own text: the one document of its index


class SuffixDrafts:
    """A sequence's suffix drafting: its own text, indexed as it grows and followed
    through edits by a copy cursor (speculation/edits.py), and its corpus key's earlier requests.
    Each step the best of the two trees and the cursor's chain (the largest expected
    accepted drafts); the draft whose outcome a step is judged on (judge) tells its
    hazard (the request's view of the key's) how far the target went along it; when
    the sequence ends, its prompt and output go into the key's corpus.

    Drafts from the corpus are priced by a hazard of their own: a match into another
    request's text (the same system prompt, the same chat markup before a reply) breaks
    off sooner than one into the request's own, and priced as one, the corpus's drafts
    were verified as long as the own text's had earned (on the 1.5B's editing sessions
    in one server, suffix timed at 1.13x and 1.24x plain in its second and third sessions,
    where each session alone replayed at 1.40x and 1.63x)."""

    def __init__(self, corpora: SuffixCorpora, key: Hashable, hazard: RequestHazard,
                 corpus_hazard: RequestHazard):
        self.corpora, self.key, self.config = corpora, key, corpora.config
        self.own = SuffixIndex(self.config.min_match)
        self.cursor = CopyCursor()  # where the output copies its own text from, through edits
        self.hazard = hazard  # the request's view of the key's (RunHazards.request): the own text's drafts
        self.corpus_hazard = corpus_hazard  # the same, for drafts from its corpus

    def follow(self, text: List[int]) -> None:
        """The sequence's text (Tokens.text: its prompt, its output, the bonus last): its
        new end indexed and followed by the cursor."""
        self.own.follow(OWN, text)
        self.cursor.follow(text)

    def probs(self, tree: Optional[DraftTree], run: int, corpus: bool = False) -> np.ndarray:
        """A tree's nodes' chances of being kept, best-first (their counts times the
        chance that the target goes on along the match that far, pricing.tree_probs, by
        the corpus's hazard or the own text's)."""
        hazard = self.corpus_hazard if corpus else self.hazard
        return np.zeros(0) if tree is None else tree_probs(tree, hazard, run)

    def best(self, text: List[int], budget: int, max_depth: int) -> Tuple[Optional[DraftTree], np.ndarray, int, bool]:
        """(the draft with the most expected accepted drafts: the own text's tree, the
        cursor's copy or the corpus's tree; its nodes' chances, the run it is priced by,
        whether it came from the corpus); (None, ...): none found one."""
        self.follow(text)
        tree, match = draft_tree(self.own, text, budget, max_depth, self.config)
        run = match.length if tree is not None else 0
        if match is not None and match.length > self.cursor.strength():
            self.cursor.anchor(match.at[0][1], match.length)
        probs = self.probs(tree, run)
        copied, copy_run = self.cursor.draft(text, max_depth)
        if copied:
            chain = continuation_tree(text[-1], [copied], budget, 0.0)
            theirs = self.probs(chain, copy_run)
            if theirs.sum() > probs.sum():
                tree, probs, run = chain, theirs, copy_run
        corpus = self.corpora.index(self.key)
        if corpus is not None:
            other, found = draft_tree(corpus, text, budget, max_depth, self.config)
            theirs = self.probs(other, found.length if found is not None else 0, corpus=True)
            if theirs.sum() > probs.sum():
                self.corpora.used(self.key, (doc for doc, _ in found.at))
                return other, theirs, found.length, True
        return tree, probs, run, False

    @staticmethod
    def judge(tree: DraftTree, run: int, deepest: Optional[int] = None,
              corpus: bool = False) -> Tuple[DraftTree, int, int, bool]:
        """What this step's outcome counts against (observe's `judged`): `tree`, drafted
        from a match of `run` tokens (into the corpus or the own text), down to `deepest`
        (default: all of it), the tree verified, or one not verified at all, judged on its
        first level."""
        return tree, run, max(tree.depths) if deepest is None else deepest, corpus

    def observe(self, emitted: Sequence[int], judged: Optional[Tuple[DraftTree, int]] = None) -> None:
        """After a step: the tokens it emitted after the bonus (the last is the next
        bonus), and what the step was judged on (judge; None: nothing)."""
        if judged is not None:
            tree, run, deepest, corpus = judged
            hazard = self.corpus_hazard if corpus else self.hazard
            hazard.observe(run, min(deepest, walk_depth(tree, emitted)), deepest)

    def finish(self, seq) -> None:
        """The sequence ended: its prompt and what the request kept of its output go into
        its key's corpus (a copy: the corpus outlives the sequence)."""
        tokens = seq.tokens
        self.corpora.add(self.key, tokens.text[:len(tokens.prompt) + seq.stats.generated_tokens])


def corpus_key(api_key: Optional[str]) -> Optional[str]:
    """The corpus key of a request's API key: a digest, so the raw key is never kept or
    shown (None: no key, the shared corpus of requests without one)."""
    if not api_key:
        return None
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()[:32]
