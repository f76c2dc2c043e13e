"""Concurrent serving, measured: aggregate tok/s and per-request latency (p50, p95, time to
first token) of dflash-server at 1, 2, 4 and 8 concurrent clients, greedy and sampled, beside
llama-server with its DFlash (`-np N --spec-type draft-dflash -md`) on the same GGUFs and
threads.

    dflash-bench concurrency                     # both bundled pairs
    dflash-bench concurrency --pairs demo --clients 1,4 --requests 2
    dflash-bench concurrency -m target.gguf -md draft.gguf -t 8 -o mine.json

Each client sends its requests one after another (streamed /v1/completions, the benchmark's
code prompts in turn), the next as soon as the last is answered. A cell (engine, pair,
sampling, clients) runs after a warm-up of one request per client and is repeated -r times;
aggregate tok/s is the completion tokens of all its requests over its wall time, latencies
are over every request of every repetition. Each row says how it compares with the same
engine's one-client figure, and ours with llama-server's at the same number of clients.

Both servers get -np N (N = clients) with a context of N times -c, so that every slot has
-c (dflash-server only when its --help offers -np; otherwise one server per pair takes
every client, its requests queue, and the results say so); llama-server also gets our
sampler order (top-k, top-p, min-p, temperature). It runs when built (python scripts/llama_cpp_build.py).
The results JSON (default results/concurrency-<UTC time>.json) carries the provenance
dflash-bench records: commit, versions, machine, threads, load average before and after.
Servers listen on loopback only; the load is bounded (clients <= 64, requests per cell
<= 1000, a timeout on every request).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import httpx

from .. import llama_cpp_tree
from ..demo import DATA
from . import provenance, serve_load
from .llama_cpp import SAMPLER_ORDER
from .prompts import PROMPTS
from .stats import Spread

PAIRS = {"demo": ("demo-target.gguf", "demo-draft.gguf"), "weak": ("demo-target.gguf", "demo-draft-weak.gguf")}
ENGINES = ("ours", "llama-server")
MAX_CLIENTS, MAX_CELL_REQUESTS = 64, 1000


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
    p.add_argument("--spec-draft-p-min", type=float, default=0.0,
                   help="llama-server's DFlash draft cut (default 0: whole blocks, as our chain drafts)")
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
    if any(t < 0 for t in args.temp) or args.top_k < 0 or not 0 < args.top_p <= 1:
        p.error("--temp must be >= 0, --top-k >= 0, --top-p in (0, 1]")
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

def ours_command(port: int, target: str, draft: Optional[str], args, slots: Optional[int], queue: int) -> List[str]:
    cmd = [sys.executable, "-m", "dflash_gguf.server", "--host", "127.0.0.1", "--port", str(port), "-m", target,
           "-t", str(args.threads), "-c", str(args.ctx_size * (slots or 1)), "-fa", "on", "-ctk", "f16", "-ctv", "f16",
           "--queue", str(queue)]
    if draft:
        cmd += ["-md", draft]
    if slots is not None:
        cmd += ["-np", str(slots)]
    return cmd


def llama_server_command(exe: Path, port: int, target: str, draft: Optional[str], args, slots: int) -> List[str]:
    from ..draft import read_draft_metadata

    t = str(args.threads)
    cmd = [str(exe), "--host", "127.0.0.1", "--port", str(port), "-m", target, "-t", t, "-tb", t,
           "-c", str(args.ctx_size * slots), "-np", str(slots), "-b", "512", "-ub", "512", "-fa", "on",
           "-ctk", "f16", "-ctv", "f16", "--no-webui"]
    if draft:
        block = int(read_draft_metadata(draft)["block_size"])
        cmd += ["-md", draft, "-td", t, "-tbd", t, "--spec-type", "draft-dflash", "--spec-draft-n-max", str(block - 1),
                "--spec-draft-n-min", "0", "--spec-draft-p-min", repr(args.spec_draft_p_min)]
    return cmd


def llama_server_version(exe: Path) -> str:
    res = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    return (res.stdout + res.stderr).strip()


# -- cells -----------------------------------------------------------------------------------------

def request_body(i: int, sampling: Sampling, args) -> dict:
    _, prompt = PROMPTS[i % len(PROMPTS)]
    return {"model": "bench", "prompt": prompt, "max_tokens": args.max_tokens, "stream": True,
            **sampling.fields(args.seed + i)}


def run_cell(url: str, clients: int, sampling: Sampling, args) -> dict:
    """One repetition of a cell: `clients` workers drain clients x requests requests."""
    bodies = [request_body(i, sampling, args) for i in range(clients * args.requests)]
    # a connection per request: llama-server may close a kept-alive connection as the next
    # request goes out on it ("Server disconnected without sending a response"), which is no
    # fault of the request; a loopback connect costs both servers the same fraction of a ms
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=0)
    with httpx.Client(trust_env=False, timeout=args.timeout, limits=limits) as http:
        serve_load.drain(bodies[:clients], clients, lambda b: serve_load.complete(http, url, {**b, "max_tokens": 8}))
        t0 = time.perf_counter()
        replies = serve_load.drain(bodies, clients, lambda b: serve_load.complete(http, url, b))
        wall = time.perf_counter() - t0
    return {"wall_seconds": wall, "replies": replies}


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

    def pct(values, q):
        v = serve_load.percentile(values, q)
        return None if v != v else round(v, 4)  # nan: no value

    latencies, ttfts = [r.seconds for r in ok], [r.ttft for r in ok if r.ttft is not None]
    als = [a for a in map(accepted_length, ok) if a]
    return {"requests": len(replies), "ok": len(ok),
            "errors": sorted({r.error or f"status {r.status}" for r in replies if not r.complete}),
            "tokens": sum(r.tokens or 0 for r in ok),
            "aggregate_tps": Spread.of(per_rep).to_json(),
            "latency_p50": pct(latencies, 0.5), "latency_p95": pct(latencies, 0.95),
            "ttft_p50": pct(ttfts, 0.5), "ttft_p95": pct(ttfts, 0.95),
            "accepted_length_median": round(Spread.of(als).median, 3) if als else None,
            "replies": [[{"status": r.status, "seconds": round(r.seconds, 5),
                          "ttft": None if r.ttft is None else round(r.ttft, 5), "tokens": r.tokens,
                          "accepted_length": accepted_length(r), "error": r.error} for r in rep["replies"]]
                        for rep in reps]}


def compare(rows: List[dict]) -> None:
    """Each row's aggregate over its engine's one-client figure, and ours over llama-server's
    at the same clients (medians)."""
    def key(r, **change):
        k = {f: r[f] for f in ("engine", "pair", "sampling", "clients")}
        k.update(change)
        return tuple(k.values())

    by = {key(r): r for r in rows}
    for r in rows:
        one = by.get(key(r, clients=1))
        r["vs_one_client"] = round(r["aggregate_tps"]["median"] / one["aggregate_tps"]["median"], 3) \
            if one and one["aggregate_tps"]["median"] > 0 else None
        peer = by.get(key(r, engine="llama-server")) if r["engine"] == "ours" else None
        r["vs_llama_server"] = round(r["aggregate_tps"]["median"] / peer["aggregate_tps"]["median"], 3) \
            if peer and peer["aggregate_tps"]["median"] > 0 else None


def table_text(rows: List[dict]) -> str:
    head = ["engine", "pair", "sampling", "clients", "-np", "tok/s", "x 1 client", "x llama-server",
            "latency p50/p95 s", "TTFT p50/p95 s", "AL", "ok"]
    lines = [head]
    for r in rows:
        t = r["aggregate_tps"]
        lines.append([r["engine"], r["pair"], r["sampling"], str(r["clients"]), str(r["slots"] or "-"),
                      f"{t['median']:.1f} [{t['min']:.0f}-{t['max']:.0f}]", f"{r['vs_one_client'] or 0:.2f}",
                      f"{r['vs_llama_server']:.2f}" if r["vs_llama_server"] else "-",
                      f"{r['latency_p50']}/{r['latency_p95']}", f"{r['ttft_p50']}/{r['ttft_p95']}",
                      str(r["accepted_length_median"] or "-"), f"{r['ok']}/{r['requests']}"])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines)


def measure(args, log_dir: Path, has_np: bool, llama_server: Optional[Path]) -> tuple:
    """(rows, failures): a server that does not start or exits badly is a failure on
    record, and the other servers still run."""
    samplings = [Sampling(t, args.top_k, args.top_p) for t in dict.fromkeys(args.temp)]
    rows, failures = [], []

    def serve(engine: str, name: str, target: str, draft: Optional[str], slots: Optional[int], clients: List[int]):
        port = serve_load.free_port()
        if engine == "ours":
            cmd = ours_command(port, target, draft, args, slots, queue=max(clients))
        else:
            cmd = llama_server_command(llama_server, port, target, draft, args, slots)
        log(f"{engine} on {name}: {' '.join(Path(c).name if c.startswith('/') else c for c in cmd)}")
        try:
            server = serve_load.ServerProcess(cmd, port, log_dir / f"{engine}-{name}-{slots or 1}.log")
        except RuntimeError as e:
            log(str(e))
            failures.append({"engine": engine, "pair": name, "slots": slots, "command": cmd, "error": str(e)})
            return
        try:
            for sampling in samplings:
                for c in clients:
                    reps = [run_cell(server.url, c, sampling, args) for _ in range(args.repetitions)]
                    row = {"engine": engine, "pair": name, "sampling": sampling.label, "clients": c, "slots": slots,
                           "command": cmd, **summarize(reps)}
                    log(f"{engine} {name} {sampling.label} x{c}: {row['aggregate_tps']['median']:.1f} tok/s, "
                        f"latency p50 {row['latency_p50']} s, {row['ok']}/{row['requests']} answered")
                    rows.append(row)
        finally:
            status = server.stop()
            if status != 0:
                log(f"{engine} exited with status {status}: {server.log_tail()}")
                failures.append({"engine": engine, "pair": name, "slots": slots, "command": cmd,
                                 "error": f"exit status {status}: {server.log_tail()}"})

    for name, target, draft in pairs_of(args):
        for engine in args.engines:
            if engine == "llama-server" and llama_server is None:
                continue
            if engine == "ours" and not has_np:
                serve(engine, name, target, draft, None, args.clients)
            else:
                for c in args.clients:
                    serve(engine, name, target, draft, c, [c])
    compare(rows)
    return rows, failures


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    check(p, args)
    try:
        has_np = serve_load.accepts_flag(serve_load.dflash_server_help(), "-np")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"bench_concurrency: error: {e}", file=sys.stderr)
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
            rows, failures = measure(args, Path(tmp), has_np, llama_server)
        except OSError as e:
            print(f"bench_concurrency: error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("bench_concurrency: interrupted", file=sys.stderr)
            return 130
    load_after = provenance.load_average()
    result = {
        "tool": "bench_concurrency", "started": started.isoformat(timespec="seconds"),
        "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "checkout": provenance.checkout(), "versions": provenance.versions(),
        "machine": provenance.machine(args.threads, "CPU"),
        "load_average": {"before": load_before, "after": load_after},
        "ours": {"np_flag": has_np,
                 "note": None if has_np else "dflash-server has no -np: one server per pair, requests queue"},
        "llama_server": {"path": str(llama_server), "version": llama_server_version(llama_server),
                         "sources": str(llama_cpp_tree.sdist_dir())} if llama_server else None,
        "pairs": [{"name": n, "target": str(Path(t).resolve()), "draft": str(Path(d).resolve()) if d else None}
                  for n, t, d in pairs_of(args)],
        "settings": {"clients": args.clients, "requests_per_client": args.requests, "repetitions": args.repetitions,
                     "max_tokens": args.max_tokens, "threads": args.threads, "ctx_per_sequence": args.ctx_size,
                     "samplings": sorted({r["sampling"] for r in rows}), "seed": args.seed,
                     "sampler_order": SAMPLER_ORDER, "spec_draft_p_min": args.spec_draft_p_min,
                     "prompts": [name for name, _ in PROMPTS]},
        "rows": rows,
        "failures": failures,
    }
    path = output_path(args.output, started)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {path}")
    if args.json:
        print(json.dumps(result))
    else:
        print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; {args.threads} threads")
        print(table_text(rows))
    for f in failures:
        print(f"FAILED {f['engine']} on {f['pair']} (-np {f['slots'] or '-'}): {f['error']}")
    unanswered = sum(r["requests"] - r["ok"] for r in rows)
    return 1 if unanswered or failures else 0

