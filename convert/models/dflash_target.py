"""The target a DFlash drafter is converted for: its config, checked against the drafter
(width, vocabulary, depth), and the target layers whose features the drafter reads."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConversionError
from ..hf import load_config, text_hparams
from .dflash_config import DRAFTER_ARCHITECTURES, DrafterConfig

log = logging.getLogger("dflash_gguf.convert")


def build_target_layer_ids(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """z-lab's default feature layers when a config lists none (dflash.model)."""
    if n_draft_layers == 1:
        return [n_target_layers // 2]
    start, end = 1, n_target_layers - 3
    return [round(start + i * (end - start) / (n_draft_layers - 1)) for i in range(n_draft_layers)]


@dataclass(frozen=True)
class DrafterTarget:
    """The target's directory and config, its shape, and the HF `target_layer_ids` the
    drafter reads (layer L: the output of HF layer L)."""

    dir: Path
    config: dict
    vocab_size: int
    embedding_length: int
    block_count: int
    layer_ids: list[int]

    @property
    def uses_mrope(self) -> bool:
        thp = self.config.get("text_config", self.config)
        rope = thp.get("rope_parameters") or thp.get("rope_scaling") or {}
        return "mrope_section" in rope


def pair_with_target(drafter: DrafterConfig, target_dir: Path) -> DrafterTarget:
    """Read the target's config and check that the drafter was made for it."""
    config = load_config(target_dir)
    drafters = set(DRAFTER_ARCHITECTURES) & set(config.get("architectures") or [])
    if drafters:
        raise ConversionError(f"--target-model-dir {target_dir} is itself a drafter ({', '.join(drafters)}); "
                              "pass the target model's directory")
    thp = text_hparams(config)
    where = f"the target ({target_dir})"
    t_embd, t_vocab, t_layers = thp.get("hidden_size"), thp.get("vocab_size"), thp.get("num_hidden_layers")
    if not all(isinstance(v, int) for v in (t_embd, t_vocab, t_layers)):
        raise ConversionError(f"{where}: config.json lacks hidden_size, vocab_size or num_hidden_layers")
    if t_embd != drafter.n_embd:
        raise ConversionError(
            f"the drafter's hidden size {drafter.n_embd} does not match the target's {t_embd} "
            f"({target_dir}): this drafter was not made for that target")
    if t_vocab != drafter.vocab_size:
        raise ConversionError(
            f"the drafter's vocab_size {drafter.vocab_size} does not match the target's {t_vocab} "
            f"({target_dir}): this drafter was not made for that target")
    n_target = drafter.value("num_target_layers")
    if isinstance(n_target, int) and n_target != t_layers:
        # same tokenizer and width, another depth: gpt-oss-20b and -120b, whose drafters
        # read features of layers that exist in both
        raise ConversionError(
            f"the drafter was made for a {n_target}-layer target, but {where} has {t_layers} layers: this "
            "drafter was not made for that target")
    ids = _target_layer_ids(drafter, n_target if isinstance(n_target, int) else t_layers, t_layers, where)
    return DrafterTarget(target_dir, config, t_vocab, t_embd, t_layers, ids)


def _target_layer_ids(drafter: DrafterConfig, n_target: int, t_layers: int, where: str) -> list[int]:
    """The config's target_layer_ids (z-lab's default for `n_target` layers when it has
    none), each a layer of the target's `t_layers`."""
    ids = drafter.value("target_layer_ids")
    if ids is None:
        ids = build_target_layer_ids(n_target, drafter.n_layer)
        log.info("no target_layer_ids in the config: using z-lab's default %s", ids)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                        for i in ids):
        raise ConversionError(f"dflash_config.target_layer_ids must be a non-empty list of layer indices, "
                              f"got {ids!r}")
    bad = [i for i in ids if not 0 <= i < t_layers]
    if bad:
        raise ConversionError(
            f"dflash_config.target_layer_ids {ids} reads layer{'s' if len(bad) > 1 else ''} "
            f"{', '.join(map(str, bad))}, but {where} has {t_layers} layers (valid ids: 0..{t_layers - 1})")
    return ids
