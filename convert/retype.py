"""Re-typing a GGUF: `convert-hf-to-gguf in.gguf --outtype q8_0 --outfile out.gguf`.

Every metadata key is kept but general.file_type (the new type's); each tensor gets the
type the output type plans for its name and shape (as a conversion from a checkpoint
would), read from the input dequantized. A tensor already in its planned type is copied
byte for byte. Changing the type of a quantized tensor to anything but f32 loses what its
quantization kept and adds the new one's error on top: refused, as llama.cpp's quantizer
refuses it, unless allow_requantize.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFReader, GGUFValueType, quants

from .base import KV, u32
from .errors import ConversionError
from .quant import OUTTYPES, plan_types
from .tensors import TensorSpec

log = logging.getLogger("dflash_gguf.convert")
_FLOAT = (T.F32, T.F16, T.BF16)


def _kvs(reader: GGUFReader, file_type: int) -> list[KV]:
    out = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        kind = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[-1]) if kind == GGUFValueType.ARRAY else None
        if sub == GGUFValueType.ARRAY:
            raise ConversionError(f"metadata key {key!r} holds nested arrays, which re-typing does not copy")
        out.append(KV(key, field.contents(), kind, sub))
    return out + [u32("general.file_type", file_type)]


def _spec(tensor, out_type: T) -> TensorSpec:
    shape = tuple(int(d) for d in reversed(tensor.shape))  # numpy order: rows last
    src_type = T(tensor.tensor_type)
    n_rows = int(np.prod(shape[:-1], dtype=np.int64))
    data = tensor.data.reshape(n_rows, -1) if src_type not in _FLOAT else tensor.data.reshape(n_rows, shape[-1])
    if out_type == src_type:
        def raw(_ckpt, r0, r1, data=data):
            return np.ascontiguousarray(data[r0:r1]).view(np.uint8).reshape(-1), 0
        return TensorSpec(tensor.name, tensor.name, shape, raw=raw, fixed_type=src_type)

    def read(_ckpt, r0, r1, data=data, src_type=src_type):
        return np.asarray(quants.dequantize(np.ascontiguousarray(data[r0:r1]), src_type), dtype=np.float32)
    return TensorSpec(tensor.name, tensor.name, shape, read=read)


def retype(src: Path, outfile: Path, outtype: str, *, allow_requantize: bool, threads: int) -> int:
    """Write `src` re-typed to `outtype` at `outfile`; returns the output's size."""
    from .writer import write_gguf

    try:
        reader = GGUFReader(str(src))
    except (OSError, ValueError) as e:
        raise ConversionError(f"cannot read {src} as a GGUF file: {e}") from None
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ConversionError(f"{src} has no general.architecture")
    shapes = [(t.name, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors]
    types = plan_types(shapes, outtype)
    refused = [f"{t.name} ({T(t.tensor_type).name} -> {types[t.name].name})" for t in reader.tensors
               if T(t.tensor_type) not in _FLOAT and types[t.name] not in (T(t.tensor_type), T.F32)]
    if refused and not allow_requantize:
        shown = ", ".join(refused[:4]) + (" ..." if len(refused) > 4 else "")
        raise ConversionError(f"{len(refused)} tensors of {src} are already quantized and would be requantized "
                              f"({shown}): their quality would suffer twice. Pass --allow-requantize to do it anyway, "
                              "or convert from the original checkpoint")
    plan = [(_spec(t, types[t.name]), types[t.name]) for t in reader.tensors]
    for spec, _ in plan:  # every type gguf-py cannot dequantize is named now, not halfway through the file
        if spec.read is not None:
            try:
                spec.read(None, 0, 1)
            except NotImplementedError:
                raise ConversionError(f"tensor {spec.name} has a type re-typing cannot read") from None
    kvs = _kvs(reader, int(OUTTYPES[outtype][0]))
    log.info("re-typing %s to %s: %d tensors (%d copied as they are)", src, outtype, len(plan),
             sum(1 for t in reader.tensors if types[t.name] == T(t.tensor_type)))
    return write_gguf(outfile, str(arch_field.contents()), kvs, plan, None, threads=threads)
