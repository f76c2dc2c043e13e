"""Published model shapes as GGUF files without weights: the header, metadata and tensor
table of a real-size model, the data region left as a hole (a sparse file, so nothing is
written or read). Enough for anything that reads only metadata, such as the memory
planner (tests/test_memory.py, scripts/memory_table.py)."""
from __future__ import annotations

import os
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGUFValueType, GGUFWriter

# Qwen/Qwen3.5-27B text_config
QWEN35_27B = dict(arch="qwen35", vocab=248320, hidden=5120, layers=64, ffn=17408, heads=24, kv_heads=4,
                  head_dim=256, lin_k_heads=16, lin_v_heads=48, lin_dim=128, conv=4, interval=4,
                  rope_theta=1e7, rot=64, ctx=262144)
# Qwen/Qwen3.5-0.8B text_config (the published model ties the LM head to the embedding;
# written untied here, like the larger shapes)
QWEN35_0_8B = dict(arch="qwen35", vocab=248320, hidden=1024, layers=24, ffn=3584, heads=8, kv_heads=2,
                   head_dim=256, lin_k_heads=16, lin_v_heads=16, lin_dim=128, conv=4, interval=4,
                   rope_theta=1e7, rot=64, ctx=262144)
# Qwen/Qwen3.5-35B-A3B text_config: 256 experts, 8 routed + a shared expert
QWEN35_35B_A3B = dict(arch="qwen35moe", vocab=248320, hidden=2048, layers=40, heads=16, kv_heads=2, head_dim=256,
                      lin_k_heads=16, lin_v_heads=32, lin_dim=128, conv=4, interval=4, rope_theta=1e7, rot=64,
                      ctx=262144, experts=256, experts_used=8, expert_ffn=512, shared_ffn=512)
# z-lab/Qwen3.5-27B-DFlash: 5 Qwen3 layers over 5 target layers, block 16 (3.2 GiB in bf16)
QWEN35_27B_DFLASH = dict(arch="dflash", hidden=5120, layers=5, ffn=17408, heads=32, kv_heads=8, head_dim=128,
                         block=16, target_layers=[2, 17, 32, 47, 62], vocab=248320, rope_theta=1e7)


def _target_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy-order shape) of every tensor, in llama.cpp's layout."""
    E, V = c["hidden"], c["vocab"]
    hd, H, Hkv = c["head_dim"], c["heads"], c["kv_heads"]
    Hk, Hv, d = c["lin_k_heads"], c["lin_v_heads"], c["lin_dim"]
    conv_ch = 2 * Hk * d + Hv * d
    out = [("token_embd.weight", (V, E))]
    for il in range(c["layers"]):
        b = f"blk.{il}."
        out += [(b + "attn_norm.weight", (E,)), (b + "post_attention_norm.weight", (E,))]
        if (il + 1) % c["interval"]:
            out += [(b + "attn_qkv.weight", (conv_ch, E)), (b + "attn_gate.weight", (Hv * d, E)),
                    (b + "ssm_conv1d.weight", (conv_ch, c["conv"])), (b + "ssm_dt.bias", (Hv,)),
                    (b + "ssm_a", (Hv,)), (b + "ssm_beta.weight", (Hv, E)), (b + "ssm_alpha.weight", (Hv, E)),
                    (b + "ssm_norm.weight", (d,)), (b + "ssm_out.weight", (E, Hv * d))]
        else:
            out += [(b + "attn_q.weight", (2 * H * hd, E)), (b + "attn_k.weight", (Hkv * hd, E)),
                    (b + "attn_v.weight", (Hkv * hd, E)), (b + "attn_output.weight", (E, H * hd)),
                    (b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))]
        if c["arch"] == "qwen35moe":
            X, F, S = c["experts"], c["expert_ffn"], c["shared_ffn"]
            out += [(b + "ffn_gate_inp.weight", (X, E)), (b + "ffn_gate_exps.weight", (X, F, E)),
                    (b + "ffn_up_exps.weight", (X, F, E)), (b + "ffn_down_exps.weight", (X, E, F)),
                    (b + "ffn_gate_inp_shexp.weight", (E,)), (b + "ffn_gate_shexp.weight", (S, E)),
                    (b + "ffn_up_shexp.weight", (S, E)), (b + "ffn_down_shexp.weight", (E, S))]
        else:
            F = c["ffn"]
            out += [(b + "ffn_gate.weight", (F, E)), (b + "ffn_up.weight", (F, E)), (b + "ffn_down.weight", (E, F))]
    return out + [("output_norm.weight", (E,)), ("output.weight", (V, E))]


def _draft_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    E, F, hd = c["hidden"], c["ffn"], c["head_dim"]
    out = [("fc.weight", (E, E * len(c["target_layers"]))), ("enc.output_norm.weight", (E,)),
           ("output_norm.weight", (E,))]
    for il in range(c["layers"]):
        b = f"blk.{il}."
        out += [(b + "attn_norm.weight", (E,)), (b + "attn_q.weight", (c["heads"] * hd, E)),
                (b + "attn_k.weight", (c["kv_heads"] * hd, E)), (b + "attn_v.weight", (c["kv_heads"] * hd, E)),
                (b + "attn_output.weight", (E, c["heads"] * hd)), (b + "attn_q_norm.weight", (hd,)),
                (b + "attn_k_norm.weight", (hd,)), (b + "ffn_norm.weight", (E,)), (b + "ffn_gate.weight", (F, E)),
                (b + "ffn_up.weight", (F, E)), (b + "ffn_down.weight", (E, F))]
    return out


def _metadata(c: dict) -> list[tuple[str, object, GGUFValueType]]:
    a, u32, f32 = c["arch"], GGUFValueType.UINT32, GGUFValueType.FLOAT32
    kv = [(f"{a}.embedding_length", c["hidden"], u32), (f"{a}.block_count", c["layers"], u32),
          (f"{a}.attention.head_count", c["heads"], u32), (f"{a}.attention.head_count_kv", c["kv_heads"], u32),
          (f"{a}.attention.key_length", c["head_dim"], u32), (f"{a}.attention.value_length", c["head_dim"], u32),
          (f"{a}.attention.layer_norm_rms_epsilon", 1e-6, f32), (f"{a}.rope.freq_base", c["rope_theta"], f32)]
    if a == "dflash":
        return kv + [(f"{a}.feed_forward_length", c["ffn"], u32), (f"{a}.block_size", c["block"], u32),
                     (f"{a}.target_layers", c["target_layers"], GGUFValueType.INT32),
                     ("tokenizer.ggml.mask_token_id", c["vocab"] - 1, u32)]
    kv += [(f"{a}.context_length", c["ctx"], u32), (f"{a}.rope.dimension_count", c["rot"], u32),
           (f"{a}.ssm.conv_kernel", c["conv"], u32), (f"{a}.ssm.state_size", c["lin_dim"], u32),
           (f"{a}.ssm.group_count", c["lin_k_heads"], u32), (f"{a}.ssm.time_step_rank", c["lin_v_heads"], u32),
           (f"{a}.ssm.inner_size", c["lin_v_heads"] * c["lin_dim"], u32),
           (f"{a}.full_attention_interval", c["interval"], u32)]
    if a == "qwen35moe":
        kv += [(f"{a}.expert_count", c["experts"], u32), (f"{a}.expert_used_count", c["experts_used"], u32),
               (f"{a}.expert_feed_forward_length", c["expert_ffn"], u32),
               (f"{a}.expert_shared_feed_forward_length", c["shared_ffn"], u32)]
    else:
        kv.append((f"{a}.feed_forward_length", c["ffn"], u32))
    return kv


def tensor_table(c: dict, outtype: str) -> list[tuple[str, tuple[int, ...], object]]:
    """(name, numpy-order shape, ggml type) of every tensor, typed as our converter's
    `outtype` (llama.cpp's choices per tensor) would type them."""
    from dflash_gguf.convert.quant import plan_types

    tensors = _draft_tensors(c) if c["arch"] == "dflash" else _target_tensors(c)
    types = plan_types(tensors, outtype)
    return [(name, shape, types[name]) for name, shape in tensors]


def tensor_nbytes(shape: tuple[int, ...], qtype) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape[:-1]:
        n *= d
    return n * (shape[-1] // block) * size


def write_shape_gguf(path: str | os.PathLike, c: dict, outtype: str) -> Path:
    """The model's GGUF with its data region a hole: header, metadata, tensor table."""
    path = Path(path)
    w = GGUFWriter(str(path), c["arch"])
    for key, value, vtype in _metadata(c):
        if isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for name, shape, qtype in tensor_table(c, outtype):
        w.add_tensor_info(name, shape, qtype.name.lower(), tensor_nbytes(shape, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    # the data region: every tensor at its aligned offset, as a hole
    size = path.stat().st_size
    align = 32
    data = 0
    for _, shape, qtype in tensor_table(c, outtype):
        data = (data + align - 1) // align * align + tensor_nbytes(shape, qtype)
    with open(path, "r+b") as f:
        f.truncate((size + align - 1) // align * align + data)
    return path
