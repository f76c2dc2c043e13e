"""A step's rows never leave the range where every row rounds as a one-row decode does
(INVARIANT_STEP_ROWS: past it the patched CPU's flash attention takes its tiled kernel):
sequences whose proposals together pass it verify in passes (decoding/verify.py), each a
graph of whole proposals, and a joining prompt's chunk rides in the room the last pass
leaves. However many sequences and whatever the tree budget, greedy output stays plain
decoding's token for token."""
from __future__ import annotations

import pytest

from dflash_gguf import Engine
from dflash_gguf.decoding.verify import step_passes
from dflash_gguf.runtime.target import DECODE, INVARIANT_STEP_ROWS
from helpers.decoding_checks import solo_and_batched
from helpers.paths import ROOT

DATA = ROOT / "dflash_gguf" / "data"
TEXTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef walk(root):",
         "def quicksort(xs):", "# Read a file line by line\n"]


@pytest.mark.parametrize("rows, most, passes", [
    ([64] * 5, 256, [[0, 1, 2, 3], [4]]),
    ([64] * 4, 256, [[0, 1, 2, 3]]),
    ([1, 300, 2], 256, [[0], [1], [2]]),
    ([100, 100, 100], 256, [[0, 1], [2]]),
    ([], 256, [[]]),
])
def test_passes_hold_whole_proposals_within_the_rows(rows, most, passes):
    assert step_passes(rows, most) == passes


def rows_per_graph(engine):
    """Record the rows of every target graph of the engine's steps that verifies (a prompt
    pass of its own may be longer: it rounds as the prompt alone does)."""
    seen = []
    step = engine.target.step

    def counting(rows, *args, **kwargs):
        if any(r.kind != DECODE for r in rows):
            seen.append(sum(r.n_rows for r in rows))
        return step(rows, *args, **kwargs)

    engine.target.step = counting
    return seen


def test_five_trees_of_63_nodes_verify_in_passes_and_equal_plain_decoding():
    """-np 5 --tree-budget 63: five 64-row trees are 320 rows, past the invariant 256."""
    with Engine(str(DATA / "demo-target.gguf"), str(DATA / "demo-draft.gguf"), n_seq=5, tree_budget=63,
                n_ctx=512, n_threads=2) as engine:
        plain = [engine.generate(t, 40, stop_tokens=(), speculative=False).tokens for t in TEXTS]
        seen = rows_per_graph(engine)
        _, batched, _ = solo_and_batched(engine, TEXTS, 40)
    assert batched == plain
    assert max(seen) <= INVARIANT_STEP_ROWS, max(seen)
    assert sum(1 for n in seen if n > INVARIANT_STEP_ROWS // 2) >= 2  # full passes ran


def test_a_long_prompt_joins_trees_within_the_rows_and_equals_plain_decoding():
    """A prompt of several hundred tokens joins four sequences verifying 64-node trees: its
    chunks go in the room their passes leave, and every output is plain decoding's."""
    long_prompt = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(60)) + "def g("
    texts = TEXTS[:4] + [long_prompt]
    with Engine(str(DATA / "demo-target.gguf"), str(DATA / "demo-draft.gguf"), n_seq=5, tree_budget=63,
                n_ctx=2048, n_threads=2) as engine:
        assert len(engine.encode(long_prompt)) > 2 * INVARIANT_STEP_ROWS
        plain = [engine.generate(t, 32, stop_tokens=(), speculative=False).tokens for t in texts]
        seen = rows_per_graph(engine)
        _, batched, _ = solo_and_batched(engine, texts, 32)
    assert batched == plain
    assert max(seen) <= INVARIANT_STEP_ROWS, max(seen)
