#!/usr/bin/env python3
"""Instructions a decode takes, counted by valgrind's callgrind: repeatable on a machine
that is not idle, where timings are not. It compares two installs of the project (before
and after a change) on the demo pair, one thread, chain and tree 8, greedy or sampled;
or plain decoding against auto held on its plain arm (what auto's plain steps cost
beyond plain decoding's).

    experiments/decode_count.py --python OLD/.venv/bin/python --python .venv/bin/python \
        --ggml-lib /path/to/avx2/ggml/lib --temp 0,0.6 --out results/decode-count-<date>.json

Each (install, mode, temperature) runs twice under callgrind, for --tokens and for one
token; the difference is the decode's cost with start-up and load cancelled. valgrind
does not run AVX-512 code, so ggml's CPU backend is preloaded from --ggml-lib: a ggml
build with GGML_NATIVE=OFF GGML_AVX2=ON (the same for every install, so the difference
is the project's code). The token ids of both runs are hashed: installs that decode
differently are reported, since their counts would not compare like with like.
"""
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

# Run by each install's interpreter: decode n tokens and print what came out.
CHILD = """
import os, sys
os.environ["DFLASH_AUTO_MEMORY"] = "off"  # what auto learnt in earlier runs stays out of the count
import numpy as np
try:
    from dflash_gguf.speculation import auto as budget
    from dflash_gguf.speculation import verify_cost
    from dflash_gguf.runtime.demo import DEMO_PROMPT, demo_paths
    from dflash_gguf.engine.engine import Engine
    from dflash_gguf.decoding.sampling import SamplingParams
except ImportError:  # an install from before the package's layers (c926561 and earlier)
    from dflash_gguf import budget, verify_cost
    from dflash_gguf.demo import DEMO_PROMPT, demo_paths
    from dflash_gguf.engine import Engine
    from dflash_gguf.sampling import SamplingParams
mode, n, temp = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
if mode == "auto-plain":  # auto held on its plain arm: no decision, probe or cost measurement
    init = budget.AutoBudget.__init__
    def held(self, *a, **k):
        init(self, *a, **k)
        self.current = self.arm = budget.PLAIN
        self.next_decision = self.next_survey = self.to_probe = self.next_probe = 10**9
    def flat(self, target, n_threads=0, cache=None):
        self.key = "flat"
        self.sizes, self.tree_seconds, self.chain_seconds = np.array([1.0, 64.0]), np.ones(2), np.ones(2)
    budget.AutoBudget.__init__, verify_cost.VerifyCost.__init__ = held, flat
sampling = SamplingParams(temperature=temp, top_k=20, top_p=0.95, seed=1) if temp > 0 else None
kw = {"tree_budget": 8} if mode == "tree" else {"tree_budget": "auto"} if mode == "auto-plain" else {}
with Engine(*demo_paths(), n_ctx=512, n_threads=1, **kw) as e:
    r = e.generate(DEMO_PROMPT, n, stop_tokens=(), sampling=sampling, speculative=mode != "plain")
print(len(r.tokens), r.stats.mean_accepted, hash(tuple(r.tokens)))
"""


def count(python: str, ggml_lib: str, mode: str, n: int, temp: float) -> dict:
    """Instructions of one run under callgrind, and its tokens' summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        env = {**os.environ, "LD_LIBRARY_PATH": ggml_lib, "PYTHONHASHSEED": "0"}
        # run outside any checkout: `python -c` puts the working directory first on
        # sys.path, where a source tree's dflash_gguf would shadow the install's
        res = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", python, "-c", CHILD,
                              mode, str(n), str(temp)], capture_output=True, text=True, env=env, cwd=tmp)
        if res.returncode != 0:
            raise SystemExit(f"{python} {mode} n={n} T={temp} failed:\n{res.stderr[-2000:]}")
        totals = re.search(r"^summary:\s+(\d+)", out.read_text(), re.M)
    tokens, accepted, digest = res.stdout.split()
    return {"instructions": int(totals.group(1)), "tokens": int(tokens), "mean_accepted": float(accepted),
            "digest": digest}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", action="append", required=True, help="an install's interpreter (repeatable)")
    p.add_argument("--ggml-lib", required=True, help="folder of an AVX2 build of ggml's libraries")
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded (default 64)")
    p.add_argument("--temp", default="0", help="temperatures, comma-separated (default 0: greedy)")
    p.add_argument("--modes", default="chain,tree",
                   help="comma list of chain, tree (tree budget 8), plain, auto-plain (--tree-budget auto "
                        "held on its plain arm) (default chain,tree)")
    p.add_argument("--out", type=Path, help="results JSON")
    args = p.parse_args(argv)
    rows = []
    for temp in (float(t) for t in args.temp.split(",")):
        for mode in args.modes.split(","):
            for python in args.python:
                long, short = (count(python, args.ggml_lib, mode, n, temp) for n in (args.tokens, 1))
                rows.append({"python": python, "mode": mode, "temperature": temp,
                             "decode_instructions": long["instructions"] - short["instructions"],
                             "startup_instructions": short["instructions"], **{k: long[k] for k in
                                                                                ("tokens", "mean_accepted", "digest")}})
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        provenance.write_results(args.out, provenance.results_doc("experiments/decode_count.py", sys.argv[1:] if argv is None else argv,
                                                                  rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
