"""draft-simple's acceptance with the drafter's output head cut to N tokens
(--spec-draft-vocab N, FR-Spec): greedy, a chain of n-max 3, on three code prompts and
one of prose, AL (tokens per target pass) at each N, and what the head then weighs.
Acceptance only: no timings (they need an idle machine).

    .venv/bin/python scripts/draft_vocab_acceptance.py --out results/draft-vocab-acceptance-2026-11-25.json

Each N's output is checked against the whole head's, token for token (the target verifies
every draft: a cut head may only lower acceptance)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

MODELS = Path(os.path.expanduser("~/.cache/dflash-gguf/models"))
TARGET = MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DRAFT = MODELS / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
PROSE = ("The Industrial Revolution, which began in Britain in the second half of the eighteenth century, "
         "changed how people worked and lived. ")


def head_bytes(path: Path, n: int) -> dict:
    """The drafter's head at N rows, and the share of its weights (the head cut in place
    of the whole one) it then is."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    head = next(t for t in reader.tensors if t.name == ("output.weight" if "output.weight" in sizes
                                                         else "token_embd.weight"))
    rows = int(head.shape[1])
    cut = sizes[head.name] * n // rows
    total = sum(sizes.values()) - (sizes[head.name] if "output.weight" in sizes else 0) + cut
    return {"head_tensor": head.name, "head_type": head.tensor_type.name, "head_bytes": cut,
            "model_bytes": total, "head_fraction": round(cut / total, 4)}


def main(argv=None) -> int:
    from dflash_gguf.bench.prompts import PROMPTS
    from dflash_gguf.bench.provenance import results_doc
    from dflash_gguf.engine import Engine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", default="0,65536,32768,16384,8192", help="N values, 0: the whole head")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    prompts = [(name, text) for name, text in PROMPTS if name in ("split", "class", "main")] + [("prose", PROSE)]
    rows, reference = [], {}
    # the checkout as the run starts
    doc = results_doc("scripts/draft_vocab_acceptance.py", sys.argv, target=TARGET.name, draft=DRAFT.name,
                      settings={"spec_type": "draft-simple", "spec_draft_n_max": 3, "greedy": True,
                                "n_predict": args.n_predict, "kept": "special tokens, then the lowest ids"},
                      prompts={name: text for name, text in prompts})
    for n in [int(x) for x in args.vocab.split(",")]:
        with Engine(str(TARGET), str(DRAFT), spec_type="draft-simple", spec_draft_n_max=3, spec_draft_vocab=n,
                    n_ctx=1024, n_threads=args.threads) as engine:
            per = {}
            pooled = []
            for name, text in prompts:
                out = engine.generate(text, args.n_predict, stop_tokens=())
                if n == 0:
                    reference[name] = out.tokens
                elif name in reference and out.tokens != reference[name]:
                    raise SystemExit(f"N {n}: prompt {name}'s output differs from the whole head's")
                per[name] = round(out.stats.mean_accepted, 3)
                pooled += out.stats.accepted_lengths
        row = {"n": n or 151936, "whole_head": n == 0, "al": round(sum(pooled) / len(pooled), 3),
               "al_by_prompt": per, "steps": len(pooled), **head_bytes(DRAFT, n or 151936)}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    doc["rows"] = rows
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
