"""A worker of train_demo.generate_onpolicy: the converted target's own greedy
continuations, by the dflash_gguf runtime, of the prompts it reads (one JSON list of
token ids per line on stdin), each written back (prompt + continuation, `total` tokens in
all) as one JSON line on stdout.

    python training/onpolicy_worker.py TARGET.gguf TOTAL < prompts.jsonl
"""
import json
import sys

from dflash_gguf.decoding.step import Sequence, sequence_steps
from dflash_gguf.decoding.requests import GenerationStats, Request, collect
from dflash_gguf.speculation.proposers import PlainProposer
from dflash_gguf.runtime.target import Target, TargetConfig


def main() -> None:
    path, total = sys.argv[1], int(sys.argv[2])
    target = Target(path, TargetConfig(n_ctx=total + 16, n_threads=1))
    for line in sys.stdin:
        prompt = json.loads(line)
        request = Request(prompt, total - len(prompt))
        out = collect(sequence_steps(Sequence(target, None, PlainProposer(), request, GenerationStats())))
        print(json.dumps(prompt + out), flush=True)


if __name__ == "__main__":
    main()
