"""Reading a Hugging Face checkpoint directory: config and safetensors weights.

Tensors are memory-mapped and converted to float32 only in row chunks, so a checkpoint
much larger than RAM converts in bounded memory. The safetensors header is parsed here
directly (it is a length-prefixed JSON table) because the safetensors package cannot
hand bfloat16 to numpy and torch is not a runtime dependency.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ConversionError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_NUMPY_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
                 "BF16": np.dtype("<u2")}
# Integer tensors: an EAGLE3 drafter's vocabulary maps (read whole by Checkpoint.integers)
# and packed quantized data, MXFP4 blocks and scales as U8 (read as bytes, never as numbers).
_INTEGER_DTYPES = {"I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
                   "U8": np.dtype("u1"), "BOOL": np.dtype("?")}


def load_config(model_dir: Path) -> dict:
    """config.json as a dict; a missing or unreadable file is a ConversionError."""
    if not model_dir.is_dir():
        raise ConversionError(f"model directory {str(model_dir)!r} does not exist")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConversionError(f"{str(model_dir)!r} has no config.json; is it a Hugging Face checkpoint directory?")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise ConversionError(f"{path} does not hold a JSON object")
    return config


def require_hparams(hp: dict, keys, what: str) -> None:
    """Every key of `keys` is in the config, or one line naming the missing ones."""
    missing = [k for k in keys if k not in hp]
    if missing:
        raise ConversionError(f"config.json lacks {', '.join(missing)} needed for {what}")


def refuse_hparams(hp: dict, refused: dict[str, str], why: str) -> None:
    """None of the options `refused` (key -> what it turns on) is set: else one line naming
    the first set one and `why` it is refused."""
    for key, what in refused.items():
        if hp.get(key):
            raise ConversionError(f"config.json sets {key}={hp[key]!r} ({what}), {why}")


def check_hparams(hp: dict, ints=(), floats=(), where: str = "config.json") -> None:
    """The keys present among `ints` are positive integers and among `floats` positive
    finite numbers: one clear line instead of an arithmetic error later on."""
    for key in ints:
        v = hp.get(key)
        if key in hp and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise ConversionError(f"{where}: {key} is {v!r}; a positive integer is expected")
    for key in floats:
        v = hp.get(key)
        if key in hp and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")):
            raise ConversionError(f"{where}: {key} is {v!r}; a positive number is expected")


def quantization_method(config: dict) -> str | None:
    """config.json's quantization_config.quant_method (a pre-quantized checkpoint), or None."""
    q = config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    return str(method) if method else "unnamed"


def text_hparams(config: dict) -> dict:
    """The language model's hyperparameters: a multimodal config's text_config over its root."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else dict(config)


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of the checkpoint: where its bytes are and how to read them."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _read_header(path: Path) -> tuple[dict, int]:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ConversionError(f"{path} is not a safetensors file (truncated header)")
            (n,) = struct.unpack("<Q", head)
            if n > path.stat().st_size - 8:  # never ask read() for a corrupt length's worth of memory
                raise ConversionError(f"{path} is not a safetensors file (header length {n} exceeds the file)")
            raw = f.read(n)
    except OSError as e:
        raise ConversionError(f"cannot read {path}: {e}") from e
    if len(raw) != n:
        raise ConversionError(f"{path} is not a safetensors file (truncated header)")
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ConversionError(f"{path} has a corrupt safetensors header: {e}") from e
    return header, 8 + n


class Checkpoint:
    """All safetensors tensors of a model directory, sharded or not, read lazily."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.tensors: dict[str, SourceTensor] = {}
        self._maps: dict[Path, np.memmap] = {}
        index = model_dir / INDEX_FILE
        if index.is_file():
            self._load_index(index)
        else:
            files = [model_dir / SINGLE_FILE] if (model_dir / SINGLE_FILE).is_file() \
                else sorted(model_dir.glob("model-*.safetensors"))
            if not files:
                raise ConversionError(
                    f"no safetensors weights in {str(model_dir)!r} (expected {SINGLE_FILE} or {INDEX_FILE}; "
                    "PyTorch .bin checkpoints are not supported)")
            _check_shard_set(files)
            for path in files:
                self._add_file(path)

    def _load_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConversionError(f"cannot read the weight map in {index}: {e}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ConversionError(f"{index}: weight_map must map tensor names to shard file names")
        files = sorted(set(weight_map.values()))
        missing_files = [f for f in files if not (self.model_dir / f).is_file()]
        if missing_files:
            raise ConversionError(f"{INDEX_FILE} lists shard files that are missing: {', '.join(missing_files)}")
        for f in files:
            self._add_file(self.model_dir / f)
        missing = sorted(n for n, f in weight_map.items()
                         if n not in self.tensors or self.tensors[n].path.name != f)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ConversionError(f"{len(missing)} tensors listed in {INDEX_FILE} are not in their shard: {shown}")

    def _add_file(self, path: Path) -> None:
        header, data_start = _read_header(path)
        if not isinstance(header, dict):
            raise ConversionError(f"{path} has a corrupt safetensors header (not a JSON object)")
        file_size = path.stat().st_size
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape = str(entry["dtype"]), tuple(int(d) for d in entry["shape"])
                begin, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise ConversionError(f"{path}: malformed header entry for {name!r}") from e
            if data_start + end > file_size:
                raise ConversionError(f"{path} is truncated: tensor {name!r} extends past the end of the file")
            numel = int(np.prod(shape, dtype=np.int64))
            known = _NUMPY_DTYPES.get(dtype, _INTEGER_DTYPES.get(dtype))
            itemsize = known.itemsize if known is not None else None
            if begin < 0 or end < begin or min(shape, default=1) < 0 or \
                    (itemsize is not None and end - begin != numel * itemsize):
                raise ConversionError(f"{path}: tensor {name!r} has {end - begin} bytes at offsets {begin}..{end}, "
                                      f"which does not fit its dtype {dtype} and shape {list(shape)}")
            if name in self.tensors:
                raise ConversionError(f"tensor {name!r} is in two shards: {self.tensors[name].path.name} and "
                                      f"{path.name}")
            self.tensors[name] = SourceTensor(name, path, dtype, shape, data_start + begin, end - begin)
        self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r") if file_size > 0 else np.zeros(0, np.uint8)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def _raw(self, t: SourceTensor) -> np.ndarray:
        np_dtype = _NUMPY_DTYPES.get(t.dtype)
        if np_dtype is None:
            raise ConversionError(
                f"tensor {t.name!r} has dtype {t.dtype}; only F32, F16, BF16 (and F64) checkpoints are supported")
        return self._maps[t.path][t.offset:t.offset + t.nbytes].view(np_dtype).reshape(t.shape)

    def integers(self, name: str) -> np.ndarray:
        """An integer or boolean tensor's values as int64."""
        t = self.tensors[name]
        np_dtype = _INTEGER_DTYPES.get(t.dtype)
        if np_dtype is None:
            raise ConversionError(f"tensor {name!r} has dtype {t.dtype}; an integer tensor is expected")
        return self._maps[t.path][t.offset:t.offset + t.nbytes].view(np_dtype).reshape(t.shape).astype(np.int64)

    def rows(self, name: str, n_rows: int) -> np.ndarray:
        """The tensor viewed as `n_rows` rows (no data is read yet), in its stored dtype."""
        t = self.tensors[name]
        return self._raw(t).reshape(n_rows, t.numel // n_rows)

    def byte_rows(self, name: str, n_rows: int) -> np.ndarray:
        """A tensor of packed bytes (U8) viewed as `n_rows` rows of bytes."""
        t = self.tensors[name]
        if t.dtype != "U8":
            raise ConversionError(f"tensor {name!r} has dtype {t.dtype}; packed quantized data (U8) is expected")
        return self._maps[t.path][t.offset:t.offset + t.nbytes].reshape(n_rows, t.nbytes // n_rows)

    def is_bf16(self, name: str) -> bool:
        return self.tensors[name].dtype == "BF16"


_SHARD_NAME = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")


def _check_shard_set(files: list[Path]) -> None:
    """Shards found without an index must be a complete model-XXXXX-of-NNNNN set."""
    totals: dict[int, set[int]] = {}
    for f in files:
        m = _SHARD_NAME.match(f.name)
        if m:
            totals.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    if len(totals) > 1:
        raise ConversionError(f"shard files from different sets ({', '.join(f'of {n}' for n in sorted(totals))}) "
                              f"are mixed in {files[0].parent}")
    for total, have in totals.items():
        missing = sorted(set(range(1, total + 1)) - have)
        if missing:
            shown = ", ".join(f"model-{i:05d}-of-{total:05d}.safetensors" for i in missing[:4])
            raise ConversionError(f"{len(missing)} of {total} shard files are missing: {shown}"
                                  + (" ..." if len(missing) > 4 else ""))


def to_float32(raw: np.ndarray, bf16: bool) -> np.ndarray:
    """Stored values (already sliced to the rows needed) as a new float32 array."""
    if bf16:
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)
