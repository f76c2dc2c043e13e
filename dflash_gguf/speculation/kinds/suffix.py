"""suffix (SuffixDecoding, ours: llama.cpp has no such kind): trees of what followed the
context's tail in the request's own text and in earlier requests' under the same corpus key
(speculation/suffix.py, docs/suffix.md)."""
from __future__ import annotations

from dataclasses import dataclass

from ..suffix import SuffixConfig, SuffixCorpora
from .kind import Kind, Options, option


@dataclass(frozen=True)
class SuffixOptions(Options):
    cache_mb: int = option(64, "--spec-suffix-cache-mb",
                           "suffix: memory for the corpus of earlier requests' prompts and responses it drafts "
                           "from (all API keys together, estimated per indexed token), the least recently used "
                           "dropped first; 0: no corpus, each request's own text only",
                           what="the suffix corpora's memory in MiB (0: no corpus, the request's own text only)",
                           lo=0, metavar="MIB")


KIND = Kind("suffix", "SuffixDecoding: trees of what followed the context's tail in the request's text and earlier "
                      "requests', no weights; docs/suffix.md",
            SuffixOptions, corpora=lambda o: SuffixCorpora(SuffixConfig(cache_mb=o.cache_mb)))
