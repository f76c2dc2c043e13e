"""The published Gemma 3 270M GGUF (google/gemma-3-270m as llama.cpp's GGUF-my-repo wrote
it: Q4_K_M mixing Q4_K, Q5_0, Q6_K and Q8_0, a tied Q8_0 embedding, SentencePiece vocabulary
of 262,144 tokens) against libllama on the same file: tokenization of real text, greedy
text over 128 tokens after eight prompts (code, prose, chat in the Gemma template, two
longer than the 512-token sliding window of the local layers, so that the window decides
the output), and the teacher-forced logits of llama.cpp's top 20 candidates at generated
positions.

llama.cpp runs as its own tools run on the CPU: flash attention on (their default `-fa auto`
turns it on wherever the device supports it) and the sliding-window layers' cache the size
of the window and a ubatch (768 cells here), used as a ring (their default: no
`--swa-full`). llama-cpp-python's defaults are the other way for both. Our runtime always
uses ggml's flash-attention op and a ring of the same size, and then the two engines'
one-token decodes are bit for bit equal (measured: 0 difference over the whole vocabulary
at 32 decode steps after the code prompt and at all 256 after the 676-token long_code
prompt). With llama-cpp-python's defaults they are not:
- without flash attention llama.cpp multiplies the f16 cache by the queries and the
  probabilities as separate products, and its logits part from its own flash-attention
  ones (and ours) by whole units: what the earlier, looser form of this test measured as
  "one-token decodes that part";
- with a full-size sliding-window cache the local layers attend over the cells in
  position order, ours in ring order, and ggml's flash attention (an online softmax with
  an f16 V accumulator) rounds another way once the ring wraps, and the texts part
  after that.
experiments/gemma3_decode_gaps.py measures all three (results/gemma3-decode-gaps-2026-11-26.json,
docs/parity.md).

Runs only where the file has been fetched (`scripts/setup.sh test` does it); under CI=true
a missing file fails."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from helpers.fixtures import missing_oracle, open_llama
from helpers.paths import ROOT

pytestmark = pytest.mark.real

N_NEW = 128  # CI's length (it was 256: the stage's time on two cores)
TOP = 20
# The teacher-forced comparison runs our batched pass over llama.cpp's continuation
# (N_FORCED rows of full-vocabulary logits at once) against llama.cpp's one-token decodes.
# A batch of rows goes through other kernels than one row (ggml's CPU matrix products
# quantize and tile a batch's activations otherwise, and its flash attention takes a tiled
# path from 32 query rows on), and Gemma's residual stream, running to thousands, grows
# those last-bit differences: our own batched and one-token passes part as llama.cpp's
# own do (the one-token decodes of both engines are equal, test_greedy_text_equals_llama_cpp).
# Measured on long_code, the farthest: a mean gap of 0.35, per-position largest gap median
# 0.72, 90th percentile 1.28, max 2.7 (results/gemma3-teacher-forced-2026-11-26.json; code
# meets near-ties often); every other prompt stayed within the bounds
# below, which the looser form of this test had set at 1.5x its measurements, with the
# best token agreeing at 95% or more. A wrong norm, RoPE base, attention scale or window
# moves every top logit by whole units and fails them.
N_FORCED = 128
MEAN_TOL = 0.75
MEDIAN_MAX_TOL = 1.2
P90_MAX_TOL = 2.0
ARGMAX_AGREE = 0.85


TEXTS = {
    "prose": "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks "
             "were striking thirteen.",
    "code": "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n"
            "    return quicksort([x for x in xs[1:] if x < pivot]) + [pivot]\n\tindented = {'a': 1}  # tab\n",
    "unicode": "Grüße aus Köln! 東京は日本の首都です。 Привет, мир! 🚀🦙 naïve café — “quotes” ½ ∑ x²",
    "spaces": "   leading spaces,  double  spaces\n\n\nnewlines\r\nand trailing   ",
    "specials": "<bos>text with <eos> inside and <start_of_turn>user\nhi<end_of_turn>",
    "digits": "In 2024, 3.14159 and 1,000,000 and 0x7fff and 12345678901234567890.",
}


def _counting_prompt() -> str:
    """742 tokens (Gemma's tokenizer splits digits): counting, past the window."""
    return ", ".join(str(i) for i in range(1, 171)) + ","


def _long_code_prompt() -> str:
    """A Python module of small functions, 680 tokens: code past the window."""
    ops = ["+", "-", "*", "//", "%", "**"]
    funcs = [f"def f{i}(x, y):\n    \"\"\"Combine x and y, rule {i}.\"\"\"\n    return (x {ops[i % 6]} {i + 1}) + y\n"
             for i in range(20)]
    return "\n\n".join(funcs) + "\n\ndef main():\n"


PROMPTS = {
    "france": "The capital of France is",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "c_code": "#include <stdio.h>\n#include <stdlib.h>\n\n/* Read integers from stdin and print their sum. */\n"
              "int main(void) {\n",
    "prose": "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin "
             "nuzzled into his breast in an effort to escape the vile wind,",
    "recipe": "Ingredients for a simple loaf of bread:\n1.",
    "chat": "<start_of_turn>user\nExplain in a few sentences why the sky is blue.<end_of_turn>\n<start_of_turn>model\n",
    "counting": _counting_prompt(),
    "long_code": _long_code_prompt(),
}
N_CTX = 1024  # the longest prompt and its continuation fit


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from dflash_gguf.tools import real_models

    if os.environ.get("CI", "").lower() == "true":
        return real_models.path("gemma-3-270m")  # fetched if missing; a failed fetch fails
    path = real_models.cached("gemma-3-270m")
    if path is None:
        missing_oracle("the published gemma-3-270m GGUF (python -m dflash_gguf.tools.real_models)")
    return path


@pytest.fixture(scope="module")
def tokenizer(gemma3_path):
    from dflash_gguf.runtime.tokenizer import Tokenizer

    return Tokenizer(str(gemma3_path))


@pytest.fixture(scope="module")
def target(gemma3_path):
    from dflash_gguf.runtime.target import Target, TargetConfig

    return Target(str(gemma3_path), TargetConfig(n_ctx=N_CTX, n_ubatch=256))


@pytest.fixture(scope="module")
def llama_runs(gemma3_path, tokenizer):
    """llama.cpp's greedy continuation of each prompt, with its top-20 logits (ids and
    values, best first) at every generated position. Flash attention on and the sliding
    window's cache a ring, as llama.cpp's tools run (see the module's docstring)."""
    import llama_cpp

    llm = open_llama(gemma3_path, n_ctx=N_CTX, n_batch=256, n_ubatch=256, n_threads=2, flash_attn=True,
                     swa_full=False)
    n_vocab = llm.n_vocab()
    runs = {}
    try:
        for name, text in PROMPTS.items():
            prompt = tokenizer.encode(text)
            llm.reset()
            llm.eval(prompt)
            tokens, top_ids, top_vals = [], [], []
            for _ in range(N_NEW):
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))
                best = np.argpartition(-logits, TOP)[:TOP]
                ids = best[np.lexsort((best, -logits[best]))]  # by value, ties by id as argmax
                top_ids.append(ids)
                top_vals.append(logits[ids].copy())
                tokens.append(int(ids[0]))
                llm.eval([tokens[-1]])
            runs[name] = (prompt, tokens, np.array(top_ids), np.array(top_vals))
    finally:
        llm.close()
    return runs


def test_file_is_the_published_layout(target, tokenizer):
    info = target.info()
    assert tokenizer.n_vocab == 262144 and tokenizer.add_bos and tokenizer.bos_id == 2
    assert info["n_layer"] == 18 and info["arch"] == "gemma3" and info["n_embd"] == 640


@pytest.mark.parametrize("name", list(TEXTS))
def test_tokenization_equals_libllama(gemma3_path, tokenizer, name):
    """Our tokenizer's ids (BOS added, special tokens parsed) are libllama's for real text,
    and decode back to the text."""
    from llama_cpp import Llama

    text = TEXTS[name]
    vocab = Llama(str(gemma3_path), vocab_only=True, verbose=False)
    try:
        theirs = vocab.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        plain = vocab.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    finally:
        vocab.close()
    ours = tokenizer.encode(text)
    assert ours == theirs
    assert ours[0] == tokenizer.bos_id and ours.count(tokenizer.bos_id) == 1 + text.count("<bos>")
    assert tokenizer.encode(text, add_bos=False, special=False) == plain
    assert tokenizer.decode(ours[1:]) == text
    decoder = tokenizer.stream_decoder()
    assert "".join(decoder.push([t]) for t in ours[1:]) + decoder.flush() == text


@pytest.mark.parametrize("name", ["counting", "long_code"])
def test_long_prompts_exceed_the_window(tokenizer, name):
    n = len(tokenizer.encode(PROMPTS[name]))
    assert 512 + 64 < n <= N_CTX - N_NEW


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_text_equals_llama_cpp(target, tokenizer, llama_runs, name):
    """Token for token over N_NEW tokens: both engines decode one token at a time with
    flash attention, and their logits are equal bit for bit (the module's docstring)."""
    from helpers.loops import greedy_generate

    prompt, theirs, top_ids, top_vals = llama_runs[name]
    target.reset()
    ours, _ = greedy_generate(target, prompt, N_NEW)
    parted = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert parted is None, (f"{name}: parts at token {parted} (ours {ours[parted]}, llama.cpp's best two "
                            f"{top_ids[parted][:2].tolist()}, {top_vals[parted, 0] - top_vals[parted, 1]:.3f} apart)")
    assert len(ours) == len(theirs) == N_NEW
    assert tokenizer.decode(ours) == tokenizer.decode(theirs)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_teacher_forced_top20_logits_agree(target, llama_runs, name):
    """At the first N_FORCED positions of llama.cpp's continuation, our logits of its 20
    best tokens from one batched pass are its one-token decodes' within the bounds above
    (mean gap; median and 90th percentile over positions of the largest gap), and our
    best token is its best at ARGMAX_AGREE of them."""
    from dflash_gguf.runtime.target import LOGITS_ALL, LOGITS_LAST

    prompt, tokens, top_ids, top_vals = llama_runs[name]
    tokens, top_ids, top_vals = tokens[:N_FORCED], top_ids[:N_FORCED], top_vals[:N_FORCED]
    target.reset()
    target.prefill(prompt, LOGITS_LAST)
    first = target.logits(0, 1)
    target.decode(tokens[:-1], LOGITS_ALL)
    ours = np.concatenate([first, target.logits(0, len(tokens) - 1)])
    gap = np.abs(np.take_along_axis(ours, top_ids, axis=1) - top_vals)
    worst = gap.max(1)
    stats = f"mean {gap.mean():.3f}, per-position max: median {np.median(worst):.3f}, " \
            f"90th percentile {np.percentile(worst, 90):.3f}, max {worst.max():.3f}"
    print(f"{name}: top-{TOP} logit gaps: {stats}")
    assert np.abs(top_vals).max() > 5.0
    assert gap.mean() < MEAN_TOL, stats
    assert np.median(worst) < MEDIAN_MAX_TOL, stats
    assert np.percentile(worst, 90) < P90_MAX_TOL, stats
    assert np.mean(ours.argmax(1) == top_ids[:, 0]) >= ARGMAX_AGREE, stats


def test_the_decode_gaps_script_sets_llama_cpps_settings_apart(gemma3_path, tmp_path):
    """experiments/gemma3_decode_gaps.py, a few steps: llama.cpp opened as its tools run is
    bit for bit our one-token decodes at every step; without flash attention it is not."""
    import subprocess
    import sys

    from dflash_gguf.bench import slim

    out = tmp_path / "gaps.json"
    script = ROOT / "experiments" / "gemma3_decode_gaps.py"
    res = subprocess.run([sys.executable, str(script), "--steps", "3", "--long-steps", "2", "-o", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    settings = slim.read(out)["settings"]
    tools = settings["tools (flash attention, ring)"]["prompts"]
    assert [p["steps_bit_equal"] for p in tools.values()] == [3, 2]
    assert all(p["best_tokens_first_differ"] is None for p in tools.values())
    no_fa = settings["no flash attention"]["prompts"]
    assert max(p["largest_gap_range"][1] for p in no_fa.values()) > 0.0
