"""Qwen3.5 mixture of experts -> GGUF architecture `qwen35moe` (llama.cpp's layout).

The token mixers are Qwen3.5's (see qwen35.py); the feed-forward block is a softmax
router over `num_experts` SwiGLU experts, of which `num_experts_per_tok` run per token,
plus a shared expert scaled by a sigmoid gate. Per-expert matrices are stacked into
3-D tensors [n_expert, rows, cols] (ffn_gate_exps, ffn_up_exps, ffn_down_exps); the
router and the shared expert's gate stay f32, as llama.cpp keeps them.
"""
from __future__ import annotations

from pathlib import Path

from ..base import KV, u32
from ..errors import ConversionError
from ..hf import Checkpoint, text_hparams
from ..tensors import TensorSpec
from .qwen35 import Qwen35Converter

_REQUIRED = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "rms_norm_eps", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
             "linear_num_key_heads", "linear_num_value_heads", "num_experts", "num_experts_per_tok",
             "moe_intermediate_size", "shared_expert_intermediate_size"]


class Qwen35MoeConverter(Qwen35Converter):
    gguf_arch = "qwen35moe"
    family = "Qwen3.5 MoE"
    required = _REQUIRED

    def __init__(self, model_dir: Path, config: dict, checkpoint: Checkpoint, **kwargs):
        hp = text_hparams(config)
        if hp.get("mlp_only_layers") or hp.get("decoder_sparse_step", 1) != 1:
            raise ConversionError("dense layers between the expert layers (mlp_only_layers, decoder_sparse_step) "
                                  "are not a layout llama.cpp's qwen35moe loads")
        n_expert, n_used = hp.get("num_experts"), hp.get("num_experts_per_tok")
        if isinstance(n_expert, int) and isinstance(n_used, int) and not 0 < n_used <= n_expert:
            raise ConversionError(f"num_experts_per_tok {n_used} is not within 1..num_experts ({n_expert})")
        super().__init__(model_dir, config, checkpoint, **kwargs)

    def _ffn_metadata(self) -> list[KV]:
        a, hp = self.gguf_arch, self.hp
        return [u32(f"{a}.expert_count", hp["num_experts"]),
                u32(f"{a}.expert_used_count", hp["num_experts_per_tok"]),
                u32(f"{a}.expert_feed_forward_length", hp["moe_intermediate_size"]),
                u32(f"{a}.expert_shared_feed_forward_length", hp["shared_expert_intermediate_size"])]

    def _ffn_specs(self, mlp: str, b: str) -> list[TensorSpec]:
        hp = self.hp
        E, X = int(hp["hidden_size"]), int(hp["num_experts"])
        F, S = int(hp["moe_intermediate_size"]), int(hp["shared_expert_intermediate_size"])
        experts = [f"{mlp}experts.{x}." for x in range(X)]
        return [
            self._spec(b + "ffn_gate_inp.weight", mlp + "gate.weight", (X, E)),
            self._stacked(b + "ffn_gate_exps.weight", [e + "gate_proj.weight" for e in experts], (X, F, E)),
            self._stacked(b + "ffn_up_exps.weight", [e + "up_proj.weight" for e in experts], (X, F, E)),
            self._stacked(b + "ffn_down_exps.weight", [e + "down_proj.weight" for e in experts], (X, E, F)),
            self._spec(b + "ffn_gate_inp_shexp.weight", mlp + "shared_expert_gate.weight", (1, E)),
            self._spec(b + "ffn_gate_shexp.weight", mlp + "shared_expert.gate_proj.weight", (S, E)),
            self._spec(b + "ffn_up_shexp.weight", mlp + "shared_expert.up_proj.weight", (S, E)),
            self._spec(b + "ffn_down_shexp.weight", mlp + "shared_expert.down_proj.weight", (E, S)),
        ]

    def _stacked(self, name: str, sources: list[str], shape: tuple[int, ...]) -> TensorSpec:
        for source in sources:
            t = self.checkpoint.tensors.get(source)
            if t is None:
                if any(n.endswith("gate_up_proj") for n in self.checkpoint.names()):
                    raise ConversionError("fused expert tensors (experts.gate_up_proj) are not supported; "
                                          "convert the per-expert checkpoint as published")
                raise ConversionError(f"checkpoint tensor {source!r} (for {name}) is missing")
            if list(t.shape) != list(shape[1:]):
                raise ConversionError(f"tensor {source!r} has shape {list(t.shape)}, but config.json implies "
                                      f"{list(shape[1:])}")
        return TensorSpec(name, sources[0], shape, stack=tuple(sources))
