"""Published model shapes as GGUF files without weights: the header, metadata and tensor
table of a real-size model, the data region left as a hole (a sparse file, so nothing is
written or read). Enough for anything that reads only metadata, such as the memory
planner (tests/test_memory.py, scripts/memory_table.py). The shapes themselves live in
dflash_gguf.convert.shapes (scripts/make_shape_model.py writes them with random weights)."""
from __future__ import annotations

import os
from pathlib import Path

from gguf import GGUFWriter

from dflash_gguf.convert.shapes import (QWEN35_0_8B, QWEN35_27B, QWEN35_27B_DFLASH, QWEN35_35B_A3B, metadata,  # noqa: F401
                                        tensor_nbytes, tensor_table)


def write_shape_gguf(path: str | os.PathLike, c: dict, outtype: str) -> Path:
    """The model's GGUF with its data region a hole: header, metadata, tensor table."""
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
    align = 32
    data = 0
    for _, shape, qtype in tensor_table(c, outtype):
        data = (data + align - 1) // align * align + tensor_nbytes(shape, qtype)
    with open(path, "r+b") as f:
        f.truncate((size + align - 1) // align * align + data)
    return path
