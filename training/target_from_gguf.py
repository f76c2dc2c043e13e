#!/usr/bin/env python3
"""An f32 Hugging Face checkpoint of the bundled demo target whose conversion gives the
bundled GGUF's tensors back byte for byte.

    .venv/bin/python training/target_from_gguf.py OUT_DIR     # from dflash_gguf/data/demo-target.gguf

Why: the heads (training/train_mtp.py, training/train_eagle3.py) are trained against the
target llama.cpp and our runtime actually run, and the MTP head is converted together
with the target, whose tensors must stay those of the bundled file. The f32 checkpoint
the target was trained as is gone and the bf16 copy in tests/data/demo-hf/target converts
to another q8_0 file (every tensor differs), but the GGUF itself determines a checkpoint:

- q8_0 and f16 values dequantize exactly (d * q), and quantizing d * q again gives d and q
  back (the block's largest |q| is 127, so its scale is recomputed exactly);
- the converter's row and column gathers (Gated DeltaNet V-head reorder) are permutations;
- its elementwise transforms (+1 on RMSNorm weights, ssm_a = -exp(A_log)) are monotonic
  in float32, and the bundled value was made by one of them, so a float32 source value
  that maps to it exactly exists: found by stepping from the rounded inverse.

Tensor recipes come from our converter itself (Qwen35Converter on the bf16 copy, which
has the same names and shapes), so each inverse is read from the step it undoes.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_GGUF = ROOT / "dflash_gguf" / "data" / "demo-target.gguf"
DEFAULT_TEMPLATE = ROOT / "tests" / "data" / "demo-hf" / "target"


def exact_preimage(forward, wanted: np.ndarray, guess: np.ndarray, max_steps: int = 256) -> np.ndarray:
    """float32 x with forward(x) == wanted bit for bit, searched from `guess` one float32
    step at a time (forward must be increasing or decreasing)."""
    wanted = wanted.astype(np.float32)
    x = guess.astype(np.float32)
    up = forward(np.float32(1.0)) < forward(np.float32(2.0))
    for _ in range(max_steps):
        got = forward(x)
        bad = got != wanted
        if not bad.any():
            return x
        # too small an output: move x the way that raises it
        rise = (got < wanted) == up
        x = np.where(bad, np.nextafter(x, np.where(rise, np.float32(np.inf), np.float32(-np.inf))), x)
    raise ValueError(f"no float32 source value reproduces {int(bad.sum())} of the GGUF's values")


def gguf_values(reader) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF as exact float32 values, in numpy (outermost-first) order."""
    import gguf

    out = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        out[t.name] = values.reshape(tuple(int(d) for d in reversed(t.shape)))
    return out


def recover(gguf_path: Path, template: Path, out_dir: Path) -> Path:
    """Write the f32 checkpoint (config, tokenizer and model.safetensors) to out_dir."""
    import gguf
    from safetensors.numpy import save_file

    from dflash_gguf.convert.hf import Checkpoint, load_config
    from dflash_gguf.convert.models.qwen35 import Qwen35Converter
    from dflash_gguf.convert.tensors import add_one, neg_exp

    config = load_config(template)
    checkpoint = Checkpoint(template)
    converter = Qwen35Converter(template, config, checkpoint, no_mtp=True)
    values = gguf_values(gguf.GGUFReader(str(gguf_path)))
    specs = converter.tensors()
    missing = sorted({s.name for s in specs} - set(values))
    if missing:  # more is fine: a head's nextn layer is not the model's
        raise ValueError(f"{gguf_path} lacks tensors of {template}'s architecture: {', '.join(missing[:5])}")

    weights: dict[str, np.ndarray] = {}
    for spec in specs:
        out = values[spec.name].reshape(spec.n_rows, spec.row_length)
        if spec.transform is add_one:
            out = exact_preimage(add_one, out, out - np.float32(1.0))
        elif spec.transform is neg_exp:
            out = exact_preimage(neg_exp, out, np.log(-out.astype(np.float64)).astype(np.float32))
        elif spec.transform is not None:
            raise ValueError(f"{spec.name}: no inverse for the converter's {spec.transform.__name__}")
        source = np.empty_like(out)
        rows = spec.rows if spec.rows is not None else np.arange(spec.n_rows)
        cols = spec.cols if spec.cols is not None else np.arange(spec.row_length)
        source[np.ix_(rows, cols)] = out  # the gathers are permutations: scatter them back
        weights[spec.source] = np.ascontiguousarray(source.reshape(checkpoint.tensors[spec.source].shape))

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    for f in template.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out_dir / f.name)
    cfg = json.loads((template / "config.json").read_text())
    cfg["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def same_main_tensors(ours: Path, reference: Path) -> list[str]:
    """Names of the model tensors of `reference` (not those of its nextn layers, an MTP
    head) that `ours` lacks or holds with other bytes or type."""
    import gguf

    mine = {t.name: t for t in gguf.GGUFReader(str(ours)).tensors}
    ref = gguf.GGUFReader(str(reference))
    arch = ref.fields["general.architecture"].contents()
    n_block = ref.fields[f"{arch}.block_count"].contents()
    n_nextn = ref.fields[f"{arch}.nextn_predict_layers"].contents() if f"{arch}.nextn_predict_layers" in ref.fields \
        else 0
    head = tuple(f"blk.{i}." for i in range(n_block - n_nextn, n_block))
    differ = []
    for t in ref.tensors:
        if t.name.startswith(head):
            continue
        o = mine.get(t.name)
        if o is None or o.tensor_type != t.tensor_type or \
                not np.array_equal(np.asarray(o.data).view(np.uint8), np.asarray(t.data).view(np.uint8)):
            differ.append(t.name)
    return differ


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path, help="where the f32 checkpoint goes (replaced)")
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help=f"the target GGUF (default {DEFAULT_GGUF})")
    p.add_argument("--template", type=Path, default=DEFAULT_TEMPLATE,
                   help=f"a checkpoint of the same architecture, for config, tokenizer and names (default {DEFAULT_TEMPLATE})")
    a = p.parse_args(argv)
    recover(a.gguf, a.template, a.out_dir)
    print(f"wrote {a.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
