"""Output tensors as recipes over checkpoint tensors, materialised in row chunks.

A TensorSpec says which checkpoint tensor a GGUF tensor comes from and how: a row gather,
a column gather, an elementwise transform and replacement rows, or a reader of its own
(a transposed source; bytes already in a ggml type). Each of these works on any subset of
rows, so a tensor never has to be in memory whole.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from .hf import Checkpoint, to_float32


@dataclass(frozen=True, eq=False)
class TensorSpec:
    """One GGUF tensor. `shape` is in numpy order (outermost first, row length last).

    `checkpoint` names another checkpoint to read `source` from (a drafter's tensor built
    from its target's weights); `patch` maps output row indices to replacement rows,
    applied after every other step. `stack` builds the tensor from several checkpoint
    tensors of one shape, one after the other (per-expert matrices -> one 3-D tensor);
    `source` is then the first of them. `read(checkpoint, r0, r1)` replaces the gather:
    it returns the rows as float32 itself. `values` are the tensor's values, computed by
    the converter instead of read (`source` names the checkpoint tensor they derive from).
    `fixed_type` is a ggml type the tensor keeps whatever the output type (integer
    tensors, a checkpoint's MXFP4 experts); `raw(checkpoint, r0, r1)` then replaces
    everything: it returns the rows' bytes already in that type and how many of their
    values are NaN.
    """

    name: str
    source: str
    shape: tuple[int, ...]
    rows: np.ndarray | None = None
    cols: np.ndarray | None = None
    transform: Callable[[np.ndarray], np.ndarray] | None = None
    checkpoint: Checkpoint | None = None
    patch: dict[int, np.ndarray] | None = None
    stack: tuple[str, ...] | None = None
    read: Callable[[Checkpoint, int, int], np.ndarray] | None = None
    raw: Callable[[Checkpoint, int, int], tuple[np.ndarray, int]] | None = None
    values: np.ndarray | None = None
    fixed_type: GGMLQuantizationType | None = None

    @property
    def row_length(self) -> int:
        return self.shape[-1]

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64))

    @property
    def numel(self) -> int:
        return self.n_rows * self.row_length


def checked_spec(checkpoint, name: str, source: str, shape: tuple[int, ...], **kw) -> TensorSpec:
    """TensorSpec(name, source, shape, **kw) once the checkpoint has `source` with as many
    values as `shape` and the same first dimension (a ConversionError otherwise)."""
    from .errors import ConversionError
    t = checkpoint.tensors.get(source)
    if t is None:
        raise ConversionError(f"checkpoint tensor {source!r} (for {name}) is missing")
    if t.numel != int(np.prod(shape, dtype=np.int64)) or (len(shape) > 1 and t.shape[0] != shape[0]):
        raise ConversionError(f"tensor {source!r} has shape {list(t.shape)}, but config.json implies {list(shape)}")
    return TensorSpec(name, source, shape, **kw)


def attention_specs(spec: Callable[..., TensorSpec], lp: str, b: str, E: int, H: int, Hkv: int,
                    hd: int) -> list[TensorSpec]:
    """Layer `lp`'s (HF prefix) input norm and q/k/v/o projections as block `b`'s tensors,
    in llama.cpp's order, through the converter's `spec(name, source, shape)`."""
    sa = lp + "self_attn."
    return [
        spec(b + "attn_norm.weight", lp + "input_layernorm.weight", (E,)),
        spec(b + "attn_q.weight", sa + "q_proj.weight", (H * hd, E)),
        spec(b + "attn_k.weight", sa + "k_proj.weight", (Hkv * hd, E)),
        spec(b + "attn_v.weight", sa + "v_proj.weight", (Hkv * hd, E)),
        spec(b + "attn_output.weight", sa + "o_proj.weight", (E, H * hd)),
    ]


def add_one(x: np.ndarray) -> np.ndarray:
    return x + np.float32(1.0)


def neg_exp(x: np.ndarray) -> np.ndarray:
    return -np.exp(x)


def row_ranges(spec: TensorSpec, max_bytes: int = 16 << 20) -> list[tuple[int, int]]:
    """Row intervals [r0, r1) covering the tensor, each at most `max_bytes` of float32."""
    step = max(1, max_bytes // (4 * spec.row_length))
    return [(r0, min(spec.n_rows, r0 + step)) for r0 in range(0, spec.n_rows, step)]


def load_rows(ckpt: Checkpoint, spec: TensorSpec, r0: int, r1: int) -> np.ndarray:
    """Rows [r0, r1) of the output tensor as a float32 [r1 - r0, row_length] array (of
    the values' own dtype for a tensor with `values`)."""
    if spec.values is not None:
        return np.ascontiguousarray(spec.values.reshape(spec.n_rows, spec.row_length)[r0:r1])
    ckpt = spec.checkpoint or ckpt
    if spec.read:
        block = spec.read(ckpt, r0, r1)
    elif spec.stack:
        per = spec.n_rows // len(spec.stack)
        pieces = []
        for k in range(r0 // per, (r1 - 1) // per + 1):
            a, b = max(r0, k * per) - k * per, min(r1, (k + 1) * per) - k * per
            pieces.append(to_float32(ckpt.rows(spec.stack[k], per)[a:b], ckpt.is_bf16(spec.stack[k])))
        block = np.concatenate(pieces)
    else:
        src = ckpt.rows(spec.source, spec.n_rows)
        block = src[spec.rows[r0:r1]] if spec.rows is not None else src[r0:r1]
        block = to_float32(block, ckpt.is_bf16(spec.source))
    if spec.cols is not None:
        block = block[:, spec.cols]
    if spec.transform is not None:
        block = spec.transform(block)
    block = np.ascontiguousarray(block, dtype=np.float32)
    if spec.patch:
        block = block.copy() if not block.flags.writeable else block
        for r, row in spec.patch.items():
            if r0 <= r < r1:
                block[r - r0] = row
    return block
