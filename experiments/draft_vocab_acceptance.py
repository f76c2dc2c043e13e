"""draft-simple's acceptance with the drafter's output head cut to N tokens
(--spec-draft-vocab N, FR-Spec): greedy, a chain of n-max 3, on three code prompts and
one of prose, AL (tokens per target pass) at each N, and what the head then weighs.
Acceptance only: no timings (they need an idle machine).

The whole head runs through the engine (draft-simple's real loop); each cut N is then
replayed from the drafter's logits over the same prompt and output (draft_simple.replayed_lengths: a greedy
chain's acceptance follows from those, the output being the same at any N), checked
against the loop at the whole head, and with --run-cut also at the cut Ns named.

    .venv/bin/python experiments/draft_vocab_acceptance.py --out results/draft-vocab-acceptance-2026-11-25.json

--from PATH (repeatable; a file or a directory of them) adds, at each N, the head cut to
the tokens commonest in that text (--spec-draft-vocab-from), beside the lowest ids.

--run-cut's outputs are checked against the whole head's, token for token (the target
verifies every draft: a cut head may only lower acceptance)."""
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
    import numpy as np

    from dflash_gguf.bench.prompts import PROMPTS
    from dflash_gguf.bench.provenance import results_doc
    from dflash_gguf.speculation.draft_simple import corpus_counts, corpus_files, kept_tokens, replayed_lengths
    from dflash_gguf.engine.engine import Engine
    from dflash_gguf.runtime.target import DECODE, Rows, Target, TargetConfig
    from dflash_gguf.runtime.tokenizer import Tokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", default="65536,32768,16384,8192", help="cut N values (the whole head always runs)")
    p.add_argument("--run-cut", default="", help="N values also run through the engine with the cut head "
                                                 "(a check of the replay; slow on a loaded machine)")
    p.add_argument("--from", dest="corpus", action="append", default=[], metavar="PATH",
                   help="a corpus whose commonest tokens a second cut at each N keeps (repeatable)")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    n_max = 3
    prompts = [(name, text) for name, text in PROMPTS if name in ("split", "class", "main")] + [("prose", PROSE)]
    doc = results_doc("experiments/draft_vocab_acceptance.py", sys.argv, target=TARGET.name, draft=DRAFT.name,
                      settings={"spec_type": "draft-simple", "spec_draft_n_max": n_max, "greedy": True,
                                "n_predict": args.n_predict, "kept": "special tokens, then the lowest ids (kept_by: lowest ids) or the commonest in --from (kept_by: corpus)"},
                      prompts={name: text for name, text in prompts})

    def engine_run(n):
        with Engine(str(TARGET), str(DRAFT), spec_type="draft-simple", spec_draft_n_max=n_max, spec_draft_vocab=n,
                    n_ctx=1024, n_threads=args.threads) as engine:
            return {name: (engine.encode(text), engine.generate(text, args.n_predict, stop_tokens=()))
                    for name, text in prompts}

    # the real loop with the whole head: the output every N must give, and its measured AL
    whole = engine_run(0)
    drafter = Target(str(DRAFT), TargetConfig(n_ctx=1024, n_threads=args.threads))
    logits = {}
    for name, (ids, out) in whole.items():
        full = list(ids) + list(out.tokens)
        drafter.reset()
        drafter.step([Rows(0, DECODE, full)])
        logits[name] = (drafter.logits(0, len(full)), len(ids), full)
    drafter.close()
    n_vocab = logits[prompts[0][0]][0].shape[1]
    counts = corpus_counts(Tokenizer(str(TARGET)), args.corpus, n_vocab) if args.corpus else None
    if counts is not None:
        doc["corpus"] = {"paths": args.corpus, "files": len(corpus_files(args.corpus)), "tokens": int(counts.sum()),
                         "distinct_tokens": int(np.count_nonzero(counts))}
    rows = []
    cuts = [int(x) for x in args.vocab.split(",") if x]
    for n, by in [(0, None)] + [(n, "lowest ids") for n in cuts] + ([(n, "corpus") for n in cuts] if args.corpus else []):
        kept = np.arange(n_vocab) if n == 0 else np.asarray(kept_tokens(str(DRAFT), n, counts if by == "corpus" else None))
        per, pooled = {}, []
        for name, _ in prompts:
            lengths = replayed_lengths(logits[name][0], kept, logits[name][1], logits[name][2], n_max)
            per[name] = round(sum(lengths) / len(lengths), 3)
            pooled += lengths
        row = {"n": n or n_vocab, "whole_head": n == 0, "kept_by": by, "al": round(sum(pooled) / len(pooled), 3),
               "al_by_prompt": per, "steps": len(pooled), "how": "replayed", **head_bytes(DRAFT, n or n_vocab)}
        if n == 0:  # the replay checked against the real loop's steps
            measured = [k for name, _ in prompts for k in whole[name][1].stats.accepted_lengths]
            row["measured_al"] = round(sum(measured) / len(measured), 3)
            row["replay_equals_the_loop"] = measured == pooled
            row["measured_al_by_prompt"] = {name: round(whole[name][1].stats.mean_accepted, 3) for name, _ in prompts}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    doc["rows"] = rows

    def write():
        if args.out:
            args.out.write_text(json.dumps(doc, indent=1) + "\n")

    write()  # the replay's rows, before the slower cut runs
    for n in [int(x) for x in args.run_cut.split(",") if x]:
        got = engine_run(n)
        if any(got[name][1].tokens != whole[name][1].tokens for name, _ in prompts):
            raise SystemExit(f"N {n}: the output differs from the whole head's")
        measured = [k for name, _ in prompts for k in got[name][1].stats.accepted_lengths]
        row = next(r for r in rows if r["n"] == n and r["kept_by"] == "lowest ids")
        row["measured_al"] = round(sum(measured) / len(measured), 3)
        row["measured_al_by_prompt"] = {name: round(got[name][1].stats.mean_accepted, 3) for name, _ in prompts}
        print(json.dumps(row), file=sys.stderr, flush=True)
        write()
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
