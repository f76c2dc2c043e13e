"""A tiny DSpark drafter for the demo target, two ways:

- make_dspark: a GGUF written as llama.cpp's converter writes DSpark GGUFs
  (conversion/qwen.py's DSparkModel, gguf-py's tensor names): the trained demo DFlash
  drafter's backbone, every key and tensor copied as they are, plus a seeded Markov head
  (markov_w1, markov_w2 and its scale) and confidence head (conf_proj), and the keys
  `dflash.sample_from_anchor` and `dflash.has_confidence_head`;
- make_dspark_hf: the same heads in a DSparkDraftModel checkpoint (the demo drafter's
  checkpoint, tests/data/demo-hf/draft, plus `markov_head.*` and `confidence_head.proj`),
  for both converters.

The Markov bias is small next to the backbone's logits (most of the backbone's drafts
survive it, so the target accepts several a step) but not nothing: it changes some
drafts, which the tests check."""
from __future__ import annotations

from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "dflash_gguf" / "data"
DEMO_TARGET = DATA / "demo-target.gguf"
DEMO_DRAFT = DATA / "demo-draft.gguf"
DEMO_HF = Path(__file__).resolve().parent / "data" / "demo-hf"
MARKOV_SCALE = 0.5


def seeded_heads(n_vocab: int, n_embd: int, rank: int, seed: int, markov_std: float, conf: bool) -> dict:
    """The heads' weights in the checkpoint's orientation ([out, in]; a GGUF's ne reversed):
    bias = MARKOV_SCALE * w2 . w1[prev], entries of w1 ~ N(0, 1) and of w2 scaled so that a
    bias entry has standard deviation markov_std."""
    rng = np.random.default_rng(seed)
    heads = {"w1": rng.standard_normal((n_vocab, rank)).astype(np.float32),
             "w2": (rng.standard_normal((n_vocab, rank)) * markov_std / (MARKOV_SCALE * np.sqrt(rank)))
             .astype(np.float32)}
    if conf:
        heads["conf"] = (rng.standard_normal((1, n_embd + rank)) / np.sqrt(n_embd)).astype(np.float32)
        heads["conf_bias"] = np.array([0.5], np.float32)
    return heads


def make_dspark(path: Path, *, rank: int = 16, seed: int = 0, markov_std: float = 0.15, conf: bool = True,
                from_anchor: bool = False, base: Path = DEMO_DRAFT) -> Path:
    """Write a DSpark GGUF at `path`: `base`'s backbone and seeded heads (markov_std: the
    standard deviation of each bias entry before the scale of 0.5)."""
    import gguf

    reader = gguf.GGUFReader(str(base))
    arch = str(reader.fields["general.architecture"].contents())
    n_embd = int(reader.fields[f"{arch}.embedding_length"].contents())
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(str(path), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_bool(f"{arch}.sample_from_anchor", from_anchor)
    writer.add_bool(f"{arch}.has_confidence_head", conf)

    w = seeded_heads(n_vocab, n_embd, rank, seed, markov_std, conf)
    heads = {"markov_w1.weight": w["w1"], "markov_w2.weight": w["w2"],
             "markov_w2.scale": np.array([MARKOV_SCALE], np.float32)}
    if conf:
        heads["conf_proj.weight"], heads["conf_proj.bias"] = w["conf"], w["conf_bias"]

    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    for name, data in heads.items():
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data)
    for data in heads.values():
        writer.write_tensor_data(data)
    writer.close()
    return path


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
