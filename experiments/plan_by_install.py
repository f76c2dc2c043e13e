#!/usr/bin/env python3
"""The memory plan of Qwen3.5-27B Q4_K_M with its DFlash drafter (q8_0), from their
published shapes (metadata-only GGUFs), by each install given: the target's compute
memory, its verify scratch with the captured features, and the whole need, for -c 32768
with q8_0 KV, -np 1 and 4, chain and tree 16. It shows what a change to the reserved
graphs or the state costs a 24 GB card.

    .venv/bin/python experiments/plan_by_install.py OLD/.venv/bin/python .venv/bin/python \
        --out results/plan-by-install-<date>.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, sys, tempfile
from pathlib import Path
from dflash_gguf.convert.shape_model import write_header_only
from dflash_gguf.convert.shapes import QWEN35_27B, QWEN35_27B_DFLASH
from dflash_gguf.engine.memory import settle
from dflash_gguf.engine.options import EngineOptions
rows = []
with tempfile.TemporaryDirectory() as tmp:
    t = str(write_header_only(Path(tmp) / "27b.gguf", QWEN35_27B, "q4_k_m"))
    d = str(write_header_only(Path(tmp) / "27b-dflash.gguf", QWEN35_27B_DFLASH, "q8_0"))
    for n_seq in (1, 4):
        for tree in (None, 16):
            _, plan, _ = settle(t, d, EngineOptions.of(n_ctx=32768 // n_seq, n_seq=n_seq, tree_budget=tree,
                                                        kv_type="q8_0"))
            dev = plan.devices[0]
            rows.append({"np": n_seq, "tree_budget": tree, "target_compute_mib": dev.parts["target_compute"] / 2**20,
                         "verify_scratch_mib": dev.parts["verify_scratch"] / 2**20, "need_mib": dev.need / 2**20})
print(json.dumps(rows))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("python", nargs="+", help="installs' interpreters")
    p.add_argument("--out", type=Path, help="results JSON")
    args = p.parse_args(argv)
    from dflash_gguf.bench.provenance import results_doc, write_results

    installs = []
    for python in args.python:
        with tempfile.TemporaryDirectory() as tmp:  # outside the checkout: the install's package
            out = subprocess.run([str(Path(python).absolute()), "-c", CHILD], check=True, cwd=tmp, capture_output=True, text=True).stdout
        installs.append({"python": python, "rows": json.loads(out)})
        for r in installs[-1]["rows"]:
            print(f"{python}: -np {r['np']} tree {r['tree_budget']}: target compute {r['target_compute_mib']:.1f} MiB, "
                  f"verify scratch and features {r['verify_scratch_mib']:.1f} MiB, need {r['need_mib']:.0f} MiB")
    if args.out:
        write_results(args.out, results_doc("experiments/plan_by_install.py", sys.argv[1:] if argv is None else argv,
                                            installs=installs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
