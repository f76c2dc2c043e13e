"""dflash_gguf.runtime.gguf_meta (ggml's GGUF reader, which the pre-load checks and dflash-train
use) reads what gguf-py's GGUFReader reads: every key's value and type and every tensor's
name, shape, type and bytes, on each bundled GGUF; a file that is not a GGUF is one
ValueError naming it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import dflash_gguf
from dflash_gguf.runtime.gguf_meta import GGUFMeta

BUNDLED = sorted((Path(dflash_gguf.__file__).parent / "data").glob("*.gguf"))


@pytest.mark.parametrize("path", BUNDLED, ids=[p.stem for p in BUNDLED])
def test_every_key_and_tensor_is_gguf_pys(path):
    from gguf import GGUFReader

    reader, meta = GGUFReader(str(path)), GGUFMeta(str(path))
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert keys
    for key in keys:
        want, got = reader.fields[key].contents(), meta.get(key)
        if isinstance(want, list) and want and not isinstance(want[0], str):
            assert np.array_equal(np.asarray(want), got), key
        elif isinstance(want, float):
            assert np.float32(want) == np.float32(got), key
        else:
            assert got == want, key
        kind, sub = meta.value_type(key)
        field = reader.fields[key]
        assert (kind, sub) == (int(field.types[0]), int(field.types[-1]) if len(field.types) > 1 else None), key
    assert set(meta.keys()) == set(keys)
    assert meta.tensors() == {t.name: (tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in reader.tensors}
    for t in reader.tensors:
        assert meta.tensor_bytes(t.name).tobytes() == np.asarray(t.data).tobytes(), t.name
    assert meta.tensor_names() == tuple(t.name for t in reader.tensors)
    assert "no.such.key" not in meta and meta.get("no.such.key", 7) == 7


def test_a_file_that_is_not_a_gguf_is_one_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(ValueError, match="cannot read .*bad.gguf as a GGUF"):
        GGUFMeta(str(bad))
    with pytest.raises(ValueError, match="as a GGUF"):
        GGUFMeta(str(tmp_path / "missing.gguf"))
