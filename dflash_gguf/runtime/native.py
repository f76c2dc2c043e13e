"""cffi (ABI mode) binding of the C runtime declared in csrc/dflash.h.

The header is installed next to the shared library and parsed at import, so the
declarations have a single source of truth.
"""
from __future__ import annotations

import re
from pathlib import Path

import cffi

# the library and its header are installed at the package's root (CMakeLists.txt)
_HERE = Path(__file__).resolve().parent.parent


class DflashError(RuntimeError):
    """A C entry point failed; the message is the runtime's own explanation."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _cdef_source(header: str) -> str:
    # cffi's parser takes plain declarations: drop preprocessor lines and C++ guards.
    text = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    text = "\n".join(lines)
    text = text.replace('extern "C" {', "")
    return re.sub(r"^\}\s*$", "", text, flags=re.M)


def _load():
    header = _HERE / "dflash.h"
    lib_path = _HERE / "libdflash.so"
    if not lib_path.exists() or not header.exists():
        raise ImportError(
            f"dflash_gguf's native library is missing from {_HERE}; install the package "
            "(scripts/setup.sh) instead of importing it from the source tree"
        )
    ffi = cffi.FFI()
    ffi.cdef(_cdef_source(header.read_text()))
    return ffi, ffi.dlopen(str(lib_path))


ffi, lib = _load()


def own_ggml_log() -> None:
    """ggml's messages through the library's callback: its debug lines (a line per matrix
    the CPU backend repacks at load) only when DFLASH_GGML_DEBUG=1 asks. Called at import
    and again before each load or probe, since importing llama-cpp-python (the tokenizer,
    the benchmarks' provenance) points ggml's log, one library shared with ours, at its
    own callback, which prints every level."""
    lib.dfl_ggml_log()


own_ggml_log()


def check(status: int) -> None:
    """Raise DflashError when a C call did not return DFL_OK."""
    if status != 0:
        raise DflashError(int(status), ffi.string(lib.dfl_last_error()).decode("utf-8", "replace"))


class NativeObject:
    """Owner of one C object: freed by close(), by the context manager's exit, or at
    garbage collection, whichever comes first."""

    _ptr = None
    _what = "object"
    _free = None  # the C function that frees it, set by each subclass

    def close(self) -> None:
        if self._ptr is not None:
            ptr, self._ptr = self._ptr, None
            type(self)._free(ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()

    def _handle(self):
        if self._ptr is None:
            raise RuntimeError(f"the {self._what} was closed")
        return self._ptr

    _last_placement = None  # the C function reporting the last graph's placement

    def placement(self) -> dict:
        """Where ggml's scheduler put the nodes of the last graph computed: node and split
        counts, the nodes left on the CPU while the device is another, as
        "OP(first source)", e.g. "GET_ROWS(token_embd.weight)", and the bytes its splits
        copy between devices per compute."""
        p = ffi.new("dfl_placement *")
        check(type(self)._last_placement(self._handle(), p))
        host = ffi.string(p.host_nodes).decode("utf-8", "replace")
        return {"n_nodes": p.n_nodes, "n_splits": p.n_splits, "n_host_nodes": p.n_host_nodes,
                "host_nodes": host.split(",") if host else [], "copy_bytes": p.copy_bytes}
