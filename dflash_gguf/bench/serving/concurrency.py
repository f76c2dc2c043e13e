"""Concurrent serving, measured: aggregate tok/s and per-request latency (p50, p95, time to
first token) of dflash-server at 1, 2, 4 and 8 concurrent clients, greedy and sampled, beside
llama-server with its DFlash (`-np N --spec-type draft-dflash -md`) on the same GGUFs and
threads, each side at its default and over a sweep of its draft settings.

    dflash-bench concurrency                     # both bundled pairs
    dflash-bench concurrency --pairs demo --clients 1,4 --requests 2
    dflash-bench concurrency -m target.gguf -md draft.gguf -t 8 -o mine.json

Each client sends its requests one after another (streamed /v1/completions, the benchmark's
code prompts in turn), the next as soon as the last is answered. An arm is a server at one
setting: ours at its defaults and at every --draft-p-min x --block-size, llama-server at its
defaults and at every --spec-draft-p-min x --spec-draft-n-max (a draft cut of 0 is not what
our chain does on a CPU, where ours cuts at 0.3 by default: each side is swept and shown at
its best and at its default). For one pair and number of clients every arm's server is
started, then the cells (arm, sampling) take turns: every cell in every repetition
(dflash_gguf.bench.method), each repetition after a warm-up of one request per client,
sending more rounds of requests until it lasted --min-seconds; within a repetition the
cells take turns a round at a time, in an order shuffled each round. Aggregate tok/s
is the completion tokens of a repetition's requests over its wall time (rows: the median
over repetitions and the range), latencies are over every request of every repetition. A
cell that starts with the 1-minute load average above --max-load per thread is marked
loaded (or waited for, --wait-idle). Each row says how it compares with the same arm's
one-client figure and with llama-server at the same setting (matched); the comparisons
pit best against best and default against default.

Both servers get -np N (N = clients) with a context of N times -c, so that every slot has
-c (dflash-server only when its --help offers -np; otherwise its requests queue, and the
results say so); llama-server also gets our sampler order (top-k, top-p, min-p,
temperature). It runs when built (python scripts/llama_cpp_build.py llama-server). The
results JSON (default results/concurrency-<UTC time>.json) carries the provenance
dflash-bench records: commit, versions, machine, threads, load average before and after
and at every cell. Servers listen on loopback only; the load is bounded (clients <= 64,
requests per round <= 1000, a timeout on every request).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import httpx

from ...engine.args import check_p_min_flags, check_sampling_flags
from ...runtime.demo import DATA
from ...tools import llama_cpp_tree
from .. import method, provenance
from ..llama_cpp import SAMPLER_ORDER
from ..prompts import PROMPTS
from ..stats import Spread
from . import serve_load

PAIRS = {"demo": ("demo-target.gguf", "demo-draft.gguf"), "weak": ("demo-target.gguf", "demo-draft-weak.gguf")}
ENGINES = ("ours", "llama-server")
MAX_CLIENTS, MAX_CELL_REQUESTS = 64, 1000
SWEEP_P_MIN = (0.0, 0.3, 0.5, 0.75)


def log(msg: str) -> None:
    print(f"[bench-concurrency] {msg}", file=sys.stderr, flush=True)


def int_list(text: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers is expected, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


def float_list(text: str) -> List[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of numbers is expected, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-bench concurrency", description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", default="demo,weak",
                   help=f"bundled pairs to serve, of {', '.join(PAIRS)} (default demo,weak; ignored with -m)")
    p.add_argument("-m", "--model", help="a target GGUF instead of the bundled pairs")
    p.add_argument("-md", "--model-draft", help="its DFlash drafter GGUF (with -m)")
    p.add_argument("--clients", type=int_list, default=[1, 2, 4, 8], help="concurrent clients (default 1,2,4,8)")
    p.add_argument("--requests", type=int, default=4, help="requests per client per repetition (default 4)")
    p.add_argument("-r", "--repetitions", type=int, default=2, help="repetitions of every cell (default 2)")
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    p.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="CPU threads of both servers (default: the CPUs this process may use)")
    p.add_argument("-c", "--ctx-size", type=int, default=2048, help="context per sequence (default 2048)")
    p.add_argument("--temp", type=float_list, default=[0.0, 0.6], help="temperatures, 0 for greedy (default 0,0.6)")
    p.add_argument("--top-k", type=int, default=20, help="top-k of sampled requests (default 20)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p of sampled requests (default 0.95)")
    p.add_argument("-s", "--seed", type=int, default=1, help="request i of a sampled cell draws with seed + i")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"of {', '.join(ENGINES)} (default both)")
    p.add_argument("--llama-cpp", type=Path, metavar="DIR",
                   help="directory holding llama-server (default: where scripts/llama_cpp_build.py builds it)")
    p.add_argument("--draft-p-min", type=float_list, default=list(SWEEP_P_MIN),
                   help="our chain's confidence cuts to sweep, a server each beside the default one (default "
                        "0,0.3,0.5,0.75)")
    p.add_argument("--block-size", type=int_list,
                   help="our chain's blocks to sweep (the bonus token and n-max drafts; default: the drafter's block)")
    p.add_argument("--spec-draft-p-min", type=float_list, default=list(SWEEP_P_MIN),
                   help="llama-server DFlash's draft cuts to sweep, a server each beside its default one (default "
                        "0,0.3,0.5,0.75)")
    p.add_argument("--spec-draft-n-max", type=int_list,
                   help="llama-server DFlash's draft counts to sweep (default: the drafter's block less the bonus "
                        "token)")
    p.add_argument("--min-seconds", type=float, default=method.MIN_SECONDS,
                   help="wall time a cell's repetition must reach; it sends more rounds of requests until it does "
                        "(default 1)")
    method.add_load_flags(p)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    p.add_argument("-o", "--output", type=Path,
                   help="results JSON (a bare file name goes under results/; default "
                        "results/concurrency-<UTC time>.json)")
    p.add_argument("--json", action="store_true", help="print the results JSON instead of the table")
    return p


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int
    top_p: float

    @property
    def label(self) -> str:
        return "greedy" if self.temperature == 0 else f"temp {self.temperature:g}, top-k {self.top_k}, " \
                                                      f"top-p {self.top_p:g}"

    def fields(self, seed: int) -> dict:
        """The request's sampling fields; llama-server takes our truncation order too (ours ignores it)."""
        if self.temperature == 0:
            return {"temperature": 0}
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": 0.0,
                "seed": seed, "samplers": SAMPLER_ORDER.split(";")}


def check(p: argparse.ArgumentParser, args) -> None:
    if args.model_draft and not args.model:
        p.error("-md needs -m")
    for f in (args.model, args.model_draft):
        if f and not Path(f).is_file():
            p.error(f"{f}: no such file")
    pairs = [x.strip() for x in args.pairs.split(",") if x.strip()]
    unknown = set(pairs) - set(PAIRS)
    if unknown or not pairs:
        p.error(f"--pairs: of {', '.join(PAIRS)}, got {args.pairs!r}")
    args.pairs = pairs
    engines = [x.strip() for x in args.engines.split(",") if x.strip()]
    if not engines or set(engines) - set(ENGINES):
        p.error(f"--engines: of {', '.join(ENGINES)}, got {args.engines!r}")
    args.engines = engines
    if any(not 1 <= c <= MAX_CLIENTS for c in args.clients):
        p.error(f"--clients must be 1..{MAX_CLIENTS}")
    if args.requests < 1 or args.repetitions < 1 or max(args.clients) * args.requests > MAX_CELL_REQUESTS:
        p.error(f"--requests and -r must be >= 1, and clients x requests <= {MAX_CELL_REQUESTS}")
    if not 1 <= args.max_tokens <= 4096 or args.threads < 1 or args.ctx_size < 256:
        p.error("-n must be 1..4096, -t >= 1, -c >= 256")
    check_sampling_flags(p, args.temp, args.top_k, args.top_p)
    check_p_min_flags(p, args.draft_p_min)
    if any(not 0 <= x <= 1 for x in args.spec_draft_p_min):
        p.error("--spec-draft-p-min values must be in [0, 1]")
    if any(b < 1 for b in args.block_size or ()) or any(n < 1 for n in args.spec_draft_n_max or ()):
        p.error("--block-size and --spec-draft-n-max values must be at least 1")
    if args.min_seconds < 0 or args.max_load < 0 or args.wait_idle_max < 0:
        p.error("--min-seconds, --max-load and --wait-idle-max must be >= 0")
    if args.llama_cpp is not None and not args.llama_cpp.is_dir():
        p.error(f"--llama-cpp {args.llama_cpp}: no such directory")


def pairs_of(args) -> List[tuple]:
    """(name, target, drafter) of the pairs to serve."""
    if args.model:
        return [(Path(args.model).stem, args.model, args.model_draft)]
    return [(name, str(DATA / PAIRS[name][0]), str(DATA / PAIRS[name][1])) for name in args.pairs]


def output_path(path: Optional[Path], started: _dt.datetime) -> Path:
    if path is None:
        path = Path(f"concurrency-{started:%Y-%m-%d-%H%M}.json")
    return Path("results") / path if path.parent == Path(".") else path


# -- servers ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arm:
    """A server at one draft setting: the engine's defaults (no draft flag), or a draft cut
    and a number of drafts (n-max; ours drafts it as a block of n-max + 1)."""

    engine: str                    # "ours" or "llama-server"
    p_min: Optional[float] = None
    n_max: Optional[int] = None

    @property
    def default(self) -> bool:
        return self.p_min is None and self.n_max is None

    @property
    def setting(self) -> str:
        return "default" if self.default else " ".join(
            ([f"p-min {self.p_min:g}"] if self.p_min is not None else []) +
            ([f"n-max {self.n_max}"] if self.n_max is not None else []))


def arms_of(args, draft: Optional[str], engines: List[str]) -> List[Arm]:
    """Each engine's default arm and its sweep (plain decoding, without a drafter, has none)."""
    from ...runtime.drafter import read_draft_metadata

    out = []
    block = int(read_draft_metadata(draft)["block_size"]) if draft else None
    for engine in engines:
        out.append(Arm(engine))
        if draft is None:
            continue
        if engine == "ours":
            out += [Arm(engine, p, b - 1) for p in args.draft_p_min for b in args.block_size or [block]]
        else:
            out += [Arm(engine, p, n) for p in args.spec_draft_p_min for n in args.spec_draft_n_max or [block - 1]]
    return out


def ours_command(port: int, target: str, draft: Optional[str], args, slots: Optional[int], queue: int,
                 arm: Arm = Arm("ours")) -> List[str]:
    cmd = [sys.executable, "-m", "dflash_gguf.serving.server", "--host", "127.0.0.1", "--port", str(port), "-m", target,
           "-t", str(args.threads), "-c", str(args.ctx_size * (slots or 1)), "-fa", "on", "-ctk", "f16", "-ctv", "f16",
           "--queue", str(queue)]
    if draft:
        cmd += ["-md", draft]
        if arm.p_min is not None:
            cmd += ["--draft-p-min", repr(arm.p_min)]
        if arm.n_max is not None:
            cmd += ["--block-size", str(arm.n_max + 1)]
    if slots is not None:
        cmd += ["-np", str(slots)]
    return cmd


def llama_server_command(exe: Path, port: int, target: str, draft: Optional[str], args, slots: int,
                         arm: Arm = Arm("llama-server")) -> List[str]:
    t = str(args.threads)
    cmd = [str(exe), "--host", "127.0.0.1", "--port", str(port), "-m", target, "-t", t, "-tb", t,
           "-c", str(args.ctx_size * slots), "-np", str(slots), "-b", "512", "-ub", "512", "-fa", "on",
           "-ctk", "f16", "-ctv", "f16", "--no-webui"]
    if draft:
        cmd += ["-md", draft, "-td", t, "-tbd", t, "--spec-type", "draft-dflash"]
        if arm.n_max is not None:
            cmd += ["--spec-draft-n-max", str(arm.n_max), "--spec-draft-n-min", "0"]
        if arm.p_min is not None:
            cmd += ["--spec-draft-p-min", repr(arm.p_min)]
    return cmd


# -- cells -----------------------------------------------------------------------------------------

def request_body(i: int, sampling: Sampling, args) -> dict:
    _, prompt = PROMPTS[i % len(PROMPTS)]
    return {"model": "bench", "prompt": prompt, "max_tokens": args.max_tokens, "stream": True,
            **sampling.fields(args.seed + i)}


def cell_round(url: str, clients: int, sampling: Sampling, args, rnd: int) -> List[tuple]:
    """A round of a cell's repetition: `clients` workers drain clients x requests requests
    (round 0 after a warm-up of one request per client). [(wall seconds, replies)]"""
    bodies = [request_body(i, sampling, args) for i in range(clients * args.requests)]
    # a connection per request: llama-server may close a kept-alive connection as the next
    # request goes out on it ("Server disconnected without sending a response"), which is no
    # fault of the request; a loopback connect costs both servers the same fraction of a ms
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
    with httpx.Client(trust_env=False, timeout=args.timeout, limits=limits) as http:
        if rnd == 0:
            serve_load.drain(bodies[:clients], clients,
                             lambda b: serve_load.complete(http, url, {**b, "max_tokens": 8}))
        t0 = time.perf_counter()
        replies = serve_load.drain(bodies, clients, lambda b: serve_load.complete(http, url, b))
        return [(time.perf_counter() - t0, replies)]


def accepted_length(reply: serve_load.Reply) -> Optional[float]:
    """Tokens per target pass: ours reports it; llama-server's timings give its drafts
    accepted, each round making its accepted drafts plus one token."""
    if reply.extension.get("mean_accepted_length"):
        return reply.extension["mean_accepted_length"]
    n, accepted = reply.timings.get("predicted_n"), reply.timings.get("draft_n_accepted")
    if n and accepted is not None and n > accepted:
        return n / (n - accepted)
    return None


def summarize(reps: List[dict]) -> dict:
    """A cell's figures over its repetitions."""
    replies = [r for rep in reps for r in rep["replies"]]
    ok = [r for r in replies if r.complete]
    per_rep = [sum(r.tokens or 0 for r in rep["replies"] if r.complete) / rep["wall_seconds"] for rep in reps]
    # each repetition's rounds as (completion tokens, wall seconds), for method.matched_ratios
    rounds = [[(sum(r.tokens or 0 for r in replies if r.complete), wall) for wall, replies in rep["rounds"]]
              for rep in reps]

    def pct(values, q):
        v = serve_load.percentile(values, q)
        return None if v != v else round(v, 4)  # nan: no value

    latencies, ttfts = [r.seconds for r in ok], [r.ttft for r in ok if r.ttft is not None]
    als = [a for a in map(accepted_length, ok) if a]
    return {"requests": len(replies), "ok": len(ok),
            "errors": sorted({r.error or f"status {r.status}" for r in replies if not r.complete}),
            "tokens": sum(r.tokens or 0 for r in ok),
            "aggregate_tps": Spread.of(per_rep).to_json(), "aggregate_tps_per_rep": per_rep,
            "rounds_per_rep": [len(r) for r in rounds], "aggregate_rounds_per_rep": rounds,
            "latency_p50": pct(latencies, 0.5), "latency_p95": pct(latencies, 0.95),
            "ttft_p50": pct(ttfts, 0.5), "ttft_p95": pct(ttfts, 0.95),
            "accepted_length_median": round(Spread.of(als).median, 3) if als else None,
            "replies": [[{"status": r.status, "seconds": round(r.seconds, 5),
                          "ttft": None if r.ttft is None else round(r.ttft, 5), "tokens": r.tokens,
                          "accepted_length": accepted_length(r), "error": r.error} for r in rep["replies"]]
                        for rep in reps]}


def _key(r: dict, **change) -> tuple:
    k = {f: r[f] for f in ("engine", "setting", "pair", "sampling", "clients")}
    k.update(change)
    return tuple(k.values())


def compare(rows: List[dict]) -> List[dict]:
    """Each row's aggregate over its arm's one-client figure, and ours over llama-server's
    at the same setting (each its own defaults for "default"), ratios of medians; and per
    pair, sampling and clients the comparisons: best vs best, default vs default."""
    by = {_key(r): r for r in rows}
    for r in rows:
        one = by.get(_key(r, clients=1))
        r["vs_one_client"] = round(r["aggregate_tps"]["median"] / one["aggregate_tps"]["median"], 3) \
            if one and one["aggregate_tps"]["median"] > 0 else None
        peer = by.get(_key(r, engine="llama-server")) if r["engine"] == "ours" else None
        r["vs_llama_server"] = round(r["aggregate_tps"]["median"] / peer["aggregate_tps"]["median"], 3) \
            if peer and peer["aggregate_tps"]["median"] > 0 else None
    out = []
    for pair, sampling, clients in dict.fromkeys((r["pair"], r["sampling"], r["clients"]) for r in rows):
        cell = [r for r in rows if (r["pair"], r["sampling"], r["clients"]) == (pair, sampling, clients)]
        pairs = method.pairings([r for r in cell if r["engine"] == "ours"],
                                [r for r in cell if r["engine"] == "llama-server"],
                                lambda r: r["aggregate_tps"]["median"] or None,
                                lambda r: dict(enumerate(r["aggregate_rounds_per_rep"])), lambda r: r["default"])
        for pr in pairs:
            out.append({"pair": pair, "sampling": sampling, "clients": clients, "pairing": pr.name,
                        "ours": pr.ours["setting"], "llama_server": pr.theirs["setting"],
                        "ours_tps_median": pr.ours["aggregate_tps"]["median"],
                        "llama_server_tps_median": pr.theirs["aggregate_tps"]["median"],
                        "ratio_of_medians": None if pr.ratio is None else round(pr.ratio, 3),
                        "per_rep_ratio_median": None if pr.paired_median is None else round(pr.paired_median, 3),
                        "per_rep_ratio_range": [round(x, 3) for x in pr.paired] if pr.paired else None,
                        "loaded": pr.ours["loaded"] or pr.theirs["loaded"]})
    return out


def _columns(lines: List[List[str]]) -> str:
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines)


def table_text(rows: List[dict]) -> str:
    """One statistic per column: medians over the repetitions, their range, ratios of medians."""
    lines = [["engine", "setting", "pair", "sampling", "clients", "-np", "tok/s median", "tok/s min-max",
              "x 1 client", "x llama-server same setting", "latency p50/p95 s", "TTFT p50/p95 s", "AL median",
              "load 1m max", "loaded", "ok"]]
    for r in rows:
        t = r["aggregate_tps"]
        loads = [x for x in r["load_1m_at_start"] if x is not None]
        lines.append([r["engine"], r["setting"], r["pair"], r["sampling"], str(r["clients"]), str(r["slots"] or "-"),
                      f"{t['median']:.1f}", f"{t['min']:.1f}-{t['max']:.1f}", f"{r['vs_one_client'] or 0:.2f}",
                      f"{r['vs_llama_server']:.2f}" if r["vs_llama_server"] else "-",
                      f"{r['latency_p50']}/{r['latency_p95']}", f"{r['ttft_p50']}/{r['ttft_p95']}",
                      str(r["accepted_length_median"] or "-"), f"{max(loads):.2f}" if loads else "-",
                      "yes" if r["loaded"] else "no", f"{r['ok']}/{r['requests']}"])
    return _columns(lines)


def comparisons_text(comparisons: List[dict]) -> str:
    if not comparisons:
        return "(no comparison with llama-server: it did not run)"
    lines = [["pair", "sampling", "clients", "pairing", "ours", "llama-server", "ours tok/s median",
              "llama-server tok/s median", "ratio of medians", "per-rep ratio median", "per-rep ratio min-max",
              "loaded"]]
    for c in comparisons:
        span = c["per_rep_ratio_range"]
        lines.append([c["pair"], c["sampling"], str(c["clients"]), c["pairing"], c["ours"], c["llama_server"],
                      f"{c['ours_tps_median']:.1f}", f"{c['llama_server_tps_median']:.1f}",
                      f"{c['ratio_of_medians']:.2f}x" if c["ratio_of_medians"] else "-",
                      f"{c['per_rep_ratio_median']:.3f}x" if c["per_rep_ratio_median"] else "-",
                      f"{span[0]:.2f}-{span[1]:.2f}x" if span else "-", "yes" if c["loaded"] else "no"])
    return _columns(lines)


def measure(args, log_dir: Path, has_np: bool, llama_server: Optional[Path]) -> tuple:
    """(rows, failures, cells): per pair and number of clients, every arm's server started,
    their cells interleaved within each repetition. A server that does not start or exits
    badly is a failure on record, and the other arms still run."""
    samplings = [Sampling(t, args.top_k, args.top_p) for t in dict.fromkeys(args.temp)]
    engines = [e for e in args.engines if e == "ours" or llama_server is not None]
    gate = method.LoadGate.per_thread(args.max_load, args.threads, wait=args.wait_idle, cap_s=args.wait_idle_max,
                                      log=log)
    rows, failures = [], []

    def start(arm: Arm, name: str, target: str, draft: Optional[str], clients: int):
        port = serve_load.free_port()
        slots = clients if arm.engine == "llama-server" or has_np else None
        if arm.engine == "ours":
            cmd = ours_command(port, target, draft, args, slots, queue=clients, arm=arm)
        else:
            cmd = llama_server_command(llama_server, port, target, draft, args, clients, arm)
        log(f"{arm.engine} {arm.setting} on {name}: {' '.join(Path(c).name if c.startswith('/') else c for c in cmd)}")
        try:
            server = serve_load.ServerProcess(
                cmd, port, log_dir / f"{arm.engine}-{arm.setting.replace(' ', '-')}-{name}-{clients}.log")
        except RuntimeError as e:
            log(str(e))
            failures.append({"engine": arm.engine, "setting": arm.setting, "pair": name, "slots": slots,
                             "command": cmd, "error": str(e)})
            return None
        return server, slots, cmd

    for name, target, draft in pairs_of(args):
        arms = arms_of(args, draft, engines)
        for c in args.clients:
            servers = {}
            try:
                for arm in arms:
                    started = start(arm, name, target, draft, c)
                    if started:
                        servers[arm] = started
                cells = [(arm, s) for arm in servers for s in samplings]
                reps, loads = {cell: [] for cell in cells}, {cell: [] for cell in cells}
                for rep in range(args.repetitions):
                    rounds: dict = {cell: [] for cell in cells}

                    def one_round(cell, rnd, rep=rep):
                        arm, s = cell
                        if rnd == 0:
                            loads[cell].append(gate.enter(f"{arm.engine} {arm.setting}, {name}, {s.label}, {c} clients, "
                                                          f"rep {rep + 1}"))
                        return cell_round(servers[arm][0].url, c, s, args, rnd)

                    # the cells take turns a round at a time (method.taking_turns)
                    for cell, got, _ in method.taking_turns(cells, one_round, lambda rs: sum(w for w, _ in rs),
                                                            args.min_seconds, random.Random(rep)):
                        rounds[cell] += got
                    for cell in cells:
                        reps[cell].append({"wall_seconds": sum(w for w, _ in rounds[cell]),
                                           "replies": [r for _, rs in rounds[cell] for r in rs],
                                           "rounds": rounds[cell]})
                for arm, s in cells:
                    _, slots, cmd = servers[arm]
                    row = {"engine": arm.engine, "setting": arm.setting, "default": arm.default, "pair": name,
                           "sampling": s.label, "clients": c, "slots": slots, "command": cmd,
                           "load_1m_at_start": [x["load_1m"] for x in loads[(arm, s)]],
                           "loaded": any(x["loaded"] for x in loads[(arm, s)]), **summarize(reps[(arm, s)])}
                    log(f"{arm.engine} {arm.setting} {name} {s.label} x{c}: {row['aggregate_tps']['median']:.1f} "
                        f"tok/s, latency p50 {row['latency_p50']} s, {row['ok']}/{row['requests']} answered")
                    rows.append(row)
            finally:
                for arm, (server, slots, cmd) in servers.items():
                    status = server.stop()
                    if status != 0:
                        log(f"{arm.engine} exited with status {status}: {server.log_tail()}")
                        failures.append({"engine": arm.engine, "setting": arm.setting, "pair": name, "slots": slots,
                                         "command": cmd, "error": f"exit status {status}: {server.log_tail()}"})
    return rows, failures, gate.cells


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    check(p, args)
    try:
        has_np = serve_load.accepts_flag(serve_load.dflash_server_help(), "-np")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"dflash-bench concurrency: error: {e}", file=sys.stderr)
        return 1
    llama_server = None
    if "llama-server" in args.engines:
        llama_server = llama_cpp_tree.tool("llama-server", args.llama_cpp)
        if llama_server is None:
            log("llama-server is not built (python scripts/llama_cpp_build.py llama-server): ours only")
    started, load_before = _dt.datetime.now(_dt.timezone.utc), provenance.load_average()
    log(f"load average {load_before[0]:.2f} on {os.cpu_count()} CPUs"
        + (": other processes are running, timings will show it" if load_before[0] > 0.5 else "")
        + f"; dflash-server {'takes' if has_np else 'has no'} -np")
    with tempfile.TemporaryDirectory(prefix="bench-concurrency-") as tmp:
        try:
            rows, failures, cells = measure(args, Path(tmp), has_np, llama_server)
        except OSError as e:
            print(f"dflash-bench concurrency: error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("dflash-bench concurrency: interrupted", file=sys.stderr)
            return 130
    load_after = provenance.load_average()
    comparisons = compare(rows)
    result = {
        "tool": "dflash-bench concurrency", "started": started.isoformat(timespec="seconds"),
        "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "checkout": provenance.checkout(), "versions": provenance.versions(),
        "machine": provenance.machine(args.threads, "CPU"),
        "load_average": {"before": load_before, "after": load_after},
        "ours": {"np_flag": has_np,
                 "note": None if has_np else "dflash-server has no -np: its requests queue"},
        "llama_server": {"path": str(llama_server), "version": serve_load.version_of(llama_server),
                         "sources": str(llama_cpp_tree.sdist_dir())} if llama_server else None,
        "pairs": [{"name": n, "target": str(Path(t).resolve()), "draft": str(Path(d).resolve()) if d else None}
                  for n, t, d in pairs_of(args)],
        "settings": {"clients": args.clients, "requests_per_client": args.requests, "repetitions": args.repetitions,
                     "max_tokens": args.max_tokens, "threads": args.threads, "ctx_per_sequence": args.ctx_size,
                     "samplings": sorted({r["sampling"] for r in rows}), "seed": args.seed,
                     "sampler_order": SAMPLER_ORDER, "draft_p_min": args.draft_p_min, "block_size": args.block_size,
                     "spec_draft_p_min": args.spec_draft_p_min, "spec_draft_n_max": args.spec_draft_n_max,
                     "min_seconds": args.min_seconds, "max_load_per_thread": args.max_load,
                     "load_threshold_1m": args.max_load * args.threads, "wait_idle": args.wait_idle,
                     "interleaved": "per pair and clients, every arm and sampling in every repetition, taking "
                                    "turns a round at a time in an order shuffled by random.Random(repetition)",
                     "prompts": [name for name, _ in PROMPTS]},
        "cells": cells,
        "rows": rows,
        "comparisons": comparisons,
        "failures": failures,
    }
    path = output_path(args.output, started)
    provenance.write_results(path, result)
    log(f"wrote {path}")
    if args.json:
        print(json.dumps(result))
    else:
        print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; {args.threads} threads; "
              f"{sum(c['loaded'] for c in cells)} of {len(cells)} cells started above "
              f"{args.max_load * args.threads:.2f}")
        print(table_text(rows))
        print()
        print(comparisons_text(comparisons))
    for f in failures:
        print(f"FAILED {f['engine']} {f['setting']} on {f['pair']} (-np {f['slots'] or '-'}): {f['error']}")
    unanswered = sum(r["requests"] - r["ok"] for r in rows)
    return 1 if unanswered or failures else 0

