"""scripts/auto_compare.py: auto and fixed arms measured side by side."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import auto_compare  # noqa: E402


def test_arms_are_parsed_and_bad_ones_refused():
    assert auto_compare.parse_arms("auto,chain,4,8") == ["auto", "chain", 4, 8]
    for bad in ("chain,4", "auto", "auto,64", "auto,tree"):
        with pytest.raises(argparse.ArgumentTypeError):
            auto_compare.parse_arms(bad)


def test_options_are_checked():
    with pytest.raises(SystemExit):
        auto_compare.main(["--demo", "-m", "x.gguf", "-md", "y.gguf"])
    with pytest.raises(SystemExit):
        auto_compare.main(["-m", "x.gguf"])


def test_a_short_comparison_on_the_bundled_pair(capsys):
    data = ROOT / "dflash_gguf" / "data"
    assert auto_compare.main(["-m", str(data / "demo-target.gguf"), "-md", str(data / "demo-draft.gguf"),
                              "--arms", "auto,chain,4", "--rounds", "1", "-n", "24", "--prompts", "2",
                              "-t", "1"]) == 0
    out = capsys.readouterr().out
    assert "| auto |" in out and "| chain |" in out and "| 4 |" in out
    ratio = float(out.split("auto / best fixed arm: **")[1].split("**")[0])
    assert 0.0 < ratio < 10.0
    steps = out.split("step by step (c chain, 4, 8, G = 16, X = 32): ")[1].splitlines()[0]
    assert steps and set(steps) <= set("c48GX")  # arms of auto's largest budget, 32
