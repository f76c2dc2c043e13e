"""The sweeps of the kinds that draft without a DFlash-family drafter (dflash-bench
--spec-type): draft-simple (a -md model of the target's vocabulary, drafting token by
token) and the weightless kinds, as speculation/kinds/ declares them (the n-gram kinds;
suffix, SuffixDecoding, ours only: llama.cpp's pinned version has no such kind). Each engine runs at its
default and over the same settings, ours as modes (ours.Mode), llama-speculative-simple's
as (p-min, n-max, size) arms:

  draft-simple  p-min (the top draft's share, llama.cpp's meaning) x n-max, the chain;
                ours also the tree (the chain with the drafter's second choices beside
                it) at its default n-max and at each swept one; `auto` (plain decoding
                or the chain of n-max drafts cut where it pays, chosen each step).
  ngram-*       the lookup size (the kind's `lookup` option: ngram-simple's size-n,
                ngram-mod's n-match) x the longest draft (llama.cpp: the kind's own flags,
                Kind.their_flags); a chain only (no tree, no auto); a kind without a
                lookup size sweeps n-max only.
  suffix        n-max (the tree's nodes, --spec-draft-n-max; its `chain` mode is its
                drafting, trees included). llama.cpp has no such kind (their_flags
                None): its n-gram kinds run at their defaults instead, none of them its
                default: its best is the only drafting row ours is compared with.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..speculation.kinds import DEFAULT_SIMPLE_N_MAX, SIMPLE, WEIGHTLESS
from .ours import Mode

KINDS = (SIMPLE, *WEIGHTLESS)
# the weightless kinds llama-speculative-simple runs, and ours alone (suffix)
THEIRS = tuple(k for k, kind in WEIGHTLESS.items() if kind.their_flags is not None)
OURS_ONLY = tuple(k for k in WEIGHTLESS if k not in THEIRS)
# the longest drafts swept where none are given (each engine's default runs beside them:
# ours 48 for the weightless kinds, each step priced to what pays)
SWEEP_N_MAX = {SIMPLE: (2, 4, 6), **{k: (8, 16, 32) for k in WEIGHTLESS}}
# the lookup sizes swept where none are given (the kinds' defaults run beside them)
SWEEP_SIZE = {k: tuple(kind.sweep_sizes) for k, kind in WEIGHTLESS.items() if kind.lookup}
# our Engine's option for a kind's lookup size
SIZE_OPTION = {k: kind.lookup_keyword() for k, kind in WEIGHTLESS.items() if kind.lookup}
MODES = {SIMPLE: ("plain", "chain", "tree", "auto"), **{k: ("plain", "chain") for k in WEIGHTLESS}}


def unsupported(kind: str, names: Sequence[str]) -> List[str]:
    """The modes named that the kind does not run."""
    return [n for n in names if n not in MODES[kind]]


def _label(head: str, p_min: Optional[float], size: Optional[int], n_max: int) -> str:
    return head + (f" p-min {p_min:g}" if p_min is not None else "") + (f" size {size}" if size is not None else "") \
        + f" n-max {n_max}"


def our_modes(kind: str, names: Sequence[str], p_mins: Sequence[float], n_maxes: Sequence[int],
              sizes: Sequence[int], vocabs: Sequence[int] = (), vocab_from: Sequence[str] = ()) -> List[Mode]:
    """Our modes of the kind: plain, the chain at its default and over the sweep, and
    (draft-simple) the tree at the default n-max and at each swept one, auto, and the
    default chain with the drafter's head cut to each of `vocabs` tokens (the commonest
    in `vocab_from`'s text where given)."""
    out = []
    for name in names:
        if name == "plain":
            out.append(Mode("plain", speculative=False))
        elif name == "chain":
            out.append(Mode("chain (default)"))
            if kind == SIMPLE:
                out += [Mode(_label("chain", p, None, n), p_min=p, options=(("spec_draft_n_max", n),))
                        for p in p_mins for n in n_maxes]
                out += [Mode(f"chain vocab {v}" + (" (corpus)" if vocab_from else ""),
                             options=(("spec_draft_vocab", v), ("spec_draft_vocab_from", tuple(vocab_from))))
                        for v in vocabs]
            elif kind not in SIZE_OPTION:
                out += [Mode(_label("chain", None, None, n), options=(("spec_draft_n_max", n),)) for n in n_maxes]
            else:
                out += [Mode(_label("chain", None, size, n), options=((SIZE_OPTION[kind], size), ("spec_draft_n_max", n)))
                        for size in sizes for n in n_maxes]
        elif name == "auto" and kind == SIMPLE:
            out.append(Mode("auto", tree_budget="auto"))
        elif name == "tree" and kind == SIMPLE:
            # any budget makes draft-simple's tree; its nodes follow from n-max (1 + 2 n-max)
            out += [Mode(_label("tree", None, None, n), tree_budget=2 * n + 1, options=(("spec_draft_n_max", n),))
                    for n in dict.fromkeys((DEFAULT_SIMPLE_N_MAX, *n_maxes))]
    return out


def their_settings(kind: str, p_mins: Sequence[float], n_maxes: Sequence[int],
                   sizes: Sequence[int]) -> List[Tuple[Optional[float], Optional[int], Optional[int]]]:
    """llama-speculative-simple's (p-min, n-max, size) of the kind: its default (all None)
    and the sweep (suffix: none, llama.cpp has no such kind; a kind without a lookup size
    whose draft length llama.cpp fixes, ngram-cache: its default only)."""
    if kind in OURS_ONLY:
        return []
    if kind == SIMPLE:
        sweep = [(p, n, None) for p in p_mins for n in n_maxes]
    else:
        sweep = [(None, n, size) for size in sizes for n in n_maxes]
    return [(None, None, None), *sweep]
