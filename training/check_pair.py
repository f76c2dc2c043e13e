"""The check at the end of train_demo.py: the converted pair through the dflash_gguf
runtime, speculative (chain) against plain greedy decoding on the prompts it reads (a
JSON list of strings on stdin); prints one JSON list of rows (prompt, mean accepted
length, accepted lengths, lossless, text).

    python training/check_pair.py TARGET.gguf DRAFT.gguf N_TOKENS THREADS < prompts.json
"""
import json
import sys

from dflash_gguf.decoding.step import Sequence, sequence_steps
from dflash_gguf.runtime.drafter import Draft, read_draft_metadata
from dflash_gguf.decoding.requests import GenerationStats, Request, collect
from dflash_gguf.speculation.proposers import PlainProposer
from dflash_gguf.speculation.drafting import chain_proposer
from dflash_gguf.runtime.target import Target, TargetConfig
from dflash_gguf.runtime.tokenizer import Tokenizer


def decoded(target: Target, draft, proposer, prompt: list, n: int):
    """n greedy tokens after prompt with proposer's drafts (none: plain decoding); (tokens, stats)."""
    stats = GenerationStats()
    return collect(sequence_steps(Sequence(target, draft, proposer, Request(prompt, n), stats))), stats


def main() -> None:
    target_path, draft_path, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    prompts = json.loads(sys.stdin.read())
    meta = read_draft_metadata(draft_path)
    target = Target(target_path, TargetConfig(n_ctx=2048, n_verify=meta["block_size"],
                                              feature_layers=meta["target_layers"], n_threads=threads))
    draft = Draft(draft_path, target)
    tok = Tokenizer(target_path)
    rows = []
    for p in prompts:
        ids = tok.encode(p)
        out, stats = decoded(target, draft, chain_proposer(target, draft, None, None), ids, n)
        plain, _ = decoded(target, None, PlainProposer(), ids, n)
        rows.append({"prompt": p, "mean_accepted": stats.mean_accepted, "accepted_lengths": stats.accepted_lengths,
                     "lossless": out == plain, "text": tok.decode(out)})
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
