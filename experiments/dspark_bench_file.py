"""A DSpark drafter for the bundled demo target, to benchmark with: the trained demo DFlash
drafter's backbone with seeded Markov and confidence heads, written as llama.cpp's
converter writes DSpark GGUFs (dflash_gguf.tools.demo_dspark's make_dspark, the one definition
of it here; the tests draft with the same file and check both runtimes draft alike).
The heads are random, so the backbone's drafts carry the acceptance and the Markov bias
changes a few of them: the file measures what a DSpark step costs each engine beside
`llama-speculative-simple --spec-type draft-dspark`, not what trained heads would add.
Prints the path; run it again and it reuses the file. results/dspark-2026-11-25.json
was measured with it.

    .venv/bin/python experiments/dspark_bench_file.py [--out FILE]
    dflash-bench -m dflash_gguf/data/demo-target.gguf -md <file> --spec-type draft-dspark ...
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash_gguf.tools.demo_dspark import make_dspark


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache" / "dflash-gguf" / "dspark-bench" / "dspark.gguf",
                    help="the GGUF written (default: ~/.cache/dflash-gguf/dspark-bench/dspark.gguf)")
    args = ap.parse_args()
    if not args.out.exists():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        make_dspark(args.out, seed=7)  # the tests' file (tests/drafters/test_dspark.py)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
