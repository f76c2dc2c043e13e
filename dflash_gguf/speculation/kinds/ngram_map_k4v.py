"""ngram-map-k4v (llama.cpp's `--spec-type ngram-map-k4v`, common/ngram-map.cpp): ngram-map-k's
map of keys (`size_n` tokens), which also counts the m-grams (`size_m` tokens) that followed
each key, up to four of them (the first four seen). The draft after the sequence's last n
tokens is the key's commonest m-gram when it followed the key at least twice as often as
the others together (llama.cpp's rule), once the key has occurred `min_hits` times; none
when the key's continuations disagree. Where ours differs from llama.cpp's code, as
ngram-map-k's (kinds/ngram_map_k.py); and llama.cpp copies the tokens after the key's
stored occurrence once the commonest m-gram dominates, ours the commonest m-gram itself."""
from __future__ import annotations

from dataclasses import dataclass

from .kind import Kind, Options, option
from .ngram_map_k import KeyRecord, NgramMap

VALUES = 4  # m-grams counted per key: llama.cpp's COMMON_NGRAM_MAX_VALUES


@dataclass(frozen=True)
class NgramMapK4vOptions(Options):
    size_n: int = option(12, "--spec-ngram-map-k4v-size-n",
                         "ngram-map-k4v: tokens of the key looked up in the history", what="the n-gram size", hi=1024)
    size_m: int = option(48, "--spec-ngram-map-k4v-size-m", "ngram-map-k4v: tokens of the m-grams it counts and drafts",
                         what="the m-gram size", hi=1024)
    min_hits: int = option(1, "--spec-ngram-map-k4v-min-hits",
                           "ngram-map-k4v: occurrences of a key before it drafts", what="the key's minimum hits")


class NgramMapK4v(NgramMap):
    """A sequence's ngram-map-k4v map: ngram-map-k's, counting each key's m-grams."""

    kind = "ngram-map-k4v"
    values = VALUES

    def _start(self, record: KeyRecord) -> int:
        """The latest occurrence followed by the key's dominant m-gram (at least twice the
        others' count together), less n: -1 when none dominates."""
        count, start = max(record.values.values())
        others = sum(c for c, _ in record.values.values()) - count
        return start if count >= 2 * others else -1


def _their_flags(size, n_max) -> list:
    """llama-speculative-simple's: the key's size, and the m-gram it drafts (its longest draft)."""
    return (["--spec-ngram-map-k4v-size-n", str(size)] if size is not None else []) + \
        (["--spec-ngram-map-k4v-size-m", str(n_max)] if n_max is not None else [])


KIND = Kind("ngram-map-k4v", "copies the m-gram that most often followed the last n tokens when it dominates the "
                             "others (up to four counted per key), no weights",
            NgramMapK4vOptions, source=lambda o: NgramMapK4v(o.size_n, o.size_m, o.min_hits), lookup="size_n",
            sweep_sizes=(4, 8), their_flags=_their_flags)
