"""What each slot of an engine's memory holds between requests, and where a request's
prefill starts in its slot: after the context the slot holds when the prompt extends it
(a chat that goes on), else after the longest checkpointed prefix of the prompt
(runtime/checkpoints.py) when one beats that."""
from __future__ import annotations

from typing import Callable, List, Optional

from ..decoding.requests import GenerationStats, Placement, Request
from ..runtime.checkpoints import PrefillSaver, PrefixCheckpoints


def goes_on(prompt: List[int], held: List[int]) -> bool:
    """The prompt continues the context a slot holds (and adds to it)."""
    return 0 < len(held) < len(prompt) and prompt[:len(held)] == held


class SlotContexts:
    """Per slot of the target (and drafter): the tokens its context holds, and whether it
    was filled speculatively; with `checkpoints` set, the prefix checkpoints prompts
    resume from and are saved into."""

    def __init__(self, models, n_seq: int):
        self.models = models  # loading.LoadedModels: the target and drafter the slots are in
        self.contexts: List[tuple] = [([], None) for _ in range(n_seq)]
        self.checkpoints: Optional[PrefixCheckpoints] = None
        self.offered: set = set()  # slots whose context as it is now keep() offered to the checkpoints

    def held(self, slot: int) -> List[int]:
        return self.contexts[slot][0]

    def forget(self) -> None:
        """Every slot holds nothing known (graphs of other work ran on the target)."""
        self.contexts = [([], None) for _ in self.contexts]
        self.offered.clear()

    def take(self, slot: int, tokens: List[int], use_draft: bool, reuse_prefix: bool) -> int:
        """How many of the prompt's tokens the slot's context already holds (0 unless the
        prompt extends it and it was filled the same way); the slot's context is unknown
        from now until the run ends (end())."""
        held, mode = self.contexts[slot]
        reused = len(held) if reuse_prefix and mode == use_draft and goes_on(tokens, held) else 0
        self.contexts[slot] = ([], None)
        self.offered.discard(slot)
        return reused

    def keep(self, slot: int) -> int:
        """Checkpoint what the slot's context holds, whole (a reply's tokens too), so that a
        prompt going on from it resumes there once another request has the slot; the
        tokens kept (0: none known, kept already, over the budget, or a state that cannot
        be checkpointed now: a speculative run's last commit still carried by the next
        step, as on a recurrent target, or a drafter context behind the target's). A context
        is offered once: an idle slot asked again costs nothing."""
        held, use_draft = self.contexts[slot]
        target, draft = self.models.target, self.models.draft if use_draft else None
        if self.checkpoints is None or not held or slot in self.offered or not target.settled(slot):
            return 0
        self.offered.add(slot)
        if draft is not None and draft.n_past(slot) != target.seq_n_past(slot):
            return 0
        return len(held) if self.checkpoints.save(held, target, draft, slot) else 0

    def placement(self, request: Request, slot: int, reused: int, use_draft: bool, stats: GenerationStats,
                  on_stage: Optional[Callable[[str], None]]) -> Placement:
        """The request's place in the slot, `reused` prompt tokens held: resumed from a
        longer checkpointed prefix when there is one, its prefill saving checkpoints."""
        tokens, saver = request.prompt, None
        if self.checkpoints is not None and tokens:
            if request.reuse_prefix:
                reused = self._resume(tokens, reused, use_draft, stats, slot)
            saver = self._saver(tokens, reused, use_draft, slot)
        return Placement(slot, reused, on_stage, saver)

    def _resume(self, tokens: List[int], reused: int, use_draft: bool, stats: GenerationStats, slot: int) -> int:
        """Restore the longest checkpointed prefix of `tokens` that beats the context
        already held (at least one prompt token is left to compute: the first new
        token comes from its logits) into the slot; returns the prompt tokens now in context."""
        draft = self.models.draft if use_draft else None
        found = self.checkpoints.lookup(tokens, len(tokens) - 1, use_draft, above=reused)
        if found is None:
            return reused
        found.restore(self.models.target, draft, slot)
        device, host = self.checkpoints.chain_bytes(found)
        stats.checkpoint = {"position": found.n_past, "device_bytes": device, "host_bytes": host}
        return found.n_past

    def _saver(self, tokens: List[int], start: int, use_draft: bool, slot: int) -> PrefillSaver:
        draft = self.models.draft if use_draft else None
        return PrefillSaver(self.checkpoints.positions(len(tokens), start),
                            lambda n: self.checkpoints.save(tokens[:n], self.models.target, draft, slot))

    def end(self, seq, out: List[int], failed: bool) -> None:
        """A sequence's run ended with `out` emitted: its slot's context is known for the
        next request unless it failed midway (a verify not committed, drafter rows not
        appended: the next request in the slot starts afresh)."""
        if failed:
            return
        # every emitted token but the last is in context, unless a stop cut a pass short
        context = seq.tokens.prompt + out[:-1]
        if out and self.models.target.seq_n_past(seq.slot) == len(context):
            self.contexts[seq.slot] = (context, seq.draft is not None)
