"""ggml's own messages: its debug lines (one per matrix the CPU backend repacks while a
quantized model loads) stay off stderr unless DFLASH_GGML_DEBUG=1 asks for them, as
llama.cpp's tools hide them unless verbose; also once the tokenizer has loaded
llama-cpp-python, whose import points ggml's log at a callback of its own."""
from __future__ import annotations

import os
import subprocess
import sys

# a Q4_K matrix placed in the CPU backend's repacked layout, as a model's load places it
# (the CPU backend logs each repack at debug level)
REPACK = """
import sys
import numpy as np
from gguf import GGMLQuantizationType
from dflash_gguf.runtime.devices import matmul_invariance
if sys.argv[1:] == ["llama_cpp"]:  # imported first, as the benchmarks' provenance does
    import llama_cpp
elif sys.argv[1:]:  # a tokenizer first, as every engine loads one
    from dflash_gguf.runtime.tokenizer import Tokenizer
    Tokenizer(sys.argv[1])
rng = np.random.default_rng(0)
matmul_invariance(int(GGMLQuantizationType.Q4_K), rng.standard_normal((64, 256)), rng.standard_normal((4, 256)))
print("ran")
"""


def _stderr(debug: str, cwd, *first) -> str:
    env = {**os.environ, "DFLASH_GGML_DEBUG": debug}
    got = subprocess.run([sys.executable, "-c", REPACK, *first], env=env, capture_output=True, text=True, timeout=120,
                         cwd=cwd)  # not the checkout, whose dflash_gguf has no native library
    assert got.returncode == 0 and "ran" in got.stdout, got.stderr[-2000:]
    return got.stderr


def test_ggml_debug_lines_are_shown_only_when_asked(tmp_path):
    asked = _stderr("1", tmp_path)
    assert "repack tensor" in asked, asked[-2000:]  # the CPU backend did repack, and said so
    assert "repack tensor" not in _stderr("0", tmp_path)
    assert "repack tensor" not in _stderr("", tmp_path)


def test_the_tokenizers_llama_cpp_does_not_bring_them_back(tmp_path):
    from dflash_gguf.runtime.demo import demo_paths
    target, _ = demo_paths()
    assert "repack tensor" not in _stderr("", tmp_path, target)
    assert "repack tensor" in _stderr("1", tmp_path, target)


def test_nor_llama_cpp_imported_before_the_library_computes(tmp_path):
    assert "repack tensor" not in _stderr("", tmp_path, "llama_cpp")
    assert "repack tensor" in _stderr("1", tmp_path, "llama_cpp")
