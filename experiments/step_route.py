#!/usr/bin/env python3
"""The files a decoding step's sequences go through (issue 68's measure): every call
inside one `decoding.step` that is handed a Sequence (or a list of them) as an argument,
in call order, by the file its function is in; the Sequence's own methods and properties
(its fields' readers) left out, runs of one file collapsed into one visit. Per proposer
kind on the bundled demo pair (draft-simple's small model: the demo target itself), over
a short generation, greedy but for one sampled chain: the longest route of any step (most
visits, then most calls), its visits, its distinct files and how often it came back to a
file it had left.

    .venv/bin/python experiments/step_route.py --out results/step-route-DATE.json
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

from dflash_gguf.decoding import step as decoding
from dflash_gguf.bench.provenance import results_doc, write_results
from dflash_gguf.runtime.demo import DEMO_PROMPT, demo_paths
from dflash_gguf.engine.engine import Engine
from dflash_gguf.decoding.sampling import SamplingParams

PACKAGE = os.path.dirname(decoding.__file__)
KINDS = {  # label: (Engine options, the drafter: the demo drafter, none, or the target itself
    # as draft-simple's small model, the demo pair having none of its own)
    "plain": ({}, None),
    "dflash chain (fused)": ({}, "draft"),
    "dflash chain, sampled": ({"temperature": 0.8}, "draft"),
    "dflash tree": ({"tree_budget": 8}, "draft"),
    "auto": ({"tree_budget": "auto"}, "draft"),
    "ngram-simple": ({"spec_type": "ngram-simple"}, None),
    "suffix": ({"spec_type": "suffix"}, None),
    "draft-dflash,suffix": ({"spec_type": "draft-dflash,suffix"}, "draft"),
    "draft-simple": ({"spec_type": "draft-simple"}, "target"),
    "draft-simple, auto": ({"spec_type": "draft-simple", "tree_budget": "auto"}, "target"),
    "draft-simple,suffix": ({"spec_type": "draft-simple,suffix"}, "target"),
}


def handed_a_sequence(value) -> bool:
    if isinstance(value, decoding.Sequence):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], decoding.Sequence)


def routes(options: dict, drafter: Optional[str], n: int) -> list:
    """Each step's route: [[file, function, ...], ...] in call order."""
    target, draft = demo_paths()
    steps, step = [], decoding.step

    def traced(*args, **kwargs):
        route = []

        def profile(frame, event, arg):
            code = frame.f_code
            if event != "call" or not code.co_filename.startswith(PACKAGE) or code.co_qualname.startswith("Sequence."):
                return
            if any(handed_a_sequence(frame.f_locals.get(a)) for a in code.co_varnames[:code.co_argcount]):
                name = os.path.relpath(code.co_filename, PACKAGE)
                if route and route[-1][0] == name:
                    route[-1].append(code.co_name)
                else:
                    route.append([name, code.co_name])

        sys.setprofile(profile)
        try:
            return step(*args, **kwargs)
        finally:
            sys.setprofile(None)
            steps.append(route)

    decoding.step = traced
    try:
        sampling = options.pop("temperature", None)
        with Engine(target, {"draft": draft, "target": target, None: None}[drafter], **options) as engine:
            engine.generate(DEMO_PROMPT, n, stop_tokens=(),
                            sampling=SamplingParams(temperature=sampling, seed=1) if sampling else None)
    finally:
        decoding.step = step
    return steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("-n", type=int, default=24, help="tokens generated per kind (default 24)")
    args = p.parse_args(argv)
    doc = results_doc("step_route", sys.argv, rows=[])
    for label, (options, drafter) in KINDS.items():
        # the step of most visits, of most calls among those
        longest = max(routes(dict(options), drafter, args.n), key=lambda r: (len(r), sum(map(len, r))))
        files = [visit[0] for visit in longest]
        row = {"kind": label, "visits": len(files), "files": len(set(files)),
               "came_back": len(files) - len(set(files)),
               "route": [f"{v[0]}({','.join(dict.fromkeys(v[1:]))})" for v in longest]}
        doc["rows"].append(row)
        print(f"{label}: {row['visits']} visits, {row['files']} files, came back {row['came_back']}\n    "
              + " > ".join(row["route"]), flush=True)
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
