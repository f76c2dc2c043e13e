"""The checkpoints of the tiny GPT-OSS bench pair (experiments/gptoss_bench_pair.py converts
them): a seeded gpt-oss target at the demo target's width and a seeded DFlash drafter for
it, from the test fixtures' builders (gptoss_fixtures.py, draft_fixtures.py), the one
definition of a tiny GPT-OSS checkpoint here, at bench widths. Run as a file, which puts
tests/ (the parent of the helpers package) first on the path; prints the two checkpoint
folders.

    python tests/helpers/gptoss_bench_checkpoints.py OUT_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

if __name__ == "__main__":  # Python put tests/helpers/ first on the path: tests/ instead, for the package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from helpers.draft_fixtures import make_dflash  # noqa: E402
from helpers.gptoss_fixtures import MASK_TOKEN, make_gptoss  # noqa: E402

WIDTHS = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, head_dim=32, num_local_experts=32, num_experts_per_tok=4)
WINDOW = 128  # gpt-oss's own


def main(out: Path) -> None:
    target_dir = make_gptoss(out / "target", seed=11, window=WINDOW, **WIDTHS)
    draft_dir = make_dflash(out / "draft", target_dir, target_layer_ids=(0, 2), block_size=8, seed=12, ffn=512)
    cfg = json.loads((draft_dir / "config.json").read_text())
    tok = json.loads((target_dir / "tokenizer.json").read_text())
    cfg["dflash_config"]["mask_token_id"] = next(t["id"] for t in tok["added_tokens"] if t["content"] == MASK_TOKEN)
    (draft_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    print(target_dir)
    print(draft_dir)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
