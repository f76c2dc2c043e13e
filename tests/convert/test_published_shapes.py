"""The published shapes (convert/published_configs.json, read by dflash_gguf.convert.shapes)
against what llama.cpp's pinned sources know of the same models: the quantization-type
snapshot of the 27B (tests/snapshots/qwen3.6-27b.schema: its hyperparameters, which
layers are attention layers, every quantizable tensor's name and the type llama-quantize
gives it) and the model-size switches of src/models/qwen35*.cpp and gemma4.cpp; the
Qwen3.5-122B-A10B and Gemma 4 26B-A4B entries also against their model cards' parameter
counts. The 27B drafter's config appears nowhere in those sources and is checked against
nothing here."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from helpers.fixtures import llama_cpp_source, missing_oracle

from dflash_gguf.convert.shapes import (GEMMA3_1B, GEMMA3_27B, GEMMA3_270M, GEMMA4_26B_A4B, GPT_OSS_20B, GPT_OSS_120B, PUBLISHED, QWEN35_0_8B,
                                        QWEN35_27B, QWEN35_35B_A3B, QWEN35_122B_A10B, is_recurrent, tensor_table)

SNAPSHOT_27B = Path("tests/snapshots/qwen3.6-27b.schema")
# llama.cpp's quantization type names -> our converter's --outtype, where it has them
OUTTYPES = {"F16": "f16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_K_M": "q4_k_m", "Q5_K_M": "q5_k_m",
            "Q6_K": "q6_k"}


@pytest.fixture(scope="module")
def src() -> Path:
    src = llama_cpp_source()
    if src is None:
        missing_oracle("llama.cpp's sources (the llama-cpp-python sdist)")
    return src


@pytest.fixture(scope="module")
def snapshot(src):
    """(header {key: int}, {type name: (default type, {tensor: type})}) of the 27B snapshot."""
    header, sections, current = {}, {}, None
    for line in (src / SNAPSHOT_27B).read_text().splitlines():
        if line.startswith("# n_embd="):
            header = {k: int(v) for k, v in (kv.split("=") for kv in line[2:].split(", "))}
        elif m := re.fullmatch(r"\[(\w+)\] (\w+)", line):
            current = m.group(1)
            sections[current] = (m.group(2).lower(), {})
        elif current and line.strip():
            name, qtype = line.split()
            sections[current][1][name] = qtype.lower()
    assert header and len(sections) > 10, "the snapshot's format changed"
    return header, sections


def test_every_published_entry_names_its_source():
    for name, entry in PUBLISHED.items():
        assert entry["source"].startswith(f"https://huggingface.co/{entry['model']}/"), name
        assert entry["architecture"] in ("qwen35", "qwen35moe", "gemma3", "gemma4", "dflash", "gpt-oss"), name


def test_27b_hyperparameters_are_llama_cpp_s(snapshot, src):
    header, _ = snapshot
    assert (src / SNAPSHOT_27B).read_text().startswith("# Model: Qwen3.5-27B\n")
    c = QWEN35_27B
    assert header == {"n_embd": c["hidden"], "n_ff": c["ffn"], "n_vocab": c["vocab"], "n_layer": c["layers"],
                      "n_head": c["heads"], "n_head_kv": c["kv_heads"]}


def test_27b_attention_layers_are_llama_cpp_s(snapshot):
    """Gated DeltaNet layers carry attn_qkv, attention layers attn_v: the snapshot's names
    give the layer pattern."""
    names = {n for _, types in snapshot[1].values() for n in types}
    recurrent = {int(m.group(1)) for n in names if (m := re.fullmatch(r"blk\.(\d+)\.attn_qkv\.weight", n))}
    attention = {int(m.group(1)) for n in names if (m := re.fullmatch(r"blk\.(\d+)\.attn_v\.weight", n))}
    assert recurrent | attention == set(range(QWEN35_27B["layers"])) and not recurrent & attention
    assert recurrent == {il for il in range(QWEN35_27B["layers"]) if is_recurrent(QWEN35_27B, il)}


@pytest.mark.parametrize("llama_type", sorted(OUTTYPES))
def test_27b_tensor_types_are_llama_quantize_s(snapshot, llama_type):
    """Every quantizable tensor the snapshot names is in our table, typed as llama-quantize
    types it (the snapshot lists the tensors that differ from the type's default)."""
    default, overrides = snapshot[1][llama_type]
    known = {n for _, types in snapshot[1].values() for n in types}
    ours = {name: qtype.name.lower() for name, _, qtype in tensor_table(QWEN35_27B, OUTTYPES[llama_type])}
    assert known <= set(ours), sorted(known - set(ours))[:5]
    wrong = {n: (ours[n], overrides.get(n, default)) for n in known if ours[n] != overrides.get(n, default)}
    assert not wrong, f"{len(wrong)} tensors typed otherwise, e.g. {sorted(wrong.items())[:5]}"


def test_moe_shapes_have_their_published_parameter_counts():
    """The entries of the two models the hub was out of reach for, against the totals
    their model cards publish (122B, 10B active; 25.2B, 3.8B active): a wrong width or
    expert count would move them by billions."""
    for c, total, active in ((QWEN35_122B_A10B, 122.1, 10), (GEMMA4_26B_A4B, 25.2, 3.8)):
        table = tensor_table(c, "bf16")
        params = sum(math.prod(shape) for _, shape, _ in table)
        experts = sum(math.prod(shape) for name, shape, _ in table if "_exps" in name)
        used = params - experts * (1 - c["experts_used"] / c["experts"])
        assert abs(params / 1e9 - total) < 0.1 and abs(used / 1e9 - active) < 0.3, (c["arch"], params, used)


def _size_cases(text: str) -> str:
    return text[text.index("switch (hparams.n_layer())"):]


def test_smaller_and_moe_shapes_are_the_sizes_llama_cpp_names(src):
    dense = _size_cases((src / "src" / "models" / "qwen35.cpp").read_text())
    assert re.search(rf"case {QWEN35_0_8B['layers']}: type = hparams\.n_embd == {QWEN35_0_8B['hidden']} \? "
                     r"LLM_TYPE_0_8B", dense)
    assert re.search(rf"case {QWEN35_27B['layers']}: type = LLM_TYPE_27B", dense)
    moe = _size_cases((src / "src" / "models" / "qwen35moe.cpp").read_text())
    assert re.search(rf"case {QWEN35_35B_A3B['layers']}: type = LLM_TYPE_35B_A3B", moe)
    assert re.search(rf"case {QWEN35_122B_A10B['layers']}: type = LLM_TYPE_122B_A10B", moe)
    gemma = _size_cases((src / "src" / "models" / "gemma4.cpp").read_text())
    assert re.search(rf"case {GEMMA4_26B_A4B['layers']}: type = LLM_TYPE_26B_A4B", gemma)
    conversion = (src / "conversion" / "qwen.py").read_text()
    at = conversion.index('@ModelBase.example("Qwen/Qwen3.5-35B-A3B")')
    assert "model_arch = gguf.MODEL_ARCH.QWEN35MOE" in conversion[at:at + 200]


def test_gpt_oss_shapes_are_the_sizes_llama_cpp_names(src):
    """llama.cpp's openai-moe names its sizes by layer count, and its converter's example
    is gpt-oss-20b; the two published shapes differ only in depth and expert count."""
    sizes = _size_cases((src / "src" / "models" / "openai-moe.cpp").read_text())
    assert re.search(rf"case {GPT_OSS_20B['layers']}: type = LLM_TYPE_20B", sizes)
    assert re.search(rf"case {GPT_OSS_120B['layers']}: type = LLM_TYPE_120B", sizes)
    conversion = (src / "conversion" / "gpt_oss.py").read_text()
    at = conversion.index('@ModelBase.example("openai/gpt-oss-20b")')
    assert "model_arch = gguf.MODEL_ARCH.GPT_OSS" in conversion[at:at + 200]
    differ = {k for k in GPT_OSS_20B if GPT_OSS_20B[k] != GPT_OSS_120B[k]}
    assert differ == {"layers", "experts"} and (GPT_OSS_20B["experts"], GPT_OSS_120B["experts"]) == (32, 128)
    # MXFP4 experts need rows of whole 32-value blocks
    assert all(shape[-1] % 32 == 0 for name, shape, _ in tensor_table(GPT_OSS_20B, "mxfp4_moe") if "_exps" in name)


def test_gemma3_shapes_are_the_sizes_llama_cpp_names(src):
    """llama.cpp's gemma3 names its sizes by layer count: 18 the 270M, 26 the 1B, 62 the
    27B; and the 27B alone scales its queries by n_embd / n_head (168, its config's
    query_pre_attn_scalar), the others by the head size."""
    sizes = _size_cases((src / "src" / "models" / "gemma3.cpp").read_text())
    for c, size in ((GEMMA3_270M, "270M"), (GEMMA3_1B, "1B"), (GEMMA3_27B, "27B")):
        assert re.search(rf"case {c['layers']}: type = LLM_TYPE_{size};", sizes), size
    for key in ("gemma3-270m", "gemma3-1b", "gemma3-27b"):
        c, cfg = shape_of_entry(key)
        want = c["hidden"] // c["heads"] if key == "gemma3-27b" else c["head_dim"]
        assert cfg["query_pre_attn_scalar"] == want, key


def shape_of_entry(key):
    from dflash_gguf.convert.shapes import CONFIGS

    return CONFIGS[key], PUBLISHED[key]["config"]


def test_gemma3_shapes_have_the_technical_reports_parameter_counts():
    """The Gemma 3 technical report's embedding and non-embedding parameters (1B: 302M and
    698M; 27B: 1,416M, its vision tokens' rows included, and 25,600M) and Google's for the
    270M (170M and 100M, rounded: 167.8M of embedding): a wrong width, FFN or head count
    moves them by far more."""
    for c, embedding, rest in ((GEMMA3_270M, 170, 100), (GEMMA3_1B, 302, 698), (GEMMA3_27B, 1416, 25600)):
        table = tensor_table(c, "bf16")
        emb = sum(math.prod(shape) for name, shape, _ in table if name == "token_embd.weight") / 1e6
        params = sum(math.prod(shape) for _, shape, _ in table) / 1e6
        assert abs(emb - embedding) < 0.02 * embedding and abs(params - emb - rest) < 0.005 * rest, (c["layers"], emb)


@pytest.mark.real
def test_gemma3_270m_shape_is_the_published_files(real_path):
    """The 270M entry against the published GGUF itself: its gemma3.* numbers and every
    tensor's name and shape."""
    from dflash_gguf.runtime.gguf_meta import GGUFMeta

    meta = GGUFMeta(str(real_path("gemma-3-270m")))
    c = GEMMA3_270M
    key = {k: meta.get(f"gemma3.{k}") for k in
           ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
            "attention.head_count_kv", "attention.key_length", "attention.sliding_window", "context_length",
            "rope.freq_base")}
    assert key == {"block_count": c["layers"], "embedding_length": c["hidden"], "feed_forward_length": c["ffn"],
                   "attention.head_count": c["heads"], "attention.head_count_kv": c["kv_heads"],
                   "attention.key_length": c["head_dim"], "attention.sliding_window": c["window"],
                   "context_length": c["ctx"], "rope.freq_base": c["rope_theta"]}
    published = {name: tuple(reversed(ne)) for name, (ne, _) in meta.tensors().items()}
    assert published == {name: shape for name, shape, _ in tensor_table(c, "q4_k_m")}
