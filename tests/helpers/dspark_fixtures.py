"""A tiny DSpark drafter for the demo target, two ways:

- make_dspark: a GGUF written as llama.cpp's converter writes DSpark GGUFs
  (dflash_gguf.tools.demo_dspark, which benchmarks use too);
- make_dspark_hf: the same heads in a DSparkDraftModel checkpoint (the demo drafter's
  checkpoint, tests/data/demo-hf/draft, plus `markov_head.*` and `confidence_head.proj`),
  for both converters.

The Markov bias is small next to the backbone's logits (most of the backbone's drafts
survive it, so the target accepts several a step) but not nothing: it changes some
drafts, which the tests check."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_gguf.tools.demo_dspark import MARKOV_SCALE, make_dspark, seeded_heads

from helpers.paths import ROOT, TESTS

DATA = ROOT / "dflash_gguf" / "data"
DEMO_TARGET = DATA / "demo-target.gguf"
DEMO_DRAFT = DATA / "demo-draft.gguf"
DEMO_HF = TESTS / "data" / "demo-hf"

__all__ = ["DEMO_DRAFT", "DEMO_HF", "DEMO_TARGET", "make_dspark", "make_dspark_hf"]


def make_dspark_hf(directory: Path, *, rank: int = 16, seed: int = 0, markov_std: float = 0.15,
                   from_anchor: bool = False) -> Path:
    """A DSparkDraftModel checkpoint: the demo drafter's, with the heads of make_dspark
    under the same arguments (the Markov scale folded into markov_w2, which a checkpoint
    has no scale for)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads((DEMO_HF / "draft" / "config.json").read_text())
    config["architectures"] = ["DSparkDraftModel"]
    config["sample_from_anchor"] = from_anchor
    config["markov_head_type"] = "vanilla"
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(str(DEMO_HF / "draft" / "model.safetensors"))
    w = seeded_heads(config["vocab_size"], config["hidden_size"], rank, seed, markov_std, True)
    heads = {"markov_head.markov_w1.weight": w["w1"], "markov_head.markov_w2.weight": w["w2"] * MARKOV_SCALE,
             "confidence_head.proj.weight": w["conf"], "confidence_head.proj.bias": w["conf_bias"]}
    tensors.update({name: torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)) for name, x in heads.items()})
    save_file(tensors, str(directory / "model.safetensors"))
    for extra in (DEMO_HF / "draft").iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            shutil.copy(extra, directory / extra.name)
    return directory
