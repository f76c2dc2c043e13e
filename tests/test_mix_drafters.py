"""scripts/mix_drafters.py, which makes the benchmark's weak drafter: a blend at either
end is that drafter, tensor for tensor; drafters that do not match are refused."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from dflash_gguf.demo import demo_paths

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import mix_drafters  # noqa: E402

DATA = Path(demo_paths()[0]).parent
DEMO, WEAK = DATA / "demo-draft.gguf", DATA / "demo-draft-weak.gguf"


def tensors(path):
    return {t.name: np.asarray(t.data) for t in GGUFReader(path).tensors}


def test_the_ends_are_the_drafters_themselves(tmp_path):
    mix_drafters.mix(WEAK, DEMO, 0.0, tmp_path / "a.gguf")
    assert (tmp_path / "a.gguf").read_bytes() == WEAK.read_bytes()
    mix_drafters.mix(WEAK, DEMO, 1.0, tmp_path / "b.gguf")
    got, want = tensors(tmp_path / "b.gguf"), tensors(DEMO)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_halfway_lies_between(tmp_path):
    mix_drafters.mix(WEAK, DEMO, 0.5, tmp_path / "h.gguf")
    name = "enc.output_norm.weight"  # f32: the blend is exact
    got, a, b = (tensors(p)[name] for p in (tmp_path / "h.gguf", WEAK, DEMO))
    assert np.allclose(got, (a + b) / 2) and not np.allclose(got, a)


def test_a_target_is_not_a_drafter_to_blend(tmp_path):
    with pytest.raises(ValueError, match="is not a dflash model"):
        mix_drafters.mix(WEAK, DATA / "demo-target.gguf", 0.5, tmp_path / "x.gguf")
