"""training/mix_drafters.py, which makes the benchmark's weak drafter, run as a user runs
it: a blend at either end is that drafter, tensor for tensor; drafters that do not match
are refused with a message and exit status 1."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from dflash_gguf.runtime.demo import demo_paths

from helpers.paths import ROOT

DATA = Path(demo_paths()[0]).parent
DEMO, WEAK = DATA / "demo-draft.gguf", DATA / "demo-draft-weak.gguf"
SCRIPT = ROOT / "training" / "mix_drafters.py"


def mix(a, b, alpha, out) -> subprocess.CompletedProcess:
    # cwd: not the checkout's root, whose source tree would shadow the installed package
    return subprocess.run([sys.executable, str(SCRIPT), str(a), str(b), str(alpha), str(out)], capture_output=True,
                          text=True, cwd=out.parent, timeout=300)


def tensors(path):
    return {t.name: np.asarray(t.data) for t in GGUFReader(path).tensors}


def test_the_ends_are_the_drafters_themselves(tmp_path):
    assert mix(WEAK, DEMO, 0.0, tmp_path / "a.gguf").returncode == 0
    assert (tmp_path / "a.gguf").read_bytes() == WEAK.read_bytes()
    assert mix(WEAK, DEMO, 1.0, tmp_path / "b.gguf").returncode == 0
    got, want = tensors(tmp_path / "b.gguf"), tensors(DEMO)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_halfway_lies_between(tmp_path):
    assert mix(WEAK, DEMO, 0.5, tmp_path / "h.gguf").returncode == 0
    name = "enc.output_norm.weight"  # f32: the blend is exact
    got, a, b = (tensors(p)[name] for p in (tmp_path / "h.gguf", WEAK, DEMO))
    assert np.allclose(got, (a + b) / 2) and not np.allclose(got, a)


def test_a_target_is_not_a_drafter_to_blend(tmp_path):
    res = mix(WEAK, DATA / "demo-target.gguf", 0.5, tmp_path / "x.gguf")
    assert res.returncode == 1 and "is not a dflash model" in res.stderr and "Traceback" not in res.stderr
