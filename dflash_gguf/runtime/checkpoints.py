"""Prefix checkpoints: the decoding state at a prompt position, kept so that a later
prompt sharing the prefix resumes there instead of prefilling it again.

A checkpoint (csrc/dfl_checkpoint.c) holds everything the position needs: attention
K/V rows, recurrent and conv states, and the drafter's context (its window). State on a
device is kept in that device's memory (copied device to device) while the store's
device budget allows, in host memory otherwise. Checkpoints of one long prompt share
its prefix: each keeps the rows from its parent checkpoint's position on, plus the
fixed-size recurrent and conv states. The store keeps them under a byte budget, least
recently used first out, never dropping a checkpoint a kept one reads from."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .native import NativeObject, check, ffi, lib


def _handle(obj):
    return obj._handle() if obj is not None else ffi.NULL


def measure(target, draft=None, parent: Optional["Checkpoint"] = None, seq: int = 0) -> Tuple[int, int]:
    """What a Checkpoint of the sequence in target (and drafter) on top of `parent` would
    hold now, kept where its state lives: (bytes of device state, bytes of host state)."""
    device, host = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    check(lib.dfl_checkpoint_measure(target._handle(), _handle(draft), int(seq), _handle(parent), device, host))
    return int(device[0]), int(host[0])


def checkpoint_bytes(target, draft=None, parent: Optional["Checkpoint"] = None, seq: int = 0) -> int:
    """The bytes a Checkpoint of the sequence in target (and drafter) on top of `parent`
    would take now."""
    return sum(measure(target, draft, parent, seq))


class Checkpoint(NativeObject):
    """The state of a sequence of a target (and drafter) at its current position, which
    restores into any of their sequence slots. `parent`: an earlier checkpoint of a
    prefix of the same tokens, whose rows this one then reads instead of copying them
    again. `on_device`: keep the copy of device state on that device (False: in host
    memory)."""

    _what = "checkpoint"
    _free = staticmethod(lib.dfl_checkpoint_free)

    def __init__(self, target, draft=None, parent: Optional["Checkpoint"] = None, on_device: bool = True,
                 seq: int = 0):
        if parent is not None and parent.has_draft != (draft is not None):
            raise ValueError("the parent checkpoint was taken with another drafter (or none)")
        out = ffi.new("dfl_checkpoint **")
        check(lib.dfl_checkpoint_save(target._handle(), _handle(draft), int(seq), _handle(parent), int(on_device), out))
        self._ptr = out[0]
        self.has_draft = draft is not None
        self.n_past = int(lib.dfl_checkpoint_n_past(self._ptr))
        self.parent_n_past = int(lib.dfl_checkpoint_parent_n_past(self._ptr))  # 0: no parent read
        self.device_bytes = int(lib.dfl_checkpoint_device_bytes(self._ptr))
        self.host_bytes = int(lib.dfl_checkpoint_host_bytes(self._ptr))
        self.overhead_bytes = int(lib.dfl_checkpoint_overhead_bytes(self._ptr))
        self.nbytes = self.device_bytes + self.host_bytes

    def restore(self, target, draft=None, seq: int = 0) -> None:
        """Put the sequence of target (and drafter) at this position; its next decode
        continues from it exactly as from the original context."""
        check(lib.dfl_checkpoint_restore(self._handle(), target._handle(), _handle(draft), int(seq)))


DEVICE_MARGIN = 512 << 20


def device_room(plan, margin: int = DEVICE_MARGIN) -> int:
    """Device memory a memory.MemoryPlan leaves for checkpoints: what each device other
    than the CPU reported free before loading, less what the plan puts there and a
    margin (the CPU's checkpoints are host memory, counted in the whole budget)."""
    return sum(max(0, d.free - d.need - margin) for d in plan.devices if d.name != "CPU" and d.free)


def _packed(tokens: Sequence[int]) -> bytes:
    """Token ids as int32 bytes, what the store's digests are taken of."""
    return np.asarray(tokens, dtype=np.int32).tobytes()


def _digests(packed: bytes, lengths: Iterable[int]) -> Dict[int, bytes]:
    """The SHA-256 of each prefix of `packed` of the given token counts, in one pass over
    it. The store keeps a prefix as its digest and length: a copy of its tokens, a block
    of kilobytes from the C heap per entry, fragmented the heap as the store turned over
    (the soak's creep), where 32 bytes stay in Python's small-object arenas."""
    h, at, out, view = hashlib.sha256(), 0, {}, memoryview(packed)
    for n in sorted(set(lengths)):
        h.update(view[4 * at:4 * n])
        at = n
        out[n] = h.copy().digest()
    return out


# Bytes of the store's own record of an entry: the key tuple and its digest, the entry,
# the Checkpoint object and the OrderedDict's slot (about 600 bytes of Python objects).
# Measured: a store of 200 checkpoints of the demo pair grew the process by 1 KiB an
# entry more than their checkpoints' own bytes (with keys that were then token copies).
_ENTRY_OVERHEAD = 1024


@dataclass
class _Entry:
    n_tokens: int
    digest: bytes  # _digests of its prefix
    checkpoint: Checkpoint
    parent: Optional[Tuple[bool, bytes]]  # the key of the entry it reads rows from
    children: int = 0  # kept entries reading rows from this one

    @property
    def overhead_bytes(self) -> int:
        """Host memory the entry keeps besides the checkpoint's state: its key and record,
        and the checkpoint's own (see dfl_checkpoint_overhead_bytes)."""
        return _ENTRY_OVERHEAD + self.checkpoint.overhead_bytes


@dataclass
class PrefillSaver:
    """Where a prefill stops to take checkpoints (absolute prompt positions), and what
    takes one there."""

    positions: Sequence[int]
    save: Callable[[int], None]


class PrefixCheckpoints:
    """Checkpoints of prompt prefixes for one Engine, at most `budget_bytes` of them,
    evicted least recently used first (a checkpoint another kept one reads from stays
    until that one goes). Taken at the end of every prompt (before its last token) and
    every `every` tokens of long prompts. Of the budget, at most `device_budget_bytes`
    (default: all of it) is device memory: a checkpoint goes to the device while that
    room lasts (or the device allocation succeeds), to host memory otherwise."""

    def __init__(self, budget_bytes: int, every: int = 512, device_budget_bytes: Optional[int] = None):
        if budget_bytes < 0:
            raise ValueError(f"the checkpoint budget must be >= 0 bytes, got {budget_bytes}")
        if every < 1:
            raise ValueError(f"checkpoints are taken every N >= 1 prompt tokens, got {every}")
        if device_budget_bytes is not None and device_budget_bytes < 0:
            raise ValueError(f"the device checkpoint budget must be >= 0 bytes, got {device_budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.every = int(every)
        self.device_budget_bytes = self.budget_bytes if device_budget_bytes is None else int(device_budget_bytes)
        self._entries: "OrderedDict[Tuple[bool, bytes], _Entry]" = OrderedDict()
        self.device_nbytes = 0
        self.host_nbytes = 0
        self.overhead_nbytes = 0  # host memory the entries keep besides the state (Entry.overhead_bytes)
        self.hits = 0
        self.misses = 0
        self.saved = 0
        self.evicted = 0

    @property
    def nbytes(self) -> int:
        """The checkpoints' state bytes (device and host)."""
        return self.device_nbytes + self.host_nbytes

    @property
    def held_nbytes(self) -> int:
        """All the store holds, its own records and the checkpoints' overhead included:
        what its budget bounds."""
        return self.nbytes + self.overhead_nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def checkpoints(self) -> List[Checkpoint]:
        """The kept checkpoints, least recently used first."""
        return [e.checkpoint for e in self._entries.values()]

    def positions(self, prompt_len: int, start: int) -> List[int]:
        """Prompt positions after `start` where the prefill takes a checkpoint: every
        `every` tokens, and before the prompt's last token (whose logits begin the
        reply), so that the same prompt again resumes there too."""
        end = prompt_len - 1
        marks = list(range((start // self.every + 1) * self.every, end, self.every))
        return marks + [end] if end > start else marks

    def _longest(self, tokens: Sequence[int], limit: int, with_draft: bool, above: int = 0,
                 exact_draft: bool = False):
        found = [(key, entry) for key, entry in self._entries.items()
                 if above < entry.n_tokens <= min(limit, len(tokens))
                 and not (with_draft and not entry.checkpoint.has_draft)
                 and not (exact_draft and entry.checkpoint.has_draft != with_draft)]
        digests = _digests(_packed(tokens[:limit]), (entry.n_tokens for _, entry in found))
        best = None
        for key, entry in found:
            if entry.digest == digests[entry.n_tokens] and (best is None or entry.n_tokens > best[1].n_tokens):
                best = (key, entry)
        return best

    def lookup(self, tokens: Sequence[int], limit: int, with_draft: bool, above: int = 0) -> Optional[Checkpoint]:
        """The longest checkpoint of a prefix of `tokens` longer than `above` and no
        longer than `limit` (with a drafter context when with_draft), counted as a hit
        or a miss."""
        best = self._longest(tokens, limit, with_draft, above)
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(best[0])
        return best[1].checkpoint

    def chain_bytes(self, checkpoint: Checkpoint) -> Tuple[int, int]:
        """(device, host) bytes a restore of `checkpoint` reads: its own and those of
        the kept checkpoints it reads rows from."""
        entry = next(e for e in self._entries.values() if e.checkpoint is checkpoint)
        device = host = 0
        while entry is not None:
            device += entry.checkpoint.device_bytes
            host += entry.checkpoint.host_bytes
            entry = self._entries[entry.parent] if entry.parent is not None else None
        return device, host

    def _evict(self, key) -> None:
        entry = self._entries.pop(key)
        self.device_nbytes -= entry.checkpoint.device_bytes
        self.host_nbytes -= entry.checkpoint.host_bytes
        self.overhead_nbytes -= entry.overhead_bytes
        entry.checkpoint.close()
        if entry.parent is not None:
            self._entries[entry.parent].children -= 1
        self.evicted += 1

    def _evict_one(self, keep) -> bool:
        """Drop the least recently used checkpoint nothing kept reads from, other than
        `keep`: a chain is shortened from its end, so a shared prefix outlives the
        prompts that branch off it."""
        for key, entry in self._entries.items():
            if entry.children == 0 and key != keep:
                self._evict(key)
                return True
        return False

    def save(self, tokens: Sequence[int], target, draft=None, seq: int = 0) -> bool:
        """Checkpoint the sequence's state as the state after `tokens`, on top of the
        longest kept checkpoint of a prefix of them; False when it is already kept or
        does not fit the budget. When only that parent could make room, it goes and the
        new one holds its rows instead (the newest position of a prompt is the one a
        follow-up needs)."""
        key = (draft is not None, _digests(_packed(tokens), [len(tokens)])[len(tokens)])
        if key in self._entries:
            self._entries.move_to_end(key)
            return False
        while True:
            found = self._longest(tokens, len(tokens) - 1, draft is not None, exact_draft=True)
            parent_key, parent = (found[0], found[1].checkpoint) if found else (None, None)
            device, host = measure(target, draft, parent, seq)
            if device + host > self.budget_bytes:
                return False
            if self.held_nbytes + device + host <= self.budget_bytes:
                break
            if not self._evict_one(keep=parent_key):
                if parent_key is None or self._entries[parent_key].children:
                    return False
                self._evict(parent_key)
        on_device = self.device_nbytes + device <= self.device_budget_bytes
        checkpoint = Checkpoint(target, draft, parent, on_device, seq)
        if checkpoint.n_past != len(tokens):
            checkpoint.close()
            raise ValueError(f"the context holds {checkpoint.n_past} tokens, not the {len(tokens)} given")
        if not checkpoint.parent_n_past:
            parent_key = None  # it holds every row itself
        if parent_key is not None:
            self._entries[parent_key].children += 1
        entry = self._entries[key] = _Entry(len(tokens), key[1], checkpoint, parent_key)
        self.device_nbytes += checkpoint.device_bytes
        self.host_nbytes += checkpoint.host_bytes
        self.overhead_nbytes += entry.overhead_bytes
        self.saved += 1
        return True

    def clear(self) -> None:
        for entry in self._entries.values():
            entry.checkpoint.close()
        self._entries.clear()
        self.device_nbytes = self.host_nbytes = self.overhead_nbytes = 0
