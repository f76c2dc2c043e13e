#!/usr/bin/env python3
"""Per-step cost of our runtime and of llama.cpp's tools, in instructions (callgrind),
which a loaded machine does not move: one plain decoding step, one chain verify of k
tokens carrying the previous step's commit, one drafter propose (with its context rows).

Ours, one process under callgrind, dumps between phases (warm-up steps build graphs and
are left out; each phase's steps are counted together and divided):

    valgrind --tool=callgrind --callgrind-out-file=/tmp/sc.%p \\
        .venv/bin/python scripts/step_count.py ours TARGET.gguf [--draft DRAFT.gguf] --threads 1 > /tmp/sc.log
    .venv/bin/python scripts/step_count.py read /tmp/sc.<pid> /tmp/sc.log

llama.cpp, the same GGUF and threads, two runs of llama-bench per figure whose difference
is the cost of the extra steps (load and warm-up cancel):

    .venv/bin/python scripts/step_count.py llama TARGET.gguf --threads 1 [--k 1,8,16]

Every phase starts from a context of --prompt tokens. Instruction counts with one thread
are repeatable; with more, ggml's spinning workers add noise.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def dump(label: str) -> None:
    """A callgrind dump of everything since the previous one (no-op outside callgrind)."""
    if os.environ.get("STEP_COUNT_DUMPS") != "0":
        subprocess.run(["callgrind_control", "-d", str(os.getpid())], check=False, capture_output=True)
    print(f"@dump {label}", flush=True)


def run_ours(args) -> None:
    from dflash_gguf.draft import Draft, DraftConfig, read_draft_metadata
    from dflash_gguf.target import LOGITS_LAST, Target, TargetConfig

    ks = [int(x) for x in args.k.split(",")] if args.k else []
    layers = read_draft_metadata(args.draft)["target_layers"] if args.draft else ()
    n_verify = max(ks + [args.block or 8])
    t = Target(args.gguf, TargetConfig(n_ctx=args.prompt + (args.steps + args.warmup) * n_verify + 512,
                                       n_ubatch=64, n_verify=n_verify, n_threads=args.threads, kv_type="f16",
                                       feature_layers=layers))
    d = Draft(args.draft, t, DraftConfig(n_threads=args.threads)) if args.draft else None
    prompt = [(13 * i) % 900 + 5 for i in range(args.prompt)]
    rows = {}
    # a window with nothing in it: what a dump itself costs inside the process (the fork
    # of callgrind_control), taken off every counted window by `read`
    dump("pre")
    dump("overhead")

    def fresh():
        t.reset()
        if d is not None:
            d.reset()
        t.prefill(prompt, LOGITS_LAST, on_chunk=(lambda _s, n: d.append_rows(n)) if d is not None else None)

    def info_delta(before, after):
        return {k: (after[k] - before[k]) / args.steps for k in ("n_host_writes", "n_host_reads", "n_graphs")}

    def timed(name, step, who=t, setup=None):
        """args.warmup untimed steps, then args.steps counted ones (the dumps bracket them);
        step(rep) runs one, who's counters are read. setup(), when given, runs before every
        step outside the counted windows (then each step has its own pair of dumps)."""
        counts = {k: 0 for k in ("n_host_writes", "n_host_reads", "n_graphs")}
        for rep in range(args.warmup + args.steps):
            if setup is not None:
                setup()
            if rep >= args.warmup and (setup is not None or rep == args.warmup):
                i0 = who.info()
                dump("pre")
            step(rep)
            if rep >= args.warmup and (setup is not None or rep == args.warmup + args.steps - 1):
                dump(name)
                d = info_delta(i0, who.info())
                counts = {k: counts[k] + d[k] for k in counts}
        rows[name] = {"nodes": who.info()["n_last_nodes"], **counts}

    if "decode" in args.phases:
        fresh()
        last = [int(t.choices(0, 1)[0])]

        def decode_one(_rep):
            t.decode(last, LOGITS_LAST)
            last[0] = (int(t.choices(0, 1)[0]) + 1) % 900  # a varied input

        timed("decode", decode_one)
    for k in ks:
        fresh()
        tokens = [10 + (7 * i) % 900 for i in range(k)]

        def verify_k(_rep, tokens=tokens, k=k):
            t.verify(tokens)
            t.choices(0, k)
            t.commit(min(2, k))  # every verify carries a commit of the same size

        timed(f"verify{k}", verify_k)
    if "batch" in args.phases:
        # like llama-bench -p k: k tokens appended at a context of --prompt tokens, logits of
        # the last row only. llama-bench restores that context before each repetition (a
        # longer one would attend over more rows); here every counted batch follows an
        # uncounted one of the same k that ends the prompt (it rebuilds the graph a reset
        # drops), so each starts from the same --prompt tokens
        for k in ks:
            if k > args.prompt:
                raise SystemExit(f"batch of {k} needs --prompt >= {k}")
            tokens = [10 + (7 * i) % 900 for i in range(k)]

            def at_depth(k=k):
                t.reset()
                t.prefill(prompt[:-k], LOGITS_LAST)
                t.decode(prompt[-k:], LOGITS_LAST)

            timed(f"batch{k}", lambda _rep, tokens=tokens: t.decode(tokens, LOGITS_LAST), setup=at_depth)
    if d is not None and "propose" in args.phases:
        fresh()
        B = args.block or d.block_size

        def propose(rep):
            d.propose(5 + rep % 50, B, read=False)
            d.block(B)
            # the target's verify is not counted: its features are the prefill's last rows
            d.append_rows(2, defer=True)

        timed("propose", propose, who=d)
        d.drop_pending()
    print("@rows " + json.dumps({"steps": args.steps, "rows": rows}), flush=True)


def callgrind_totals(prefix: str) -> list[int]:
    files = [f for f in Path(prefix).parent.glob(Path(prefix).name + ".*") if f.name.rsplit(".", 1)[1].isdigit()]
    files.sort(key=lambda f: int(f.name.rsplit(".", 1)[1]))
    out = []
    for f in files:
        m = re.search(r"^(?:summary|totals): (\d+)", f.read_text(errors="replace"), re.M)
        out.append(int(m.group(1)) if m else 0)
    return out


def read_ours(prefix: str, log: str) -> None:
    counts = callgrind_totals(prefix)
    lines = Path(log).read_text().splitlines()
    labels = [ln.split()[1] for ln in lines if ln.startswith("@dump")]
    meta = json.loads(next(ln for ln in lines if ln.startswith("@rows "))[6:])
    steps = meta["steps"]
    per_label, windows = {}, {}
    for label, c in zip(labels, counts):
        if label != "pre":
            per_label[label] = per_label.get(label, 0) + c
            windows[label] = windows.get(label, 0) + 1
    overhead = per_label.pop("overhead", 0)
    print(f"(a dump costs {overhead / 1e6:.3f} M instructions in the process; taken off each counted window)")
    print("| step | instructions per step | graph nodes | input writes | result reads |")
    print("|---|---:|---:|---:|---:|")
    for label, c in per_label.items():
        r = meta["rows"].get(label, {})
        c -= windows[label] * overhead
        print(f"| {label} | {c / steps / 1e6:.3f} M | {r.get('nodes', '')} | {r.get('n_host_writes', 0):.1f} | "
              f"{r.get('n_host_reads', 0):.1f} |")


def llama_bench_instructions(exe: Path, gguf: str, threads: int, extra: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", str(exe), "-m", gguf, "-t", str(threads),
               "-r", "1", "-fa", "1", "-ctk", "f16", "-ctv", "f16", *extra]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"llama-bench failed: {' '.join(cmd)}\n{res.stderr[-2000:]}")
        m = re.search(r"^(?:summary|totals): (\d+)", out.read_text(errors="replace"), re.M)
        return int(m.group(1))


def run_llama(args) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from llama_cpp_build import llama_binary

    exe = llama_binary("llama-bench")
    if exe is None:
        raise SystemExit("llama-bench is not built (scripts/llama_cpp_build.py llama-bench)")
    d = str(args.prompt)
    print("| step | instructions per step | runs |")
    print("|---|---:|---|")
    if "decode" in args.phases:
        lo, hi = args.steps, 3 * args.steps
        a = llama_bench_instructions(exe, args.gguf, args.threads, ["-d", d, "-p", "0", "-n", str(lo)])
        b = llama_bench_instructions(exe, args.gguf, args.threads, ["-d", d, "-p", "0", "-n", str(hi)])
        print(f"| decode | {(b - a) / (hi - lo) / 1e6:.3f} M | -n {lo} vs {hi} at depth {d} |", flush=True)
    for k in [int(x) for x in args.k.split(",")] if args.k else []:
        # every repetition restores the depth's state and runs the batch of k: the
        # difference of 1 and 3 repetitions is two of them
        a = llama_bench_instructions(exe, args.gguf, args.threads, ["-d", d, "-p", str(k), "-n", "0"])
        b = llama_bench_instructions(exe, args.gguf, args.threads, ["-d", d, "-p", str(k), "-n", "0", "-r", "3"])
        print(f"| batch{k} | {(b - a) / 2 / 1e6:.3f} M | -p {k} -r 1 vs 3 at depth {d} (state restore included) |",
              flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("ours", "llama"):
        s = sub.add_parser(name)
        s.add_argument("gguf")
        s.add_argument("--threads", type=int, default=1)
        s.add_argument("--prompt", type=int, default=64, help="context before each phase (default 64)")
        s.add_argument("--steps", type=int, default=16, help="counted steps per phase (default 16)")
        s.add_argument("--k", default="1,8,16", help="chain verify / batch sizes (default 1,8,16; '' for none)")
        s.add_argument("--phases", default="decode,propose", help="of decode, batch (k tokens, last-row logits), propose (default decode,propose)")
        if name == "ours":
            s.add_argument("--draft", help="drafter GGUF (for the propose phase)")
            s.add_argument("--block", type=int, help="drafted block (default the drafter's)")
            s.add_argument("--warmup", type=int, default=3)
    r = sub.add_parser("read")
    r.add_argument("prefix")
    r.add_argument("log")
    args = p.parse_args(argv)
    if args.cmd == "ours":
        run_ours(args)
    elif args.cmd == "llama":
        run_llama(args)
    else:
        read_ours(args.prefix, args.log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
