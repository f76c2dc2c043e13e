"""The demo `dflash-run` runs with no -m: the trained pair shipped in dflash_gguf/data
when present, else a small untrained qwen35 model written with numpy alone (noise)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

DEMO_PROMPT = "Write quicksort in Python."


def _byte_level_alphabet() -> list:
    # GPT-2's byte -> printable-unicode table, the alphabet of byte-level BPE vocabularies.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


DATA = Path(__file__).resolve().parent / "data"


def demo_paths():
    """(target, drafter or None) for the demo."""
    target, draft = DATA / "demo-target.gguf", DATA / "demo-draft.gguf"
    if target.exists() and draft.exists():
        return str(target), str(draft)
    return str(demo_target_path()), None


def cache_dir() -> Path:
    root = os.environ.get("DFLASH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dflash-gguf")
    return Path(root)


def demo_target_path() -> Path:
    path = cache_dir() / "demo-untrained-qwen35.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_untrained_qwen35(tmp)
        tmp.replace(path)
    return path


def write_untrained_qwen35(path: Path, seed: int = 0) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    arch = "qwen35"
    n_embd, n_layer, n_ff, n_head, n_kv, hd = 64, 4, 128, 2, 1, 32
    d_conv, n_k, n_v, s = 4, 1, 2, 16
    d_inner = n_v * s
    tokens = _byte_level_alphabet() + ["ĠĠ", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * 257 + [3, 3, 3]
    n_vocab = len(tokens)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("dflash-gguf untrained demo")
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e7)
    w.add_rope_dimension_count(hd // 4)
    w.add_rope_dimension_sections([2, 1, 1, 0])
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_state_size(s)
    w.add_ssm_group_count(n_k)
    w.add_ssm_time_step_rank(n_v)
    w.add_ssm_inner_size(d_inner)
    w.add_full_attention_interval(4)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ Ġ"])
    w.add_eos_token_id(n_vocab - 1)
    w.add_pad_token_id(n_vocab - 3)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    def mat(rows, cols):  # a [rows, cols] numpy array is a GGUF tensor of ne = [cols, rows]
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def vec(n, mean=1.0):
        return (mean + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, n_embd)).astype(np.float32))
    w.add_tensor("output_norm.weight", vec(n_embd))
    conv_ch = d_inner + 2 * n_k * s
    for il in range(n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", vec(n_embd))
        w.add_tensor(p + "post_attention_norm.weight", vec(n_embd))
        if (il + 1) % 4 != 0:
            w.add_tensor(p + "attn_qkv.weight", mat(conv_ch, n_embd))
            w.add_tensor(p + "attn_gate.weight", mat(d_inner, n_embd))
            w.add_tensor(p + "ssm_conv1d.weight", (0.5 * rng.standard_normal((conv_ch, d_conv))).astype(np.float32))
            w.add_tensor(p + "ssm_dt.bias", vec(n_v, 0.0))
            w.add_tensor(p + "ssm_a", -np.exp(vec(n_v, 0.0)))
            w.add_tensor(p + "ssm_beta.weight", mat(n_v, n_embd))
            w.add_tensor(p + "ssm_alpha.weight", mat(n_v, n_embd))
            w.add_tensor(p + "ssm_norm.weight", vec(s))
            w.add_tensor(p + "ssm_out.weight", mat(n_embd, d_inner))
        else:
            w.add_tensor(p + "attn_q.weight", mat(2 * n_head * hd, n_embd))
            w.add_tensor(p + "attn_k.weight", mat(n_kv * hd, n_embd))
            w.add_tensor(p + "attn_v.weight", mat(n_kv * hd, n_embd))
            w.add_tensor(p + "attn_output.weight", mat(n_embd, n_head * hd))
            w.add_tensor(p + "attn_q_norm.weight", vec(hd))
            w.add_tensor(p + "attn_k_norm.weight", vec(hd))
        w.add_tensor(p + "ffn_gate.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(p + "ffn_down.weight", mat(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
