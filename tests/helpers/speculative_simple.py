"""llama.cpp's llama-speculative-simple as an oracle of drafted and accepted counts: its
run (greedy, on the same GGUFs) and the same loop on our runtime, for every drafter kind
(test_mtp, test_eagle3, test_dspark, test_draft_simple, test_dflash_llama_cpp), and for
draft-simple on the published models the Engine's own steps against it
(engine_draft_simple_counts: test_real_pair, test_real_gemma3_pair,
experiments/draft_counts_llama_cpp.py). At -lv 5 it also logs every drafted position's top
candidates (the first is the draft) and each round's accepted count and last token, which
steps=True reads round by round."""
from __future__ import annotations

import re
from typing import Callable, Iterable, List, Optional, Sequence

# runs of llama-speculative-simple until one logs its summary (each takes a fraction of a
# second on the tests' tiny models)
ATTEMPTS = 20


# common/speculative.cpp: " - seq_id 0, draft candidate   0, pos   3:    123 (   0.456) 'piece'"
_CANDIDATE = re.compile(r" - seq_id (\d+), draft candidate\s+(\d+), pos\s+(\d+):\s+(-?\d+) \(")
# examples/speculative-simple: "accepted 2/7 draft tokens, the last target token is: (123)"
_ACCEPTED = re.compile(r"accepted (\d+)/(\d+) draft tokens, the last target token is: \((-?\d+)\)")
# a refuted pass undone on a target verified with checkpoints: "partial acceptance: 1 < 8, restoring checkpoint"
_RESTORED = re.compile(r"partial acceptance: (\d+) < (\d+), restoring checkpoint")


def parse_steps(log: str) -> list:
    """Each round of a -lv 5 log: the drafts the drafter made (before the loop cut them to
    the room left), how many the loop verified and the target accepted, and the target's
    token that ended the round. A weightless kind (ngram-*) logs no candidates: its rounds
    are read without their drafts."""
    rounds = [tuple(int(g) for g in m.groups()) for m in _ACCEPTED.finditer(log)]
    if not _CANDIDATE.search(log):
        return weightless_rounds(log)
    blocks, prev = [], None
    for m in _CANDIDATE.finditer(log):
        seq, cand, pos, tok = (int(g) for g in m.groups())
        if seq != 0 or cand != 0:
            continue
        if prev is None or pos <= prev:  # the first position of a new draft
            blocks.append([])
        blocks[-1].append(tok)
        prev = pos
    if len(blocks) != len(rounds):
        raise AssertionError(f"llama-speculative-simple logged {len(blocks)} drafts for {len(rounds)} rounds")
    return [{"drafts": b, "n_verified": n_draft, "n_accept": n_acc, "last": last}
            for b, (n_acc, n_draft, last) in zip(blocks, rounds)]


def weightless_rounds(log: str) -> list:
    """Each round of a -lv 5 log whose drafts are not logged (a weightless kind's): how many
    the loop verified and the target accepted, the target's token that ended it and, on a
    target verified with checkpoints, the length of the refuted draft the round undid
    first ("undone", 0 when none)."""
    marks = sorted([(m.start(), "accepted", tuple(int(g) for g in m.groups())) for m in _ACCEPTED.finditer(log)] +
                   [(m.start(), "undone", (int(m.group(2)),)) for m in _RESTORED.finditer(log)])
    rounds, undone = [], 0
    for _, what, values in marks:
        if what == "undone":
            undone = values[0]
            continue
        n_acc, n_draft, last = values
        rounds.append({"n_verified": n_draft, "n_accept": n_acc, "last": last, "undone": undone})
        undone = 0
    return rounds


def generated(steps: list, eog: Iterable[int]) -> list:
    """The tokens the rounds produced: each round's accepted drafts and the target's token
    after them, up to the first end-of-generation token (where the loop stops)."""
    eog, out = set(eog), []
    for s in steps:
        for t in s["drafts"][:s["n_accept"]] + [s["last"]]:
            out.append(t)
            if t in eog:
                return out
    return out


def llama_speculative_simple(model: str, text: str, n_predict: int, spec_type: str, n_max: int, *,
                             draft: Optional[str] = None, p_min: float = 0.0, n_ctx: int = 512,
                             steps: bool = False, exact: bool = False, flags: Sequence[str] = ()) -> dict:
    """llama-speculative-simple --spec-type `spec_type`, greedy, n-min 0, one thread: its
    counts (bench.llama_cpp.parse_speculative), with steps=True its rounds too ("steps":
    parse_steps). exact: the target's and the drafter's KV caches in f32 (llama.cpp's
    default is f16), as the tests run ours, and no flash attention (its CPU kernel rounds
    otherwise: a drafter logit tie 0.0014 apart picks the other token with it, and the
    same as ours without). `flags`: more of its flags (a weightless kind's). The text it
    printed is "stdout". A missing tool is a missing oracle."""
    from dflash_gguf.tools import llama_cpp_tree
    from dflash_gguf.bench.llama_cpp import parse_speculative, run_parsed
    from helpers.fixtures import missing_oracle

    exe = llama_cpp_tree.tool("llama-speculative-simple")
    if exe is None:
        missing_oracle("llama-speculative-simple is not built (.venv/bin/python scripts/llama_cpp_build.py "
                       "llama-speculative-simple)")
    cmd = [str(exe), "-m", str(model), *(["-md", str(draft)] if draft else []), "-c", str(n_ctx),
           "-n", str(n_predict), "-t", "1", "-tb", "1", "--temp", "0", "--spec-type", spec_type,
           "--spec-draft-n-max", str(n_max), "--spec-draft-n-min", "0", "--spec-draft-p-min", str(p_min),
           *(["-lv", "5"] if steps else []),
           *(["-ctk", "f32", "-ctv", "f32", "-ctkd", "f32", "-ctvd", "f32", "-fa", "off"] if exact else []),
           *flags, "-p", text]

    def parse(log: str) -> dict:
        out = parse_speculative(log)
        if steps and "rounds" in out:
            out["steps"] = parse_steps(log)
        return out

    # llama.cpp's logger is a thread its exit does not wait for (common/log.cpp leaks it on
    # purpose): on a loaded machine most runs lose the summary, so a run is tried often
    stdout, r = run_parsed(cmd, parse, "rounds", attempts=ATTEMPTS)
    return {**r, "stdout": stdout}


def speculative_simple_loop(target, draft_step: Callable[[int, List[int], int], List[int]], tokens: List[int],
                            n_predict: int, n_ctx: int, eog, checkpoints: bool = False) -> dict:
    """llama-speculative-simple's loop on our target, whose context holds the prompt but
    its last token: every step drafts after the last token (draft_step(last, pending,
    room): `pending` the tokens committed since its last call, `room` what the context
    and n_predict leave, 0 for no limit, as llama.cpp passes it), verifies the drafts
    with it and keeps the accepted; the loop ends past n_predict tokens or at an
    end-of-generation token. Its counts, and its rounds ("steps", as parse_steps reads
    llama.cpp's).

    checkpoints: as llama.cpp runs a target whose context cannot drop its last positions
    (a recurrent one: "will use checkpoints"): a draft the target refutes is undone and
    the kept drafts with the target's token after them are verified again as the round's
    draft, the refuted pass counting nothing; so the round reports them all accepted
    (its drafter hears that count) and ends on the token after them. Ours decodes that
    token after the kept ones (its rows round as a longer pass's)."""
    last, n_past, pending = tokens[-1], len(tokens) - 1, []
    eog = set(eog)
    counts = {"n_drafted": 0, "n_accept": 0, "n_predict": 0, "steps": []}
    while True:
        room = max(0, min(n_ctx - n_past - 2, n_predict - counts["n_predict"] - 1))
        made, undone = draft_step(last, pending, room), 0
        drafts = made[:room] if room > 0 else made
        block = [last] + drafts
        target.verify(block)
        choice = target.choices(0, len(block))
        n_acc = 0
        while n_acc < len(drafts) and drafts[n_acc] == int(choice[n_acc]):
            n_acc += 1
        ids = drafts[:n_acc] + [int(choice[n_acc])]
        target.commit(n_acc + 1)
        pending = block[:n_acc + 1]
        if checkpoints and n_acc < len(drafts):
            target.verify(ids[-1:])
            following = int(target.choices(0, 1)[0])
            target.commit(1)
            pending, made, undone = pending + ids[-1:], ids, len(drafts)
            drafts, n_acc, ids = ids, len(ids), ids + [following]
        counts["n_drafted"] += len(drafts)
        counts["n_accept"] += n_acc
        counts["n_predict"] += len(ids)
        eog_at = next((i for i, t in enumerate(ids) if t in eog), None)
        counts["steps"].append({"drafts": made, "n_verified": len(drafts), "n_accept": n_acc,
                                "last": ids[-1] if eog_at is None else ids[eog_at],
                                **({"undone": undone} if checkpoints else {})})
        n_past += len(ids)
        last = ids[-1]
        if counts["n_predict"] > n_predict or eog_at is not None:
            return counts


COUNTS = ("n_drafted", "n_accept", "n_predict")


def began_with_room(produced: List[int], n_predict: int) -> int:
    """How many of a loop's first rounds (`produced`: the tokens each made) began with room
    to draft under -n n_predict: fewer than n_predict - 1 tokens out before them."""
    done = 0
    for i, n in enumerate(produced):
        if n_predict - done - 1 < 1:
            return i
        done += n
    return len(produced)


def engine_draft_simple_counts(target: str, small: str, text: str, n_new: int, n_max: int,
                                p_min: float = 0.0) -> dict:
    """The Engine's own greedy draft-simple chain (its steps: decoding.step) against
    llama-speculative-simple --spec-type draft-simple on the same files, same n-max and
    p-min, one thread, each side's default (f16) caches: each side's n_drafted, n_accept
    and n_predict ("ours", "llama"), whether they are equal and whether the greedy tokens
    are ("tokens_equal").

    llama.cpp's loop differs from the Engine's in two places, neither a bug of ours, and
    the counts are compared modulo both:
    - its start: it prefills the prompt but its last token and drafts its first round
      after that token (its first draft guesses the first generated token), where the
      Engine's prefill chooses the first token with the prompt's last row and drafts from
      the next step on. llama.cpp is given the prompt followed by the Engine's first
      token, and -n one less: its rounds are then the Engine's steps;
    - its end: a round drafts at most what -n leaves after the target's own token
      (n - n_predict - 1, floored at 0), but a room of 0 goes to the drafter as its
      n_max 0, which common/speculative.cpp reads as no limit, and the loop stops only
      past -n. So a round that begins with no room drafts a whole n_max and overshoots
      -n, where the Engine's last step decodes its last token alone (drafts 0) and stops
      at n_new. Only the rounds llama.cpp began with room count (-lv 5 logs each); on our
      side the steps that began with room (a later one drafts nothing)."""
    from dflash_gguf import Engine
    from dflash_gguf.speculation.kinds import SIMPLE
    from dflash_gguf.runtime.tokenizer import Tokenizer

    tok = Tokenizer(target)
    with Engine(target, small, n_ctx=512, spec_draft_n_max=n_max, draft_p_min=p_min, n_threads=1) as engine:
        got = engine.generate(text, n_new, stop_tokens=())
    stats, first, rest = got.stats, got.tokens[0], got.tokens[1:]
    shifted = text + tok.decode([first])
    if tok.encode(shifted) != tok.encode(text) + [first]:
        raise ValueError(f"{text!r} followed by its first token's text tokenizes otherwise: pick another prompt")
    want = llama_speculative_simple(target, shifted, n_new - 1, "draft-simple", n_max, draft=small,
                                    p_min=p_min, steps=True)
    rounds = want["steps"][:began_with_room([s["n_accept"] + 1 for s in want["steps"]], n_new - 1)]
    llama = {"n_drafted": sum(s["n_verified"] for s in rounds), "n_accept": sum(s["n_accept"] for s in rounds),
             "n_predict": sum(s["n_accept"] + 1 for s in rounds)}
    lengths = stats.accepted_lengths
    ours = {"n_drafted": stats.drafts.drafted.get(SIMPLE, 0), "n_accept": stats.drafts.accepted.get(SIMPLE, 0),
            "n_predict": sum(lengths[:began_with_room(lengths, n_new - 1)])}
    return {"ours": ours, "llama": llama, "llama_whole": {k: want[k] for k in COUNTS}, "equal": ours == llama,
            "tokens_equal": generated(want["steps"], tok.eog_ids)[:n_new - 1] == rest,
            "llama_attempts": want.get("attempts")}
