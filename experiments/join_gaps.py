#!/usr/bin/env python3
"""The running streams' inter-token gap while a long prompt joins them (dflash-server -np):
a Batch of `--running` streams decoding (chains of the drafter, or --no-spec), then a
prompt of --prompt-tokens tokens joining in the last slot, as many times as
--admissions, each a fresh prompt computed whole. Per install it reports the gaps
between the running streams' tokens (each round gives every stream its tokens, so a
gap is a round) at a steady state and while each prompt goes in, as p50 and p99, and
the prompt's prefill throughput beside the running decodes.

With --before and --after (two installs' interpreters) the installs take turns, each
round running before, after, after, before, as experiments/install_ab.py does; an install
whose Batch has no -b runs with its own rounds. Time it on an idle machine.

    .venv/bin/python experiments/join_gaps.py --before OLD/.venv/bin/python --after .venv/bin/python \
        --rounds 3 --out results/join-gaps-<date>.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TEXT = ("The cat sat on the mat. The dog sat on the log. The cat sat on the mat. "
        "The dog sat on the log. The cat sat on the mat. The dog sat")


def measure(args) -> dict:
    """One install's run in this process: the gaps and prefill throughputs of every admission."""
    from dflash_gguf.engine.engine import Engine
    from dflash_gguf.decoding.requests import Request

    target, draft = args.model, args.model_draft
    if target is None:
        from dflash_gguf.runtime.demo import demo_paths

        target, draft = map(str, demo_paths())
    n_slots = args.running + 1
    with Engine(target, None if args.no_spec else draft, n_ctx=args.prompt_tokens + 256, n_ubatch=args.ubatch_size,
                n_seq=n_slots, n_threads=args.threads) as engine:
        has_b = "n_batch" in inspect.signature(engine.batch).parameters
        batch = engine.batch(args.batch_size) if has_b else engine.batch()
        prompt = engine.encode(TEXT)
        streams = [engine.sequence(Request(prompt, 1500, stop_tokens=()), slot=i) for i in range(args.running)]
        for seq in streams:
            batch.add(seq)
        while len(batch.active) < args.running:
            batch.advance()

        def round_ms() -> float:
            t0 = time.perf_counter()
            got = {id(seq) for seq, new in batch.advance() if new}
            missing = [s.slot for s in streams if id(s) not in got]
            if missing:
                raise SystemExit(f"running streams {missing} emitted nothing in a round")
            return (time.perf_counter() - t0) * 1e3

        steady = [round_ms() for _ in range(args.steady_rounds)]
        rng = np.random.default_rng(args.seed)
        admissions = []
        for _ in range(args.admissions):
            tokens = rng.integers(100, engine.target.n_vocab - 100, args.prompt_tokens).tolist()
            joining = engine.sequence(Request(tokens, 1, stop_tokens=(), reuse_prefix=False), slot=args.running,
                                      speculative=False)
            batch.add(joining)
            t0, gaps = time.perf_counter(), []
            while not joining.stats.generated_tokens:
                gaps.append(round_ms())
            seconds = time.perf_counter() - t0
            admissions.append({"gaps_ms": gaps, "prefill_seconds": seconds,
                               "prefill_tok_s": args.prompt_tokens / seconds})
            while len(batch) > args.running:  # it leaves once its one token is out
                batch.advance()
        return {"batch_size": args.batch_size if has_b else None, "steady_gaps_ms": steady, "admissions": admissions}


def pct(values, q) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summary(runs) -> dict:
    gaps = [g for r in runs for a in r["admissions"] for g in a["gaps_ms"]]
    steady = [g for r in runs for g in r["steady_gaps_ms"]]
    return {"admission_gap_ms_p50": pct(gaps, 50), "admission_gap_ms_p99": pct(gaps, 99),
            "steady_gap_ms_p50": pct(steady, 50), "steady_gap_ms_p99": pct(steady, 99),
            "prefill_tok_s_median": statistics.median(a["prefill_tok_s"] for r in runs for a in r["admissions"]),
            "rounds_per_admission_median": statistics.median(len(a["gaps_ms"]) for r in runs
                                                             for a in r["admissions"]),
            "n_gaps": len(gaps)}


CHILD_FLAGS = ("model", "model_draft", "running", "prompt_tokens", "admissions", "steady_rounds", "ubatch_size",
               "batch_size", "threads", "seed")


def child(python: str, args) -> dict:
    argv = ["--child"]
    for name in CHILD_FLAGS:
        value = getattr(args, name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    if args.no_spec:
        argv.append("--no-spec")
    with tempfile.TemporaryDirectory() as tmp:
        # run outside the checkout, so that the install's package is the one imported
        out = subprocess.run([python, str(Path(__file__).resolve()), *argv], check=True, cwd=tmp,
                             capture_output=True, text=True).stdout
    return json.loads(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", help="target GGUF (default: the bundled demo pair)")
    p.add_argument("-md", "--model-draft", help="its drafter")
    p.add_argument("--no-spec", action="store_true", help="the running streams decode plainly")
    p.add_argument("--running", type=int, default=3, help="streams decoding while the prompt joins (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=4096, help="the joining prompt's length (default 4096)")
    p.add_argument("--admissions", type=int, default=3, help="prompts joining one after another (default 3)")
    p.add_argument("--steady-rounds", type=int, default=20, help="rounds timed before any joins (default 20)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("-b", "--batch-size", type=int, help="tokens a round (default: -ub)")
    p.add_argument("-t", "--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--before", help="an install's interpreter to compare (with --after)")
    p.add_argument("--after", help="the other install's interpreter (default: this one)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of the installs taking turns (default 1)")
    p.add_argument("--out", type=Path, help="results JSON")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    from dflash_gguf.bench.provenance import load_average, results_doc, write_results

    after = ("after", args.after or sys.executable)
    order = [("before", args.before), after, after, ("before", args.before)] if args.before else [after]
    runs = []
    for r in range(args.rounds):
        for side, python in order:
            load = load_average()
            run = child(python, args)
            runs.append({"round": r, "side": side, "load_1m_at_start": load, **run})
            s = summary([run])
            print(f"round {r} {side}: gap p50 {s['admission_gap_ms_p50']:.1f} ms, p99 "
                  f"{s['admission_gap_ms_p99']:.1f} ms while joining (steady {s['steady_gap_ms_p50']:.1f}); "
                  f"prefill {s['prefill_tok_s_median']:.0f} tok/s", flush=True)
    table = {side: summary([r for r in runs if r["side"] == side]) for side in dict.fromkeys(s for s, _ in order)}
    for side, s in table.items():
        print(f"{side}: {json.dumps(s)}")
    if args.out:
        write_results(args.out, results_doc("experiments/join_gaps.py", sys.argv[1:] if argv is None else argv,
                                            table=table, runs=runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
