"""Load test of dflash-server on loopback: C concurrent clients, each sending R streamed
completion requests in turn; reports throughput and latency percentiles (time to the
first token, whole request) and FIFO fairness (requests started on the engine out of
their sending order).

    dflash-bench serve                      # starts a demo server itself
    dflash-bench serve --clients 8 --requests 4 --max-tokens 64
    dflash-bench serve --url http://127.0.0.1:8080 --json

Only loopback addresses are accepted, and the load is bounded (at most 64 clients,
1000 requests in all, every request with a timeout).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from . import serve_load

PROMPTS = [
    "def read_lines(path):\n    ",
    "class Stack:\n    def __init__(self):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "    for line in lines:\n",
    "def fibonacci(n):\n",
    "class Queue:\n    \"\"\"A first-in first-out queue.\"\"\"\n",
]


def fifo_inversions(results):
    """Pairs of requests the scheduler took in one before the other but started the other
    way round, on the server's own clock (queued_at, started_at): 0 for a FIFO server.
    The clients' send times cannot say it: two requests sent a few milliseconds apart
    reach the scheduler in either order, after their handlers parse them."""
    timed = [(r["queued_at"], r["started_at"]) for r in results if r.get("started_at") is not None]
    return sum(1 for a_in, a_start in timed for b_in, b_start in timed if a_in < b_in and a_start > b_start)


def one_request(http, url, prompt, max_tokens):
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    r = serve_load.complete(http, url, body)
    if not r.complete:
        return {"status": r.status, "arrival": r.sent}
    return {"status": 200, "arrival": r.sent, "ttft": r.ttft if r.ttft is not None else r.seconds,
            "total": r.seconds, "tokens": r.extension.get("generated_tokens", 0),
            "queue": r.extension.get("queue_seconds", 0.0), "al": r.extension.get("mean_accepted_length"),
            "queued_at": r.extension.get("queued_at"), "started_at": r.extension.get("started_at")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dflash-bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (loopback only); default: start the demo server")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (1..64, default 8)")
    p.add_argument("--requests", type=int, default=3, help="requests per client (default 3)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default 64)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout in seconds (default 300)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("server_args", nargs="*", help="flags for the started server (after --)")
    args = p.parse_args(argv)
    if not 1 <= args.clients <= 64 or args.requests < 1 or args.clients * args.requests > 1000:
        p.error("1..64 clients and at most 1000 requests in all")
    server = None
    if args.url:
        try:
            url = serve_load.loopback_url(args.url)
        except ValueError as e:
            p.error(str(e))
    else:
        port = serve_load.free_port()
        log = Path(tempfile.mkdtemp(prefix="bench-server-")) / "server.log"
        try:
            server = serve_load.ServerProcess([sys.executable, "-m", "dflash_gguf.serving.server", "--port", str(port), "-t",
                                               "2", "--queue", str(args.clients), *args.server_args], port, log)
        except RuntimeError as e:
            raise SystemExit(str(e)) from None
        url = server.url
    try:
        with httpx.Client(trust_env=False, timeout=args.timeout,
                          limits=httpx.Limits(max_connections=args.clients)) as http:
            def client(i):
                return [one_request(http, url, PROMPTS[(i + r) % len(PROMPTS)], args.max_tokens)
                        for r in range(args.requests)]

            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                results = [r for rs in pool.map(client, range(args.clients)) for r in rs]
            wall = time.perf_counter() - t0
    finally:
        if server is not None:
            server.stop()
    ok = [r for r in results if r["status"] == 200]
    tokens = sum(r["tokens"] for r in ok)
    summary = {
        "clients": args.clients, "requests": len(results), "ok": len(ok),
        "refused": sum(r["status"] == 503 for r in results),
        "wall_seconds": round(wall, 3), "generated_tokens": tokens,
        "throughput_tokens_per_second": round(tokens / wall, 1) if wall > 0 else None,
        "requests_per_second": round(len(ok) / wall, 2) if wall > 0 else None,
        "ttft_p50": round(serve_load.percentile([r["ttft"] for r in ok], 0.5), 4),
        "ttft_p90": round(serve_load.percentile([r["ttft"] for r in ok], 0.9), 4),
        "ttft_p99": round(serve_load.percentile([r["ttft"] for r in ok], 0.99), 4),
        "latency_p50": round(serve_load.percentile([r["total"] for r in ok], 0.5), 4),
        "latency_p90": round(serve_load.percentile([r["total"] for r in ok], 0.9), 4),
        "latency_p99": round(serve_load.percentile([r["total"] for r in ok], 0.99), 4),
        "queue_p50": round(serve_load.percentile([r["queue"] for r in ok], 0.5), 4),
        "queue_max": round(max((r["queue"] for r in ok), default=0.0), 4),
        "mean_accepted_length": round(statistics.mean([r["al"] for r in ok if r["al"]]), 3)
        if any(r["al"] for r in ok) else None,
        "fifo_inversions": fifo_inversions(ok),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:32} {v}")
    return 0 if len(ok) == len(results) else 1

