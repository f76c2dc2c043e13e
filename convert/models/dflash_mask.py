"""`mask_embedding.pt`, a trained mask-token vector shipped next to some drafters: it
becomes a drafter-owned token embedding (the target's table, or the drafter's own, with
the mask row replaced) plus the target's output head, as llama.cpp writes them."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ..errors import ConversionError
from ..hf import Checkpoint, text_hparams
from ..tensors import TensorSpec
from .dflash_config import DrafterConfig
from .dflash_target import DrafterTarget
from .dflash_tensors import CheckpointNames, checked_spec

log = logging.getLogger("dflash_gguf.convert")

MASK_EMBEDDING_FILE = "mask_embedding.pt"
_TARGET_EMBEDDINGS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                      "language_model.model.embed_tokens.weight")


def mask_embedding_specs(cfg: DrafterConfig, model_dir: Path, paired: DrafterTarget, specs: list[TensorSpec],
                         names: CheckpointNames) -> list[TensorSpec]:
    """token_embd (mask row replaced) and output from the target, for a drafter with a
    mask_embedding.pt; replaces a drafter-owned token_embd spec in `specs` in place."""
    path = model_dir / MASK_EMBEDDING_FILE
    if not path.is_file():
        return []
    E, V, mask_id = cfg.n_embd, cfg.vocab_size, cfg.mask_token_id
    vector = _read_mask_embedding(path, mask_id, E)
    log.info("%s: replacing the embedding row of mask token %d", MASK_EMBEDDING_FILE, mask_id)

    target = Checkpoint(paired.dir)
    target_embd = next((n for n in _TARGET_EMBEDDINGS if n in target), None)
    out: list[TensorSpec] = []
    if "lm_head.weight" not in names:
        head = target_embd if text_hparams(paired.config).get("tie_word_embeddings", False) else "lm_head.weight"
        if head is None or head not in target:
            raise ConversionError(f"{MASK_EMBEDDING_FILE}: the target checkpoint has no output head "
                                  f"({head or 'embed_tokens'})")
        out.append(checked_spec(target, "output.weight", head, (V, E), checkpoint=target))
    for k, s in enumerate(specs):
        if s.name == "token_embd.weight":  # the drafter's own table, patched
            row = _round_to(vector, names.checkpoint.tensors[s.source].dtype)
            specs[k] = TensorSpec(s.name, s.source, s.shape, patch={mask_id: row})
            return out
    if target_embd is None:
        raise ConversionError(f"{MASK_EMBEDDING_FILE}: the target checkpoint has no token embedding "
                              f"({_TARGET_EMBEDDINGS[0]})")
    row = _round_to(vector, target.tensors[target_embd].dtype)
    out.append(checked_spec(target, "token_embd.weight", target_embd, (V, E), checkpoint=target,
                            patch={mask_id: row}))
    return out


def _read_mask_embedding(path: Path, mask_id: int, n_embd: int) -> np.ndarray:
    try:
        import torch
    except ImportError as e:
        raise ConversionError(f"{path} is a PyTorch file: install torch to convert this drafter") from e
    try:
        data = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # pickle and zip errors of every kind
        raise ConversionError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict) or "mask_token_id" not in data or "embedding" not in data:
        raise ConversionError(f"{path} must hold a dict with mask_token_id and embedding")
    if int(data["mask_token_id"]) != mask_id:
        raise ConversionError(f"{path} is for mask token {int(data['mask_token_id'])}, but dflash_config's "
                              f"mask_token_id is {mask_id}")
    emb = data["embedding"]
    if tuple(emb.shape) != (n_embd,):
        raise ConversionError(f"{path}: embedding has shape {list(emb.shape)}, expected [{n_embd}]")
    return emb.detach().to(torch.float32).numpy().astype(np.float32)


def _round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to a checkpoint dtype and back (what assigning into a tensor
    of that dtype does)."""
    if dtype == "BF16":
        from ..quant import _to_bf16

        return (_to_bf16(values).astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return values.astype(np.float16).astype(np.float32)
    return values.astype(np.float32)
