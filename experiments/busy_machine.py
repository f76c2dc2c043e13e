"""Plain decoding beside another process: ours against llama.cpp's llama-completion (the
same ggml build), each with -t 1 and -t 2, on an idle machine and with cores kept busy
by plain spinning processes (what a browser tab, an IDE's indexer or a second request
does to a user's decode). Arms run one at a time, interleaved, each in a fresh process;
the busy processes run through a whole repetition of every arm.

    python experiments/busy_machine.py --model demo --reps 3 --out results/busy-machine-demo.json
    python experiments/busy_machine.py --model qwen2.5-coder-1.5b --tokens 64 --reps 3
    python experiments/busy_machine.py --env GOMP_SPINCOUNT=1000 ...   # our arms under an environment

Rates are decode tokens per second after the first token (ours: GenerationStats.decode_tps;
llama-completion: its "eval time" line), greedy, 128 tokens by default."""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "def read_lines(path):\n    "
OURS = """
import sys
from dflash_gguf import Engine
with Engine(sys.argv[1], n_threads=int(sys.argv[2])) as e:
    r = e.generate(sys.argv[4], int(sys.argv[3]), stop_tokens=(), speculative=False)
    print("RATE", r.stats.decode_tps, r.stats.generated_tokens)
"""


def spin() -> None:
    while True:
        pass


def model_path(name: str) -> str:
    if name == "demo":
        from dflash_gguf.runtime.demo import demo_paths

        return demo_paths()[0]
    from dflash_gguf.tools import real_models

    return str(real_models.path(name)) if name in real_models.MODELS else name


def ours(model: str, threads: int, tokens: int, env: dict) -> float:
    out = subprocess.run([sys.executable, "-c", OURS, model, str(threads), str(tokens), PROMPT], capture_output=True,
                         text=True, env={**os.environ, **env}, timeout=1800, cwd=tempfile.gettempdir())  # not the source tree
    m = re.search(r"RATE ([0-9.e+-]+) (\d+)", out.stdout)
    if not m:
        raise RuntimeError(f"our arm failed: {out.stderr[-2000:]}")
    return float(m.group(1))


def theirs(binary: str, model: str, threads: int, tokens: int) -> float:
    out = subprocess.run([binary, "-m", model, "-p", PROMPT, "-n", str(tokens), "-t", str(threads), "--temp", "0",
                          "-no-cnv", "--no-warmup", "--ignore-eos"], capture_output=True, text=True, timeout=1800)
    m = re.search(r"(?<!prompt )\beval time =.*?([0-9.]+) tokens per second", out.stdout + out.stderr)
    if not m:
        raise RuntimeError(f"llama-completion failed: {(out.stdout + out.stderr)[-2000:]}")
    return float(m.group(1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="demo, a name of dflash_gguf.tools.real_models, or a GGUF path")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    p.add_argument("--busy", type=int, nargs="+", default=[0, 1], help="spinning processes beside the arms")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for our arms (repeatable)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    from dflash_gguf.bench.provenance import load_average, machine, results_doc, write_results
    from dflash_gguf.tools.llama_cpp_tree import tool

    binary = tool("llama-completion")
    if binary is None:
        raise SystemExit("llama-completion is not built: scripts/llama_cpp_build.py llama-completion")
    model = model_path(a.model)
    env = dict(kv.split("=", 1) for kv in a.env)
    arms = [(engine, t) for t in a.threads for engine in ("ours", "llama-completion")]
    rates = {f"busy {b}": {f"{e} -t {t}": [] for e, t in arms} for b in a.busy}
    load = load_average()
    for rep in range(a.reps):
        for b in a.busy:
            spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(b)]
            for s in spinners:
                s.start()
            try:
                time.sleep(0.5 if b else 0)
                for engine, t in arms:
                    try:
                        rate = round(ours(model, t, a.tokens, env) if engine == "ours"
                                     else theirs(str(binary), model, t, a.tokens), 1)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:  # kept as a failed repetition
                        rate = None
                        print(f"rep {rep} busy {b} {engine} -t {t} failed: {str(e)[-500:]}", flush=True)
                    rates[f"busy {b}"][f"{engine} -t {t}"].append(rate)
                    print(f"rep {rep} busy {b} {engine} -t {t}: {rate} tok/s", flush=True)
            finally:
                for s in spinners:
                    s.terminate()
                    s.join()
    summary = {}
    for load_name, by_arm in rates.items():
        for t in a.threads:
            pairs = [(x, y) for x, y in zip(by_arm[f"ours -t {t}"], by_arm[f"llama-completion -t {t}"])
                     if x is not None and y is not None]
            if not pairs:
                continue
            o, l = zip(*pairs)
            summary[f"{load_name}, -t {t}: ours / llama-completion (median, range over reps)"] = {
                "median": round(statistics.median(o) / statistics.median(l), 3),
                "range": [round(min(x / y for x, y in zip(o, l)), 3), round(max(x / y for x, y in zip(o, l)), 3)]}
    print(json.dumps(summary, indent=1))
    if a.out:
        doc = results_doc("experiments/busy_machine.py", sys.argv[1:] if argv is None else argv,
                          machine=machine(max(a.threads), "CPU"), load_average_at_start=load, model=model,
                          tokens=a.tokens, env_of_our_arms=env, tok_per_s=rates, ratios=summary)
        write_results(Path(a.out), doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
