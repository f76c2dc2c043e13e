"""DFlash block-diffusion drafters (z-lab's DFlashDraftModel and DFlash2DraftModel) -> GGUF
architecture `dflash`, with llama.cpp's keys, tensor names and layouts.

- A drafter has no embedding or LM head of its own: it uses its target's. Its tokenizer
  is therefore the target's (`--target-model-dir`), with `tokenizer.ggml.mask_token_id`
  set to the drafter's mask token.
- `dflash.target_layers` stores the HF `target_layer_ids` plus one (llama.cpp's
  convention: layer L means the input of layer L, i.e. the output of HF layer L-1).
- Qwen3 RMSNorm weights are applied as they are (no +1, unlike Qwen3.5's).
- A Qwen3.5 target ropes in sections (M-RoPE); its drafter ropes on the temporal section
  only, written as the degenerate sections [head_dim/2, 0, 0, 0].
- DFlash2 adds per-layer grouped dynamic convolutions around attention and MLP and a
  low-rank candidate selector.
- `dflash.target.*` (ours; llama.cpp ignores unknown keys) records the target the drafter
  is converted for: its directory name, tokenizer fingerprint (sha256 of tokens, merges
  and special ids), embedding shape and layer count (gpt-oss-20b and -120b share the
  first two). The runtime refuses the drafter with any other
  target; drafters without these keys (llama.cpp's converter) are checked by shape and
  by the vocabulary they carry.
- DSpark drafters (DSparkDraftModel, Qwen3DSparkModel: DFlash plus `markov_head.*` and
  `confidence_head.proj`) are the same `dflash` GGUF with llama.cpp's `markov_w1`,
  `markov_w2` and `conf_proj` tensors and its keys `dflash.sample_from_anchor` (the
  config's, else true: the DFlash-lineage default) and `dflash.has_confidence_head`.
  Vanilla Markov heads over the whole vocabulary only (no `d2t`), as the runtime runs.
- `mask_embedding.pt` (a trained mask-token vector shipped next to some drafters) becomes
  a drafter-owned token embedding: the target's table with the mask row replaced, plus
  the target's output head, as llama.cpp writes it.
"""
from __future__ import annotations

from pathlib import Path

from ..base import KV, ModelConverter
from ..errors import ConversionError
from ..hf import Checkpoint
from ..tensors import TensorSpec
from .dflash_config import DrafterConfig
from .dflash_keys import ARCH, dflash_metadata
from .dflash_mask import mask_embedding_specs
from .dflash_target import pair_with_target
from .dflash_tensors import CheckpointNames, drafter_specs, llama_cpp_order


class DFlashConverter(ModelConverter):
    """The drafter's config (DrafterConfig), paired with its target (DrafterTarget), its
    tensors mapped (dflash_tensors, dflash_mask) and its keys written (dflash_keys)."""

    gguf_arch = ARCH
    needs_target = True

    def __init__(self, model_dir: Path, config: dict, checkpoint: Checkpoint, *, target_dir: Path | None = None):
        super().__init__(model_dir, config, checkpoint, target_dir=target_dir)
        if target_dir is None:
            raise ConversionError(
                "a DFlash drafter has no tokenizer or embeddings of its own: pass --target-model-dir with the "
                "target model's checkpoint directory")
        self.drafter = DrafterConfig(config)
        self.target = pair_with_target(self.drafter, target_dir)
        names = CheckpointNames(checkpoint, self.drafter.dspark)
        specs = drafter_specs(self.drafter, len(self.target.layer_ids), names)
        specs = mask_embedding_specs(self.drafter, model_dir, self.target, specs, names) + specs
        names.refuse_unused(self.drafter.dflash2)
        self._specs = llama_cpp_order(specs)
        self._skipped = names.skipped
        self._has_confidence = "confidence_head.proj.weight" in names
        self._tokenizer_sha256: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.drafter.vocab_size

    def vocab_source(self) -> tuple[Path, dict]:
        return self.target.dir, self.target.config

    def adjust_vocab(self, vocab) -> None:
        # the tokenizer is the target's: its fingerprint, taken before the mask id joins it
        self._tokenizer_sha256 = vocab.fingerprint()
        vocab.special_ids["mask"] = self.drafter.mask_token_id

    def metadata(self) -> list[KV]:
        return dflash_metadata(self.drafter, self.target, self._has_confidence, self._tokenizer_sha256)

    def tensors(self) -> list[TensorSpec]:
        return self._specs

    def skipped(self) -> dict[str, int]:
        return dict(self._skipped)
