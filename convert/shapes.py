"""Published model shapes: the tensor table and metadata of a real-size GGUF, in
llama.cpp's names, layouts and keys (as our converter writes them), derived from the
model's published config.json, whose entries published_configs.json records with their
source. dflash_gguf.convert.shape_model writes them as files: weightless for the memory
planner, or with random weights that run.

A shape is a plain dict; `shrunk` derives smaller ones of the same structure."""
from __future__ import annotations

import json
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGUFValueType

from .quant import OUTTYPES, plan_types

PUBLISHED = {name: entry for name, entry in
             json.loads((Path(__file__).with_name("published_configs.json")).read_text(encoding="utf-8")).items()
             if not name.startswith("_")}


def _rope(cfg: dict) -> dict:
    """The RoPE parameters (a Gemma 4 config's: of its full-attention layers)."""
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg["rope_theta"]}
    return rope.get("full_attention", rope)


def is_full(c: dict, il: int) -> bool:
    """A Gemma 4 layer with full attention: every interval-th, and the last (transformers
    makes the last layer full whatever layer_types says)."""
    return (il + 1) % c["interval"] == 0 or il == c["layers"] - 1


def shape_of(entry: dict) -> dict:
    """The shape dict of a published config entry, mapped as the converter maps config.json."""
    cfg, arch = entry["config"], entry["architecture"]
    if arch == "gpt-oss":
        yarn = cfg["rope_scaling"]
        return dict(arch=arch, vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
                    heads=cfg["num_attention_heads"], kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                    rope_theta=float(cfg["rope_theta"]), ctx=cfg["max_position_embeddings"],
                    experts=cfg["num_local_experts"], experts_used=cfg["num_experts_per_tok"],
                    expert_ffn=cfg["intermediate_size"], window=cfg["sliding_window"], yarn_factor=yarn["factor"],
                    yarn_orig_ctx=yarn["original_max_position_embeddings"])
    rope = _rope(cfg)
    c = dict(arch=arch, vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
             heads=cfg["num_attention_heads"], kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
             rope_theta=float(rope["rope_theta"]), ctx=cfg["max_position_embeddings"])
    if arch == "dflash":
        # llama.cpp's convention: dflash.target_layers holds the HF ids + 1 (the input of the
        # next layer); the target's multi-section RoPE becomes one section over the whole head
        draft = cfg["dflash_config"]
        return {**c, "ffn": cfg["intermediate_size"], "block": draft["block_size"],
                "target_layers": [i + 1 for i in draft["target_layer_ids"]]}
    if arch == "gemma4":
        return _gemma4_shape(cfg, c)
    if arch == "gemma3":
        return _gemma3_shape(cfg, c)
    c.update(lin_k_heads=cfg["linear_num_key_heads"], lin_v_heads=cfg["linear_num_value_heads"],
             lin_dim=cfg["linear_key_head_dim"], conv=cfg["linear_conv_kernel_dim"],
             interval=cfg["full_attention_interval"], rot=int(cfg["head_dim"] * rope["partial_rotary_factor"]),
             sections=(list(rope["mrope_section"]) + [0] * 4)[:4])
    if cfg.get("tie_word_embeddings"):
        c["tied"] = True  # the LM head is the token embedding: no output.weight
    if arch == "qwen35moe":
        c.update(experts=cfg["num_experts"], experts_used=cfg["num_experts_per_tok"],
                 expert_ffn=cfg["moe_intermediate_size"], shared_ffn=cfg["shared_expert_intermediate_size"])
    else:
        c["ffn"] = cfg["intermediate_size"]
    return c


def _gemma3_shape(cfg: dict, c: dict) -> dict:
    """A Gemma 3 text model: sliding-window layers with a global layer every
    sliding_window_pattern-th (llama.cpp's period), the local layers' RoPE base of their
    own, linear RoPE scaling on the global layers where the config has it, a tied head."""
    scaling = cfg.get("rope_scaling") or {}
    return {**c, "ffn": cfg["intermediate_size"], "window": cfg["sliding_window"],
            "interval": cfg["sliding_window_pattern"], "rope_theta_swa": float(cfg["rope_local_base_freq"]),
            "rope_linear": float(scaling["factor"]) if scaling.get("rope_type") == "linear" else 0.0, "tied": True}


def is_global(c: dict, il: int) -> bool:
    """A Gemma 3 global (full-attention) layer: every interval-th (llama.cpp's
    load_swa_pattern with a period)."""
    return il % c["interval"] == c["interval"] - 1


def _gemma4_shape(cfg: dict, c: dict) -> dict:
    """A Gemma 4 text model: sliding layers (head_dim, num_key_value_heads) with every
    interval-th layer and the last full (global_head_dim; with attention_k_eq_v its own KV
    head count, K doubling as V), proportional RoPE on the full layers (rope_freqs marks
    the rotated pairs), a dense FFN in every layer and, with enable_moe_block, routed
    experts beside it. Per-layer input embeddings and shared KV layers are left out
    (none of the published MoE models has them)."""
    types = cfg["layer_types"]
    interval = types.index("full_attention") + 1
    full, swa = cfg["rope_parameters"]["full_attention"], cfg["rope_parameters"]["sliding_attention"]
    c.update(ffn=cfg["intermediate_size"], head_dim_full=cfg["global_head_dim"], interval=interval,
             kv_heads_full=cfg["num_global_key_value_heads"] if cfg["attention_k_eq_v"] else cfg["num_key_value_heads"],
             k_eq_v=bool(cfg["attention_k_eq_v"]), window=cfg["sliding_window"],
             softcap=float(cfg["final_logit_softcapping"]), rope_theta=float(full["rope_theta"]),
             rope_theta_swa=float(swa["rope_theta"]), tied=True)
    if types != ["full_attention" if is_full(c, il) else "sliding_attention" for il in range(c["layers"])]:
        raise ValueError("gemma4 shapes take layer_types of one full layer every N, the last one full")
    if cfg.get("num_kv_shared_layers") or cfg.get("hidden_size_per_layer_input"):
        raise ValueError("gemma4 shapes have no shared KV layers and no per-layer input embeddings")
    if cfg.get("enable_moe_block"):
        c.update(experts=cfg["num_experts"], experts_used=cfg["top_k_experts"], expert_ffn=cfg["moe_intermediate_size"])
    return c


QWEN35_27B = shape_of(PUBLISHED["qwen35-27b"])
QWEN35_0_8B = shape_of(PUBLISHED["qwen35-0.8b"])
QWEN35_35B_A3B = shape_of(PUBLISHED["qwen35-35b-a3b"])
QWEN35_27B_DFLASH = shape_of(PUBLISHED["qwen35-27b-dflash"])  # block 16, 3.2 GiB in bf16
QWEN35_122B_A10B = shape_of(PUBLISHED["qwen35-122b-a10b"])
GEMMA4_26B_A4B = shape_of(PUBLISHED["gemma4-26b-a4b"])
GEMMA3_27B = shape_of(PUBLISHED["gemma3-27b"])
GEMMA3_1B = shape_of(PUBLISHED["gemma3-1b"])
GEMMA3_270M = shape_of(PUBLISHED["gemma3-270m"])
GPT_OSS_20B = shape_of(PUBLISHED["gpt-oss-20b"])
GPT_OSS_120B = shape_of(PUBLISHED["gpt-oss-120b"])

CONFIGS = {"qwen35-27b": QWEN35_27B, "qwen35-35b-a3b": QWEN35_35B_A3B, "qwen35-27b-dflash": QWEN35_27B_DFLASH,
           "qwen35-122b-a10b": QWEN35_122B_A10B, "gemma4-26b-a4b": GEMMA4_26B_A4B, "gemma3-27b": GEMMA3_27B,
           "gemma3-1b": GEMMA3_1B, "gemma3-270m": GEMMA3_270M,
           "gpt-oss-20b": GPT_OSS_20B, "gpt-oss-120b": GPT_OSS_120B}


def gptoss_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy-order shape) of every tensor of a gpt-oss target."""
    E, V, X, F = c["hidden"], c["vocab"], c["experts"], c["expert_ffn"]
    q, kv = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    out = [("token_embd.weight", (V, E))]
    for il in range(c["layers"]):
        b = f"blk.{il}."
        out += [(b + "attn_norm.weight", (E,)), (b + "post_attention_norm.weight", (E,)),
                (b + "attn_q.weight", (q, E)), (b + "attn_q.bias", (q,)), (b + "attn_k.weight", (kv, E)),
                (b + "attn_k.bias", (kv,)), (b + "attn_v.weight", (kv, E)), (b + "attn_v.bias", (kv,)),
                (b + "attn_output.weight", (E, q)), (b + "attn_output.bias", (E,)),
                (b + "attn_sinks.weight", (c["heads"],)),
                (b + "ffn_gate_inp.weight", (X, E)), (b + "ffn_gate_inp.bias", (X,)),
                (b + "ffn_gate_exps.weight", (X, F, E)), (b + "ffn_gate_exps.bias", (X, F)),
                (b + "ffn_up_exps.weight", (X, F, E)), (b + "ffn_up_exps.bias", (X, F)),
                (b + "ffn_down_exps.weight", (X, E, F)), (b + "ffn_down_exps.bias", (X, E))]
    return out + [("output_norm.weight", (E,)), ("output.weight", (V, E))]


def target_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy-order shape) of every tensor of a target."""
    if c["arch"] == "gpt-oss":
        return gptoss_tensors(c)
    if c["arch"] == "gemma4":
        return gemma4_tensors(c)
    if c["arch"] == "gemma3":
        return gemma3_tensors(c)
    E, V = c["hidden"], c["vocab"]
    hd, H, Hkv = c["head_dim"], c["heads"], c["kv_heads"]
    Hk, Hv, d = c["lin_k_heads"], c["lin_v_heads"], c["lin_dim"]
    conv_ch = 2 * Hk * d + Hv * d
    out = [("token_embd.weight", (V, E))]
    for il in range(c["layers"]):
        b = f"blk.{il}."
        out += [(b + "attn_norm.weight", (E,)), (b + "post_attention_norm.weight", (E,))]
        if is_recurrent(c, il):
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
    out.append(("output_norm.weight", (E,)))
    return out if c.get("tied") else out + [("output.weight", (V, E))]


def gemma3_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """A Gemma 3 target's tensors (llama.cpp's gemma3 names; the head tied to the embedding)."""
    E, V, F, H, Hkv, hd = c["hidden"], c["vocab"], c["ffn"], c["heads"], c["kv_heads"], c["head_dim"]
    out = [("token_embd.weight", (V, E))]
    for il in range(c["layers"]):
        b = f"blk.{il}."
        out += [(b + "attn_norm.weight", (E,)), (b + "attn_q.weight", (H * hd, E)), (b + "attn_k.weight", (Hkv * hd, E)),
                (b + "attn_v.weight", (Hkv * hd, E)), (b + "attn_output.weight", (E, H * hd)),
                (b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,)),
                (b + "post_attention_norm.weight", (E,)), (b + "ffn_norm.weight", (E,)),
                (b + "ffn_gate.weight", (F, E)), (b + "ffn_up.weight", (F, E)), (b + "ffn_down.weight", (E, F)),
                (b + "post_ffw_norm.weight", (E,))]
    return out + [("output_norm.weight", (E,))]


def gemma4_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """A Gemma 4 target's tensors, in our converter's order (convert/models/gemma4.py)."""
    E, V, F, H = c["hidden"], c["vocab"], c["ffn"], c["heads"]
    out = [("rope_freqs.weight", (c["head_dim_full"] // 2,)), ("token_embd.weight", (V, E))]
    for il in range(c["layers"]):
        b = f"blk.{il}."
        full = is_full(c, il)
        hd, kvh = (c["head_dim_full"], c["kv_heads_full"]) if full else (c["head_dim"], c["kv_heads"])
        out += [(b + "attn_norm.weight", (E,)), (b + "attn_q.weight", (H * hd, E)), (b + "attn_q_norm.weight", (hd,)),
                (b + "attn_output.weight", (E, H * hd)), (b + "post_attention_norm.weight", (E,)),
                (b + "ffn_norm.weight", (E,)), (b + "ffn_gate.weight", (F, E)), (b + "ffn_up.weight", (F, E)),
                (b + "ffn_down.weight", (E, F)), (b + "post_ffw_norm.weight", (E,)),
                (b + "layer_output_scale.weight", (1,)), (b + "attn_k.weight", (kvh * hd, E)),
                (b + "attn_k_norm.weight", (hd,))]
        if not (full and c["k_eq_v"]):
            out.append((b + "attn_v.weight", (kvh * hd, E)))
        if "experts" in c:
            X, Fx = c["experts"], c["expert_ffn"]
            out += [(b + "ffn_gate_inp.weight", (X, E)), (b + "ffn_gate_inp.scale", (E,)),
                    (b + "ffn_down_exps.scale", (X,)), (b + "pre_ffw_norm_2.weight", (E,)),
                    (b + "post_ffw_norm_1.weight", (E,)), (b + "post_ffw_norm_2.weight", (E,)),
                    (b + "ffn_gate_up_exps.weight", (X, 2 * Fx, E)), (b + "ffn_down_exps.weight", (X, E, Fx))]
    return out + [("output_norm.weight", (E,))]


def draft_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The DFlash drafter's own tensors (it shares the target's embedding and LM head)."""
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


def is_recurrent(c: dict, il: int) -> bool:
    return (il + 1) % c["interval"] != 0


def metadata(c: dict) -> list[tuple[str, object, GGUFValueType]]:
    """Architecture keys (`{arch}.*`) and the drafter's mask token; tokenizer.* and
    general.* are the writer's."""
    a, u32, f32, i32 = c["arch"], GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.INT32
    kv = [(f"{a}.embedding_length", c["hidden"], u32), (f"{a}.block_count", c["layers"], u32),
          (f"{a}.context_length", c["ctx"], u32),
          (f"{a}.attention.head_count", c["heads"], u32), (f"{a}.attention.head_count_kv", c["kv_heads"], u32),
          (f"{a}.attention.key_length", c["head_dim"], u32), (f"{a}.attention.value_length", c["head_dim"], u32),
          (f"{a}.attention.layer_norm_rms_epsilon", 1e-6, f32), (f"{a}.rope.freq_base", c["rope_theta"], f32)]
    if a == "gemma4":
        return kv[:4] + _gemma4_metadata(c)  # its head counts and sizes are per kind of layer
    if a == "gemma3":
        # llama.cpp's keys (its converter's and ours: convert/models/gemma3.py); the period of
        # global layers is llama.cpp's default 6, written only when it differs
        kv += [(f"{a}.feed_forward_length", c["ffn"], u32), (f"{a}.rope.freq_base_swa", c["rope_theta_swa"], f32),
               (f"{a}.attention.sliding_window", c["window"], u32)]
        if c["interval"] != 6:
            kv.append((f"{a}.attention.sliding_window_pattern", c["interval"], u32))
        if c["rope_linear"]:
            kv += [(f"{a}.rope.scaling.type", "linear", GGUFValueType.STRING),
                   (f"{a}.rope.scaling.factor", c["rope_linear"], f32)]
        return kv
    if a == "gpt-oss":
        return kv + [(f"{a}.feed_forward_length", c["expert_ffn"], u32),
                     (f"{a}.expert_feed_forward_length", c["expert_ffn"], u32),
                     (f"{a}.expert_count", c["experts"], u32), (f"{a}.expert_used_count", c["experts_used"], u32),
                     (f"{a}.attention.sliding_window", c["window"], u32),
                     (f"{a}.rope.scaling.type", "yarn", GGUFValueType.STRING),
                     (f"{a}.rope.scaling.factor", c["yarn_factor"], f32),
                     (f"{a}.rope.scaling.original_context_length", c["yarn_orig_ctx"], u32)]
    if a == "dflash":
        return kv + [(f"{a}.feed_forward_length", c["ffn"], u32), (f"{a}.block_size", c["block"], u32),
                     (f"{a}.target_layers", c["target_layers"], i32),
                     (f"{a}.rope.dimension_sections", [c["head_dim"] // 2, 0, 0, 0], i32),
                     ("tokenizer.ggml.mask_token_id", c["vocab"] - 1, u32)]
    kv += [(f"{a}.rope.dimension_count", c["rot"], u32), (f"{a}.rope.dimension_sections", c["sections"], i32),
           (f"{a}.ssm.conv_kernel", c["conv"], u32), (f"{a}.ssm.state_size", c["lin_dim"], u32),
           (f"{a}.ssm.group_count", c["lin_k_heads"], u32), (f"{a}.ssm.time_step_rank", c["lin_v_heads"], u32),
           (f"{a}.ssm.inner_size", c["lin_v_heads"] * c["lin_dim"], u32),
           (f"{a}.attention.recurrent_layers", [is_recurrent(c, il) for il in range(c["layers"])],
            GGUFValueType.BOOL),
           (f"{a}.full_attention_interval", c["interval"], u32)]
    if a == "qwen35moe":
        kv += [(f"{a}.expert_count", c["experts"], u32), (f"{a}.expert_used_count", c["experts_used"], u32),
               (f"{a}.expert_feed_forward_length", c["expert_ffn"], u32),
               (f"{a}.expert_shared_feed_forward_length", c["shared_ffn"], u32)]
    else:
        kv.append((f"{a}.feed_forward_length", c["ffn"], u32))
    return kv


def _gemma4_metadata(c: dict) -> list[tuple[str, object, GGUFValueType]]:
    """The gemma4.* keys our converter writes beside the common ones (convert/models/gemma4.py)."""
    a, u32, f32, i32 = c["arch"], GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.INT32
    full = [is_full(c, il) for il in range(c["layers"])]
    kv = [(f"{a}.feed_forward_length", c["ffn"], u32), (f"{a}.rope.freq_base", c["rope_theta"], f32),
          (f"{a}.rope.freq_base_swa", c["rope_theta_swa"], f32), (f"{a}.attention.layer_norm_rms_epsilon", 1e-6, f32),
          (f"{a}.attention.key_length", c["head_dim_full"], u32),
          (f"{a}.attention.value_length", c["head_dim_full"], u32),
          (f"{a}.attention.sliding_window", c["window"], u32), (f"{a}.attention.shared_kv_layers", 0, u32),
          (f"{a}.embedding_length_per_layer_input", 0, u32),
          (f"{a}.attention.sliding_window_pattern", [not f for f in full], GGUFValueType.BOOL),
          (f"{a}.attention.key_length_swa", c["head_dim"], u32),
          (f"{a}.attention.value_length_swa", c["head_dim"], u32),
          (f"{a}.rope.dimension_count", c["head_dim_full"], u32), (f"{a}.rope.dimension_count_swa", c["head_dim"], u32),
          (f"{a}.attention.head_count_kv", [c["kv_heads_full"] if f else c["kv_heads"] for f in full], i32),
          (f"{a}.final_logit_softcapping", c["softcap"], f32)]
    if "experts" in c:
        kv += [(f"{a}.expert_count", c["experts"], u32), (f"{a}.expert_used_count", c["experts_used"], u32),
               (f"{a}.expert_feed_forward_length", c["expert_ffn"], u32)]
    return kv


def tensor_table(c: dict, outtype: str) -> list[tuple[str, tuple[int, ...], object]]:
    """(name, numpy-order shape, ggml type) of every tensor, typed as our converter's
    `outtype` (llama.cpp's choices per tensor) would type them."""
    tensors = draft_tensors(c) if c["arch"] == "dflash" else target_tensors(c)
    types = plan_types(tensors, outtype)
    return [(name, shape, types[name]) for name, shape in tensors]


def tensor_nbytes(shape: tuple[int, ...], qtype) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape[:-1]:
        n *= d
    return n * (shape[-1] // block) * size


def file_type(outtype: str) -> int:
    return int(OUTTYPES[outtype][0])


def shrunk(c: dict, layers: int | None = None, **overrides) -> dict:
    """The config with fewer layers (a target keeps its recurrent:attention pattern; a
    drafter's target layers must then be given) and any other entries replaced."""
    unknown = set(overrides) - set(c)
    if unknown:
        raise ValueError(f"unknown config entries for {c['arch']}: {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(sorted(c))})")
    out = {**c, **overrides}
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        out["layers"] = layers
    if out["arch"] in ("qwen35", "qwen35moe") and out["layers"] < out["interval"]:
        raise ValueError(f"a {out['arch']} target needs at least {out['interval']} layers (one full-attention "
                         f"layer every {out['interval']}), got {out['layers']}")
    return out
