"""ggml devices the runtime can place the target on."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from .native import check, ffi, lib, own_ggml_log


def list_devices() -> List[Dict[str, str]]:
    """Every device in ggml's backend registry: name, description and type
    (cpu, gpu, igpu or accel), in registry order."""
    out = []
    buf = ffi.new("char[512]")
    for i in range(lib.dfl_device_count()):
        check(lib.dfl_device_describe(i, buf, len(buf)))
        name, description, kind = ffi.string(buf).decode("utf-8", "replace").split("|")
        out.append({"name": name, "description": description, "type": kind})
    return out


def device_description(device: str) -> str:
    """One device's description (list_devices' field), asking no other device of the
    registry: a registered RPC device whose server has gone away cannot be described."""
    buf = ffi.new("char[512]")
    check(lib.dfl_device_description(device.encode(), buf, len(buf)))
    return ffi.string(buf).decode("utf-8", "replace")


def default_device() -> str:
    """The device a model runs on when none is named: the first GPU, else the CPU (as
    the runtime picks it)."""
    devices = list_devices()
    return next((d["name"] for d in devices if d["type"] in ("gpu", "igpu")), "CPU")


def add_rpc_server(endpoint: str) -> None:
    """Make the devices of a ggml RPC server ("host:port") available as RPC0, RPC1, ...
    A remote GPU is then picked like a local one (the first GPU unless a device is named)."""
    check(lib.dfl_rpc_add_server(endpoint.encode()))


def matmul_invariance(ggml_type: int, w: np.ndarray, x: np.ndarray, device: Optional[str] = None,
                      repack: bool = True, n_threads: int = 2) -> Tuple[int, float]:
    """Whether `device`'s matrix product is batch-invariant for weights of `ggml_type`
    (a GGMLQuantizationType value): w [n_out, n_in] quantized to that type times the
    columns of x [n_cols, n_in] in one pass, against each column alone. Returns the
    columns that differ in any bit and the largest difference (0 and 0.0 when it is
    invariant). repack places w in the device's repacked layout where it has one, as
    models load."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if w.ndim != 2 or x.ndim != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"w [n_out, n_in] and x [n_cols, n_in] expected, got {w.shape} and {x.shape}")
    n_differ, max_diff = ffi.new("int32_t *"), ffi.new("float *")
    own_ggml_log()
    check(lib.dfl_matmul_invariance((device or "").encode(), int(ggml_type), int(repack),
                                    ffi.from_buffer("float[]", w), w.shape[1], w.shape[0],
                                    ffi.from_buffer("float[]", x), x.shape[0], int(n_threads), n_differ, max_diff))
    return int(n_differ[0]), float(max_diff[0])


def attention_invariance(kv_type: int, head_dim: int, n_head: int, n_head_kv: int, n_kv: int, n_rows: int,
                         device: Optional[str] = None, n_threads: int = 2, seed: int = 0,
                         tree: bool = False) -> Tuple[int, float]:
    """Whether `device`'s flash attention is batch-invariant: n_rows query rows (n_head
    heads of head_dim, GQA over n_head_kv) at the last positions of a random cache of
    n_kv cells (K and V of `kv_type`, a GGMLQuantizationType value) under a causal mask,
    in one pass, against each row alone over the same cache. tree: the rows are a random
    tree's nodes (a tree verify's mask: each sees the cells before the rows and its own
    ancestors'), each against one row over just the cells it sees, in order (its path
    decoded alone). Returns the rows that differ in any bit and the largest difference (0
    and 0.0 when it is invariant)."""
    n_differ, max_diff = ffi.new("int32_t *"), ffi.new("float *")
    own_ggml_log()
    check(lib.dfl_attention_invariance((device or "").encode(), int(kv_type), int(head_dim), int(n_head),
                                       int(n_head_kv), int(n_kv), int(n_rows), int(bool(tree)), int(n_threads),
                                       int(seed), n_differ, max_diff))
    return int(n_differ[0]), float(max_diff[0])
