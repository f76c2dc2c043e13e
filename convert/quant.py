"""Output types: which ggml type each tensor gets, and turning float32 rows into it.

`plan_types` is a pure function of tensor names and shapes. For f32/f16/bf16/q8_0 it
follows llama.cpp's convert_hf_to_gguf.py; for q4_0, the K-quant mixes and mxfp4_moe it
reproduces what `llama-quantize` (src/llama-quant.cpp) picks when given a converted file
of this architecture, so a single step gives the file the two llama.cpp steps would.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, LlamaFileType

# outtype -> (general.file_type, default tensor type)
OUTTYPES: dict[str, tuple[LlamaFileType, T]] = {
    "f32": (LlamaFileType.ALL_F32, T.F32),
    "f16": (LlamaFileType.MOSTLY_F16, T.F16),
    "bf16": (LlamaFileType.MOSTLY_BF16, T.BF16),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, T.Q8_0),
    "q4_0": (LlamaFileType.MOSTLY_Q4_0, T.Q4_0),
    "q4_k_m": (LlamaFileType.MOSTLY_Q4_K_M, T.Q4_K),
    "q5_k_m": (LlamaFileType.MOSTLY_Q5_K_M, T.Q5_K),
    "q6_k": (LlamaFileType.MOSTLY_Q6_K, T.Q6_K),
    # experts (3-D tensors) MXFP4, every other matrix q8_0: llama-quantize's MXFP4_MOE
    "mxfp4_moe": (LlamaFileType.MOSTLY_MXFP4_MOE, T.MXFP4),
}
# Types convert_hf_to_gguf.py writes itself; the others are llama-quantize's.
_CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")

# llama-quantize's replacement when a row is not a whole number of blocks.
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0, T.MXFP4: T.Q8_0}

_LAYER = re.compile(r"^blk\.(\d+)\.")


def block_size(t: T) -> int:
    return GGML_QUANT_SIZES[t][0]


def row_bytes(t: T, row_length: int) -> int:
    blck, size = GGML_QUANT_SIZES[t]
    return row_length // blck * size


def tensor_bytes(t: T, shape: Sequence[int]) -> int:
    return int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes(t, shape[-1])


def stays_f32(name: str, shape: Sequence[int]) -> bool:
    """Vectors, norms, the short convolution and non-weight parameters (ssm_a, biases)
    are float32 in every llama.cpp file type."""
    return (len(shape) <= 1 or name.endswith("_norm.weight") or "ssm_conv1d" in name
            or "ffn_gate_inp" in name  # expert routers (and the shared expert's gate) stay f32
            or not name.endswith(".weight"))


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for cat in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight", "attn_k.weight", "attn_q.weight",
                "attn_output.weight", "ffn_up", "ffn_gate", "ffn_down"):
        if cat in name:
            return cat
    return "other"


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fits(t: T, row_length: int) -> bool:
    return row_length % block_size(t) == 0


def _with_fallback(t: T, row_length: int) -> T:
    if _fits(t, row_length):
        return t
    t = _FALLBACK.get(t, t)
    return t if _fits(t, row_length) else T.F16


def plan_types(tensors: Sequence[tuple[str, Sequence[int]]], outtype: str) -> dict[str, T]:
    """ggml type of every tensor, given (GGUF name, numpy-order shape) pairs."""
    if outtype not in OUTTYPES:
        raise ValueError(f"unknown outtype {outtype!r}")
    ftype, default = OUTTYPES[outtype]
    plan: dict[str, T] = {}
    if outtype in _CONVERTER_TYPES:
        for name, shape in tensors:
            if stays_f32(name, shape):
                plan[name] = T.F32
            elif default == T.Q8_0 and not _fits(T.Q8_0, shape[-1]):
                plan[name] = T.F16
            else:
                plan[name] = default
        return plan

    if outtype == "mxfp4_moe":
        for name, shape in tensors:
            expert = len(shape) == 3 and shape[0] > 1
            plan[name] = T.F32 if stays_f32(name, shape) else _with_fallback(T.MXFP4 if expert else T.Q8_0, shape[-1])
        return plan

    names = [n for n, _ in tensors]
    tied = "output.weight" not in names
    n_attn_v = sum(_category(n) in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight") for n in names)
    layers = [int(m.group(1)) for n in names if (m := _LAYER.match(n))]
    n_layer = max(layers) + 1 if layers else 0
    k_mix = ftype in (LlamaFileType.MOSTLY_Q4_K_M, LlamaFileType.MOSTLY_Q5_K_M)
    i_attn_v = i_ffn_down = 0
    # mixtures of experts: a layer's ffn_down tensors (routed and shared) take the
    # layer's choice, read from the name, and 8-expert models keep attention at higher
    # precision, as llama-quantize does
    n_expert = next((int(s[0]) for n, s in tensors if n.endswith("ffn_gate_exps.weight")), 1)

    # llama-quantize walks tensors by layer (non-layer tensors first), then by name; the
    # attn_v and ffn_down counters follow that order.
    def order(item):
        m = _LAYER.match(item[0])
        return (int(m.group(1)) if m else -1, item[0])

    for name, shape in sorted(tensors, key=order):
        if stays_f32(name, shape):
            plan[name] = T.F32
            continue
        cat, t = _category(name), default
        if cat == "output" or (tied and cat == "token_embd"):
            if not _fits(default, shape[-1]):
                t = T.Q8_0
            elif default != T.Q8_0:
                t = T.Q6_K
        elif cat in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight"):
            if k_mix and _use_more_bits(i_attn_v, n_attn_v):
                t = T.Q6_K
            if n_expert == 8:
                t = T.Q8_0
            i_attn_v += 1
        elif cat == "attn_k.weight" and n_expert == 8:
            t = T.Q8_0
        elif cat == "attn_output.weight" and n_expert == 8 and ftype == LlamaFileType.MOSTLY_Q4_K_M:
            t = T.Q5_K
        elif cat == "ffn_down":
            layer = int(_LAYER.match(name).group(1)) if n_expert > 1 else i_ffn_down
            if k_mix and _use_more_bits(layer, n_layer):
                t = T.Q6_K
            i_ffn_down += 1
        plan[name] = _with_fallback(t, shape[-1])
    return plan


def encode_rows(rows: np.ndarray, t: T) -> np.ndarray:
    """float32 [n, row_length] (integers for I64) -> the bytes of those rows stored as type `t`."""
    if t == T.I64:
        return np.ascontiguousarray(rows, dtype="<i8").view(np.uint8).reshape(-1)
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if t == T.F32:
        return rows.view(np.uint8).reshape(-1)
    if t == T.F16:
        return rows.astype(np.float16).view(np.uint8).reshape(-1)
    if t == T.BF16:
        return _to_bf16(rows).view(np.uint8).reshape(-1)
    return _quantize(rows, t)


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, NaNs kept quiet: ggml's fp32 -> bf16 rule."""
    u = x.view(np.uint32)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 64).astype(np.uint16)
    return rounded


def _quantize(rows: np.ndarray, t: T) -> np.ndarray:
    from ..runtime.native import check, ffi, lib

    n_rows, row_length = rows.shape
    out = np.empty(n_rows * row_bytes(t, row_length), dtype=np.uint8)
    written = ffi.new("size_t *")
    check(lib.dfl_quantize(int(t), ffi.from_buffer("float[]", rows), ffi.from_buffer(out), n_rows, row_length,
                           written))
    if written[0] != out.nbytes:
        raise RuntimeError(f"ggml wrote {written[0]} bytes for {n_rows} rows of {t.name}, expected {out.nbytes}")
    return out
