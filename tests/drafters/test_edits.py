"""The copy cursor (speculation/edits.py): following an output that copies its history through
edits, learning a substitution once the copy has taken up the source again, making it in
later drafts, forgetting it when the target does not follow it."""
from __future__ import annotations

from dflash_gguf.speculation.edits import CONFIRM, CopyCursor

# a source "file": 1 2 3 4 5 at two places, each followed by other text
SOURCE = [10, 11, 1, 2, 3, 4, 5, 12, 13, 14, 1, 2, 3, 4, 5, 15, 16, 17, 18, 19]
OLD, NEW = 3, 30  # the rename: token 3 becomes 30


def copying(source, copied, pos=0, run=8):
    """A cursor anchored at source[pos] (run tokens matched before it), then following an
    output that wrote `copied` after the source."""
    history = list(source)
    cursor = CopyCursor()
    cursor.follow(history)
    cursor.anchor(pos, run)
    for t in copied:
        history.append(t)
        cursor.follow(history)
    return cursor, history


def renamed(tokens):
    return [NEW if t == OLD else t for t in tokens]


def test_a_plain_copy_is_left_to_the_match_that_anchored_it():
    cursor, history = copying(SOURCE, SOURCE[:6])
    assert cursor.pos == 6 and cursor.run == 8 + 6
    # no edit yet: the suffix tree drafts this copy with the match's other occurrences
    assert cursor.draft(history, 4) == ([], 0)


def test_a_rename_is_learnt_after_the_copy_resumes_and_made_in_later_drafts():
    out = renamed(SOURCE[:5 + CONFIRM])  # through the first rename and CONFIRM tokens on
    cursor, history = copying(SOURCE, out)
    assert cursor.changes == {OLD: {(OLD,): (NEW,)}}  # token for token: made wherever 3 occurs
    drafts, run = cursor.draft(history, 12)
    assert drafts == renamed(SOURCE[len(out):len(out) + 12])  # the second 3 drafted as 30
    assert run == cursor.since_sync == CONFIRM  # priced by the copy since it took up the source


def test_a_rename_is_made_whatever_follows_the_renamed_token():
    # the second 3 is followed by 6, not by the 4 the first was: a rename is made there too
    source = [10, 11, 1, 2, 3, 4, 5, 12, 13, 14, 3, 6, 7, 8, 9]
    out = renamed(source[:5 + CONFIRM])
    cursor, history = copying(source, out)
    assert cursor.draft(history, 7)[0] == renamed(source[len(out):])  # 13 14 30 6 7 8 9


def test_a_change_of_another_length_is_made_only_before_the_token_it_was_seen_before():
    # 3 becomes 30 31: a rewrite of its place, learnt with the 4 after it
    source = [10, 11, 1, 2, 3, 4, 5, 12, 13, 14, 3, 6, 7, 8, 3, 4, 9]
    out = source[:4] + [30, 31] + source[5:5 + CONFIRM]
    cursor, history = copying(source, out)
    assert cursor.changes == {OLD: {(OLD, 4): (30, 31, 4)}}
    assert cursor.draft(history, 9)[0] == [13, 14, 3, 6, 7, 8, 30, 31, 4]  # the 3 before 6 left as it is


def test_an_insertion_resyncs_but_is_not_learnt():
    out = SOURCE[:3] + [40, 41] + SOURCE[3:8]  # two tokens inserted after the first 1
    cursor, history = copying(SOURCE, out)
    assert cursor.changes == {} and cursor.pos == 8
    assert cursor.draft(history, 3)[0] == SOURCE[8:11]


def test_a_change_the_target_does_not_follow_is_forgotten():
    out = renamed(SOURCE[:5 + CONFIRM]) + SOURCE[5 + CONFIRM:13]  # the second 3 kept as it was
    cursor, history = copying(SOURCE, out)
    assert cursor.changes.get(OLD, {}) == {}
    assert cursor.broke is not None  # the kept 3 is an edit of the changed copy


def test_a_chance_resync_gives_way_to_the_edit_going_on():
    # after the break, 1 matches the source near it by chance; the next token leaves it
    source = [20, 21, 22, 23, 1, 24, 25, 26, 27, 28, 29]
    out = [20, 21, 50, 1, 51, 52, 24, 25, 26, 27]  # 22 23 1 -> 50 1 51 52: resumes at 24
    cursor, history = copying(source, out)
    assert cursor.broke is None and cursor.pos == 9
    assert cursor.draft(history, 1)[0] == [28]


def test_an_edit_too_long_to_be_one_lets_go():
    out = SOURCE[:3] + list(range(100, 170))
    cursor, history = copying(SOURCE, out)
    assert cursor.pos is None and cursor.draft(history, 4) == ([], 0)
