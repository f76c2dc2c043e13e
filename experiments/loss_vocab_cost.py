#!/usr/bin/env python3
"""What dflash-train's --loss-vocab costs in acceptance: two runs on the bundled demo target
with one seed, data and step budget, the loss over the whole head (--loss-vocab 0) and over
the data's N most frequent tokens (default 1024 of its 4096: the share 32,768 is of Qwen's
151,936), each drafter's held-out AL measured by the run's own probe at its end.

    .venv/bin/python experiments/loss_vocab_cost.py [--keep 1024] [--steps 300] [--data-glob '[a-c]*.py'] [-t 2] [--out PATH]

Step-budgeted and seeded: the result does not depend on the machine's speed or load.
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
import sysconfig
import tempfile
from pathlib import Path

from dflash_gguf.bench import provenance
from dflash_gguf.runtime.demo import demo_paths
from dflash_gguf.train import TrainOptions, train


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keep", type=int, default=1024, help="the kept vocabulary of the cut run")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--data-glob", default="[a-c]*.py", help="the standard library's modules to train on (default [a-c]*.py)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="default results/loss-vocab-cost-DATE.json")
    a = p.parse_args(argv)
    target = demo_paths()[0]
    out = a.out or Path("results") / f"loss-vocab-cost-{dt.date.today()}.json"
    data = sorted(str(f) for f in Path(sysconfig.get_paths()["stdlib"]).glob(a.data_glob))
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, keep in (("whole head", 0), (f"kept {a.keep}", a.keep)):
            opts = TrainOptions.from_flags(model=target, data=data, output=str(Path(tmp) / f"d{keep}.gguf"), seed=0,
                                           steps=a.steps, threads=a.threads, block_size=8, target_layer_ids=[0, 1, 2],
                                           ctx_size=256, batch=8, loss_vocab=keep, eval_every=0, regenerate=True,
                                           progress=False)
            r = train(opts)
            runs[label] = {"loss_vocab": keep, "heldout_al": r["heldout_al"], "acceptance": r["acceptance"],
                           "final_loss": r["curve"][-1]["loss"], "minutes": r["minutes"]}
            print(f"{label}: held-out AL {r['heldout_al']:.3f} after {r['steps']} steps ({r['minutes']:.1f} min)",
                  file=sys.stderr, flush=True)
    whole, cut = runs["whole head"]["heldout_al"], runs[f"kept {a.keep}"]["heldout_al"]
    doc = provenance.results_doc("experiments/loss_vocab_cost.py", sys.argv[1:] if argv is None else argv,
                                 models={"target": target}, steps=a.steps, runs=runs, al_ratio_cut_vs_whole=cut / whole)
    path = provenance.write_results(out, doc)
    print(f"kept {a.keep} / whole head: held-out AL {cut:.3f} / {whole:.3f} = {cut / whole:.3f}; results: {path or out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
