"""ngram-cache (llama.cpp's `--spec-type ngram-cache`, common/ngram-cache.cpp, its lookup
decoding): counts of the tokens that followed every 1..4 tokens of the history (the context
cache), drafted token by token. Each next token is the commonest follower of the longest of
the last 4, 3, 2, 1 tokens (the drafts so far included) whose followers were seen often
enough and agree enough: for the last 1, 2, 3, 4 tokens at least 2, 2, 1, 1 times, the
commonest at least 66%, 50%, 50%, 50% of them (llama.cpp's lax thresholds for the context
cache); the draft ends at the first position none passes, or after 8 tokens (llama.cpp's
fixed length).

Where ours differs from llama.cpp's code, by design: llama.cpp updates its context cache
from each step's new tokens alone, so the n-grams that span two steps are never counted;
ours counts every n-gram of the history once. Its static and dynamic caches (files,
-lcs / -lcd) are not read. Among followers of equal count llama.cpp takes the first in its
hash table's order, ours the first seen."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from ..ngram import ChainSource
from .kind import Kind

N_MIN, N_MAX = 1, 4  # the n-gram sizes counted: llama.cpp's LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX
# by n-gram size 1..4: the fewest followers seen, and the commonest's least share in percent
MIN_SAMPLES = (2, 2, 1, 1)
MIN_PERCENT = (66, 50, 50, 50)
N_DRAFT = 8  # llama.cpp's draft length (create_state_ngram_cache's n_draft)


class NgramCache(ChainSource):
    """A sequence's context cache: for every n-gram of 1..4 tokens of its history, how
    often each token followed it (in the order first seen), counted as the history grows."""

    kind = "ngram-cache"

    def __init__(self):
        self.counts: Dict[Tuple[int, ...], Dict[int, int]] = {}
        self._done = 0  # history positions whose token is counted after its n-grams

    def catch_up(self, history: Sequence[int]) -> None:
        for i in range(self._done, len(history)):
            for n in range(N_MIN, min(N_MAX, i) + 1):
                followers = self.counts.setdefault(tuple(history[i - n:i]), {})
                followers[history[i]] = followers.get(history[i], 0) + 1
        self._done = max(self._done, len(history))

    def next_token(self, tail: Sequence[int]) -> Tuple[int, int]:
        """(the token drafted after `tail`, the n-gram size that found it); (-1, 0) when no
        n-gram's followers pass its thresholds."""
        for n in range(min(N_MAX, len(tail)), N_MIN - 1, -1):
            followers = self.counts.get(tuple(tail[-n:]))
            if not followers:
                continue
            token, count = max(followers.items(), key=lambda tc: tc[1])  # the first seen on a tie
            total = sum(followers.values())
            if total >= MIN_SAMPLES[n - 1] and 100 * count >= MIN_PERCENT[n - 1] * total:
                return token, n
        return -1, 0

    def draft(self, history: List[int], n_max: int) -> Tuple[List[int], int]:
        """(the tokens drafted one by one after the history, at most 8 and n_max, the run:
        the n-gram size that found the first); ([], 0) when none is found."""
        self.catch_up(history)
        if len(history) < 2:  # llama.cpp drafts after two tokens at least (LLAMA_NGRAM_STATIC)
            return [], 0
        tail, drafts, run = list(history[-N_MAX:]), [], 0
        while len(drafts) < min(N_DRAFT, n_max):
            token, n = self.next_token(tail)
            if token < 0:
                break
            run = run or n
            drafts.append(token)
            tail = tail[1:] + [token] if len(tail) == N_MAX else tail + [token]
        return drafts, run


KIND = Kind("ngram-cache", "drafts token by token the commonest followers of the last 1..4 tokens in the history, "
                           "no weights", source=lambda o: NgramCache(), their_flags=lambda size, n_max: [])
