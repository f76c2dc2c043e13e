"""A seeded DSpark drafter for the demo target, written as llama.cpp's converter writes
DSpark GGUFs (conversion/qwen.py's DSparkModel, gguf-py's tensor names): the trained demo
DFlash drafter's backbone, every key and tensor copied as they are, plus a seeded Markov
head (markov_w1, markov_w2 and its scale) and confidence head (conf_proj), and the keys
`dflash.sample_from_anchor` and `dflash.has_confidence_head`. The tests draft with it
(tests/helpers/dspark_fixtures.py) and experiments/dspark_bench_file.py benchmarks with it.

The Markov bias is small next to the backbone's logits (most of the backbone's drafts
survive it, so the target accepts several a step) but not nothing: it changes some
drafts."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..runtime.demo import DATA

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
                from_anchor: bool = False, base: Path = DATA / "demo-draft.gguf") -> Path:
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
