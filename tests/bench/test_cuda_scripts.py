"""scripts/cuda/: what pack.py leaves out of the llama-cpp-python sources, and how bench.py
joins parts run in separate calls into one results file (the GPU runs themselves happen
on the lent machine; scripts/cuda/README.md)."""
from __future__ import annotations

import importlib.util
import json

from dflash_gguf.bench import slim

from helpers.paths import ROOT

CUDA_SCRIPTS = ROOT / "scripts" / "cuda"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"cuda_{name}", CUDA_SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pack_keeps_what_a_cuda_build_reads():
    pack = load("pack")
    top = "llama_cpp_python-0.3.36"
    kept = ["CMakeLists.txt", "llama_cpp/llama.py", "vendor/llama.cpp/ggml/src/ggml-cuda/mmq.cu",
            "vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c", "vendor/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp",
            "vendor/llama.cpp/tools/llama-bench/llama-bench.cpp", "vendor/llama.cpp/tools/mtmd/CMakeLists.txt",
            "vendor/llama.cpp/examples/speculative-simple/speculative-simple.cpp",
            "vendor/llama.cpp/modelsX/a-name-that-only-starts-like-a-pruned-one"]
    dropped = ["vendor/llama.cpp/models/ggml-vocab-qwen2.gguf", "vendor/llama.cpp/docs/build.md",
               "vendor/llama.cpp/tools/ui/index.html", "vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp",
               "vendor/llama.cpp/ggml/src/ggml-hip/CMakeLists.txt", "docs/index.md", ".git/HEAD"]
    assert [p for p in kept if pack.pruned(f"{top}/{p}", top)] == []
    assert [p for p in dropped if not pack.pruned(f"{top}/{p}", top)] == []


def _steps(depth: int, decode_tps: float) -> dict:
    return {"depth": depth, "tokens": 32, "decode_tps": decode_tps, "decode_nodes": 2100, "verify_nodes": 2300,
            "graph_builds_timed": {}, "verify_ms": {"1": 25.0, "16": 30.0}, "load_s": 9.0, "prefill_depth_s": 20.0,
            "memory": {"used": 17 << 30, "plan": 16 << 30, "ratio": 17 / 16}}


def test_merge_joins_parts_into_one_results_file(tmp_path):
    bench = load("bench")
    header = {"date": "2026-11-24 09:30", "commit": "abc", "device": "CUDA0", "smoke": False,
              "device_description": "NVIDIA H100 80GB HBM3", "gpu": "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB",
              "driver": "580.159.04", "build": "flags", "cpu_count": 16, "prompts": ["x"], "n": 128, "reps": 3}
    runs = lambda tps, al: [{"prompt": 0, "tps": tps, "al": al, "text": "t", "n_host_reads": 3.0}]  # noqa: E731
    pairs = {"demo greedy": {"ours": {arm: runs(400.0 if arm == "chain" else 200.0, 4.0) for arm in bench.ARMS},
                             "llama-completion": [{"tps": 250.0, "al": 1.0, "text": "t"}],
                             "llama-spec p-min 0": [{"tps": 320.0, "al": 3.5}]}}
    long = {"q8_0": {"ours": _steps(32768, 50.0), "llama-bench": {"s": {"0/32/32768": 0.8, "16/0/32768": 0.024}}}}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"header": header, "pairs": pairs}))
    b.write_text(json.dumps({"header": {**header, "date": "2026-11-24 09:50"}, "long": long}))
    assert bench.main(["--merge", str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "cuda-h100-2026-11-24-0930.md").read_text()
    merged = slim.read(tmp_path / "out" / "cuda-h100-2026-11-24-0930.json")
    assert set(merged) == {"header", "pairs", "long"} and merged["header"]["date"] == "2026-11-24 09:30"
    # chain 400 tok/s against llama-speculative-simple's 320: 1.25; plain decode 50 tok/s
    # against llama-bench's 32 tokens in 0.8 s: 1.25; verify of 16: 24 ms against our 30
    assert "| demo | greedy | llama-spec p-min 0 | 320.0 | 3.50 | – | 1.25 |" in md
    assert "ours 50.0 tok/s, llama-bench 40.0 (ours / theirs 1.25)" in md
    assert "| 16 | 30.00 | 1.50 | – | – | 24.00 | 0.80 |" in md  # a decode step: 20 ms
    assert "ours plain = llama-completion on 1/1" in md


def test_plain_check_runs_its_matrix_on_the_rpc_stand_in(rpc_endpoint, tmp_path):
    """The lent GPU's plain check, dry-run on the CPU's stand-in for a device: every cell of
    a (smaller) matrix runs in a process of its own with its settings, gives the CPU's
    tokens for its cache type (the settings are ggml-cuda's: on RPC they change nothing),
    and the results file holds every cell."""
    import subprocess
    import sys

    out = tmp_path / "plain-check.json"
    res = subprocess.run([sys.executable, str(CUDA_SCRIPTS / "plain_check.py"), "--device", "RPC0", "--rpc",
                          rpc_endpoint, "-n", "12", "--kv", "f16,q8_0", "--pdl", "0", "--fusion", "off",
                          "--out", str(out)], capture_output=True, text=True, cwd="/", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    cells = json.loads(out.read_text())["cells"]
    assert [(c["mode"], c["kv"], c["graphs"]) for c in cells] == [
        ("plain", "f16", "on"), ("plain", "q8_0", "on"), ("plain", "f16", "off"), ("plain", "q8_0", "off"),
        ("chain", "f16", "off")]
    assert all(c["parts_from_cpu_at"] is None and c["tokens"] == 12 for c in cells), cells
    bad = subprocess.run([sys.executable, str(CUDA_SCRIPTS / "plain_check.py"), "--pdl", "maybe"],
                         capture_output=True, text=True, cwd="/")
    assert bad.returncode == 2 and "--pdl: maybe is not one of default, 0" in bad.stderr


def test_apply_patches_skips_only_what_the_pack_prunes(tmp_path):
    """build.sh applies the ggml patches to the packed sources with apply_patches.py: sections
    for files the pack prunes (another backend's) are skipped, every other must apply."""
    apply = load("apply_patches")
    src = tmp_path / "src"
    (src / "ggml-cuda").mkdir(parents=True)
    (src / "ggml-cuda" / "a.cu").write_text("one\ntwo\nthree\n")
    kept = ("diff --git a/ggml-cuda/a.cu b/ggml-cuda/a.cu\n--- a/ggml-cuda/a.cu\n+++ b/ggml-cuda/a.cu\n"
            "@@ -1,3 +1,3 @@\n one\n-two\n+TWO\n three\n")
    new = ("diff --git a/ggml-cuda/n.cuh b/ggml-cuda/n.cuh\nnew file mode 100644\n--- /dev/null\n"
           "+++ b/ggml-cuda/n.cuh\n@@ -0,0 +1 @@\n+new\n")
    pruned = ("diff --git a/ggml-vulkan/v.cpp b/ggml-vulkan/v.cpp\n--- a/ggml-vulkan/v.cpp\n+++ b/ggml-vulkan/v.cpp\n"
              "@@ -1 +1 @@\n-x\n+y\n")
    patch = tmp_path / "0001-x.patch"
    patch.write_text(kept + pruned + new)
    assert apply.main([str(src), str(patch)]) == 0
    assert (src / "ggml-cuda" / "a.cu").read_text() == "one\nTWO\nthree\n"
    assert (src / "ggml-cuda" / "n.cuh").read_text() == "new\n"
    assert not (src / "ggml-vulkan").exists()
    (src / "ggml-cuda" / "a.cu").write_text("one\nother\nthree\n")  # a section that does not apply fails
    patch.write_text(kept)
    assert apply.main([str(src), str(patch)]) == 1
