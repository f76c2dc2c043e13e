#!/usr/bin/env python3
"""Blend two DFlash drafters of one architecture into a third: every weight is
(1 - alpha) * A + alpha * B, quantized back to A's type, with A's metadata.

The benchmark's weak drafter is made this way: the early-stopped drafter of
training/train_weak_drafter.py (chain AL about 1.5 on the bench prompts) blended halfway
with the demo drafter (about 3.3). Both were trained by one recipe from one seeded
initialisation, so the weights in between stay a working drafter whose acceptance lies
between the two; alpha sets it without another training run.

    .venv/bin/python training/mix_drafters.py EARLY.gguf dflash_gguf/data/demo-draft.gguf 0.5 \\
        dflash_gguf/data/demo-draft-weak.gguf
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from dflash_gguf.convert.gguf_fields import field_value


def mix(a_path: Path, b_path: Path, alpha: float, out: Path) -> None:
    a, b = GGUFReader(a_path), GGUFReader(b_path)
    arch = field_value(a.fields["general.architecture"])[0]
    if field_value(b.fields["general.architecture"])[0] != arch:
        raise ValueError(f"{b_path} is not a {arch} model")
    b_tensors = {t.name: t for t in b.tensors}
    mismatched = [t.name for t in a.tensors
                  if t.name not in b_tensors or list(b_tensors[t.name].shape) != list(t.shape)]
    if mismatched or len(b_tensors) != len(a.tensors):
        raise ValueError(f"the drafters differ in tensors: {', '.join(mismatched) or 'count'}")

    w = GGUFWriter(out, arch)
    for field in a.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value, kind, sub = field_value(field)
        w.add_key_value(field.name, value, kind, sub_type=sub)
    for t in a.tensors:
        u = b_tensors[t.name]
        blend = ((1.0 - alpha) * quants.dequantize(t.data, t.tensor_type)
                 + alpha * quants.dequantize(u.data, u.tensor_type)).astype(np.float32)
        if t.tensor_type == GGMLQuantizationType.F32:
            w.add_tensor(t.name, blend)
        else:
            q = quants.quantize(blend, t.tensor_type)
            w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="drafter GGUF whose metadata and tensor types the result keeps")
    p.add_argument("b", type=Path, help="drafter GGUF of the same architecture and shapes")
    p.add_argument("alpha", type=float, help="weight of b, 0..1")
    p.add_argument("out", type=Path)
    args = p.parse_args()
    if not 0.0 <= args.alpha <= 1.0:
        p.error("alpha must be 0..1")
    try:
        mix(args.a, args.b, args.alpha, args.out)
    except (ValueError, OSError) as e:
        print(f"mix_drafters: error: {e}", file=sys.stderr)
        return 1
    print(f"mix_drafters: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
