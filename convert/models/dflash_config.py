"""A DFlash drafter's config.json, read and checked: its shape, mask token and flavour
(DFlash, DFlash2, DSpark). Settings are looked up in `dflash_config` first, then at the
config's root, as z-lab's code does."""
from __future__ import annotations

from ..errors import ConversionError
from ..hf import check_hparams, require_hparams, text_hparams

DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DSPARK_ARCHITECTURES = ("DSparkDraftModel", "Qwen3DSparkModel")
DRAFTER_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel", *DSPARK_ARCHITECTURES)

_REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]


class DrafterConfig:
    """The drafter's hyperparameters (`hp`: the text config; `dcfg`: its dflash_config)."""

    def __init__(self, config: dict):
        hp = self.hp = text_hparams(config)
        dcfg = hp.get("dflash_config")
        self.dcfg = dict(dcfg) if isinstance(dcfg, dict) else {}
        require_hparams(hp, _REQUIRED, "a DFlash drafter")
        check_hparams(hp, _REQUIRED + ["num_key_value_heads", "head_dim", "max_position_embeddings",
                                       "num_target_layers", "block_size"], ["rms_norm_eps", "rope_theta"])
        check_hparams(self.dcfg, ["block_size", "num_target_layers", "train_context_length"],
                      where="config.json dflash_config")
        _refuse_unsupported(hp, self.dcfg)

        self.n_layer = int(hp["num_hidden_layers"])
        self.n_embd = int(hp["hidden_size"])
        self.n_ff = int(hp["intermediate_size"])
        self.n_head = int(hp["num_attention_heads"])
        self.n_head_kv = int(hp.get("num_key_value_heads") or self.n_head)
        self.head_dim = int(hp.get("head_dim") or self.n_embd // self.n_head)

        mask = self.value("mask_token_id")
        if not isinstance(mask, int) or not 0 <= mask < self.vocab_size:
            raise ConversionError(f"dflash_config.mask_token_id is {mask!r}; it must be a token id below "
                                  f"vocab_size {self.vocab_size}")
        self.mask_token_id = mask
        architectures = config.get("architectures") or []
        self.dflash2 = self.value("conv_kernel_size") is not None
        if self.dflash2:
            missing = [k for k in DFLASH2_KEYS if self.value(k) is None]
            if missing:
                raise ConversionError(f"DFlash2 drafter: dflash_config lacks {', '.join(missing)}")
        elif "DFlash2DraftModel" in architectures:
            raise ConversionError(f"DFlash2DraftModel without {', '.join(DFLASH2_KEYS)} in dflash_config")

        self.dspark = bool(set(DSPARK_ARCHITECTURES) & set(architectures))
        if self.dspark:
            self._check_dspark()

    @property
    def vocab_size(self) -> int:
        return int(self.hp["vocab_size"])

    def value(self, name: str, default=None):
        """A drafter setting: dflash_config first, then the config root (z-lab's lookup)."""
        if name in self.dcfg and self.dcfg[name] is not None:
            return self.dcfg[name]
        return self.hp.get(name, default)

    def _check_dspark(self) -> None:
        hp = self.hp
        if "transformer_layer_config" in hp or "aux_hidden_state_layer_ids" in hp:
            raise ConversionError("EAGLE3-schema DSpark exports (transformer_layer_config) are not supported: "
                                  "only DFlash-lineage DSpark checkpoints")
        if hp.get("markov_head_type", "vanilla") != "vanilla":
            raise ConversionError(f"markov_head_type {hp['markov_head_type']!r}: only 'vanilla' is supported")
        if (hp.get("draft_vocab_size") or self.vocab_size) != self.vocab_size:
            raise ConversionError("a reduced draft vocabulary (draft_vocab_size, d2t) is not supported")
        if self.dflash2:
            raise ConversionError("a DSpark Markov head over a DFlash2 backbone is not supported")


def _refuse_unsupported(hp: dict, dcfg: dict) -> None:
    """Architectures the dflash GGUF layout cannot describe."""
    if hp.get("attention_bias"):
        raise ConversionError("attention_bias=true: the dflash GGUF layout has no attention biases")
    act = hp.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"hidden_act {act!r}: only SiLU (SwiGLU) drafters are supported")
    experts = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if hp.get(k)]
    if experts:
        raise ConversionError("mixture-of-experts drafters are not supported")
    sliding = "sliding_attention" in (hp.get("layer_types") or [])
    windowed = hp.get("use_sliding_window") or dcfg.get("use_swa")
    if sliding and not windowed and hp.get("is_causal") is None and dcfg.get("causal") is None:
        # the reference drafter runs such layers causally without a window; the GGUF
        # (llama.cpp's keys) can say causal only for all layers or with a window
        raise ConversionError("layer_types marks sliding_attention layers but use_sliding_window is false: "
                              "set use_sliding_window (and sliding_window) or is_causal")
