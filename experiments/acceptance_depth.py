#!/usr/bin/env python3
"""Drafters' acceptance against depth (issue 86 item 4): how many tokens a target pass
yields as the context before a request grows from nothing to 32K tokens.

Each probe is the same passage (a held-out standard-library file's first tokens) put
after a filler of D tokens (the standard library's [t-z]*.py, file by file), so that
only the depth changes from row to row, not what is continued. At every depth the
target (the published Qwen2.5-Coder 1.5B) continues each probe greedily for -n tokens,
one row a pass (its plain decoding); then

  - the weightless kinds (suffix, ngram-simple, ngram-mod) are replayed over that
    continuation as they draft while decoding (experiments/weightless_replay.py's
    replay: the same proposers, drafts walked against the known greedy text, trees priced
    by this machine's verify cost table by depth);
  - draft-simple (the published 0.5B, llama.cpp's 3 drafts) is replayed from the
    drafter's own greedy choices over filler, probe and continuation
    (draft_simple.chain_lengths: each step's chain, as the engine's loop runs it);
  - with --demo, the demo pair's DFlash drafter runs for real (Engine.generate) at
    depths up to its 4K context, at each --draft-window (0: the whole context).

The filler is shared: each depth extends the last, and a probe's rows are dropped again
(seq_truncate) before the next, so the longest depth is filled once. Depths are whole
512-token chunks, so the target fills its context in the chunks the engine would (a
prompt's rows past 256 a pass round by the pass: another chunking could part near a tie):
the continuation is the engine's plain reply, and the draft-simple replay gives the
engine's own accepted lengths step for step (checked at 512). Acceptance does not
depend on the machine's speed: this is not a timed run.

    .venv/bin/python experiments/acceptance_depth.py --depths 0,2048,8192,16384,31744 -n 64 \\
        --out results/acceptance-depth-DATE.json [--demo --windows 0,256,1024] [--plot docs/acceptance-depth.svg] \
        [--cost-from results/weightless-replay-qwen2.5-coder-1.5b-2026-11-29-depth-priced.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weightless_replay import proposer_of, replay  # noqa: E402  (a sibling script: the same replay)

from dflash_gguf import Engine  # noqa: E402
from dflash_gguf.bench.provenance import load_average, machine, results_doc, versions, write_results  # noqa: E402
from dflash_gguf.runtime.demo import demo_paths  # noqa: E402
from dflash_gguf.runtime.target import LOGITS_ALL, LOGITS_NONE, Target, TargetConfig  # noqa: E402
from dflash_gguf.speculation.draft_simple import chain_lengths  # noqa: E402
from dflash_gguf.speculation.kinds import parse_spec_types  # noqa: E402
from dflash_gguf.speculation.kinds.drafters import DEFAULT_SIMPLE_N_MAX  # noqa: E402
from dflash_gguf.speculation.verify_cost import CostTable  # noqa: E402
from dflash_gguf.tools import real_models  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
WEIGHTLESS_ARMS = ("suffix", "ngram-simple", "ngram-mod")


def stdlib_tokens(encode, pattern: str, n_tokens: int) -> tuple[list, list]:
    """At least n_tokens of the standard library's files matching pattern, in name order."""
    files, ids = [], []
    for f in sorted(STDLIB.glob(pattern)):
        files.append(f.name)
        ids += encode(f.read_text(encoding="utf-8"))
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens], files


def probes(encode, n: int, size: int) -> list:
    """n probes of `size` tokens: the first tokens of held-out files (the [p-s] modules,
    which the filler does not hold), one a file, each at least size tokens long."""
    out = []
    for f in sorted(STDLIB.glob("[p-s]*.py")):
        ids = encode(f.read_text(encoding="utf-8"))
        if len(ids) >= size:
            out.append((f.name, ids[:size]))
        if len(out) == n:
            return out
    raise SystemExit(f"fewer than {n} standard-library files of {size} tokens")


def greedy(target: Target, prompt_tail: list, n: int) -> list:
    """The target's plain greedy continuation of its context plus prompt_tail, one row a
    pass; the context is left holding the prompt and the continuation."""
    target.prefill(prompt_tail)
    out = [int(target.choices(0, 1)[0])]
    while len(out) < n:
        target.decode([out[-1]])
        out.append(int(target.choices(0, 1)[0]))
    return out


def drafter_choices(drafter: Target, rows: list) -> np.ndarray:
    """The drafter's greedy choice at each of rows appended to its context (every row's)."""
    got = []
    for start in range(0, len(rows), drafter.n_ubatch):
        chunk = rows[start:start + drafter.n_ubatch]
        drafter.decode(chunk, LOGITS_ALL)
        got.append(drafter.choices(0, len(chunk)))
    return np.concatenate(got)


def al(lengths: list) -> float:
    return sum(lengths) / max(len(lengths), 1)


def real_rows(args, doc: dict) -> None:
    """The target's continuations at every depth, and the replayed kinds over them."""
    target_path, simple_path = real_models.path(args.model), real_models.path(args.simple)
    n_ctx = max(args.depths) + args.probe_tokens + args.n + 64
    with Engine(str(target_path), spec_type="suffix", n_ctx=2048, n_threads=args.threads) as engine:
        if args.cost_from:  # a table timed on an idle machine: this run's trees sized as that run's
            cost = CostTable.from_record(json.loads(args.cost_from.read_text())["verify_cost_s"])
            doc["verify_cost_note"] = f"the table {args.cost_from} recorded"
        else:
            engine.prepare_auto()  # this build's verify cost table by depth (cached per build)
            cost = engine.choice.verify_cost
        encode = engine.encode
        filler, files = stdlib_tokens(encode, "[t-z]*.py", max(args.depths))
        passages = probes(encode, args.probes, args.probe_tokens)
    doc["verify_cost_s"] = cost.record()
    doc["filler"] = {"files": files, "tokens": len(filler)}
    doc["probes"] = [name for name, _ in passages]
    config = TargetConfig(n_ctx=n_ctx, n_threads=args.threads)
    target, drafter = Target(str(target_path), config), Target(str(simple_path), config)
    arms = [parse_spec_types(a) for a in args.arms]
    held = 0  # filler tokens both contexts hold
    try:
        for depth in sorted(args.depths):
            t0 = time.time()
            for model in (target, drafter):
                model.prefill(filler[held:depth], LOGITS_NONE)
            held = depth
            fill_s = time.time() - t0
            for name, probe in passages:
                prompt = filler[:depth] + probe
                out = greedy(target, probe, args.n)
                target.seq_truncate(0, depth)
                full = prompt + out
                # the drafter's choice at every row from the prompt's last on (earlier rows draft nothing)
                drafter.prefill(probe[:-1], LOGITS_NONE)
                tail = drafter_choices(drafter, full[len(prompt) - 1:-1])
                drafter.seq_truncate(0, depth)
                choice = np.concatenate([np.full(len(prompt) - 1, -1, np.int32), tail])
                lengths = chain_lengths(choice, len(prompt), full, DEFAULT_SIMPLE_N_MAX)
                rows = [{"drafter": "draft-simple", "passes": len(lengths), "al": round(al(lengths), 3)}]
                for kinds in arms:
                    got = replay(proposer_of(kinds, cost, args.spec_draft_n_max), [(prompt, out)], cost)
                    rows.append({"drafter": ",".join(kinds), "passes": got["passes"], "drafted": got["drafted"],
                                 "accepted": got["accepted"],
                                 "al": round((got["accepted"] + got["passes"]) / got["passes"], 3)})
                for row in rows:
                    doc["rows"].append({"target": args.model, "depth": depth, "probe": name, "tokens": args.n, **row})
                print(f"depth {depth:6} {name:18} " + "  ".join(f"{r['drafter']} {r['al']:.2f}" for r in rows)
                      + f"  (fill {fill_s:.0f} s, {time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
                fill_s = 0.0
            write_results(args.out, doc)
    finally:
        target.close()
        drafter.close()


def demo_rows(args, doc: dict) -> None:
    """The demo pair's DFlash drafter, run, at each window and depth within its context."""
    target, draft = demo_paths()
    for window in args.windows:
        with Engine(target, draft, n_ctx=4096, n_threads=args.threads, draft_window=window) as engine:
            filler, _ = stdlib_tokens(engine.encode, "[t-z]*.py", 4096)
            passages = probes(engine.encode, args.probes, args.probe_tokens)
            for depth in [d for d in sorted(args.demo_depths) if d + args.probe_tokens + args.n <= 4096]:
                for name, probe in passages:
                    r = engine.generate(filler[:depth] + probe, args.n, stop_tokens=())
                    lengths = r.stats.accepted_lengths
                    doc["rows"].append({"target": "demo", "drafter": "dflash", "window": window, "depth": depth,
                                        "probe": name, "tokens": args.n, "passes": len(lengths),
                                        "al": round(al(lengths), 3)})
                print(f"demo dflash window {window} depth {depth}: AL "
                      f"{al([r['al'] for r in doc['rows'] if r.get('window') == window and r['depth'] == depth]):.2f}",
                      file=sys.stderr, flush=True)
    write_results(args.out, doc)


def table(doc: dict) -> list:
    """Mean accepted length by (target, drafter, window, depth) over the probes."""
    cells = {}
    for r in doc["rows"]:
        cells.setdefault((r["target"], r["drafter"], r.get("window"), r["depth"]), []).append(r["al"])
    return [{"target": t, "drafter": d, "window": w, "depth": depth, "al": round(float(np.mean(v)), 3),
             "al_min": min(v), "al_max": max(v), "probes": len(v)}
            for (t, d, w, depth), v in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0, kv[0][3]))]


def plot(docs: list, path: Path) -> None:
    """The tables of one or more results files (a real-model run, a --demo-only run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    lines, model = {}, next(d["settings"]["model"] for d in docs)
    for row in (r for d in docs for r in d.get("table") or table(d)):
        label = row["drafter"] + (f", window {row['window'] or 'whole'}" if row["window"] is not None else "")
        # a depth two files measured: the later file's (docs in the order given)
        lines.setdefault((row["target"], label), {})[row["depth"]] = row["al"]
    for (t, label), pts in lines.items():
        ax = axes[0] if t != "demo" else axes[1]
        xs, ys = zip(*sorted(pts.items()))
        ax.plot([max(x, 1) for x in xs], ys, marker="o", label=label)
    for ax, title in zip(axes, (f"{model}: replayed over its greedy text",
                                "demo pair: DFlash run")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens of context before the probe")
        ax.set_ylabel("tokens per target pass")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    ints = lambda v: [int(x) for x in v.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b", help="a real_models name")
    p.add_argument("--simple", default="qwen2.5-coder-0.5b", help="draft-simple's drafter, a real_models name")
    p.add_argument("--depths", type=ints, default=[0, 2048, 8192, 16384, 31744])
    p.add_argument("--arm", dest="arms", action="append", default=None,
                   help=f"a weightless --spec-type replayed (repeat; default {', '.join(WEIGHTLESS_ARMS)})")
    p.add_argument("--probes", type=int, default=4)
    p.add_argument("--probe-tokens", type=int, default=384)
    p.add_argument("-n", type=int, default=64, help="tokens each probe is continued for")
    p.add_argument("--spec-draft-n-max", type=int, default=48)
    p.add_argument("--cost-from", type=Path, help="size suffix trees by the verify cost table this earlier results "
                   "file recorded (default: this build's, measured once and cached)")
    p.add_argument("--demo", action="store_true", help="also the demo pair's DFlash drafter, run")
    p.add_argument("--demo-only", action="store_true", help="only the demo pair")
    p.add_argument("--demo-depths", type=ints, default=[0, 512, 1024, 2048, 3584])
    p.add_argument("--windows", type=ints, default=[0, 256, 1024], help="the demo drafter's --draft-window values")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--plot", type=Path, help="draw the table to this file (svg or png)")
    p.add_argument("--plot-from", type=Path, nargs="+", help="only draw: earlier results files")
    args = p.parse_args(argv)
    if args.plot_from:
        plot([json.loads(f.read_text()) for f in args.plot_from], args.plot)
        return 0
    args.arms = args.arms or list(WEIGHTLESS_ARMS)
    if any(d % 512 for d in args.depths):
        p.error("--depths must be whole 512-token chunks (the engine's prompt chunks)")
    doc = results_doc("experiments/acceptance_depth.py", sys.argv[1:] if argv is None else argv,
                      machine=machine(args.threads, "CPU"), versions=versions(),
                      load_average={"start": load_average()},  # counts, not times: a busy machine changes none
                      settings={"model": args.model, "simple": args.simple, "depths": args.depths, "arms": args.arms,
                                "probes": args.probes, "probe_tokens": args.probe_tokens, "n": args.n,
                                "spec_draft_n_max": args.spec_draft_n_max, "simple_n_max": DEFAULT_SIMPLE_N_MAX,
                                "demo_depths": args.demo_depths if args.demo or args.demo_only else None,
                                "windows": args.windows if args.demo or args.demo_only else None},
                      rows=[])
    if not args.demo_only:
        real_rows(args, doc)
    if args.demo or args.demo_only:
        demo_rows(args, doc)
    doc["table"] = table(doc)
    write_results(args.out, doc)
    for row in doc["table"]:
        print(json.dumps(row))
    if args.plot:
        plot([doc], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
