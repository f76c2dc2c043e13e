#!/usr/bin/env python3
"""The whole exactness matrix on the published models, results on file (CI runs a subset:
tests/runtime/test_near_ties.py, tests/drafters/test_real_exactness.py):

- rows: each model (the Qwen2.5-Coder 1.5B and 0.5B, Gemma 3 270M) teacher-forced over
  --positions tokens of real text (standard-library code, docstrings and prose, numbered
  lists); every row of every mode of dflash_gguf.tools.invariance.hunt compared bit for bit with
  one-row decoding, and the smallest top-2 gaps covered;
- e2e (--e2e): the 32 tie-prone prompts x --n-new tokens, every speculative mode
  (dflash_gguf.tools.invariance.E2E_MODES) of the real pair and of Gemma 3 270M drafting for
  itself, each with an untrained DFlash drafter too, against plain decoding, token for token.

    .venv/bin/python experiments/near_tie_hunt.py --out results/near-tie-hunt-DATE.json [--e2e]

The parts can run apart (--no-rows, --e2e-targets, --e2e-modes), one results file each; the
file is written again after every model and mode, so a stopped run keeps what it finished,
and the e2e outputs after every prompt (OUT.progress.json): started again with the same
arguments, a stopped run goes on from the prompt it was in.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import time
from pathlib import Path

from dflash_gguf.tools import invariance
from dflash_gguf.tools import real_models
from dflash_gguf.bench.provenance import load_average, machine, results_doc, versions, write_results
from dflash_gguf.runtime.target import Target, TargetConfig
from dflash_gguf.runtime.tokenizer import Tokenizer

MODELS = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma-3-270m")
# e2e: each target with its small drafter (Gemma 3 270M drafts for itself)
E2E_PAIRS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b", "gemma-3-270m": "gemma-3-270m"}


def corpus() -> str:
    """Real text of every kind the hunt wants: code, docstrings, prose paragraphs, lists."""
    import argparse as a
    import textwrap
    import string

    lists = "\n".join(f"{i}. {w}" for i, w in enumerate(
        "Choose a quiet room. Open the windows. Make a list of chores. Sort the laundry. Water the plants. "
        "Call a friend. Read a chapter. Cook a soup. Clean the kitchen. Plan the week.".split(". "), 1))
    return inspect.getsource(textwrap) + "\n" + lists + "\n" + inspect.getsource(a) + inspect.getsource(string)


def hunt_rows(args, log, rows: list, save) -> None:
    for name in args.models:
        path = str(real_models.path(name))
        tok = Tokenizer(path)
        ids = tok.encode(corpus(), add_bos=False)
        prompt, text, side = ids[:256], ids[256:256 + args.positions], ids[-2000:]
        t0 = time.perf_counter()
        # each slot holds the prompt and the text, or the other sequence's span and a chunk past it
        n_ctx = max(256 + args.positions, invariance.SIDE_SPAN + invariance.CHUNK) + 64
        cfg = TargetConfig(n_ctx=n_ctx, n_ubatch=128, n_verify=16, n_seq=2, n_threads=args.threads,
                           device=args.device)
        with Target(path, cfg) as target:
            got = invariance.hunt(target, prompt, text, side, modes=args.row_modes,
                                  on_mode=lambda r: log(f"{name} {r.mode}: {r.compared} rows, "
                                                        f"{len(r.differing)} differ"))
        rows.append({"model": name, "positions": got["positions"], "seconds": round(time.perf_counter() - t0, 1),
                     "smallest_top2_gaps": got["smallest_gaps"],
                     "gaps_below": {str(t): int((got["gaps"] < t).sum()) for t in (1e-3, 1e-2, 0.05, 0.1)},
                     "modes": [{"mode": r.mode, "rows": r.compared, "differing": len(r.differing),
                                "first_differing": r.differing[:10]} for r in got["modes"]],
                     "load_average": load_average()})
        save()


class Progress:
    """The e2e outputs had so far, per prompt, beside the results file (OUT.progress.json,
    which git ignores): a run stopped inside a mode (the 1.5B's DFlash modes take hours on
    two cores) goes on from them when started again with the same arguments, and the
    results file then lists every run that contributed (its checkout and date)."""

    def __init__(self, out: Path, args, run: dict):
        self.path = out.with_name(out.stem + ".progress.json")
        self.key = {"n_new": args.n_new, "prompts": invariance.TIE_PRONE_PROMPTS}
        self.data = {"key": self.key, "outputs": {}, "seconds": {}, "runs": []}
        if self.path.is_file():
            had = json.loads(self.path.read_text())
            if had.get("key") == self.key:
                self.data = had
        self.data["runs"].append(run)
        self.t0 = time.perf_counter()

    def known(self, part: str) -> dict:
        return {int(i): tokens for i, tokens in self.data["outputs"].get(part, {}).items()}

    def told(self, part: str):
        def on_output(i: int, tokens: list) -> None:
            self.data["outputs"].setdefault(part, {})[str(i)] = list(tokens)
            now = time.perf_counter()
            self.data["seconds"][part] = round(self.data["seconds"].get(part, 0.0) + now - self.t0, 1)
            self.t0 = now
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data))
            tmp.replace(self.path)  # whole or not at all
        return on_output

    def seconds(self, part: str) -> float:
        return self.data["seconds"].get(part, 0.0)


def e2e_rows(args, log, rows: list, save, progress: Progress) -> None:
    prompts = invariance.TIE_PRONE_PROMPTS
    for name in args.e2e_targets:
        small = E2E_PAIRS[name]
        target = str(real_models.path(name))
        with tempfile.TemporaryDirectory() as tmp:
            drafters = {"small": str(real_models.path(small)),
                        "dflash": invariance.untrained_dflash(target, str(Path(tmp) / "untrained.gguf"))}
            plain = invariance.plain_outputs(target, prompts, args.n_new, known=progress.known(f"{name} plain"),
                                             on_output=progress.told(f"{name} plain"))
            for mode in args.e2e_modes:
                part = f"{name} {mode}"
                got = invariance.mode_outputs(mode, target, drafters, prompts, args.n_new, known=progress.known(part),
                                              on_output=progress.told(part))
                parted = [{"prompt": p, "token": next((i for i, (a, b) in enumerate(zip(w, o)) if a != b),
                                                      min(len(w), len(o)))}
                          for p, w, o in zip(prompts, plain, got) if w != o]
                log(f"e2e {name} {mode}: {len(prompts) - len(parted)} of {len(prompts)} equal to plain")
                rows.append({"target": name, "small": small, "mode": mode, "prompts": len(prompts),
                             "n_new": args.n_new, "equal": len(prompts) - len(parted), "parted": parted,
                             "seconds": progress.seconds(part), "load_average": load_average()})
                save()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="results file (JSON)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--positions", type=int, default=2048, help="teacher-forced positions per model (default 2048)")
    p.add_argument("--no-rows", dest="rows", action="store_false", help="leave out the teacher-forced rows")
    p.add_argument("--row-modes", nargs="+", default=list(invariance.MODES), choices=list(invariance.MODES),
                   help="the rows' modes (default: all)")
    p.add_argument("--e2e", action="store_true", help="also the 32 prompts x every mode of the real pair")
    p.add_argument("--e2e-targets", nargs="+", default=list(E2E_PAIRS), choices=list(E2E_PAIRS))
    p.add_argument("--e2e-modes", nargs="+", default=list(invariance.E2E_MODES), choices=list(invariance.E2E_MODES))
    p.add_argument("--n-new", type=int, default=256, help="tokens per e2e prompt (default 256)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--device", default=None,
                   help="the rows' device (Vulkan0, CUDA0; default: the runtime's choice); the e2e part runs on the CPU")
    args = p.parse_args(argv)
    if args.device and args.e2e:
        p.error("--device is for the teacher-forced rows; the e2e part runs on the CPU")
    if not args.rows and not args.e2e:
        p.error("nothing to run: --no-rows without --e2e")

    def log(msg: str) -> None:
        print(f"[near-tie-hunt] {msg}", file=sys.stderr, flush=True)

    doc = results_doc("near_tie_hunt", sys.argv, machine=machine(args.threads, args.device or "CPU"), versions=versions(),
                      rows=[])
    if args.e2e:
        doc["e2e"] = []
        progress = Progress(args.out, args, {"checkout": doc["checkout"], "date": doc["date"]})
        doc["e2e_runs"] = progress.data["runs"]  # every run whose outputs the rows use

    def save() -> None:
        write_results(args.out, doc)

    if args.rows:
        hunt_rows(args, log, doc["rows"], save)
    if args.e2e:
        e2e_rows(args, log, doc["e2e"], save, progress)
    save()
    bad = [r for r in doc["rows"] if any(m["differing"] for m in r["modes"])] + \
          [r for r in doc.get("e2e", []) if r["parted"]]
    log(f"results in {args.out}; {'all equal' if not bad else f'{len(bad)} rows with differences'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
