"""The Qwen3.5 target runtime (csrc/dfl_target*.c through dflash_gguf.runtime.target) against its
oracles: transformers (logits, hidden states), llama.cpp's converter (same GGUF layout)
and llama.cpp itself through llama-cpp-python (greedy decoding of quantized GGUFs).

Error measure used throughout: the relative error of a set of rows is
    max over rows of  max|ours - ref| / max|ref|      (per row, then the worst row)
"""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch

from helpers.fixtures import make_qwen35
from helpers.target_workers import ChildCrashed, run_isolated

from dflash_gguf.runtime.native import DflashError
from dflash_gguf.runtime.target import LOGITS_ALL, LOGITS_LAST, LOGITS_NONE, Target, TargetConfig

N_PROMPT = 20     # prefill length of the logits tests (>= 16)
N_DECODE = 32     # single-token decode steps after it
REL_TOL = 1e-3

# An attention layer first (the other fixture shapes all start with a linear layer).
ATTN_FIRST = dict(layers=4, layer_types=["full_attention", "linear_attention", "linear_attention",
                                         "full_attention"], heads=4, kv_heads=2, seed=7)


# ---- helpers -------------------------------------------------------------------------

def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    """Worst per-row max|a-b| / max|b|."""
    ours = np.atleast_2d(ours).reshape(-1, ours.shape[-1])
    ref = np.atleast_2d(ref).reshape(-1, ref.shape[-1])
    return float(np.max(np.abs(ours - ref).max(axis=1) / np.abs(ref).max(axis=1)))


def tokens_for(n_vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, n_vocab, size=n).tolist()


class HF:
    """A transformers model saved in a directory, loaded once: logits and hidden states."""

    def __init__(self, model_dir):
        from transformers import Qwen3_5ForCausalLM

        self.model = Qwen3_5ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.n_layer = self.model.config.num_hidden_layers
        self.vocab = self.model.config.vocab_size

    def run(self, tokens):
        """(logits [n, vocab], hidden_states list of [n, embd], pre-norm output of the last layer)."""
        captured = {}
        hook = self.model.model.layers[-1].register_forward_hook(
            lambda mod, inp, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out))
        try:
            with torch.no_grad():
                out = self.model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
        finally:
            hook.remove()
        hs = [h[0].numpy() for h in out.hidden_states]
        return out.logits[0].numpy(), hs, captured["last"][0].numpy()

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.model.model.norm(torch.from_numpy(np.ascontiguousarray(x))).numpy()


@pytest.fixture(scope="module")
def model_dir(qwen35_dir, tmp_path_factory):
    """model_dir(shape) -> checkpoint: the shared QWEN35_SHAPES plus this module's attn_first."""
    own = {}

    def get(shape: str):
        if shape == "attn_first":
            if shape not in own:
                own[shape] = make_qwen35(tmp_path_factory.mktemp("attn_first") / "attn_first", **ATTN_FIRST)
            return own[shape]
        return qwen35_dir(shape)

    return get


@pytest.fixture(scope="module")
def hf(model_dir):
    cache = {}

    def get(shape: str) -> HF:
        if shape not in cache:
            cache[shape] = HF(model_dir(shape))
        return cache[shape]

    return get


@pytest.fixture(scope="module")
def gguf(model_dir, convert_model):
    """gguf(shape, outtype="f32") -> our converter's GGUF of that checkpoint."""
    return lambda shape, outtype="f32": convert_model(model_dir(shape), outtype)


def run_prefill_then_decode(t: Target, toks: list[int], n_prompt: int) -> np.ndarray:
    """Logits after the prompt (prefilled in ubatch chunks), then after each single-token
    decode of the rest: [len(toks) - n_prompt + 1, vocab] for positions n_prompt-1 ..."""
    t.prefill(toks[:n_prompt], LOGITS_LAST)
    rows = [t.logits(0, 1)[0]]
    for tok in toks[n_prompt:]:
        t.decode([tok], LOGITS_LAST)
        rows.append(t.logits(0, 1)[0])
    return np.stack(rows)


# ---- 1. logits equal transformers ------------------------------------------------------

@pytest.mark.parametrize("shape,kv_type,n_ubatch", [
    ("base", "f16", 512),       # GQA, linear key heads < value heads
    ("base", "f32", 6),         # prefill in 4 ubatches
    ("tied", "f16", 7),         # tied embeddings, custom pattern, MQA, padded vocab
    ("interval", "f32", 512),   # pattern from full_attention_interval, 3 V heads per K head
    # attention layer first; f32 because ggml's CPU flash attention accumulates V·softmax
    # in f16 for an f16 cache, which costs 2.0e-3 here (llama.cpp with f16 KV + flash
    # attention gives bit-identical logits, 7.6e-4 without flash attention)
    ("attn_first", "f32", 8),
    ("k256", "f16", 512),       # hidden 256
    ("k256", "f32", 9),
])
def test_logits_match_transformers(shape, kv_type, n_ubatch, gguf, hf):
    ref_model = hf(shape)
    toks = tokens_for(ref_model.vocab, N_PROMPT + N_DECODE, seed=11)
    ref, _, _ = ref_model.run(toks)
    with Target(gguf(shape), TargetConfig(n_ctx=128, n_ubatch=n_ubatch, n_verify=8, n_threads=2,
                                          kv_type=kv_type)) as t:
        assert t.n_vocab == ref.shape[1]
        ours = run_prefill_then_decode(t, toks, N_PROMPT)
        assert t.n_past == len(toks)
        # argmax on the device agrees with the host's over the same logits
        assert int(t.choices(0, 1)[0]) == int(np.argmax(ours[-1]))
    err = rel_err(ours, ref[N_PROMPT - 1:])
    assert err < REL_TOL, f"{shape} kv={kv_type} ubatch={n_ubatch}: relative logit error {err:.2e}"


def test_prefill_logits_all_rows(gguf, hf):
    """LOGITS_ALL over a chunked prefill keeps every row of the last chunk, each equal to
    transformers at its position."""
    ref_model = hf("base")
    toks = tokens_for(ref_model.vocab, 23, seed=12)
    ref, _, _ = ref_model.run(toks)
    with Target(gguf("base"), TargetConfig(n_ctx=64, n_ubatch=10, kv_type="f32", n_threads=2)) as t:
        t.prefill(toks, LOGITS_ALL)              # chunks 10, 10, 3
        ours = t.logits(0, 3)
        with pytest.raises(DflashError):
            t.logits(0, 4)
        assert list(t.choices(0, 3)) == list(np.argmax(ours, axis=1))
    assert rel_err(ours, ref[20:]) < REL_TOL


@pytest.mark.parametrize("kv_type,tol", [("bf16", 2e-2), ("q8_0", 2e-2), ("q4_0", 1e-1)])
def test_quantized_kv_cache_close(kv_type, tol, gguf, hf):
    """The lossy cache types run and stay near transformers (loose bound: a smoke test)."""
    ref_model = hf("k256")
    toks = tokens_for(ref_model.vocab, 40, seed=13)
    ref, _, _ = ref_model.run(toks)
    with Target(gguf("k256"), TargetConfig(n_ctx=64, n_ubatch=16, kv_type=kv_type, n_threads=2)) as t:
        ours = run_prefill_then_decode(t, toks, 24)
    err = rel_err(ours, ref[23:])
    assert err < tol, f"kv {kv_type}: relative logit error {err:.2e}"


# ---- 2. llama.cpp's converter output loads and gives the same logits --------------------

@pytest.mark.parametrize("shape", ["base", "tied"])
def test_llama_cpp_converted_gguf_same_logits(shape, model_dir, gguf, llama_cpp_convert, hf):
    theirs_path = llama_cpp_convert(model_dir(shape), "f32")
    toks = tokens_for(hf(shape).vocab, 36, seed=14)
    out = {}
    for name, path in (("ours", gguf(shape)), ("llama.cpp", theirs_path)):
        with Target(path, TargetConfig(n_ctx=64, n_ubatch=8, kv_type="f32", n_threads=2)) as t:
            out[name] = run_prefill_then_decode(t, toks, 16)
    # Same tensors up to float rounding (e.g. ssm_a = -exp(A_log) may differ by an ulp),
    # so the logits agree to float32 noise, far below the transformers tolerance.
    err = rel_err(out["ours"], out["llama.cpp"])
    assert err <= 2e-5, f"{shape}: logits from the two converters differ by {err:.2e} (relative)"
    ref, _, _ = hf(shape).run(toks)
    assert rel_err(out["llama.cpp"], ref[15:]) < REL_TOL


# ---- 3. greedy decoding of quantized GGUFs equals llama.cpp ------------------------------
#
# Quantized weights run through CPU kernels chosen per machine (weight repacking, AMX), so
# both sides run in child processes (target_workers): a crash fails one test, not the
# session. llama.cpp runs as users get it (extra buffer types on, i.e. the same repacked
# weights our runtime uses; f16 KV cache; flash attention) except that AMX is denied to
# its process when compiled in (ggml's AMX matmul crashes on AMX CPUs with 0.3.36; see
# target_workers.deny_amx_permission). With repacking off (--no-repack) llama.cpp is no
# oracle for K-quants: its own batched rows then differ from its single-token rows by
# ~0.2 in the logits on q4_k_m (see test_verify_equals_sequential_quantized for why).

N_GREEDY = 64


@pytest.mark.parametrize("outtype", ["q8_0", "q4_k_m"])
def test_greedy_matches_llama_cpp(outtype, gguf, hf):
    path = str(gguf("k256", outtype))
    vocab = hf("k256").vocab
    prompts = [tokens_for(vocab, n, seed=20 + i) for i, n in enumerate((3, 8, 17, 30, 45))]
    try:
        theirs = run_isolated("llama_greedy", path, prompts, N_GREEDY, deny_amx=True)
    except ChildCrashed as e:
        pytest.fail(f"llama.cpp crashed on {outtype}: {e}")
    try:
        ours = run_isolated("ours_greedy", path, prompts, N_GREEDY)
    except ChildCrashed as e:
        pytest.fail(f"the runtime crashed on a {outtype} GGUF: {e}")
    for prompt, a, b in zip(prompts, theirs, ours):
        if a["tokens"] == b["tokens"]:
            continue
        step = next(i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y)
        pytest.fail(f"{outtype}, prompt of {len(prompt)}: step {step} llama.cpp picks {a['tokens'][step]}, we pick "
                    f"{b['tokens'][step]}; top-2 gaps {a['gaps'][step]:.2e} (llama.cpp) / {b['gaps'][step]:.2e} "
                    "(ours): the same ggml, one token a step on both sides, must give the same tokens")


# ---- 4. verify + commit == decoding only the kept tokens ---------------------------------

def _sequential_logits(t: Target, prefix: list[int], toks: list[int]) -> np.ndarray:
    """Logits after prefix+toks[:i+1] for every i, decoding one token at a time."""
    t.reset()
    t.prefill(prefix, LOGITS_NONE)
    rows = []
    for tok in toks:
        t.decode([tok], LOGITS_LAST)
        rows.append(t.logits(0, 1)[0])
    return np.stack(rows)


@pytest.mark.parametrize("shape", ["base", "attn_first"])
def test_verify_commit_equals_sequential_decode(shape, gguf):
    K = 8
    path = gguf(shape)
    cfg = TargetConfig(n_ctx=64, n_ubatch=16, n_verify=K, kv_type="f32", n_threads=2)
    with Target(path, cfg) as t, Target(path, cfg) as ref:
        prefix = tokens_for(t.n_vocab, 18, seed=30)
        cands = tokens_for(t.n_vocab, K, seed=31)
        tail = tokens_for(t.n_vocab, 3, seed=32)
        seq = _sequential_logits(ref, prefix, cands)
        for j in range(K + 1):
            t.reset()
            t.prefill(prefix, LOGITS_LAST)
            t.verify(cands)
            rows = t.logits(0, K)
            # a batch of queries may take another attention kernel than one query: f32 rounding
            diff = float(np.abs(rows - seq).max())
            assert diff <= 3e-5, f"{shape}: verify rows differ from sequential decode by {diff:.2e}"
            assert list(t.choices(0, K)) == list(np.argmax(rows, axis=1))
            assert t.n_past == len(prefix)            # nothing committed yet
            t.commit(j)
            assert t.n_past == len(prefix) + j
            t.decode(tail, LOGITS_ALL)
            after = t.logits(0, len(tail))

            # a fresh target that decoded prefix + j tokens directly
            with Target(path, cfg) as fresh:
                fresh.prefill(prefix + cands[:j], LOGITS_NONE)
                fresh.decode(tail, LOGITS_ALL)
                expect = fresh.logits(0, len(tail))
            diff = float(np.abs(after - expect).max())
            assert diff <= 1e-5, f"{shape}: after verify {K} + commit {j}, logits differ by {diff:.2e}"


@pytest.mark.parametrize("outtype", ["q8_0", "q4_k_m"])
def test_verify_equals_sequential_quantized(outtype, gguf):
    """Quantized weights: verifying a chain of any length 1..8 gives the rows single-token
    decoding gives, and commit leaves the state decoding would.

    q8_0 must be exact. K-quants quantize activations to q8_K inside the matmul, and ggml's
    CPU backend picks the kernel by batch size (repacked GEMM from 4 rows, a tiled kernel
    from 8 rows for weights it does not repack, a GEMV below): their float results differ
    by ~1e-7, which now and then moves an activation across a q8_K rounding boundary, and
    this random tiny model turns one such flip into ~0.1 in the logits (measured: the
    residual stream differs by 5e-7 after layer 0 and by 3.5e-2 after layer 1). Those are
    rounding ties one level down, so for q4_k_m at most two such jumps are allowed (each
    <= 0.25); every other comparison must be tight, and the greedy choices must agree."""
    try:
        r = run_isolated("ours_verify_vs_sequential", str(gguf("k256", outtype)), 21, 8)
    except ChildCrashed as e:
        pytest.fail(f"the runtime crashed on a {outtype} GGUF: {e}")
    assert r["argmax_equal"] and r["greedy_equal"], r
    diffs = {f"verify {k}": v for k, v in r["rows"].items()}
    diffs.update({f"verify/commit {k}": v for k, v in r["after_commit"].items()})
    off = {k: f"{v:.1e}" for k, v in diffs.items() if v > 1e-4}
    if outtype == "q4_k_m":
        assert len(off) <= 2 and max(diffs.values()) <= 0.25, f"{outtype}: rows off for {off}"
    else:
        assert not off, f"{outtype}: rows off for {off}"


def test_verify_commit_rounds_cross_cache_window(gguf):
    """Several verify/commit rounds that cross the 256-token attention window step, with
    a KV cache in f16: the context equals one decoded token by token."""
    path = gguf("base")
    cfg = TargetConfig(n_ctx=320, n_ubatch=64, n_verify=6, kv_type="f16", n_threads=2)
    rng = np.random.default_rng(40)
    with Target(path, cfg) as t, Target(path, cfg) as ref:
        prefix = rng.integers(0, t.n_vocab, size=243).tolist()
        t.prefill(prefix, LOGITS_NONE)
        committed = list(prefix)
        for keep in (6, 0, 3, 6, 1, 5, 2, 6):
            cands = rng.integers(0, t.n_vocab, size=6).tolist()
            t.verify(cands)
            rows = t.logits(0, 6)
            ref.reset()
            ref.prefill(committed, LOGITS_NONE)
            ref.decode(cands, LOGITS_ALL)
            assert np.abs(rows - ref.logits(0, 6)).max() <= 1e-4
            t.commit(keep)
            committed += cands[:keep]
            assert t.n_past == len(committed)
        probe = rng.integers(0, t.n_vocab, size=4).tolist()
        t.decode(probe, LOGITS_ALL)
        ref.reset()
        ref.prefill(committed, LOGITS_NONE)
        ref.decode(probe, LOGITS_ALL)
        assert len(committed) > 256
        assert np.abs(t.logits(0, 4) - ref.logits(0, 4)).max() <= 1e-4


def test_verify_is_not_committed_until_commit(gguf):
    """A verify followed by commit(0) leaves the context exactly as it was."""
    path = gguf("base")
    cfg = TargetConfig(n_ctx=64, n_ubatch=32, n_verify=4, kv_type="f32", n_threads=2)
    with Target(path, cfg) as t:
        prefix = tokens_for(t.n_vocab, 10, seed=50)
        probe = tokens_for(t.n_vocab, 2, seed=51)
        t.prefill(prefix, LOGITS_NONE)
        t.decode(probe, LOGITS_ALL)
        before = t.logits(0, 2)
        t.reset()
        t.prefill(prefix, LOGITS_NONE)
        for _ in range(3):
            t.verify(tokens_for(t.n_vocab, 4, seed=52 + _))
            t.commit(0)
        t.decode(probe, LOGITS_ALL)
        assert np.array_equal(t.logits(0, 2), before)


# ---- 5. captured features equal transformers' hidden states ------------------------------

def _expected_features(hf_model: HF, layers, hs) -> np.ndarray:
    """[n, len(layers), embd]: layer L (llama.cpp convention) is HF hidden_states[L], the
    output of HF layer L-1; for L == n_layer that is the final-normed state, which is what
    z-lab's drafters read for the last target layer."""
    return np.stack([hs[L] for L in layers], axis=1)


def test_features_match_hidden_states(gguf, hf):
    hf_model = hf("base")
    n_layer = hf_model.n_layer
    layers = (n_layer, 1, 3)           # HF ids n_layer-1 (the last), 0, 2; order kept
    toks = tokens_for(hf_model.vocab, 26, seed=60)
    n_prompt, k = 20, 6
    _, hs, last_raw = hf_model.run(toks)
    # transformers ties hidden_states[-1] to the final-normed output
    assert np.allclose(hs[n_layer], hf_model.final_norm(last_raw), atol=1e-5)
    expect = _expected_features(hf_model, layers, hs)

    cfg = TargetConfig(n_ctx=64, n_ubatch=7, n_verify=8, kv_type="f32", n_threads=2, feature_layers=layers)
    with Target(gguf("base"), cfg) as t:
        got = np.zeros((n_prompt, len(layers), t.n_embd), np.float32)
        seen = []

        def on_chunk(start, n):
            seen.append((start, n))
            got[start:start + n] = t.features(0, n)

        t.prefill(toks[:n_prompt], LOGITS_LAST, on_chunk=on_chunk)
        assert seen == [(0, 7), (7, 7), (14, 6)]
        assert rel_err(got, expect[:n_prompt]) < REL_TOL

        # verify rows carry the features of every candidate
        t.verify(toks[n_prompt:n_prompt + k])
        assert rel_err(t.features(0, k), expect[n_prompt:]) < REL_TOL
        with pytest.raises(DflashError):
            t.features(0, k + 1)

        # after a partial commit, decode rows continue at the right positions
        t.commit(2)
        t.decode(toks[n_prompt + 2:n_prompt + 4], LOGITS_NONE)
        assert rel_err(t.features(0, 2), expect[n_prompt + 2:n_prompt + 4]) < REL_TOL


# ---- 6. errors are exceptions, never crashes -----------------------------------------------

@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, gguf):
    import gguf as gg

    root = tmp_path_factory.mktemp("bad")
    good = gguf("base").read_bytes()
    files = {}

    w = gg.GGUFWriter(str(root / "llama.gguf"), "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    files["wrong_arch"] = root / "llama.gguf"

    (root / "trunc_data.gguf").write_bytes(good[: len(good) // 2])
    files["truncated_data"] = root / "trunc_data.gguf"
    (root / "trunc_header.gguf").write_bytes(good[:200])
    files["truncated_header"] = root / "trunc_header.gguf"
    (root / "garbage.gguf").write_bytes(np.random.default_rng(0).bytes(4096))
    files["garbage"] = root / "garbage.gguf"
    # a valid magic followed by nonsense counts
    (root / "bad_counts.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**62, 2**62) + b"\0" * 64)
    files["bad_counts"] = root / "bad_counts.gguf"
    (root / "empty.gguf").write_bytes(b"")
    files["empty"] = root / "empty.gguf"
    files["missing"] = root / "does-not-exist.gguf"
    files["directory"] = root
    return files


@pytest.mark.parametrize("case", ["wrong_arch", "truncated_data", "truncated_header", "garbage", "bad_counts",
                                  "empty", "missing", "directory"])
def test_load_errors(case, bad_files):
    with pytest.raises(DflashError) as e:
        Target(bad_files[case], TargetConfig(n_ctx=64))
    msg = str(e.value)
    assert str(bad_files[case]) in msg or case == "directory", msg
    if case == "wrong_arch":
        assert "llama" in msg and "qwen35" in msg


@pytest.mark.parametrize("cfg,exc", [
    (dict(kv_type="q5_k"), ValueError),
    (dict(kv_type="f8"), ValueError),
    (dict(feature_layers=(0,)), DflashError),
    (dict(feature_layers=(5,)), DflashError),       # base has 4 layers
    (dict(feature_layers=tuple(range(1, 18))), ValueError),
    (dict(n_ctx=16, n_verify=32), DflashError),
    # the C runtime refuses a bad size instead of replacing it with its default
    (dict(n_ctx=0), DflashError),
    (dict(n_ubatch=-1), DflashError),
    (dict(n_verify=0), DflashError),
    (dict(n_seq=0), DflashError),
    (dict(n_threads=-1), DflashError),
])
def test_bad_settings(cfg, exc, gguf):
    with pytest.raises(exc) as e:
        Target(gguf("base"), TargetConfig(**cfg))
    if "n_ctx" in cfg and cfg["n_ctx"] <= 0 or "n_seq" in cfg:
        assert "must be positive" in str(e.value)
    if "n_threads" in cfg:
        assert "n_threads must be 0" in str(e.value)


def test_default_threads_are_the_cpus_we_may_use(gguf):
    """ggml's own default is 4 threads, whatever the machine: on 2 cores the spinning
    workers starved each other (tree verify 4x slower)."""
    with Target(gguf("base"), TargetConfig(n_ctx=32)) as t:
        assert t.info()["n_threads"] == len(os.sched_getaffinity(0))
    with Target(gguf("base"), TargetConfig(n_ctx=32, n_threads=1)) as t:
        assert t.info()["n_threads"] == 1


def test_runtime_errors(gguf):
    cfg = TargetConfig(n_ctx=32, n_ubatch=8, n_verify=4, kv_type="f32", n_threads=2)
    with Target(gguf("base"), cfg) as t:
        V = t.n_vocab
        for bad in ([V], [-1], [3, V + 100, 4]):
            with pytest.raises(DflashError, match="vocabulary"):
                t.decode(bad)
            with pytest.raises(DflashError, match="vocabulary"):
                t.verify(bad)
        with pytest.raises(DflashError):
            t.decode([])
        with pytest.raises(DflashError):
            t.decode(list(range(9)))                      # more than n_ubatch
        with pytest.raises(DflashError):
            t.decode([1], logits=3)
        with pytest.raises(DflashError, match="commit"):
            t.commit(0)                                   # commit without verify
        with pytest.raises(DflashError):
            t.verify(list(range(5)))                      # more than n_verify
        with pytest.raises(DflashError):
            t.logits(0, 1)                                # nothing evaluated yet
        with pytest.raises(DflashError):
            t.features(0, 1)                              # no feature layers configured
        assert t.n_past == 0

        t.prefill(list(range(30)), LOGITS_LAST)
        ok = t.logits(0, 1)
        with pytest.raises(DflashError, match="overflow"):
            t.decode([1, 2, 3])                           # 30 + 3 > 32
        with pytest.raises(DflashError, match="overflow"):
            t.verify([1, 2, 3])
        assert t.n_past == 30
        with pytest.raises(DflashError):
            t.logits(1, 1)
        with pytest.raises(DflashError):
            t.logits(-1, 1)

        t.verify([5, 6])
        with pytest.raises(DflashError):
            t.decode([1])                                 # verify pending
        with pytest.raises(DflashError):
            t.verify([1])                                 # verify pending
        with pytest.raises(DflashError):
            t.commit(3)                                   # more than verified
        with pytest.raises(DflashError):
            t.commit(-1)
        t.commit(2)
        assert t.n_past == 32
        with pytest.raises(DflashError, match="overflow"):
            t.decode([1])

        # still healthy: the same prompt gives the same logits after a reset
        t.reset()
        t.prefill(list(range(30)), LOGITS_LAST)
        assert np.array_equal(t.logits(0, 1), ok)

    with pytest.raises(RuntimeError):
        t.decode([1])                                     # closed
