"""A GGUF's metadata through ggml's own reader (gguf.h), which the runtime loads models with.

The checks made before a model loads (which kind of drafter a file is, whether two
vocabularies agree, the trained context) read a few keys; gguf-py's GGUFReader builds numpy
views for every element of every array, which for a 262,144-token vocabulary is most of a
minute on two cores. ggml parses the same header in milliseconds.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import cffi
import numpy as np

from .native import _HERE

_CDEF = """
struct gguf_context;
struct ggml_context;
struct gguf_init_params { bool no_alloc; struct ggml_context ** ctx; };
struct gguf_context * gguf_init_from_file(const char * fname, struct gguf_init_params params);
void gguf_free(struct gguf_context * ctx);
int64_t gguf_get_n_kv(const struct gguf_context * ctx);
int64_t gguf_find_key(const struct gguf_context * ctx, const char * key);
const char * gguf_get_key(const struct gguf_context * ctx, int64_t key_id);
int gguf_get_kv_type(const struct gguf_context * ctx, int64_t key_id);
int gguf_get_arr_type(const struct gguf_context * ctx, int64_t key_id);
const char * gguf_get_val_str(const struct gguf_context * ctx, int64_t key_id);
const void * gguf_get_val_data(const struct gguf_context * ctx, int64_t key_id);
size_t gguf_get_arr_n(const struct gguf_context * ctx, int64_t key_id);
const void * gguf_get_arr_data(const struct gguf_context * ctx, int64_t key_id);
const char * gguf_get_arr_str(const struct gguf_context * ctx, int64_t key_id, size_t i);
int64_t gguf_get_n_tensors(const struct gguf_context * ctx);
const char * gguf_get_tensor_name(const struct gguf_context * ctx, int64_t tensor_id);
const int64_t * gguf_get_tensor_ne(const struct gguf_context * ctx, int64_t tensor_id);
int gguf_get_tensor_type(const struct gguf_context * ctx, int64_t tensor_id);
size_t gguf_get_data_offset(const struct gguf_context * ctx);
size_t gguf_get_tensor_offset(const struct gguf_context * ctx, int64_t tensor_id);
size_t gguf_get_tensor_size(const struct gguf_context * ctx, int64_t tensor_id);
int64_t gguf_find_tensor(const struct gguf_context * ctx, const char * name);
"""
_ffi = cffi.FFI()
_ffi.cdef(_CDEF)
# libdflash.so links libggml-base, whose symbols a lookup through its handle finds
_lib = _ffi.dlopen(str(_HERE / "libdflash.so"))

_STRING, _ARRAY = 8, 9
# gguf_type -> numpy dtype of the non-string scalar types (gguf.h's enum gguf_type)
_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
           6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


def _text(ptr) -> str:
    return _ffi.string(ptr).decode("utf-8", "replace")


class GGUFMeta:
    """The key-values and tensor names of one GGUF file (no tensor data is read).
    `get(key)` gives a str, an int, a float or a bool, and an array as a list of str or a
    numpy array; a file ggml cannot parse is a ValueError naming it."""

    def __init__(self, path: str):
        self.path = str(path)
        params = _ffi.new("struct gguf_init_params *", {"no_alloc": True, "ctx": _ffi.NULL})
        ctx = _lib.gguf_init_from_file(self.path.encode(), params[0])
        if ctx == _ffi.NULL:
            raise ValueError(f"cannot read {self.path} as a GGUF (ggml's reader rejected it)")
        self._ctx = _ffi.gc(ctx, _lib.gguf_free)

    def __contains__(self, key: str) -> bool:
        return _lib.gguf_find_key(self._ctx, key.encode()) >= 0

    def keys(self) -> Tuple[str, ...]:
        return tuple(_text(_lib.gguf_get_key(self._ctx, i)) for i in range(_lib.gguf_get_n_kv(self._ctx)))

    def value_type(self, key: str) -> Tuple[int, Optional[int]]:
        """The key's gguf type number and, for an array, its elements' (gguf-py's
        GGUFValueType numbers them alike)."""
        i = _lib.gguf_find_key(self._ctx, key.encode())
        if i < 0:
            raise KeyError(key)
        kind = _lib.gguf_get_kv_type(self._ctx, i)
        return kind, _lib.gguf_get_arr_type(self._ctx, i) if kind == _ARRAY else None

    def get(self, key: str, default: Any = None) -> Any:
        i = _lib.gguf_find_key(self._ctx, key.encode())
        if i < 0:
            return default
        kind = _lib.gguf_get_kv_type(self._ctx, i)
        if kind == _STRING:
            return _text(_lib.gguf_get_val_str(self._ctx, i))
        if kind == _ARRAY:
            return self._array(i)
        dtype = np.dtype(_DTYPES[kind])
        value = np.frombuffer(_ffi.buffer(_lib.gguf_get_val_data(self._ctx, i), dtype.itemsize), dtype)[0]
        return value.item()

    def _array(self, i: int):
        n, kind = _lib.gguf_get_arr_n(self._ctx, i), _lib.gguf_get_arr_type(self._ctx, i)
        if kind == _STRING:
            return [_text(_lib.gguf_get_arr_str(self._ctx, i, j)) for j in range(n)]
        if kind not in _DTYPES:  # an array of arrays: no key we read is one
            raise ValueError(f"{self.path}: a nested array is not read here")
        dtype = np.dtype(_DTYPES[kind])
        if n == 0:
            return np.zeros(0, dtype)
        return np.frombuffer(_ffi.buffer(_lib.gguf_get_arr_data(self._ctx, i), n * dtype.itemsize), dtype).copy()

    def tensor_names(self) -> Tuple[str, ...]:
        return tuple(_text(_lib.gguf_get_tensor_name(self._ctx, t))
                     for t in range(_lib.gguf_get_n_tensors(self._ctx)))

    def tensors(self) -> Dict[str, Tuple[Tuple[int, ...], int]]:
        """Each tensor's (shape in ggml's order, ne[0] first, without the trailing 1s ggml
        pads to four dimensions; ggml type number), by name, in file order."""
        out = {}
        for t in range(_lib.gguf_get_n_tensors(self._ctx)):
            ne = list(_lib.gguf_get_tensor_ne(self._ctx, t)[0:4])
            while len(ne) > 1 and ne[-1] == 1:
                ne.pop()
            out[_text(_lib.gguf_get_tensor_name(self._ctx, t))] = (tuple(ne), _lib.gguf_get_tensor_type(self._ctx, t))
        return out

    def tensor_bytes(self, name: str) -> np.ndarray:
        """A tensor's data as it is in the file (mapped, not read), one row of bytes per
        row of ne[0] elements: what gguf.quants.dequantize takes."""
        t = _lib.gguf_find_tensor(self._ctx, name.encode())
        if t < 0:
            raise KeyError(name)
        ne = _lib.gguf_get_tensor_ne(self._ctx, t)
        rows = int(ne[1]) * int(ne[2]) * int(ne[3])
        offset = _lib.gguf_get_data_offset(self._ctx) + _lib.gguf_get_tensor_offset(self._ctx, t)
        size = _lib.gguf_get_tensor_size(self._ctx, t)
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=offset, shape=(size,)).reshape(rows, -1)
