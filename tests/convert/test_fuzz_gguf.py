"""Hostile GGUF input: mutants of the demo target and drafter end in a clear error or a
correct load -- never a crash, an abort, a hang, a traceback or an absurd allocation.
The bounded fuzz run here is the default one; longer ones take the options
`--fuzz-count N --fuzz-seed S` (and `--fuzz-only I` replays one mutant), e.g.

    .venv/bin/pytest tests/convert/test_fuzz_gguf.py -k fuzzed --fuzz-count 5000 --fuzz-seed 1

Each crash the fuzzer found has a crafted file of its own below."""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import gguf_fuzz
from helpers.gguf_fuzz import STR, U32, build, enc_kv, parse

from dflash_gguf.runtime.demo import demo_paths

SEED = 14  # the default run's, which the reproducibility test reads


@pytest.fixture(scope="module")
def demo():
    target, draft = demo_paths()
    return {"target": target, "draft": draft, "T": parse(Path(target).read_bytes()),
            "D": parse(Path(draft).read_bytes())}


def test_fuzzed_loads_end_in_clear_errors_or_correct_loads(demo, request):
    seed, only = request.config.getoption("--fuzz-seed"), request.config.getoption("--fuzz-only")
    count = request.config.getoption("--fuzz-count")
    indices = only or [-1] + list(range(count))
    results = gguf_fuzz.run(demo["target"], demo["draft"], seed, indices, jobs=2)
    assert len(results) == len(indices)
    failures = gguf_fuzz.describe_failures(results)
    assert not failures, f"seed {seed}:\n{failures}"
    print(f"\nseed {seed}, {len(indices)} cases: {gguf_fuzz.summary(results)}")
    if only:
        return
    counts = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    # the harness is alive: some mutants still load (reordered keys, harmless values), most are refused
    assert counts.get("ok", 0) >= count // 10 and counts.get("error", 0) >= count // 2, counts


def test_mutants_are_reproducible(demo):
    originals = {"target": demo["T"], "draft": demo["D"]}
    for i in (0, 1, 77, 201):
        assert gguf_fuzz.mutant(originals, SEED, i) == gguf_fuzz.mutant(originals, SEED, i)


# ---- every crash the fuzzer found, as a crafted file -------------------------------------

def _set(L, key, fmt, value, i=0) -> bytes:
    buf = bytearray(L.data)
    struct.pack_into(fmt, buf, L.kv(key).elems[i], value)
    return bytes(buf)


def _tensors(L, change=None):
    out = []
    for t in L.tensors:
        entry = (t.name, list(t.dims), t.type, L.payload(t))
        out.append(change(entry) if change else entry)
    return out


def _kvs(L, replace=None, add=()):
    raws = [L.data[k.start:k.end] for k in L.kvs]
    for key, raw in (replace or {}).items():
        raws[[k.key for k in L.kvs].index(key)] = raw
    return raws + list(add)


def _retype(name, typ, nbytes_of=gguf_fuzz.tensor_nbytes):
    def change(entry):
        n, dims, old, payload = entry
        if n != name:
            return entry
        return n, dims, typ, bytes(nbytes_of(dims, typ))
    return change


def _duplicate_token(L) -> bytes:
    buf = bytearray(L.data)
    toks = L.kv("tokenizer.ggml.tokens")
    lens = [struct.unpack_from("<Q", buf, e)[0] for e in toks.elems]
    a = next(i for i in range(len(lens)) if lens[i] == 3)
    b = next(i for i in range(a + 1, len(lens)) if lens[i] == 3)
    buf[toks.elems[b] + 8:toks.elems[b] + 11] = buf[toks.elems[a] + 8:toks.elems[a] + 11]
    return bytes(buf)


def _kind(L, key, t) -> bytes:
    buf = bytearray(L.data)
    struct.pack_into("<I", buf, L.kv(key).type_off, t)
    return bytes(buf)


def _arr_len(L, key, n) -> bytes:
    buf = bytearray(L.data)
    struct.pack_into("<Q", buf, L.kv(key).arr_n_off, n)
    return bytes(buf)


def _retyped(L, name, typ) -> bytes:
    return build(_kvs(L), _tensors(L, _retype(name, typ)))


def _aligned_16(L) -> bytes:
    # a consistent file whose data starts 16 bytes past a 32-byte boundary
    return build(_kvs(L, add=[enc_kv("general.alignment", U32, 16), enc_kv("fuzz.pad", STR, "x" * 3)]), _tensors(L), 16)


NORM, BETA, ATTN_K = "blk.1.post_attention_norm.weight", "blk.1.ssm_beta.weight", "blk.3.attn_k.weight"
EPS_T, EPS_D = "qwen35.attention.layer_norm_rms_epsilon", "dflash.attention.layer_norm_rms_epsilon"

# name: (file mutated, how, what the error says). The comment: what loading the file did
# before these checks (measured on the sources of commit 9fedaa9).
CRAFTED = {
    "duplicate token": ("target", lambda T, D: _duplicate_token(T), "same text"),  # abort in llama.cpp's vocab
    "vector retyped i32": ("target", lambda T, D: _retyped(T, NORM, 26), "vectors must be f32"),  # abort in ggml_mul
    "vector retyped iq1_s": ("target", lambda T, D: _retyped(T, NORM, 19), "vectors must be f32"),  # abort
    "matrix retyped q8_k": ("target", lambda T, D: _retyped(T, BETA, 15), "not a weight type"),  # segfault
    "matrix retyped i8": ("target", lambda T, D: _retyped(T, ATTN_K, 24), "not a weight type"),  # segfault
    "negative epsilon": ("target", lambda T, D: _set(T, EPS_T, "<f", -1e-6), "epsilon"),  # GGML_ASSERT(eps >= 0)
    "drafter negative epsilon": ("draft", lambda T, D: _set(D, EPS_D, "<f", -1e-6), "epsilon"),  # same
    "infinite epsilon": ("target", lambda T, D: _set(T, EPS_T, "<f", float("inf")), "finite"),  # NaN logits
    "alignment 16": ("target", lambda T, D: _aligned_16(T), "align"),  # GGML_ASSERT: unaligned host buffer
    "no attention layer": ("target", lambda T, D: _set(T, "qwen35.block_count", "<I", 3),
                           "attention layer"),  # GGML_ASSERT(buf != NULL) at the first decode
    "rope dims wrap": ("target", lambda T, D: _set(T, "qwen35.rope.dimension_count", "<I", 2**32 - 16),
                       "invalid value"),  # hang: negative rope dimensions
    "drafter block size 2^30": ("draft", lambda T, D: _set(D, "dflash.block_size", "<I", 1 << 30),
                                "block size"),  # Draft(): a 4 GiB block buffer
    "drafter truncated header": ("draft", lambda T, D: D.data[:99170], "valid GGUF"),  # IndexError in gguf-py
    "drafter key type": ("draft", lambda T, D: _kind(D, "dflash.attention.head_count", STR), "GGUF"),  # IndexError
    "drafter array length": ("draft", lambda T, D: _arr_len(D, "dflash.target_layers", 4095), "GGUF"),  # IndexError
}


def test_each_crash_found_is_a_clear_error(demo, tmp_path):
    pairs, expect = [], []
    for name, (which, make, needle) in CRAFTED.items():
        path = tmp_path / (name.replace(" ", "_") + ".gguf")
        path.write_bytes(make(demo["T"], demo["D"]))
        pairs.append((path, demo["draft"], name) if which == "target" else (demo["target"], path, name))
        expect.append(needle)
    results = gguf_fuzz.run_files(pairs)
    for r, needle in zip(results, expect):
        assert r["outcome"] == "error", (r["desc"], r["outcome"], r["message"][:600])
        assert needle in r["message"], (r["desc"], r["message"])


def test_dflash_run_reports_a_corrupt_drafter_without_a_traceback(demo, tmp_path):
    bad = tmp_path / "draft.gguf"
    bad.write_bytes(demo["D"].data[:99170])
    run = str(Path(sys.executable).with_name("dflash-run"))
    for extra in ([], ["--block-size", "4"]):
        res = subprocess.run([run, "-m", demo["target"], "-md", str(bad), "-p", "x", "-n", "4", *extra],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "GGML_NO_BACKTRACE": "1"})
        assert res.returncode == 1, res.stderr
        assert "Traceback" not in res.stderr and str(bad) in res.stderr


def test_unused_tensors_are_not_loaded(demo, tmp_path):
    """A tensor the model does not use (e.g. MTP layers) is never placed or read: junk there
    does not matter."""
    T = demo["T"]
    extra = [("blk.7.nextn.weight", [32, 4], 26, bytes(512)),  # an i32 matrix: no layer would accept it
             ("extra", [0, 5], 8, b"")]  # empty rows: GGML_ASSERT in ggml_mul_mat when it was placed (9fedaa9)
    path = tmp_path / "extra.gguf"
    path.write_bytes(build(_kvs(T), _tensors(T) + extra))
    (r,) = gguf_fuzz.run_files([(path, demo["draft"], "extra tensor")])
    assert r["outcome"] == "ok", r["message"]
