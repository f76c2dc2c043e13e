#!/usr/bin/env python3
"""Instructions per generated token on the tiny GPT-OSS bench pair (experiments/gptoss_bench_pair.py),
counted by valgrind's callgrind for both engines: ours (plain, and the chain at several
--draft-p-min x block sizes) and llama.cpp's llama-completion and llama-speculative-simple
--spec-type draft-dflash (at several --spec-draft-p-min x --spec-draft-n-max), one thread,
greedy (or sampled: --temp, top-k 20, top-p 0.95), the bench's first prompt. Repeatable on a machine that is not idle, where timings
are not.

    experiments/gptoss_count.py --ggml-lib /path/to/avx2/ggml/lib --llama-bin /path/to/avx2/llama/bin \
        [--pythonpath OLD_SITE] --out results/gptoss-count-<date>.json

Each arm runs twice, for --tokens + 16 and for 16 tokens; the difference over --tokens is
the per-token cost with start-up, load, prefill and the first steps cancelled. valgrind
does not run AVX-512 code, so both engines use AVX2 builds of the same ggml with the same
flags (AVX2 kernels, llamafile's sgemm on, as the installed wheel has it): ours preloads
ggml's shared libraries from --ggml-lib, llama.cpp's tools come from --llama-bin (they link
ggml statically). From the llama.cpp sources scripts/llama_cpp_build.py uses (SRC):

    FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
           -DGGML_LLAMAFILE=ON"
    cp -r $SRC/ggml ggml-src && touch ggml-src/ggml.pc.in   # the vendored copy lacks it
    cmake -S ggml-src -B ggml-build $FLAGS -DBUILD_SHARED_LIBS=ON -DGGML_RPC=ON -DGGML_BUILD_EXAMPLES=OFF \
        -DCMAKE_INSTALL_PREFIX=$PWD/ggml && cmake --build ggml-build && cmake --install ggml-build
    cmake -S $SRC -B llama-build $FLAGS -DLLAMA_CURL=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF && \
        cmake --build llama-build --target llama-completion llama-speculative-simple

and pass --ggml-lib ggml/lib --llama-bin llama-build/bin. Ours also reports how much of a token is ggml's graph
computes (target and drafter, ggml_graph_compute inclusive) and the rest (host code in
Python and C, building and allocating graphs)."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_gguf.bench import provenance

WARM = 16  # tokens of the short run: past the prefill and the first graphs

# Run by the install's interpreter: decode n tokens of the prompt after a warm-up request.
CHILD = """
import sys
from dflash_gguf.bench.prompts import PROMPTS, WARMUP
from dflash_gguf.engine.engine import Engine
from dflash_gguf.decoding.sampling import SamplingParams
target, draft, n, p_min, block = sys.argv[1], sys.argv[2] or None, int(sys.argv[3]), sys.argv[4], sys.argv[5]
temp = float(sys.argv[6])
opts = {"draft_p_min": float(p_min) if p_min else None, **({"block_size": int(block)} if block else {})}
sampling = SamplingParams(temp, 20, 0.95, seed=1) if temp > 0 else None
with Engine(target, draft, n_ctx=512, n_threads=1, **opts) as e:
    e.generate(WARMUP, 8, stop_tokens=())
    r = e.generate(PROMPTS[0][1], n, stop_tokens=(), sampling=sampling)
    builds = e.target.info()["n_graph_builds"]
print(len(r.tokens), r.stats.mean_accepted, builds, hash(tuple(r.tokens)))
"""

# the bench's arms (dflash-bench --draft-p-min 0,0.3,0.5,0.75 x n-max 3,7), fewer: with a random
# drafter every cut above 0 stops at the same place (its drafts' probabilities are all small)
OURS = [("plain", None, None, None), ("chain (default)", "", None, None)] + [
    (f"chain p-min {p:g} n-max {b - 1}", "", p, b) for p, b in ((0.0, 4), (0.0, 8), (0.3, 4), (0.75, 8))]
LLAMA_SPEC = [("default", [])] + [
    (f"p-min {p:g} n-max {n}", ["--spec-draft-n-max", str(n), "--spec-draft-n-min", "0", "--spec-draft-p-min", repr(p)])
    for p, n in ((0.0, 3), (0.0, 7), (0.3, 3), (0.5, 3), (0.75, 7))]


def callgrind(cmd, env=None, cwd=None) -> tuple:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        res = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *cmd],
                             capture_output=True, text=True, errors="replace", env=env, cwd=cwd or tmp)
        if res.returncode != 0:
            raise SystemExit(f"{' '.join(cmd[:3])} failed:\n{res.stderr[-2000:]}")
        total = int(re.search(r"^summary:\s+(\d+)", out.read_text(), re.M).group(1))
        annotated = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(out)],
                                   capture_output=True, text=True).stdout
    compute = sum(int(m.group(1).replace(",", "")) for m in re.finditer(
        r"^\s*([\d,]+) \([^)]*\)\s+\S*:ggml_graph_compute \[", annotated, re.M))
    return total, compute, res.stdout


def ours(python: str, pythonpath: str, ggml_lib: str, target: str, draft: str, arm, n: int, temp: float) -> dict:
    name, use_draft, p_min, block = arm
    env = {**os.environ, "LD_LIBRARY_PATH": ggml_lib, "PYTHONHASHSEED": "0"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    runs = []
    for tokens in (WARM, WARM + n):
        total, compute, stdout = callgrind([python, "-c", CHILD, target, draft if use_draft is not None else "",
                                           str(tokens), "" if p_min is None else repr(p_min),
                                           "" if block is None else str(block), repr(temp)], env)
        runs.append((total, compute, stdout.split()))
    (t0, c0, _), (t1, c1, out) = runs
    return {"engine": "ours", "arm": name, "instructions_per_token": round((t1 - t0) / n),
            "graph_compute_per_token": round((c1 - c0) / n),
            "tokens": int(out[0]), "mean_accepted": float(out[1]), "target_graph_builds": int(out[2]), "digest": out[3]}


def llama(bin_dir: Path, tool: str, target: str, draft: str, flags, n: int, prompt: str, temp: float) -> dict:
    sampling = ["--temp", repr(temp), "--top-k", "20", "--top-p", "0.95", "--min-p", "0", "-s", "1",
                "--samplers", "top_k;top_p;min_p;temperature"] if temp > 0 else ["--temp", "0"]
    # --ignore-eos: every run decodes its -n tokens, as ours do (stop_tokens=()), so that the
    # difference of the two runs is -n tokens' work (a trained target ends its text early)
    common = ["-m", target, "-c", "512", "-b", "512", "-ub", "512", "-t", "1", "-tb", "1", "-fa", "on",
              "-ctk", "f16", "-ctv", "f16", "--ignore-eos", *sampling, "-p", prompt]
    extra = ["-no-cnv", "--no-display-prompt"] if tool == "llama-completion" else \
        ["-md", draft, "-td", "1", "-tbd", "1", "--spec-type", "draft-dflash", *flags]
    totals = []
    for tokens in (WARM, WARM + n):
        total, _, _ = callgrind([str(bin_dir / tool), *common, "-n", str(tokens), *extra])
        totals.append(total)
    return {"instructions_per_token": round((totals[1] - totals[0]) / n)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default=sys.executable, help="our install's interpreter (default: this one)")
    p.add_argument("--pythonpath", default="", help="a folder put first on PYTHONPATH for our runs "
                                                    "(a copy of another version of the package)")
    p.add_argument("--ggml-lib", required=True, help="folder of an AVX2 build of ggml's shared libraries")
    p.add_argument("--llama-bin", type=Path, help="folder of AVX2 builds of llama-completion and "
                                                  "llama-speculative-simple (omitted: ours only)")
    p.add_argument("--tokens", type=int, default=64, help="tokens counted (default 64)")
    p.add_argument("--pair", type=Path, default=Path.home() / ".cache" / "dflash-gguf" / "gptoss-bench",
                   help="folder of experiments/gptoss_bench_pair.py's GGUFs")
    p.add_argument("--target", type=Path, help="another target GGUF (default: the pair's; with --plain, e.g. the "
                                                "demo target, for plain decoding against llama-completion)")
    p.add_argument("--draft", type=Path, help="another drafter GGUF (default: the pair's)")
    p.add_argument("--temp", type=float, default=0.0,
                   help="0: greedy (default); above: sampled at that temperature, top-k 20, top-p 0.95")
    p.add_argument("--plain", action="store_true", help="plain decoding only (ours and llama-completion)")
    p.add_argument("--out", type=Path, help="results JSON")
    args = p.parse_args(argv)
    target = str(args.target or args.pair / "gptoss-target-mxfp4_moe.gguf")
    draft = str(args.draft or args.pair / "gptoss-draft-q8_0.gguf")
    from dflash_gguf.bench.prompts import PROMPTS  # the installed package's (run by its interpreter)
    rows = []
    for arm in OURS[:1] if args.plain else OURS:
        rows.append(ours(args.python, args.pythonpath, args.ggml_lib, target, draft, arm, args.tokens, args.temp))
        print(json.dumps(rows[-1]), flush=True)
    if args.llama_bin:
        arms = [("llama-completion", "plain", [])] + ([] if args.plain else [
            ("llama-speculative-simple", f"DFlash {name}", flags) for name, flags in LLAMA_SPEC])
        for tool, name, flags in arms:
            rows.append({"engine": "llama.cpp", "arm": f"{tool} {name}",
                         **llama(args.llama_bin, tool, target, draft, flags, args.tokens, PROMPTS[0][1], args.temp)})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        provenance.write_results(args.out, provenance.results_doc("experiments/gptoss_count.py", sys.argv[1:] if argv is None else argv,
                                                                  rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
