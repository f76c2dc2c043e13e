"""ngram-map-k (llama.cpp's `--spec-type ngram-map-k`, common/ngram-map.cpp): a map from
every key (`size_n` tokens) of the history to what followed it. The draft after the
sequence's last n tokens is the m-gram (`size_m` tokens) that followed the key's latest
occurrence, once the key has occurred `min_hits` times. As llama.cpp stores, per key, how
many tokens of its last draft the target accepted, a key whose draft the target refuted
proposes no more than it kept next time.

Where ours differs from llama.cpp's code, by design: the map is exact (llama.cpp's is a
hashed table of 2^18 slots, whose first-stored position of a key stays even when the key
occurs again later, and which skips the n + m positions at the prompt's end); a draft cut
by its price (speculation/pricing.py) and kept whole leaves the key's limit as it was,
since the target refuted nothing of it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from ..ngram import MAX_RUN, ChainSource, agreeing_before
from .kind import Kind, Options, option


@dataclass(frozen=True)
class NgramMapKOptions(Options):
    size_n: int = option(12, "--spec-ngram-map-k-size-n", "ngram-map-k: tokens of the key looked up in the history",
                         what="the n-gram size", hi=1024)
    size_m: int = option(48, "--spec-ngram-map-k-size-m", "ngram-map-k: tokens of the m-gram it drafts",
                         what="the m-gram size", hi=1024)
    min_hits: int = option(1, "--spec-ngram-map-k-min-hits",
                           "ngram-map-k: occurrences of a key before it drafts", what="the key's minimum hits")


@dataclass
class KeyRecord:
    """What the map knows of one key: its occurrences followed by a whole m-gram, the
    latest's start, the m-grams seen after it with their counts and latest starts (at
    most `values` of them, the first seen: llama.cpp's four slots), and how many tokens
    its drafts propose at most (m, lowered to what the target kept of a refuted draft)."""

    hits: int
    latest: int
    limit: int
    values: Dict[Tuple[int, ...], List[int]] = field(default_factory=dict)  # m-gram -> [count, latest start]


class NgramMap(ChainSource):
    """A sequence's n-gram map: each key's record, indexed as the history grows (an
    occurrence at i once its m-gram is whole: i + n + m <= len), and the key its last
    draft came from."""

    kind = "ngram-map-k"
    values = 0  # m-grams counted per key (0: none, the latest occurrence's drafts)

    def __init__(self, size_n: int, size_m: int, min_hits: int):
        self.n, self.m, self.min_hits = size_n, size_m, min_hits
        self.keys: Dict[Tuple[int, ...], KeyRecord] = {}
        self._done = 0  # occurrences indexed so far
        self._last: Tuple[int, ...] = ()  # the key the last draft came from

    def catch_up(self, history: Sequence[int]) -> None:
        n, m = self.n, self.m
        for i in range(self._done, len(history) - n - m + 1):
            key = tuple(history[i:i + n])
            record = self.keys.get(key)
            if record is None:
                record = self.keys[key] = KeyRecord(0, i, m)
            record.hits += 1
            record.latest = i
            if self.values:
                value = tuple(history[i + n:i + n + m])
                counted = record.values.get(value)
                if counted is not None:
                    counted[0] += 1
                    counted[1] = i
                elif len(record.values) < self.values:
                    record.values[value] = [1, i]
        self._done = max(self._done, len(history) - n - m + 1)

    def _start(self, record: KeyRecord) -> int:
        """Where the drafted m-gram starts less n: the key's latest occurrence."""
        return record.latest

    def draft(self, history: List[int], n_max: int) -> Tuple[List[int], int]:
        """(the m-gram after the last n tokens' key, cut to the key's limit and n_max, the
        run: the key and the agreeing tokens before its occurrence); ([], 0) when the key
        is unknown, has too few hits or names no m-gram."""
        self.catch_up(history)
        n = self.n
        self._last = ()
        if len(history) < n or n_max < 1:
            return [], 0
        key = tuple(history[-n:])
        record = self.keys.get(key)
        if record is None or record.hits < self.min_hits:
            return [], 0
        j = self._start(record)
        if j < 0:
            return [], 0
        self._last = key
        drafts = history[j + n:j + n + min(self.m, record.limit, n_max)]
        return drafts, n + agreeing_before(history, j, history, len(history) - n, MAX_RUN - n)

    def heard(self, drafts: Sequence[int], kept: int) -> None:
        """A refuted draft limits its key's next drafts to what the target kept of it."""
        record = self.keys.get(self._last)
        if record is not None and kept < len(drafts):
            record.limit = kept


def _their_flags(size, n_max) -> list:
    """llama-speculative-simple's: the key's size, and the m-gram it drafts (its longest draft)."""
    return (["--spec-ngram-map-k-size-n", str(size)] if size is not None else []) + \
        (["--spec-ngram-map-k-size-m", str(n_max)] if n_max is not None else [])


KIND = Kind("ngram-map-k", "copies the m tokens that followed the last n tokens' latest occurrence, from a map of "
                           "the history, no weights",
            NgramMapKOptions, source=lambda o: NgramMap(o.size_n, o.size_m, o.min_hits), lookup="size_n",
            sweep_sizes=(4, 8), their_flags=_their_flags)
