"""ggml devices the runtime can place the target on."""
from __future__ import annotations

from typing import Dict, List

from ._native import check, ffi, lib


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


def default_device() -> str:
    """The device a model runs on when none is named: the first GPU, else the CPU (as
    the runtime picks it)."""
    devices = list_devices()
    return next((d["name"] for d in devices if d["type"] in ("gpu", "igpu")), "CPU")


def add_rpc_server(endpoint: str) -> None:
    """Make the devices of a ggml RPC server ("host:port") available as RPC0, RPC1, ...
    A remote GPU is then picked like a local one (the first GPU unless a device is named)."""
    check(lib.dfl_rpc_add_server(endpoint.encode()))
