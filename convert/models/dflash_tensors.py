"""A DFlash drafter's checkpoint tensors -> the dflash GGUF's names and layouts, each
checked against the shape config.json implies; a checkpoint tensor nothing maps is an
error."""
from __future__ import annotations

import numpy as np

from ..errors import ConversionError
from ..hf import Checkpoint
from ..tensors import TensorSpec
from .dflash_config import DrafterConfig

# Per-layer checkpoint names (after `layers.N.`) -> GGUF names (after `blk.N.`).
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_DFLASH2_LAYER_TENSORS = {
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
# Checkpoint tensors that are buffers, not weights.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def interleaved_to_neox(n: int, head_dim: int) -> np.ndarray:
    """Gather index taking each head's rotary pairs from interleaved order (x0, y0, x1, y1,
    ...) to NeoX halves (x0, x1, ..., y0, y1, ...) over `n` elements."""
    return np.arange(n).reshape(-1, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


def checked_spec(ckpt: Checkpoint, name: str, source: str, shape: tuple[int, ...], *,
                 checkpoint: Checkpoint | None = None, **kw) -> TensorSpec:
    """The recipe for GGUF tensor `name` from `source`, which `ckpt` must hold with `shape`;
    `checkpoint` is the spec's (None: the converted checkpoint, the drafter's)."""
    t = ckpt.tensors.get(source)
    if t is None:
        raise ConversionError(f"checkpoint tensor {source!r} (for {name}) is missing")
    if t.shape != tuple(shape):
        raise ConversionError(f"tensor {source!r} has shape {list(t.shape)}, but config.json implies "
                              f"{list(shape)}")
    return TensorSpec(name, source, tuple(shape), checkpoint=checkpoint, **kw)


class CheckpointNames:
    """The drafter checkpoint's tensors by canonical name (no `model.` prefix, codebooks
    with `.weight`), what was left out on purpose, and which ones a spec has used."""

    def __init__(self, checkpoint: Checkpoint, dspark: bool):
        self.checkpoint = checkpoint
        self.names: dict[str, str] = {}  # canonical -> checkpoint name
        self.skipped: dict[str, int] = {}
        self.used: set[str] = set()
        for n in checkpoint.names():
            canon = n[len("model."):] if n.startswith("model.") else n
            if canon in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
                canon += ".weight"  # z-lab stores the codebooks without the suffix
            if dspark and canon == "t2d":  # llama.cpp drops it too: not used at runtime
                continue
            if canon.endswith(_IGNORED_SUFFIXES):
                self.skipped["rotary embedding buffers"] = self.skipped.get("rotary embedding buffers", 0) + 1
                continue
            self.names[canon] = n

    def __contains__(self, canon: str) -> bool:
        return canon in self.names

    def shape(self, canon: str) -> tuple[int, ...] | None:
        n = self.names.get(canon)
        return None if n is None else self.checkpoint.tensors[n].shape

    def spec(self, gguf_name: str, canon: str, shape: tuple[int, ...], **kw) -> TensorSpec:
        if canon not in self.names:
            raise ConversionError(f"checkpoint tensor {canon!r} (for {gguf_name}) is missing")
        self.used.add(canon)
        return checked_spec(self.checkpoint, gguf_name, self.names[canon], shape, **kw)

    def refuse_unused(self, dflash2: bool) -> None:
        unexpected = sorted(set(self.names) - self.used)
        if unexpected:
            shown = ", ".join(self.names[n] for n in unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
            hint = " (DFlash2 tensors, but dflash_config has no conv_kernel_size)" \
                if any("_conv." in n or "candidate_selector" in n for n in unexpected) and not dflash2 else ""
            raise ConversionError(f"{len(unexpected)} checkpoint tensors have no dflash mapping{hint}: {shown}")


def drafter_specs(cfg: DrafterConfig, n_feat: int, names: CheckpointNames) -> list[TensorSpec]:
    """The specs of the drafter's own tensors, for a drafter fusing `n_feat` target layers."""
    E, V = cfg.n_embd, cfg.vocab_size
    fc = names.shape("fc.weight")
    if fc is not None and fc[1:] != (n_feat * E,):
        raise ConversionError(f"fc.weight has shape {list(fc)}: it fuses {fc[-1] // E} target layers, but "
                              f"target_layer_ids lists {n_feat}")
    specs = [
        names.spec("fc.weight", "fc.weight", (E, n_feat * E)),
        names.spec("enc.output_norm.weight", "hidden_norm.weight", (E,)),
        names.spec("output_norm.weight", "norm.weight", (E,)),
    ]
    layer_tensors, shapes = dict(LAYER_TENSORS), _layer_shapes(cfg)
    if cfg.dflash2:
        layer_tensors.update(_DFLASH2_LAYER_TENSORS)
        specs += _dflash2_specs(cfg, names, shapes)
    for i in range(cfg.n_layer):
        for hf, gg in layer_tensors.items():
            shape, kw = shapes[gg]
            specs.append(names.spec(f"blk.{i}.{gg}", f"layers.{i}.{hf}", shape, **kw))
    if cfg.dspark:
        specs += _dspark_specs(cfg, names)
    # A drafter may carry its own embedding and head (llama.cpp maps them as usual).
    if "embed_tokens.weight" in names:
        specs.append(names.spec("token_embd.weight", "embed_tokens.weight", (V, E)))
    if "lm_head.weight" in names:
        specs.append(names.spec("output.weight", "lm_head.weight", (V, E)))
    return specs


def _layer_shapes(cfg: DrafterConfig) -> dict[str, tuple[tuple[int, ...], dict]]:
    """GGUF layer tensor -> (shape, spec options): interleaved rope's q and k rows (and
    their norms) gathered into NeoX order."""
    E, hd = cfg.n_embd, cfg.head_dim
    q_dim, kv_dim = cfg.n_head * hd, cfg.n_head_kv * hd
    neox = cfg.hp.get("rope_is_neox_style", True)
    q_rows = None if neox else interleaved_to_neox(q_dim, hd)
    k_rows = None if neox else interleaved_to_neox(kv_dim, hd)
    norm_cols = None if neox else interleaved_to_neox(hd, hd)
    return {
        "attn_norm.weight": ((E,), {}),
        "attn_q.weight": ((q_dim, E), {"rows": q_rows}),
        "attn_k.weight": ((kv_dim, E), {"rows": k_rows}),
        "attn_v.weight": ((kv_dim, E), {}),
        "attn_output.weight": ((E, q_dim), {}),
        "attn_q_norm.weight": ((hd,), {"cols": norm_cols}),
        "attn_k_norm.weight": ((hd,), {"cols": norm_cols}),
        "ffn_norm.weight": ((E,), {}),
        "ffn_gate.weight": ((cfg.n_ff, E), {}),
        "ffn_up.weight": ((cfg.n_ff, E), {}),
        "ffn_down.weight": ((E, cfg.n_ff), {}),
    }


def _dflash2_specs(cfg: DrafterConfig, names: CheckpointNames, shapes: dict) -> list[TensorSpec]:
    """The candidate selector's specs; adds the per-layer convolutions' shapes to `shapes`."""
    E, V = cfg.n_embd, cfg.vocab_size
    kernel, group = int(cfg.value("conv_kernel_size")), int(cfg.value("conv_group_size"))
    rank, top_k = int(cfg.value("selector_rank")), int(cfg.value("selector_top_k"))
    if group <= 0 or E % group != 0:
        raise ConversionError(f"DFlash2: hidden size {E} is not a multiple of conv_group_size {group}")
    if kernel <= 0 or rank <= 0 or top_k <= 0:
        raise ConversionError("DFlash2: conv_kernel_size, selector_rank and selector_top_k must be positive")
    projected = 2 * kernel * (E // group)
    shapes.update({
        "attn_conv_base": ((2, kernel, E), {}), "attn_conv_proj.weight": ((projected, E), {}),
        "ffn_conv_base": ((2, kernel, E), {}), "ffn_conv_proj.weight": ((projected, E), {}),
    })
    return [
        names.spec("selector_predecessor.weight", "candidate_selector.predecessor_codebook.weight", (V, rank)),
        names.spec("selector_successor.weight", "candidate_selector.successor_codebook.weight", (V, rank)),
        names.spec("selector_hidden.weight", "candidate_selector.hidden_projection.weight", (rank, E)),
    ]


def _dspark_specs(cfg: DrafterConfig, names: CheckpointNames) -> list[TensorSpec]:
    """The Markov head and the confidence head (when the checkpoint has one)."""
    E, V = cfg.n_embd, cfg.vocab_size
    w1 = names.shape("markov_head.markov_w1.weight")
    if w1 is None:
        raise ConversionError("a DSpark checkpoint without markov_head.markov_w1.weight")
    rank = w1[-1]
    specs = [names.spec("markov_w1.weight", "markov_head.markov_w1.weight", (V, rank)),
             names.spec("markov_w2.weight", "markov_head.markov_w2.weight", (V, rank))]
    if "confidence_head.proj.weight" in names:
        specs.append(names.spec("conf_proj.weight", "confidence_head.proj.weight", (1, E + rank)))
        if "confidence_head.proj.bias" in names:
            specs.append(names.spec("conf_proj.bias", "confidence_head.proj.bias", (1,)))
    return specs


def llama_cpp_order(specs: list[TensorSpec]) -> list[TensorSpec]:
    """llama.cpp writes generated tensors first, then the checkpoint's in name order."""
    generated = [s for s in specs if s.checkpoint is not None or s.patch]
    rest = sorted((s for s in specs if s not in generated), key=lambda s: s.source)
    return generated + rest
