"""The published Gemma 3 270M GGUF (google/gemma-3-270m as llama.cpp's GGUF-my-repo wrote
it: Q4_K_M mixing Q4_K, Q5_0, Q6_K and Q8_0, a tied Q8_0 embedding, SentencePiece vocabulary
of 262,144 tokens) against libllama on the same file: tokenization of real text, greedy
text over 128 tokens after three prompts (one longer than the 512-token sliding window of
the local layers, so that the window decides the output), and the teacher-forced logits
of llama.cpp's top 20 candidates at every generated position.

Runs only where the file has been fetched (`scripts/setup.sh test` does it); under CI=true
a missing file fails."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from fixtures import missing_oracle, open_llama

pytestmark = pytest.mark.real

N_NEW = 128
TOP = 20
# Both engines run the same quantized weights through ggml's CPU kernels, which quantize
# each matrix's activations to 8 bits; Gemma's residual stream runs to thousands, so the
# last bits of the two graphs' differences (attention and softmax in another order; until
# the parity tool found it, also the GELU: ours was tanh-GELU in f32 as transformers', now
# it is ggml's as llama.cpp's, docs/parity.md) flip roundings that move the logits. On an
# f32 copy of this file (libllama's own requantizer) the two agree to 0.004 over
# llama.cpp's top 20 after the short prompt; on the Q4_K_M file
# we measured, over the three prompts' 128 positions: a mean gap of 0.16-0.50, a median of
# the per-position largest gap of 0.36-0.74 and its 90th percentile 0.54-1.33, with a few
# chaotic positions of the long prompt far off (up to 13: there our own batched and
# one-token decodes differ by 3.5 even in f32, and so does llama.cpp against itself). The
# figures above were measured with the f32 GELU (with ggml's the bounds hold too). The
# bounds below leave a margin of about 1.5x over those and still fail on a real error: a
# wrong norm, RoPE base, attention scale or window moves every top logit by whole units.
# llama.cpp's best two closer than this are a near-tie the two engines may break apart
# (the median per-position gap above is 0.36-0.74)
NEAR_TIE = 0.5
MEAN_TOL = 0.75
MEDIAN_MAX_TOL = 1.2
P90_MAX_TOL = 2.0


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


def _long_prompt() -> str:
    """More than 512 tokens (Gemma's tokenizer splits digits): counting, which the model
    continues with wide margins between its best two tokens (7 logits and more), so that
    greedy output past the window is decided by the model, not by rounding. Real prose
    meets near-ties within a few tokens (textwrap.py's source: a margin of 0.05 at the
    tenth token), where the two engines' rounding of the quantized matrices' activations
    (see MEAN_TOL) picks either token."""
    return ", ".join(str(i) for i in range(1, 171)) + ","


PROMPTS = {
    "france": "The capital of France is",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "long": _long_prompt(),  # 742 tokens
}


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from dflash_gguf import real_models

    if os.environ.get("CI", "").lower() == "true":
        return real_models.path("gemma-3-270m")  # fetched if missing; a failed fetch fails
    path = real_models.cached("gemma-3-270m")
    if path is None:
        missing_oracle("the published gemma-3-270m GGUF (python -m dflash_gguf.real_models)")
    return path


@pytest.fixture(scope="module")
def tokenizer(gemma3_path):
    from dflash_gguf.tokenizer import Tokenizer

    return Tokenizer(str(gemma3_path))


@pytest.fixture(scope="module")
def target(gemma3_path):
    from dflash_gguf.target import Target, TargetConfig

    return Target(str(gemma3_path), TargetConfig(n_ctx=1024, n_ubatch=256))


@pytest.fixture(scope="module")
def llama_runs(gemma3_path, tokenizer):
    """llama.cpp's greedy continuation of each prompt, with its top-20 logits (ids and
    values) at every generated position."""
    import llama_cpp

    llm = open_llama(gemma3_path, n_ctx=1024, n_batch=256, n_ubatch=256, n_threads=2)
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
                ids = np.argsort(-logits, kind="stable")[:TOP]
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


def test_long_prompt_exceeds_the_window(tokenizer):
    assert len(tokenizer.encode(PROMPTS["long"])) > 512 + 64


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_text_equals_llama_cpp(target, tokenizer, llama_runs, name):
    """Token for token, or parting only at a near-tie of llama.cpp's best two (under
    NEAR_TIE; ours then one of those two), after at least 16 equal tokens: past it the two
    texts continue different contexts. The code prompt parts at its 24th token (llama.cpp's
    best two 0.25 apart, ours 0.9 the other way: the one-token decodes of the two engines
    part by the gaps measured above, although their prompt passes agree to llama.cpp's
    printing, docs/parity.md)."""
    from loops import greedy_generate

    prompt, theirs, top_ids, top_vals = llama_runs[name]
    target.reset()
    ours, _ = greedy_generate(target, prompt, N_NEW)
    parted = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
    assert tokenizer.decode(ours[:parted]) == tokenizer.decode(theirs[:parted])
    if parted < len(theirs):
        margin = top_vals[parted, 0] - top_vals[parted, 1]
        assert parted >= 16 and margin < NEAR_TIE and ours[parted] in top_ids[parted][:2], (name, parted, margin)
    assert len(ours) == len(theirs)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_teacher_forced_top20_logits_agree(target, llama_runs, name):
    """At the positions of llama.cpp's continuation, our logits of its 20 best tokens are
    its logits within the bounds above (mean gap; median and 90th percentile over
    positions of the largest gap), and our best token is its best at 95% of them."""
    from dflash_gguf.target import LOGITS_ALL, LOGITS_LAST

    prompt, tokens, top_ids, top_vals = llama_runs[name]
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
    assert np.mean(ours.argmax(1) == top_ids[:, 0]) >= 0.95
