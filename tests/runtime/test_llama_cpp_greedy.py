"""Greedy decoding of the trained demo target against llama.cpp's (libllama through
llama-cpp-python: the same ggml, GGUF, f16 cache and flash attention) on dflash-bench's
built-in prompts, 64 tokens each, end-of-generation tokens generated like any other.

The old benchmark found llama-completion's greedy text different from ours on 2 of its 6
prompts. The cause was its flag --ignore-eos, which llama.cpp implements as a -inf logit
bias on every end-of-generation token (common/common.cpp): where greedy decoding emits
<|im_end|>, llama.cpp took the next-best token instead. Decoding by one rule, the tokens
are the same; with the bias applied to llama.cpp alone they part exactly there."""
from __future__ import annotations

import numpy as np
import pytest

from helpers.parity import Parity
from helpers.paths import TESTS

from dflash_gguf.bench.prompts import PROMPTS
from dflash_gguf.runtime.demo import demo_paths
from dflash_gguf.engine.engine import Engine

N = 64


def llama_greedy(llm, prompt: list[int], n: int, banned=()) -> list[int]:
    """n greedy tokens from libllama, one eval per token; `banned` tokens get a -inf
    logit (what llama.cpp's --ignore-eos does to end-of-generation tokens)."""
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1])
        row[list(banned)] = -np.inf
        out.append(int(np.argmax(row)))
        llm.eval(out[-1:])
    return out


@pytest.fixture(scope="module", params=["f32", "q8_0"])
def target(request, convert_model):
    """The demo target as the old benchmark ran it: converted to f32 from its bf16 HF copy,
    and the bundled q8_0 file."""
    if request.param == "q8_0":
        return demo_paths()[0]
    return str(convert_model(TESTS / "data" / "demo-hf" / "target", "f32"))


def test_greedy_equals_llama_cpp_on_the_bench_prompts(target):
    from llama_cpp import Llama

    # one thread each: a matrix row's dot product is one thread's either way, and spinning
    # worker threads crawl on a loaded machine
    llm = Llama(target, n_ctx=512, n_threads=1, flash_attn=True, logits_all=True, verbose=False)
    with Engine(target, n_ctx=512, n_threads=1, kv_type="f16") as engine:
        eog = engine.tokenizer.eog_ids
        parted_at_eog = 0
        with Parity(engine.target) as parity:
            for _, text in PROMPTS:
                prompt = engine.encode(text)
                ours = engine.generate(prompt, max_tokens=N, stop_tokens=()).tokens
                parity.check(prompt, llama_greedy(llm, prompt, N), ours)
                first_eog = next((i for i, t in enumerate(ours) if t in eog), None)
                if first_eog is None:  # then the bias changes nothing: no greedy choice was an EOG
                    continue
                ignoring_eos = llama_greedy(llm, prompt, N, banned=eog)
                first_difference = next((i for i, (a, b) in enumerate(zip(ours, ignoring_eos)) if a != b), None)
                assert first_difference == first_eog, (text, first_difference, first_eog)
                parted_at_eog += 1
    llm.close()
    assert parted_at_eog == 2  # "split" and "files" end a generation within 64 tokens
