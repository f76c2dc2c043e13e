"""Copying through edits: where a reply returns a text it was given with changes (rename
a variable, add a check, fix a line), the target copies the source, breaks off where an
edit starts, writes the edit and takes up the source again just after it. A match of the
context's tail finds the source anew only once the context past the edit is long enough
to occur there, and every later occurrence of the same change (a renamed variable's next
use) breaks the copy again. The cursor follows the copy instead:

  copying   it knows where in the text (the sequence's own history: the prompt, earlier
            turns, the output so far) the next token is copied from, and drafts from there
  an edit   on a token the source does not have, it holds the break and looks for where
            the source resumes: the nearest place shortly after the break whose tokens
            end the output so far
  a change  once the copy has gone on past such a resync, the edit is learnt as a
            substitution (the source's tokens from the break to the resync, written as
            the output's; with the first resync token on both sides unless it replaced
            them token for token, as a rename does): later drafts make it wherever the
            source has those tokens again, and forget it the first time the target does
            not follow it

A draft from the cursor is priced by the tokens copied since the copy took up the source
again (its run, pricing.RunHazard; none before CONFIRM of them), as a match of that length would be: a long copy
through an edit is not surer of the next edit than the match is. SuffixDrafts anchors the
cursor at its longest match (one longer than the cursor's run so far, which goes on
through edits) and weighs its chain against the suffix tree; the chain is offered only
once the copy has gone through an edit: before, it is the match's own continuation, which
the tree drafts with the match's other occurrences."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

RESYNC_WINDOW = 32  # the source tokens after a break where the copy may resume
RESYNC_WITHIN = 64  # an edit longer than this output is not a change of the source: let go
ANCHOR_IN_EDIT = 8  # inside an edit, a match this long moves the cursor (shorter ones are chance)
CONFIRM = 3  # tokens copied after a resync before its edit is learnt (a chance resync breaks sooner)
MAX_CHANGE = 16  # the longest substitution learnt (tokens of the source's side, and of the output's)
MAX_CHANGES = 64


class CopyCursor:
    """Where a sequence's output copies its history from, through edits (the module's
    doc). `follow` consumes the tokens the history gained; `anchor` points it at a
    match; `draft` reads ahead from where it stands."""

    __slots__ = ("pos", "pending", "applying", "run", "since_sync", "broke", "last_break",
                 "learning", "changes", "seen")

    def __init__(self):
        self.pos: Optional[int] = None  # the history index the next token copies (None: not copying)
        self.pending: List[int] = []  # a change's tokens still to come before history[pos]
        self.applying: Optional[Tuple[int, ...]] = None  # the change pending comes from
        self.run = 0  # tokens copied since anchored, through edits
        self.since_sync = 0  # tokens copied since anchored or resynced
        self.broke: Optional[Tuple[int, int]] = None  # an edit: (source index, output index) of its first token
        self.last_break: Optional[Tuple[int, int]] = None  # the edit the last resync ended
        self.learning: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None  # a change awaiting CONFIRM
        self.changes: Dict[int, Dict[Tuple[int, ...], Tuple[int, ...]]] = {}  # first token -> {source: output}
        self.seen: Optional[int] = None  # history tokens consumed

    # -- following the output ----------------------------------------------------------------

    def anchor(self, pos: int, run: int) -> None:
        """The output now copies from history[pos] on, having agreed with the text before it
        for `run` tokens (a match's length)."""
        self.pos, self.pending, self.applying = pos, [], None
        self.run = self.since_sync = run
        self.broke = self.last_break = self.learning = None

    def strength(self) -> int:
        """How long a match must be to anchor the cursor elsewhere: longer than its own
        run while it copies; an edit in progress keeps its break against short matches."""
        if self.broke is not None:
            return max(self.run, ANCHOR_IN_EDIT)
        return self.run if self.pos is not None else 0

    def follow(self, history: Sequence[int]) -> None:
        """Consume the tokens the history gained since the last call (the first call only
        notes where the output starts)."""
        if self.seen is None:
            self.seen = len(history)
            return
        for i in range(self.seen, len(history)):
            if self.broke is not None:
                self._resync(history, i)
            elif self.pos is not None:
                self._copy(history, i)
        self.seen = len(history)

    def _copy(self, h: Sequence[int], i: int) -> None:
        expected = self.pending[0] if self.pending else h[self.pos]
        if h[i] == expected:
            if self.pending:
                self.pending.pop(0)
            else:
                self.pos += 1
            self.run += 1
            self.since_sync += 1
            if self.learning is not None and self.since_sync >= CONFIRM:
                source, output = self.learning
                if len(self.changes) < MAX_CHANGES:
                    self.changes.setdefault(source[0], {})[source] = output
                self.learning = None
            self._expand(h, i + 1)
            return
        # the target left the copy: a change it made now is wrong, forget it
        if self.applying is not None:
            self.changes.get(self.applying[0], {}).pop(self.applying, None)
            self.pos -= len(self.applying)
        self.pending, self.applying, self.learning = [], None, None
        if self.last_break is not None and self.since_sync < CONFIRM:
            self.broke = self.last_break  # the resync was chance: the edit goes on
            self._resync(h, i)
        else:
            self.broke = (self.pos, i)

    def _resync(self, h: Sequence[int], i: int) -> None:
        """An edit started at source index b, output index o: does history[i] take up the
        source again shortly after b? The candidate nearest to a same-length edit wins."""
        b, o = self.broke
        if i - o > RESYNC_WITHIN:
            self.pos, self.broke = None, None  # not an edit of this source: let go
            return
        t, best = h[i], None
        for s in range(b, min(b + RESYNC_WINDOW, o)):
            if h[s] == t:
                off = abs((s - b) - (i - o))
                if best is None or off < best[0]:
                    best = (off, s)
        if best is None:
            return
        s = best[1]
        self.last_break, self.broke = (b, o), None
        self.pos, self.since_sync = s + 1, 1
        self.run += 1
        source, output = tuple(h[b:s]), tuple(h[o:i])
        # a substitution: an insertion (nothing of the source replaced) is not a change to
        # make elsewhere. One token for token (a rename) is made wherever its source
        # tokens occur; another is keyed with the token after it, where it was seen
        if source and len(source) <= MAX_CHANGE and len(output) <= MAX_CHANGE:
            self.learning = (source, output) if len(source) == len(output) else (source + (t,), output + (t,))
        self._expand(h, i + 1)

    def _expand(self, h: Sequence[int], end: int) -> None:
        """At a source position a learnt change starts: its output replaces it."""
        if self.pending or self.pos >= end:
            return
        change = self._change_at(h, self.pos, end)
        if change is not None:
            self.applying, output = change
            self.pending = list(output)
            self.pos += len(self.applying)

    # -- drafting ------------------------------------------------------------------------

    def draft(self, history: Sequence[int], n_max: int) -> Tuple[List[int], int]:
        """(the next tokens of the copy, learnt changes made, at most n_max, up to where
        the copy catches up with the output; the run they are priced by). ([], 0) while
        not copying, inside an edit, fewer than CONFIRM tokens past one, or before any
        edit (till then the copy is the match's own continuation, which the suffix tree
        drafts with the match's other occurrences)."""
        if self.pos is None or self.broke is not None or self.last_break is None or self.since_sync < CONFIRM:
            return [], 0
        end, out, pos = len(history), list(self.pending[:n_max]), self.pos
        while len(out) < n_max and pos < end:
            change = self._change_at(history, pos, end)
            if change is None:
                out.append(history[pos])
                pos += 1
            else:
                out.extend(change[1][:n_max - len(out)])
                pos += len(change[0])
        return out, self.since_sync

    def _change_at(self, h: Sequence[int], pos: int, end: int):
        """The learnt change whose source side starts at history[pos] (None: none)."""
        for source, output in self.changes.get(h[pos], {}).items():
            n = len(source)
            if pos + n <= end and tuple(h[pos:pos + n]) == source:
                return source, output
        return None
