"""Qwen2 / Qwen2.5 (and DeepSeek-R1-Distill-Qwen) -> GGUF architecture `qwen2`
(llama.cpp's layout): Qwen3's dense decoder (convert/models/qwen3.py) with biases on the q, k
and v projections instead of norms on q and k."""
from __future__ import annotations

from ..base import KV
from ..errors import ConversionError
from .qwen3 import QwenDenseConverter


class Qwen2Converter(QwenDenseConverter):
    gguf_arch, family, qkv_bias, qk_norm, default_context = "qwen2", "Qwen2", True, False, None

    def check_layout(self, hp: dict) -> None:
        # llama.cpp's qwen2 has one attention shape: the output projection is n_embd square
        heads, hidden = hp["num_attention_heads"], hp["hidden_size"]
        if hp.get("head_dim") not in (None, hidden // heads) or hidden % heads:
            raise ConversionError(f"config.json: head_dim {hp.get('head_dim')!r} with {heads} heads does not "
                                  f"span hidden_size {hidden}, which llama.cpp's qwen2 layout requires")
        # Qwen2's optional sliding window (layers from max_window_layers on) has no key in
        # the qwen2 GGUF: converting would run those layers with full attention
        if hp.get("use_sliding_window"):
            raise ConversionError("use_sliding_window=true (Qwen2's sliding-window attention) is not supported: "
                                  "the qwen2 GGUF layout has no sliding window")

    def head_dim_kv(self) -> list[KV]:
        # written only when config.json names head_dim, as llama.cpp's converter does
        return super().head_dim_kv() if "head_dim" in self.hp else []
