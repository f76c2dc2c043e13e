#!/usr/bin/env python3
"""Why a llama.cpp built apart from the llama-cpp-python wheel seems to round otherwise
(issue 66, item 5): the same greedy continuation through llama-completion of a cmake build
and through the wheel (in another virtualenv), at each tool's defaults and with the
settings that set them apart made equal, one row of the table each.

Both sides must come from the same sources (stock or patched): --completion names the
cmake build's llama-completion (scripts/llama_cpp_build.py builds it), --wheel-python a
python whose llama_cpp is the wheel (for the stock wheel: a virtualenv with the wheel that
setup.sh built before the patch). Texts are compared, not token ids: llama-completion
prints text only.

    .venv/bin/python experiments/llama_cpp_settings.py --completion BUILD/bin/llama-completion \\
        --wheel-python STOCK_VENV/bin/python --out results/llama-cpp-settings-DATE.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from dflash_gguf.tools import real_models
from dflash_gguf.bench.provenance import load_average, machine, results_doc, versions, write_results

CASES = {
    "gemma-textwrap": ("gemma-3-270m", inspect.getsource(textwrap)[:5200]),
    "qwen-fib": ("qwen2.5-coder-1.5b", "def fibonacci(n):\n"),
}
COMPLETION_SETTINGS = {
    "defaults": [],
    "--no-escape": ["--no-escape"],
    "--no-escape --swa-full -fa off": ["--no-escape", "--swa-full", "-fa", "off"],
    "--no-escape --swa-full -fa on": ["--no-escape", "--swa-full", "-fa", "on"],
    "--no-escape --swa-full -fa on --no-repack": ["--no-escape", "--swa-full", "-fa", "on", "--no-repack"],
}
# the wheel's greedy continuation, one eval a token (llama-cpp-python's Llama: n_batch 512,
# full-size SWA cache); argv: model, prompt file, tokens, flash attention (0/1)
WHEEL = """
import sys, numpy as np, llama_cpp
model, prompt, n, fa = sys.argv[1], open(sys.argv[2]).read(), int(sys.argv[3]), sys.argv[4] == "1"
llm = llama_cpp.Llama(model, n_threads=2, n_ctx=4096, flash_attn=fa, verbose=False)
llm.eval(llm.tokenize(prompt.encode(), add_bos=True, special=False))
out = []
for _ in range(n):
    row = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    out.append(int(np.argmax(row)))
    llm.eval(out[-1:])
sys.stdout.write(llm.detokenize(out).decode(errors="replace"))
"""


def completion(binary: str, model: str, prompt_file: Path, n: int, extra: list) -> str:
    return subprocess.run([binary, "-m", model, "-f", str(prompt_file), "-n", str(n), "--temp", "0", "-t", "2",
                           "-c", "4096", "--no-warmup", "-no-cnv", "--no-display-prompt", *extra],
                          capture_output=True, text=True, check=True).stdout


def wheel(python: str, model: str, prompt_file: Path, n: int, fa: bool) -> str:
    return subprocess.run([python, "-c", WHEEL, model, str(prompt_file), str(n), "1" if fa else "0"],
                          capture_output=True, text=True, check=True).stdout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--completion", required=True, help="llama-completion of the cmake build")
    p.add_argument("--wheel-python", required=True, help="a python whose llama_cpp is the wheel")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("-n", type=int, default=12, help="tokens (default 12)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases:
            model_name, prompt = CASES[name]
            model = str(real_models.path(model_name))
            plain, for_completion = Path(tmp) / f"{name}.txt", Path(tmp) / f"{name}-completion.txt"
            plain.write_text(prompt)
            # llama-completion drops one trailing newline of a -f file: give it one more
            for_completion.write_text(prompt + "\n" if prompt.endswith("\n") else prompt)
            for label, extra in COMPLETION_SETTINGS.items():
                # at its defaults it reads the file as a user would write it, newline dropped
                text = completion(args.completion, model, plain if not extra else for_completion, args.n, extra)
                rows.append({"case": name, "tool": "llama-completion (cmake build)", "settings": label,
                             "continuation": text})
                print(f"[settings] {name} completion {label}: {text!r}", file=sys.stderr, flush=True)
            for fa in (False, True):
                text = wheel(args.wheel_python, model, plain, args.n, fa)
                rows.append({"case": name, "tool": "llama-cpp-python wheel", "settings": f"flash_attn={fa}",
                             "continuation": text})
                print(f"[settings] {name} wheel flash_attn={fa}: {text!r}", file=sys.stderr, flush=True)
    doc = results_doc("experiments/llama_cpp_settings.py", sys.argv, machine=machine(2, "CPU"), versions=versions(),
                      builds={"completion": args.completion, "wheel_python": args.wheel_python,
                              "wheel_llama_cpp": subprocess.run(
                                  [args.wheel_python, "-c", "import llama_cpp; print(llama_cpp.__file__)"],
                                  capture_output=True, text=True).stdout.strip()},
                      n_new=args.n, prompts={k: v[1] for k, v in CASES.items() if k in args.cases},
                      rows=rows, load_average=load_average())
    write_results(args.out, doc)
    print(json.dumps([(r["case"], r["tool"], r["settings"], r["continuation"][:24]) for r in rows], indent=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
