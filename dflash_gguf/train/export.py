"""The trained drafter as files: a DFlash GGUF in the layout convert/models/dflash.py writes
(llama.cpp's keys and tensor names, the target's tokenizer with the mask token, and our
dflash.target.* pairing fingerprint of the target GGUF it was trained against), and
z-lab's HF layout (config.json with dflash_config + model.safetensors) for PyPI
`dflash`'s DFlashDraftModel."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..convert.models.dflash_tensors import LAYER_TENSORS
from ..runtime.drafter import tokenizer_fingerprint

_TOP = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight"}


def gguf_name(hf: str) -> str:
    if hf in _TOP:
        return _TOP[hf]
    _, i, rest = hf.split(".", 2)  # layers.N.<rest>
    return f"blk.{i}.{LAYER_TENSORS[rest]}"


def write_gguf(path: str | os.PathLike, state: dict, shape, meta: dict, target_path: str, layer_ids: list[int],
               block_size: int, mask_id: int, outtype: str = "f32", head_tokens=None, train_window: int = 0) -> None:
    """state: the drafter's HF state dict as numpy float32 arrays. head_tokens: the kept
    set the file carries (dflash.head_tokens, ascending ids: our runtime drafts over
    those rows of the head only; llama.cpp ignores the key). train_window: the longest
    context it was trained on (dflash.train_context_length, which --draft-window auto
    takes; 0 writes none). Written to a temporary name and renamed, so a reader never
    sees half a file."""
    import gguf

    a = "dflash"
    tmp = Path(str(path) + ".tmp")
    w = gguf.GGUFWriter(str(tmp), a)
    w.add_string("general.type", "model")
    w.add_name(f"{meta['name']} DFlash drafter (dflash-train)")
    w.add_uint32(f"{a}.block_count", shape.layers)
    w.add_uint32(f"{a}.context_length", meta["n_ctx_train"])
    w.add_uint32(f"{a}.embedding_length", shape.hidden)
    w.add_uint32(f"{a}.feed_forward_length", shape.ffn)
    w.add_uint32(f"{a}.attention.head_count", shape.heads)
    w.add_uint32(f"{a}.attention.head_count_kv", shape.kv_heads)
    w.add_float32(f"{a}.rope.freq_base", shape.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", shape.eps)
    w.add_uint32(f"{a}.attention.key_length", shape.head_dim)
    w.add_uint32(f"{a}.attention.value_length", shape.head_dim)
    w.add_uint32(f"{a}.block_size", block_size)
    if train_window:
        w.add_uint32(f"{a}.train_context_length", train_window)
    # llama.cpp's convention: the input of layer id+1 = the output of HF layer id
    w.add_array(f"{a}.target_layers", [i + 1 for i in layer_ids])
    if meta["mrope"]:  # the drafter ropes on the temporal section only (convert/models/dflash.py)
        w.add_array(f"{a}.rope.dimension_sections", [shape.head_dim // 2, 0, 0, 0])
    w.add_string(f"{a}.target.name", Path(target_path).name)
    w.add_string(f"{a}.target.tokenizer_sha256", tokenizer_fingerprint(target_path))
    w.add_uint32(f"{a}.target.embedding_length", meta["n_embd"])
    w.add_uint32(f"{a}.target.vocab_size", meta["n_vocab"])
    w.add_uint32(f"{a}.target.block_count", meta["n_layer"])
    if meta["embd_scale"] != 1.0:  # the target's (Gemma's sqrt(n_embd)): the block's embedding as the target's
        w.add_float32(f"{a}.embedding_scale", meta["embd_scale"])
    if meta["softcap"] > 0:
        w.add_float32(f"{a}.final_logit_softcapping", meta["softcap"])
    if head_tokens is not None:
        w.add_array(f"{a}.head_tokens", [int(t) for t in head_tokens])
    ftype = {"f32": 0, "f16": 1}[outtype]
    w.add_uint32("general.file_type", ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # the tokenizer is the target's, plus the mask token
    source = meta["gguf"]
    for key in source.keys():
        if key.startswith("tokenizer.") and key != "tokenizer.ggml.mask_token_id":
            copy_key(w, source, key)
    w.add_uint32("tokenizer.ggml.mask_token_id", mask_id)
    for hf in sorted(state):  # the checkpoint's name order, as the converter writes it
        x = np.ascontiguousarray(state[hf], dtype=np.float32)
        if outtype == "f16" and x.ndim == 2:
            x = x.astype(np.float16)
        w.add_tensor(gguf_name(hf), x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)


def copy_key(writer, source, key: str) -> None:
    """A key of a GGUF (source: its gguf_meta.GGUFMeta), with its value type, into a
    GGUFWriter."""
    import gguf

    kind, sub = source.value_type(key)
    value = source.get(key)
    value = value.tolist() if isinstance(value, np.ndarray) else value
    writer.add_key_value(key, value, gguf.GGUFValueType(kind),
                         sub_type=None if sub is None else gguf.GGUFValueType(sub))


def write_hf(out_dir: str | os.PathLike, state: dict, shape, meta: dict, layer_ids: list[int], block_size: int,
             mask_id: int, train_window: int = 0) -> Path:
    """z-lab's layout: a Qwen3Config with dflash_config, architectures DFlashDraftModel
    (train_window as dflash_config.train_context_length, which our converter reads)."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "dtype": "float32",
        "vocab_size": meta["n_vocab"], "hidden_size": shape.hidden, "intermediate_size": shape.ffn,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "hidden_act": "silu",
        "max_position_embeddings": meta["n_ctx_train"], "rms_norm_eps": shape.eps,
        "rope_theta": shape.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "attention_bias": False, "tie_word_embeddings": False, "num_target_layers": meta["n_layer"],
        "dflash_config": {"target_layer_ids": list(layer_ids), "block_size": block_size, "mask_token_id": mask_id},
    }
    # a Gemma target's embedding scale and softcap, under the names convert/models/dflash.py reads
    if meta["embd_scale"] != 1.0:
        cfg["dflash_config"]["input_embedding_scale"] = meta["embd_scale"]
    if meta["softcap"] > 0:
        cfg["dflash_config"]["final_logit_softcapping"] = meta["softcap"]
    if train_window:
        cfg["dflash_config"]["train_context_length"] = train_window
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_untrained(target_path: str, path: str | os.PathLike, mask_token: str, block_size: int = 16,
                    seed: int = 0) -> None:
    """dflash-train's default drafter for a target, seeded weights and no training: a
    drafter of the right shape for exercising the runtime (costs, exactness), whose
    drafts are noise. mask_token: a token of the target's vocabulary that stands in for
    the mask (an unused special token)."""
    from . import recipe
    from .model import Drafter, default_shape
    from .target import embedding_and_head, read_target_meta

    meta = read_target_meta(str(target_path))
    meta["n_vocab"] = embedding_and_head(meta["gguf"])[0].shape[0]
    layer_ids = recipe.target_layer_ids(meta["n_layer"], 2)
    shape = default_shape(meta["n_embd"], len(layer_ids), 2, meta["rope_theta"], meta["eps"])
    model = Drafter(shape)
    model.init_weights(seed)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tokens = meta["gguf"].get("tokenizer.ggml.tokens")
    write_gguf(path, state, shape, meta, str(target_path), layer_ids, block_size, tokens.index(mask_token))
