"""Streaming GGUF output: header, metadata and tensor table first, then each tensor's
data converted and written in row chunks, so memory stays bounded by one chunk."""
from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from tqdm import tqdm

from .base import KV
from .errors import ConversionError
from .hf import Checkpoint
from .quant import encode_rows, tensor_bytes
from .tensors import TensorSpec, load_rows, row_ranges

log = logging.getLogger("dflash_gguf.convert")


class _StreamedTensor:
    """Stands in for an ndarray in GGUFWriter.write_tensor_data: it needs the byte
    count up front and a tofile() that writes the data."""

    def __init__(self, nbytes: int, chunks: Callable[[], Iterator[np.ndarray]], on_bytes: Callable[[int], None]):
        self.nbytes = nbytes
        self._chunks = chunks
        self._on_bytes = on_bytes

    def tofile(self, fout) -> None:
        written = 0
        for block in self._chunks():
            block.tofile(fout)
            written += block.nbytes
            self._on_bytes(block.nbytes)
        if written != self.nbytes:
            raise RuntimeError(f"wrote {written} bytes for a tensor planned at {self.nbytes}")


def _ordered_map(fn: Callable, items: Iterable, pool: ThreadPoolExecutor | None, window: int) -> Iterator:
    """fn over items, results in order, at most `window` items in flight (bounded memory)."""
    if pool is None:
        yield from map(fn, items)
        return
    pending: deque = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _non_finite(x: np.ndarray) -> tuple[int, int]:
    """(NaN count, infinity count) of a float32 array."""
    if np.isfinite(x).all():
        return 0, 0
    n_nan = int(np.count_nonzero(np.isnan(x)))
    return n_nan, int(x.size - n_nan - np.count_nonzero(np.isfinite(x)))


def _describe_non_finite(bad: dict[str, tuple[int, int]]) -> str:
    parts = []
    for name, (n_nan, n_inf) in bad.items():
        counts = [f"{n} {what}" for n, what in ((n_nan, "NaN"), (n_inf, "Inf")) if n]
        parts.append(f"{name} ({', '.join(counts)})")
    shown = "; ".join(parts[:8]) + (f"; and {len(parts) - 8} more" if len(parts) > 8 else "")
    return f"{len(bad)} tensor{'s' if len(bad) > 1 else ''} with NaN/Inf values: {shown}"


def write_gguf(path: Path, arch: str, kvs: Sequence[KV], plan: Sequence[tuple[TensorSpec, GGMLQuantizationType]],
               checkpoint: Checkpoint, *, threads: int = 1, progress: bool | None = None,
               allow_nan: bool = False) -> int:
    """Write the file to `path` via a `.partial` sibling renamed at the end; returns its size.

    Row chunks are read, transformed and quantized on `threads` threads (ggml and numpy
    release the GIL); `progress=None` shows the bar only on a terminal.

    Every value written is checked: NaN or infinite weights stop the conversion
    (ConversionError naming each such tensor, after scanning the rest without writing)
    unless `allow_nan`, which writes them and logs the same list as a warning. Whatever
    stops the writing -- an error, Ctrl-C -- removes the partial file: `path` only ever
    holds a complete file (an existing one is replaced at the very end, never before).
    """
    tmp = path.with_name(path.name + ".partial")
    writer = GGUFWriter(None, arch)
    for kv in kvs:
        writer.add_key_value(kv.key, kv.value, kv.type, sub_type=kv.sub_type)
    sizes = [tensor_bytes(t, spec.shape) for spec, t in plan]
    for (spec, t), nbytes in zip(plan, sizes):
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), nbytes, raw_dtype=t)

    bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, unit_divisor=1024, desc="converting",
               disable=None if progress is None else not progress, dynamic_ncols=True)
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    bad: dict[str, tuple[int, int]] = {}  # tensor -> (NaN, Inf) counts
    lock = threading.Lock()

    def count(name: str, x: np.ndarray) -> None:
        n_nan, n_inf = _non_finite(x)
        if n_nan or n_inf:
            with lock:
                old = bad.get(name, (0, 0))
                bad[name] = (old[0] + n_nan, old[1] + n_inf)

    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, ((spec, t), nbytes) in enumerate(zip(plan, sizes)):
            if bad and not allow_nan:  # refused: only look for the other tensors to name them all
                def scan(rows, spec=spec):
                    if spec.raw:
                        count(spec.name, np.full(spec.raw(checkpoint, *rows)[1], np.nan, np.float32))
                    else:
                        count(spec.name, load_rows(checkpoint, spec, *rows))

                for _ in _ordered_map(scan, row_ranges(spec), pool, window=2 * threads):
                    pass
                bar.update(nbytes)
                continue
            bar.set_postfix_str(f"tensor {i + 1}/{len(plan)} {spec.name}", refresh=False)

            def encode(rows, spec=spec, t=t):
                if spec.raw:  # bytes already in their type (MXFP4 blocks kept as they are)
                    data, n_nan = spec.raw(checkpoint, *rows)
                    count(spec.name, np.full(n_nan, np.nan, np.float32))
                    return data
                x = load_rows(checkpoint, spec, *rows)
                count(spec.name, x)
                return encode_rows(x, t)

            def chunks(spec=spec, encode=encode):
                return _ordered_map(encode, row_ranges(spec), pool, window=2 * threads)

            writer.write_tensor_data(_StreamedTensor(nbytes, chunks, bar.update))
        if bad and not allow_nan:
            raise ConversionError(_describe_non_finite(bad) + "; pass --allow-nan to convert anyway")
        if bad:
            log.warning("%s (written as they are: --allow-nan)", _describe_non_finite(bad))
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        bar.close()
    return path.stat().st_size
