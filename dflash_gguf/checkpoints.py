"""Prefix checkpoints: the decoding state at a prompt position, kept so that a later
prompt sharing the prefix resumes there instead of prefilling it again.

A checkpoint (csrc/dfl_checkpoint.c) holds everything the position needs: attention
K/V rows, recurrent and conv states, and the drafter's context (its window). The store
keeps them in host memory under a byte budget, least recently used first out."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from ._native import NativeObject, check, ffi, lib


def checkpoint_bytes(target, draft=None) -> int:
    """What a Checkpoint of target (and drafter) would take now."""
    out = ffi.new("uint64_t *")
    check(lib.dfl_checkpoint_measure(target._handle(), draft._handle() if draft is not None else ffi.NULL, out))
    return int(out[0])


class Checkpoint(NativeObject):
    """The state of a target (and drafter) at their current position, in host memory."""

    _what = "checkpoint"
    _free = staticmethod(lib.dfl_checkpoint_free)

    def __init__(self, target, draft=None):
        if draft is not None and draft._pending is not None:
            raise RuntimeError("the drafter has deferred context rows: flush them before taking a checkpoint")
        out = ffi.new("dfl_checkpoint **")
        check(lib.dfl_checkpoint_save(target._handle(), draft._handle() if draft is not None else ffi.NULL, out))
        self._ptr = out[0]
        self.has_draft = draft is not None
        self.n_past = int(lib.dfl_checkpoint_n_past(self._ptr))
        self.nbytes = int(lib.dfl_checkpoint_bytes(self._ptr))

    def restore(self, target, draft=None) -> None:
        """Put target (and drafter) back at this position; their next decode continues
        from it exactly as from the original context."""
        if draft is not None:
            draft.drop_pending()
        check(lib.dfl_checkpoint_restore(self._handle(), target._handle(),
                                         draft._handle() if draft is not None else ffi.NULL))


@dataclass
class _Entry:
    tokens: Tuple[int, ...]
    checkpoint: Checkpoint


@dataclass
class PrefillSaver:
    """Where a prefill stops to take checkpoints (absolute prompt positions), and what
    takes one there."""

    positions: Sequence[int]
    save: Callable[[int], None]


class PrefixCheckpoints:
    """Checkpoints of prompt prefixes for one Engine, at most `budget_bytes` of them
    (host memory), evicted least recently used first. Taken at the end of every prompt
    (before its last token) and every `every` tokens of long prompts."""

    def __init__(self, budget_bytes: int, every: int = 512):
        if budget_bytes < 0:
            raise ValueError(f"the checkpoint budget must be >= 0 bytes, got {budget_bytes}")
        if every < 1:
            raise ValueError(f"checkpoints are taken every N >= 1 prompt tokens, got {every}")
        self.budget_bytes = int(budget_bytes)
        self.every = int(every)
        self._entries: "OrderedDict[Tuple[bool, Tuple[int, ...]], _Entry]" = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.saved = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def positions(self, prompt_len: int, start: int) -> List[int]:
        """Prompt positions after `start` where the prefill takes a checkpoint: every
        `every` tokens, and before the prompt's last token (whose logits begin the
        reply), so that the same prompt again resumes there too."""
        end = prompt_len - 1
        marks = list(range((start // self.every + 1) * self.every, end, self.every))
        return marks + [end] if end > start else marks

    def lookup(self, tokens: Sequence[int], limit: int, with_draft: bool, above: int = 0) -> Optional[Checkpoint]:
        """The longest checkpoint of a prefix of `tokens` longer than `above` and no
        longer than `limit` (with a drafter context when with_draft), counted as a hit
        or a miss."""
        best: Optional[Tuple[Tuple[bool, Tuple[int, ...]], _Entry]] = None
        for key, entry in self._entries.items():
            n = len(entry.tokens)
            if not above < n <= limit or (with_draft and not entry.checkpoint.has_draft):
                continue
            if best is not None and n <= len(best[1].tokens):
                continue
            if tuple(tokens[:n]) == entry.tokens:
                best = (key, entry)
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(best[0])
        return best[1].checkpoint

    def save(self, tokens: Sequence[int], target, draft=None) -> bool:
        """Checkpoint the current state as the state after `tokens`; False when it is
        already kept or larger than the whole budget."""
        key = (draft is not None, tuple(tokens))
        if key in self._entries:
            self._entries.move_to_end(key)
            return False
        if checkpoint_bytes(target, draft) > self.budget_bytes:
            return False
        checkpoint = Checkpoint(target, draft)
        if checkpoint.n_past != len(tokens):
            checkpoint.close()
            raise ValueError(f"the context holds {checkpoint.n_past} tokens, not the {len(tokens)} given")
        while self._entries and self.nbytes + checkpoint.nbytes > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.checkpoint.nbytes
            old.checkpoint.close()
            self.evicted += 1
        self._entries[key] = _Entry(key[1], checkpoint)
        self.nbytes += checkpoint.nbytes
        self.saved += 1
        return True

    def clear(self) -> None:
        for entry in self._entries.values():
            entry.checkpoint.close()
        self._entries.clear()
        self.nbytes = 0
