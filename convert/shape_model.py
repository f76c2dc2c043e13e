"""GGUF files with the exact tensor shapes, types and metadata of a published model,
without its checkpoint: random weights written straight to the file tensor by tensor
(bounded memory), or no weights at all (a header whose data region is a hole).

    python -m dflash_gguf.convert.shape_model qwen35-27b --outtype q4_k_m --outfile 27b-q4_k_m.gguf
    python -m dflash_gguf.convert.shape_model qwen35-27b-dflash --outtype q8_0 --outfile draft.gguf
    python -m dflash_gguf.convert.shape_model qwen35-35b-a3b --outtype q4_k_m --outfile a3b.gguf
    python -m dflash_gguf.convert.shape_model qwen35-27b --outtype q4_0 --layers 16 --outfile 27b-16l.gguf
    python -m dflash_gguf.convert.shape_model qwen35-27b --set hidden=256 --set vocab=4096 ... (tiny)

Configs (shapes.py, from the published config.json entries in published_configs.json):
  qwen35-27b         Qwen/Qwen3.5-27B text model (64 layers, hidden 5120; Q4_K_M 16.5 GB)
  qwen35-35b-a3b     Qwen/Qwen3.5-35B-A3B text model (40 layers, 256 experts; Q4_K_M 21.2 GB)
  qwen35-27b-dflash  z-lab/Qwen3.5-27B-DFlash drafter (5 layers over the 27B's features); q8_0 1.8 GB
  qwen35-122b-a10b   Qwen/Qwen3.5-122B-A10B text model (48 layers, 256 experts; Q4_K_M 74.2 GB)
  gemma4-26b-a4b     google/gemma-4-26B-A4B-it text model (30 layers, 128 experts; Q4_K_M 17.6 GB)
  gpt-oss-20b        openai/gpt-oss-20b (24 layers, 32 experts; mxfp4_moe 12.1 GB)
  gpt-oss-120b       openai/gpt-oss-120b (36 layers, 128 experts; mxfp4_moe 63 GB)
`--layers N` keeps a target's hybrid pattern with fewer layers (a drafter's
`target_layers` must then be set to layers that exist); `--set KEY=VALUE` replaces any
config entry (lists comma-separated), for small files of the same structure.

Tensor types follow `--outtype` exactly as our converter (quant.py) types them: q4_k_m is
llama-quantize's Q4_K_M mix (Q6_K LM head and some attn_v/ffn_down, Q4_K elsewhere, f32
norms and vectors), q8_0 and f16 the converter's own choices.

Weights are NOT quantized floats: a quantized tensor is random block bytes with every
block's f16 scale fields (d, and dmin/m where the type has one) overwritten by a fixed
small value, so that the dequantized weights are finite with a spread like a trained
model's (std ~0.02). That writes at disk speed, ~100x faster than quantizing floats.
f16/bf16/f32 matrices are Gaussian; norms ~1, `ssm_a` negative, as the runtime expects.
Only speed and memory mean anything on such a model; its tokens are noise.

Targets carry the demo model's tokenizer padded to the config's vocabulary with unused
[PAD] tokens, so both our runtime and llama.cpp (llama-bench) load them. The output is
written to OUTFILE.part and renamed when complete; the free space of its file system is
checked before anything is written.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFReader, GGUFValueType, GGUFWriter, TokenType

from .gguf_fields import field_value
from .quant import OUTTYPES
from .shapes import CONFIGS, file_type, metadata, shrunk, tensor_nbytes, tensor_table

ALIGN = 32
CHUNK_BYTES = 64 << 20  # bytes generated and written at a time
MARGIN = 256 << 20      # free space left on the file system after writing

# f16 scale fields of a block: (byte offset, value) for each. Values give dequantized
# weights of std ~0.02 from uniformly random quants and sub-scales.
_SCALES = {
    T.Q8_0: [(0, 2.7e-4)],
    T.Q4_0: [(0, 4e-3)],
    T.Q4_1: [(0, 4e-3), (2, -0.03)],
    T.Q5_0: [(0, 2e-3)],
    T.Q5_1: [(0, 2e-3), (2, -0.03)],
    T.Q4_K: [(0, 8e-5), (2, 6e-4)],
    T.Q5_K: [(0, 4e-5), (2, 6e-4)],
    T.Q6_K: [(208, 1.5e-5)],
}
# E8M0 scale bytes (a power of two, 2^(e - 128) times the codes' doubled values): MXFP4's
# 2^-8 gives weights of std ~0.02 from uniformly random codes
_BYTE_SCALES = {T.MXFP4: [(0, 120)]}


def demo_tokenizer() -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """tokenizer.* of the bundled demo target: (key, value, type, array item type)."""
    from ..runtime.demo import demo_paths

    r = GGUFReader(str(demo_paths()[0]))
    return [(key, *field_value(f)) for key, f in r.fields.items()
            if key.startswith("tokenizer.") and key != "tokenizer.ggml.mask_token_id"]


def padded_tokenizer(n_vocab: int):
    kvs = demo_tokenizer()
    tokens = next(v for k, v, *_ in kvs if k == "tokenizer.ggml.tokens")
    if len(tokens) > n_vocab:
        raise ValueError(f"vocab {n_vocab} is smaller than the demo tokenizer's {len(tokens)} tokens")
    n_pad = n_vocab - len(tokens)
    out = []
    for key, value, vtype, sub in kvs:
        if key == "tokenizer.ggml.tokens":
            value = value + [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [int(TokenType.UNUSED)] * n_pad
        elif key == "tokenizer.ggml.scores":
            value = value + [0.0] * n_pad
        out.append((key, value, vtype, sub))
    return out


def random_f32(name: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Values a trained model's f32 tensors plausibly hold, by role."""
    if name.endswith("ssm_a"):
        return -rng.uniform(0.1, 1.0, n).astype(np.float32)
    if name.endswith("_norm.weight") or "scale" in name:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    if name == "rope_freqs.weight":  # every pair rotated (a trained file marks the unrotated ones 1e30)
        return np.ones(n, dtype=np.float32)
    if "ssm_conv1d" in name or name.endswith(".bias"):
        return (0.2 * rng.standard_normal(n)).astype(np.float32)
    return (0.02 * rng.standard_normal(n)).astype(np.float32)


def random_data(name: str, qtype: T, n_rows: int, row_len: int, rng: np.random.Generator) -> np.ndarray:
    """The bytes of `n_rows` rows of a tensor of type `qtype`."""
    n = n_rows * row_len
    if qtype == T.F32:
        return random_f32(name, n, rng).view(np.uint8)
    if qtype == T.F16:
        return (0.02 * rng.standard_normal(n, dtype=np.float32)).astype(np.float16).view(np.uint8)
    if qtype == T.BF16:
        bits = (0.02 * rng.standard_normal(n, dtype=np.float32)).view(np.uint32) >> 16  # truncated to bf16
        return bits.astype(np.uint16).view(np.uint8)
    if qtype not in _SCALES and qtype not in _BYTE_SCALES:
        raise ValueError(f"no random block recipe for {qtype.name} ({name})")
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n // block, size), dtype=np.uint8)
    for offset, value in _SCALES.get(qtype, []):
        blocks[:, offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    for offset, value in _BYTE_SCALES.get(qtype, []):
        blocks[:, offset] = value
    return blocks.reshape(-1)


def write_model(c: dict, outtype: str, outfile: Path, seed: int = 0, progress: bool = True) -> Path:
    table = tensor_table(c, outtype)
    data_bytes = sum(-(-tensor_nbytes(shape, qt) // ALIGN) * ALIGN for _, shape, qt in table)
    outfile.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(outfile.parent).free
    if data_bytes + MARGIN > free:
        raise ValueError(f"{outfile.parent} has {free / 2**30:.1f} GiB free; the model needs "
                         f"{data_bytes / 2**30:.1f} GiB (+{MARGIN >> 20} MiB margin)")
    part = outfile.with_name(outfile.name + ".part")
    w = GGUFWriter(str(part), c["arch"])
    w.add_string("general.type", "model")
    w.add_string("general.name", f"random {c['arch']} shape")
    w.add_uint32("general.file_type", file_type(outtype))
    w.add_uint32("general.quantization_version", 2)
    for key, value, vtype in metadata(c):
        if isinstance(value, list):
            w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=vtype)
        else:
            w.add_key_value(key, value, vtype)
    if c["arch"] != "dflash":
        for key, value, vtype, sub in padded_tokenizer(c["vocab"]):
            w.add_key_value(key, value, vtype, sub_type=sub)
    for name, shape, qtype in table:
        w.add_tensor_info(name, shape, qtype.name.lower(), tensor_nbytes(shape, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()

    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    with open(part, "r+b") as f, tqdm(total=data_bytes, unit="B", unit_scale=True, desc=outfile.name,
                                      disable=not progress) as bar:
        f.seek(0, 2)
        f.write(b"\0" * (-f.tell() % ALIGN))
        for name, shape, qtype in table:
            row_len = shape[-1]
            n_rows = int(np.prod(shape[:-1], dtype=np.int64))
            row_bytes = tensor_nbytes((1, row_len), qtype)
            step = max(1, CHUNK_BYTES // max(row_bytes, row_len * 4))  # rows per chunk (floats drawn as f32)
            for r0 in range(0, n_rows, step):
                chunk = random_data(name, qtype, min(step, n_rows - r0), row_len, rng)
                f.write(chunk.tobytes())
                bar.update(chunk.nbytes)
            pad = -tensor_nbytes(shape, qtype) % ALIGN
            f.write(b"\0" * pad)
            bar.update(pad)
    part.rename(outfile)
    return outfile


def write_header_only(path: str | os.PathLike, c: dict, outtype: str) -> Path:
    """The model's GGUF with its data region a hole (a sparse file: nothing is written or
    read): header, metadata, tensor table. Enough for what reads metadata only, such as
    the memory planner."""
    path = Path(path)
    w = GGUFWriter(str(path), c["arch"])
    for key, value, vtype in metadata(c):
        if isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for name, shape, qtype in tensor_table(c, outtype):
        w.add_tensor_info(name, shape, qtype.name.lower(), tensor_nbytes(shape, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    # the data region: every tensor at its aligned offset, as a hole
    size = path.stat().st_size
    data = 0
    for _, shape, qtype in tensor_table(c, outtype):
        data = (data + ALIGN - 1) // ALIGN * ALIGN + tensor_nbytes(shape, qtype)
    with open(path, "r+b") as f:
        f.truncate((size + ALIGN - 1) // ALIGN * ALIGN + data)
    return path


def parse_value(text: str, like):
    if isinstance(like, list):
        return [int(x) for x in text.split(",") if x]
    if isinstance(like, float):
        return float(text)
    if isinstance(like, int):
        return int(text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_gguf.convert.shape_model",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", choices=sorted(CONFIGS))
    p.add_argument("--outtype", default="q4_k_m", choices=sorted(OUTTYPES))
    p.add_argument("--outfile", required=True, type=Path)
    p.add_argument("--layers", type=int, help="fewer layers (targets keep their hybrid pattern)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="replace a config entry (repeatable; lists comma-separated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite OUTFILE")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    base = CONFIGS[a.config]
    overrides = {}
    for item in a.set:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set takes KEY=VALUE, got {item!r}")
        if key not in base:
            p.error(f"unknown config entry {key!r} (known: {', '.join(sorted(base))})")
        try:
            overrides[key] = parse_value(value, base[key])
        except ValueError:
            p.error(f"bad value for {key}: {value!r}")
    try:
        c = shrunk(base, a.layers, **overrides)
    except ValueError as e:
        p.error(str(e))
    if a.outfile.exists() and not a.force:
        p.error(f"{a.outfile} exists (--force to overwrite)")
    try:
        out = write_model(c, a.outtype, a.outfile, a.seed, progress=not a.quiet)
    except ValueError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
