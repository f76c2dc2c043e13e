"""The near-tie hunter: teacher-force a target over real text and check, at every position,
that the logits row a verify computes is bit for bit the row a one-row decode computes.

Speculative decoding is lossless only if this holds: where the two rows differ in the last
bit, a near tie between the top two tokens (common in prose: 8-bit activation quantization
turns a last-bit difference into logit moves of 0.1-0.3) flips the verify's choice away from
plain decoding's. The reference is one decode step per token. Each mode then covers the same
positions in its own shape of step, and every row is compared whole (a digest of its bytes):

- ``chain-K``: verifies of K rows, committed whole (K = 2, 4, 8, 16);
- ``tree``: trees whose true path of 8 nodes carries a wrong sibling at every depth below the root;
- ``two-seqs``: chains of 4 beside another sequence's chain of 4 in the same step;
- ``chunk``: chains of 16 beside another sequence's 112-row prompt chunk in the same step.

``experiments/near_tie_hunt.py`` runs the whole matrix over thousands of positions and writes
the results on file; ``tests/runtime/test_near_ties.py`` runs a subset in CI.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from ..runtime.target import CHAIN, DECODE, LOGITS_LAST, LOGITS_NONE, TREE, Rows, Target

MODES = ("chain-2", "chain-4", "chain-8", "chain-16", "tree", "two-seqs", "chunk")
TREE_DEPTH = 8
SIDE_CHAIN = 4  # the other sequence's rows in two-seqs
# the other sequence's prompt chunk in chunk: with the 16 chain rows, a step of 128 rows,
# past the 64 where stock ggml's flash attention turns to its tiled kernel and within the
# 256 where the patched kernels keep every row's own (docs/exactness.md)
CHUNK_CHAIN = 16
CHUNK = 112
SIDE_SPAN = 512  # positions the other sequence runs through before it starts over


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row).tobytes(), digest_size=16).digest()


@dataclass
class Reference:
    """One-row decoding's rows after each token of `text`, as digests, with each row's
    top-1 minus top-2 logit."""

    digests: List[bytes] = field(default_factory=list)
    gaps: List[float] = field(default_factory=list)


@dataclass
class ModeResult:
    mode: str
    compared: int = 0
    differing: List[int] = field(default_factory=list)  # text positions whose rows differ

    @property
    def ok(self) -> bool:
        return self.compared > 0 and not self.differing


def reference(target: Target, prompt: Sequence[int], text: Sequence[int]) -> Reference:
    target.seq_reset(0)
    target.prefill(prompt, LOGITS_NONE)
    ref = Reference()
    for tok in text:
        target.decode([tok], LOGITS_LAST)
        row = target.logits(0, 1)[0]
        top2 = np.partition(row, -2)[-2:]
        ref.digests.append(_digest(row))
        ref.gaps.append(float(abs(top2[1] - top2[0])))
    return ref


def _compare(result: ModeResult, ref: Reference, pos: int, rows: np.ndarray) -> None:
    for i, row in enumerate(rows):
        result.compared += 1
        if _digest(row) != ref.digests[pos + i]:
            result.differing.append(pos + i)


def _chain(target: Target, text, ref, result, k: int, side: Callable[[int], List[Rows]] | None = None) -> None:
    for pos in range(0, len(text) - k + 1, k):
        rows = [Rows(0, CHAIN, text[pos:pos + k])] + (side(pos) if side else [])
        target.step(rows)
        _compare(result, ref, pos, target.logits(0, k))
        target.commit(k, seq=0)
        for r in rows[1:]:
            if r.kind == CHAIN:
                target.commit(r.n_rows, seq=r.seq)


def _tree(target: Target, text, ref, result, vocab: int) -> None:
    d = TREE_DEPTH
    for pos in range(0, len(text) - d + 1, d):
        # the root (the token the target has not seen yet), then depth by depth the true
        # node and a wrong sibling under the previous true node
        tokens, parents, path = [int(text[pos])], [-1], [0]
        for j in range(1, d):
            true_tok = int(text[pos + j])
            parents += [path[-1], path[-1]]
            path.append(len(tokens))
            tokens += [true_tok, (true_tok + 1 + j) % vocab]
        target.step([Rows(0, TREE, tokens, parents)])
        logits = target.logits(0, len(tokens))
        _compare(result, ref, pos, logits[path])
        target.commit_path(path, seq=0)


def hunt(target: Target, prompt: Sequence[int], text: Sequence[int], side_text: Sequence[int],
         modes: Sequence[str] = MODES, on_mode: Callable[[ModeResult], None] | None = None) -> Dict[str, object]:
    """Every mode's comparison of `text`'s rows (after `prompt`) with one-row decoding.
    The target needs 2 sequence slots, n_verify >= 2 * TREE_DEPTH - 1 and n_ubatch >= CHUNK + CHUNK_CHAIN;
    side_text feeds the other sequence (two-seqs, chunk)."""
    text = [int(t) for t in text]
    side_text = [int(t) for t in side_text]
    ref = reference(target, prompt, text)
    out: List[ModeResult] = []
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (one of {', '.join(MODES)})")
        result = ModeResult(mode)
        target.seq_reset(0)
        target.prefill(prompt, LOGITS_NONE)
        target.seq_reset(1)
        if mode.startswith("chain-"):
            _chain(target, text, ref, result, int(mode.split("-")[1]))
        elif mode == "tree":
            _tree(target, text, ref, result, target.n_vocab)
        elif mode == "two-seqs":
            _chain(target, text, ref, result, 4, side=lambda pos: [_side(target, side_text, CHAIN, SIDE_CHAIN)])
        else:
            _chain(target, text, ref, result, CHUNK_CHAIN, side=lambda pos: [_side(target, side_text, DECODE, CHUNK)])
        out.append(result)
        if on_mode:
            on_mode(result)
    gaps = np.asarray(ref.gaps)
    return {"positions": len(text), "modes": out, "gaps": gaps,
            "smallest_gaps": sorted(float(g) for g in gaps)[:10]}


def _side(target: Target, side_text: Sequence[int], kind: int, n: int) -> Rows:
    """The other sequence's next rows: a chain it commits, or a prompt chunk; it starts
    over (an empty sequence's first rows) when SIDE_SPAN positions are used."""
    if target.seq_n_past(1) + n > SIDE_SPAN:
        target.seq_reset(1)
    if target.seq_n_past(1) == 0 and kind == CHAIN:
        target.decode(side_text[:1], LOGITS_NONE, seq=1)  # a chain verifies after a committed token
    start = target.seq_n_past(1)
    tokens = [side_text[(start + i) % len(side_text)] for i in range(n)]
    return Rows(1, kind, tokens, logits=LOGITS_NONE if kind == DECODE else LOGITS_LAST)


# -- end to end: every speculative mode's greedy text against plain decoding's -----------

# Engine options of each mode; "draft" names the drafter it takes: "small" (a smaller
# model of the family, draft-simple) or "dflash" (a DFlash drafter for the target)
E2E_MODES: Dict[str, dict] = {
    "draft-simple": {"draft": "small", "spec_draft_n_max": 8},
    "draft-simple-tree": {"draft": "small", "spec_draft_n_max": 8, "tree_budget": 8},
    "cut-head": {"draft": "small", "spec_draft_n_max": 8, "spec_draft_vocab": 8192},
    "ngram-simple": {"spec_type": "ngram-simple"},
    "ngram-mod": {"spec_type": "ngram-mod"},
    "suffix": {"spec_type": "suffix"},
    "dflash": {"draft": "dflash", "draft_p_min": 0.0},
    "dflash-tree": {"draft": "dflash", "tree_budget": 8},
    "auto": {"draft": "small", "spec_draft_n_max": 8, "tree_budget": "auto"},
    "np4-joining": {"draft": "small", "spec_draft_n_max": 8, "n_seq": 4},
}
# an unused special token of each family stands in for an untrained DFlash drafter's mask
MASK_TOKENS = ("<|fim_pad|>", "<unused0>")


def untrained_dflash(target: str, out: str) -> str:
    """A seeded, untrained DFlash drafter for `target` at `out` (dflash-train's default
    shape): its drafts are noise, so nearly every verify row is a rejected draft's."""
    from ..runtime.gguf_meta import GGUFMeta
    from ..train.export import write_untrained

    tokens = GGUFMeta(target).get("tokenizer.ggml.tokens")
    mask = next((t for t in MASK_TOKENS if t in tokens), None)
    if mask is None:
        raise ValueError(f"{target}: none of {MASK_TOKENS} in its vocabulary to stand in for the mask")
    write_untrained(target, out, mask)
    return out


# per prompt index, the output a caller already has (not run again), and what it is told
# of each output a call makes (the index and the tokens): a long matrix resumes with them
Known = Optional[Dict[int, List[int]]]
OnOutput = Optional[Callable[[int, List[int]], None]]


def _each(prompts: Sequence[str], known: Known, on_output: OnOutput,
          run: Callable[[str], List[int]]) -> List[List[int]]:
    outs = []
    for i, p in enumerate(prompts):
        if known and i in known:
            outs.append(known[i])
            continue
        outs.append(run(p))
        if on_output is not None:
            on_output(i, outs[-1])
    return outs


def plain_outputs(model: str, prompts: Sequence[str], n_new: int, n_ctx: int = 1024, known: Known = None,
                  on_output: OnOutput = None) -> List[List[int]]:
    """Each prompt's plain greedy tokens (known, on_output: see Known, OnOutput)."""
    from ..engine.engine import Engine

    with Engine(model, n_ctx=n_ctx) as engine:
        return _each(prompts, known, on_output, lambda p: engine.generate(p, n_new, stop_tokens=()).tokens)


def mode_outputs(mode: str, model: str, drafters: Dict[str, str], prompts: Sequence[str], n_new: int,
                 n_ctx: int = 1024, known: Known = None, on_output: OnOutput = None) -> List[List[int]]:
    """Each prompt's greedy tokens under `mode` (E2E_MODES), drafters by kind ("small",
    "dflash": their files). np4-joining runs them four slots at a time, a new one
    joining every third round while the others decode (a group is run again unless
    all of it is known)."""
    from ..decoding.requests import Request
    from ..engine.engine import Engine

    options = dict(E2E_MODES[mode])
    kind = options.pop("draft", None)
    with Engine(model, drafters[kind] if kind else None, n_ctx=n_ctx, **options) as engine:
        if mode != "np4-joining":
            return _each(prompts, known, on_output, lambda p: engine.generate(p, n_new, stop_tokens=()).tokens)
        outs: List[List[int]] = [[] for _ in prompts]
        for first in range(0, len(prompts), 4):
            group = list(range(first, min(first + 4, len(prompts))))
            if known and all(i in known for i in group):
                for i in group:
                    outs[i] = known[i]
                continue
            members, batch, rounds, seqs = list(group), engine.batch(), 0, {}
            while group or len(batch):
                if group and rounds % 3 == 0:
                    i = group.pop(0)
                    seq = engine.sequence(Request(engine.encode(prompts[i]), n_new, ()), slot=i - first)
                    seqs[id(seq)] = i
                    batch.add(seq)
                for seq, new in batch.advance():
                    if seq.error is not None:
                        raise RuntimeError(seq.error)
                    outs[seqs[id(seq)]] += new
                rounds += 1
            if on_output is not None:
                for i in members:
                    on_output(i, outs[i])
        return outs


# Prompts where near ties are common: prose lists whose items could come in any order,
# sequences of numbers, docstrings, repeated list items, code openings with several good
# continuations. The first eight are the CI subset (tests/drafters/test_real_exactness.py).
TIE_PRONE_PROMPTS = [
    "def fibonacci(n):\n",
    "Ten things to do on a rainy Sunday:\n1. Choose a",
    'def parse_date(text):\n    """',
    "Primes below 200: 2, 3, 5, 7, 11,",
    "class Inventory:\n    def __init__(self",
    "Shopping list:\n- milk\n- eggs\n- bread\n- milk\n-",
    "The three most common mistakes new gardeners make are",
    "/* Returns the number of set bits in x. */\nint popcount(unsigned x) {\n",
    "Steps to brew pour-over coffee:\n1.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\n\n    Args:\n",
    "1, 1, 2, 3, 5, 8, 13, 21,",
    "Good names for a grey cat: Smoke, Ash,",
    "import os\nimport sys\nimport",
    "Q: What is the difference between a list and a tuple in Python?\nA:",
    "- apples\n- apples\n- pears\n- apples\n- pears\n-",
    "SELECT name, email FROM users WHERE",
    "The meeting covered budget, hiring and",
    "def is_palindrome(s: str) -> bool:\n",
    "Colors of the rainbow: red, orange,",
    "    # TODO: handle the case where",
    "Dear team,\n\nThank you all for",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "Reasons to learn a second language:\n\n1.",
    "0x00, 0x01, 0x02, 0x03,",
    "const express = require('express');\nconst app = express();\n",
    "Once upon a time, in a small village by the sea,",
    "def quicksort(xs):\n",
    "Monday: gym\nTuesday: gym\nWednesday:",
    "A good unit test should be",
    "#!/bin/bash\nset -euo pipefail\n\n",
    "Ingredients:\n- 2 cups flour\n- 1 cup sugar\n-",
    "The capital of France is Paris. The capital of Spain is",
]
