"""llama.cpp's sampler chain (through llama-cpp-python's low-level API) as an oracle for
our sampling rule: the probabilities its final dist sampler assigns over a logits row."""
from __future__ import annotations

import ctypes

import numpy as np

from dflash_gguf.decoding.sampling import SamplingParams

# llama_token_data as numpy sees it (int32 id, float logit, float p): a whole vocabulary's
# row goes to llama.cpp without a Python object per token
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


def llama_cpp_oracle():
    """The llama_cpp module, or the test skipped (failed under CI=true) without it."""
    try:
        import llama_cpp
    except ImportError:
        from helpers.fixtures import missing_oracle

        missing_oracle("llama-cpp-python")
    return llama_cpp


def llama_cpp_chain(params: SamplingParams, n_vocab: int, window=()):
    """llama.cpp's default order (penalties, top-k, top-p, min-p, temperature, dist) for
    `params`, its penalties having seen `window`. The caller frees it
    (llama_sampler_free)."""
    import llama_cpp as lc

    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    parts = [lc.llama_sampler_init_penalties(n_vocab, params.repeat_last_n, params.repeat_penalty,
                                             params.frequency_penalty, params.presence_penalty)]
    if params.top_k > 0:
        parts.append(lc.llama_sampler_init_top_k(params.top_k))
    parts += [lc.llama_sampler_init_top_p(params.top_p, 1), lc.llama_sampler_init_min_p(params.min_p, 1),
              lc.llama_sampler_init_temp(params.temperature), lc.llama_sampler_init_dist(0)]
    for part in parts:
        lc.llama_sampler_chain_add(chain, part)  # the chain owns them from here
    for tok in window:
        lc.llama_sampler_accept(chain, int(tok))
    return chain


def apply_to_row(sampler, logits) -> np.ndarray:
    """Runs a llama.cpp sampler over one row of logits; returns the token data it leaves
    (TOKEN_DATA records: the kept tokens, their logits and p as it wrote them)."""
    import llama_cpp as lc

    data = np.zeros(len(logits), dtype=TOKEN_DATA)
    data["id"] = np.arange(len(logits))
    data["logit"] = np.asarray(logits, dtype=np.float32)
    arr = lc.llama_token_data_array(data.ctypes.data_as(ctypes.POINTER(lc.llama_token_data)), len(logits), -1, False)
    lc.llama_sampler_apply(sampler, ctypes.byref(arr))
    return data[: arr.size].copy()  # the samplers sort and truncate in place


def llama_cpp_distribution(logits, params: SamplingParams, window=()) -> np.ndarray:
    """The probabilities llama.cpp's chain gives each token of a logits row (0 where its
    filters drop it): what its dist sampler writes, which is what it draws from."""
    import llama_cpp as lc

    chain = llama_cpp_chain(params, len(logits), window)
    try:
        kept = apply_to_row(chain, logits)
    finally:
        lc.llama_sampler_free(chain)
    out = np.zeros(len(logits))
    out[kept["id"]] = kept["p"]
    return out
