"""Soak test of dflash-server on loopback: a bounded run of mixed requests from concurrent
clients, checked for crashes, lost or doubled answers, wrong answers and memory growth.

    dflash-bench soak                                  # 200 requests on the demo pair
    dflash-bench soak --requests 10000 -t 2            # a long one (up to 20,000 requests)
    dflash-bench soak --duration 3600 -t 2             # requests for an hour
    dflash-bench soak --requests 40 --max-tokens 32 -- -t 1
    dflash-bench soak --url http://127.0.0.1:8080 -o my-server.json

The requests (a seeded plan, reproducible from --seed and the settings) mix greedy
completions, streamed or not; follow-ups, the next turn of a conversation (an earlier
greedy request's prompt, its answer as the server gave it, and new text: the prefix
checkpoints serve these); seeded sampled ones; clients that leave mid-stream; clients
that leave as soon as their long prompt's response starts (in the queue or the prefill);
and malformed requests. --slots clients drain the plan at once on a fresh server (a
follow-up's client waits for the answer it continues). Then each greedy request and
follow-up answered is sent alone, with cache_prompt false (computed whole), to a second
fresh server of the same command (with --url: to the same server, after the soak), and
the two answers must be equal. dflash-server is
started with -np SLOTS when its --help offers -np, else its requests queue behind one
another (the results say which).

Checks: the server stays up (and exits 0 with no traceback when this command started it);
no request is lost (every one gets its answer, its 4xx, or was left by its client) or
answered twice (one final chunk, one [DONE], nothing after); the server's counters agree
(requests run = requests accepted, none failed, cancellations <= clients that left);
every greedy answer equals its solo answer, and some of those compared were prefilled
cold (no prompt token reused) while other requests were in flight; some follow-ups
resumed from a prefix checkpoint (and so were compared restored); malformed requests get
a 4xx with a reason; the resident memory less the prefix checkpoints' bytes (both from
/metrics) stays within --rss-tolerance (1%) of its level after warm-up. Exit status 0
when every check passes. The results JSON (default results/soak-<UTC time>.json) carries
the provenance dflash-bench records and a compact record of every request. Bounded: at
most 20,000 requests, 64 clients, an hour of requests.
"""
from __future__ import annotations

import argparse
import bisect
import datetime as _dt
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import httpx

from .. import provenance
from ..prompts import PROMPTS
from . import serve_load

# share of each kind of request in the plan
KINDS = {"greedy": 0.30, "follow-up": 0.15, "sampled": 0.10, "leave-stream": 0.15, "leave-early": 0.15,
         "malformed": 0.15}
GREEDY = ("greedy", "follow-up")  # the kinds compared with their solo answers
TURNS = 4                         # the longest conversation: a greedy request and 3 follow-ups
RECENT = 40                       # a follow-up continues one of the last RECENT conversations
# bodies the server must refuse with a 4xx (each with the path it goes to); raw bytes are sent as they are
MALFORMED = [
    ("/v1/completions", b'{"prompt": "def f(x):", "max_tokens": 8'),
    ("/v1/completions", b"[1, 2, 3]"),
    ("/v1/completions", {"prompt": 5, "max_tokens": 8}),
    ("/v1/completions", {"prompt": "def f(x):", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "def f(x):", "temperature": "hot"}),
    ("/v1/completions", {"prompt": [1 << 30], "max_tokens": 8}),
    ("/v1/completions", {"prompt": "def f(x):", "n": 17}),  # n is 1-16
    ("/v1/completions", {"prompt": "def f(x):", "stop": [1, 2]}),
    ("/v1/completions", {"prompt": "", "max_tokens": 8, "stream": True}),
    ("/v1/chat/completions", {"messages": "hello", "max_tokens": 8}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 8}),
]
MAX_REQUESTS, MAX_CLIENTS, MAX_DURATION = 20000, 64, 3600.0


def log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


@dataclass
class Spec:
    """One planned request."""

    index: int
    kind: str
    path: str
    body: object                       # a dict (sent as JSON) or raw bytes
    leave_after: Optional[int] = None  # streamed: leave after this many text events (0: at once)
    parent: Optional[int] = None       # a follow-up: the request whose prompt and answer it continues
    turn_text: str = ""                # a follow-up: the new text after that answer
    turn: int = 0                      # a conversation's turn (0: its first request)


def random_prompt(rng: random.Random, index: int, lo: int, hi: int) -> str:
    """Code-like text of lo..hi characters after a line naming request `index`: the
    benchmark's prompts shuffled and cut. Every request has its own prompt (a repeated one
    could be answered from a cache alone) sharing prefixes with others (which the prefix
    checkpoints serve)."""
    length = rng.randint(lo, hi)
    parts: List[str] = []
    while sum(map(len, parts)) < length:
        parts.append(rng.choice(PROMPTS)[1])
    return f"# request {index}\n" + "".join(parts)[:length]


def plan(n: int, seed: int, max_tokens: int, long_chars: int) -> List[Spec]:
    """`n` requests of the KINDS, in a random order fixed by `seed`."""
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=n)
    specs: List[Spec] = []
    open_turns: List[Spec] = []  # greedy requests and follow-ups a follow-up may continue, latest last
    for i, kind in enumerate(kinds):
        if kind == "follow-up" and not open_turns:
            kind = "greedy"  # nothing to continue yet
        if kind == "follow-up":
            parent = rng.choice(open_turns[-RECENT:])
            spec = Spec(i, kind, "/v1/completions",
                        {"model": "soak", "prompt": None,  # the parent's prompt and answer: known when it is sent
                         "max_tokens": rng.randint(1, max_tokens), "stream": rng.random() < 0.5, "temperature": 0},
                        parent=parent.index, turn_text="\n" + random_prompt(rng, i, 8, 300), turn=parent.turn + 1)
            specs.append(spec)
            if spec.turn + 1 < TURNS:
                open_turns.append(spec)
            continue
        if kind == "malformed":
            path, body = MALFORMED[rng.randrange(len(MALFORMED))]
            specs.append(Spec(i, kind, path, body))
            continue
        long = kind == "leave-early"
        body = {"model": "soak", "prompt": random_prompt(rng, i, long_chars // 2, long_chars) if long
                else random_prompt(rng, i, 8, 600),
                "max_tokens": rng.randint(1, max_tokens), "stream": kind != "greedy" or rng.random() < 0.5,
                "temperature": 0}
        if kind == "sampled":
            body.update(temperature=0.6, top_k=20, top_p=0.95, seed=rng.randrange(1 << 30))
        leave = {"leave-stream": rng.randint(1, 8), "leave-early": 0}.get(kind)
        specs.append(Spec(i, kind, "/v1/completions", body, leave))
        if kind == "greedy":
            open_turns.append(specs[-1])
    return specs


class Conversations:
    """The answers follow-ups continue: a follow-up's prompt is its parent's prompt, the
    parent's answer as the server gave it, and its own new text, known once the parent
    is answered (a client waits for it, as a person waits for a reply). A parent that got
    no answer (or none in `timeout` seconds) is continued with no answer text."""

    def __init__(self, specs: List[Spec], timeout: float):
        self.timeout = timeout
        parents = {s.parent for s in specs if s.parent is not None}
        self._done = {i: threading.Event() for i in parents}
        self._answer: dict = {}

    def prompt(self, spec: Spec) -> None:
        """Fill in a follow-up's prompt (its body is sent, and later sent alone, as filled)."""
        if spec.parent is None:
            return
        self._done[spec.parent].wait(self.timeout)
        prompt, text = self._answer.get(spec.parent, ("", ""))
        spec.body["prompt"] = prompt + text + spec.turn_text

    def answered(self, spec: Spec, reply: Optional[serve_load.Reply]) -> None:
        if spec.index in self._done:
            text = reply.text if reply is not None and reply.complete else ""
            self._answer[spec.index] = (spec.body["prompt"], text)
            self._done[spec.index].set()


# -- checks (pure: the records of a run in, a verdict out) ------------------------------------------

def check(ok: bool, detail: str) -> dict:
    return {"ok": bool(ok), "detail": detail}


def check_outcomes(specs: List[Spec], replies: List[Optional[serve_load.Reply]], by_time: bool = False) -> dict:
    """Every request run got what it should, once; every one planned was sent (`by_time`:
    a --duration run, which sends what its time allows)."""
    lost, twice, refused, wrong_status = [], [], [], []
    for spec, r in zip(specs, replies):
        if r is None:
            continue  # not sent: the time limit came first
        if r.finals > 1 or r.dones > 1 or r.after_done:
            twice.append(spec.index)
        elif spec.kind == "malformed":
            if not (r.status is not None and 400 <= r.status < 500 and r.error):
                refused.append(spec.index)
        elif r.status is None:  # a transport error: a client leaves only after its response starts
            lost.append(spec.index)
        elif r.status != 200:
            wrong_status.append((spec.index, r.status, r.error))
        elif not r.left and not r.complete:
            lost.append(spec.index)
        elif not r.left and spec.body.get("stream") and r.dones != 1:
            lost.append(spec.index)
    sent = sum(r is not None for r in replies)
    return {
        "all_sent": check(sent == len(specs) or (by_time and sent > 0),
                          f"{sent} of {len(specs)} requests sent " + ("in the time given" if by_time
                                                                       else "before the time limit")),
        "none_lost": check(not lost and not wrong_status,
                           f"lost (no whole answer): {lost[:20]}; not 200: {wrong_status[:20]}"
                           if lost or wrong_status else "every request answered, refused or left by its client"),
        "none_twice": check(not twice, f"answered twice: {twice[:20]}" if twice else "no answer sent twice"),
        "malformed_refused": check(not refused, f"not refused with a 4xx and a reason: {refused[:20]}" if refused
                                   else "every malformed request got a 4xx with a reason"),
    }


def prefilled_among_others(replies: List[Optional[serve_load.Reply]]) -> List[bool]:
    """Per reply: whether another request was in flight while it was prefilled (from its
    sending to its first text, or its end), as the client saw it."""
    spans = [(r.sent, r.sent + r.seconds, i) for i, r in enumerate(replies) if r is not None]
    spans.sort()
    # the two latest ends among the spans started so far: one of them is not the reply's own
    top: List[List[tuple]] = []
    best: List[tuple] = []
    for start, end, i in spans:
        best = sorted(best + [(end, i)], reverse=True)[:2]
        top.append(best)
    starts = [s for s, _, _ in spans]
    out = [False] * len(replies)
    for i, r in enumerate(replies):
        if r is None:
            continue
        prefill_end = r.sent + (r.ttft if r.ttft is not None else r.seconds)
        k = bisect.bisect_left(starts, prefill_end) - 1  # spans started before its prefill ended
        out[i] = k >= 0 and any(end > r.sent and j != i for end, j in top[k])
    return out


def check_solo(specs: List[Spec], replies: List[Optional[serve_load.Reply]], solo: dict,
               clients: int = 2) -> dict:
    """Every greedy answer kept equals the same request's answer alone, and some of those
    compared were prefilled cold (no prompt token reused: not resumed from a checkpoint)
    while other requests were in flight (with one client none is: cold is enough)."""
    differ, compared, cold, batched, both = [], 0, 0, 0, 0
    follow_ups, restored = 0, 0
    among = prefilled_among_others(replies)
    for spec, r, busy in zip(specs, replies, among):
        if spec.kind not in GREEDY or r is None or not r.complete or spec.index not in solo:
            continue
        want = solo[spec.index]
        compared += 1
        was_cold = r.extension.get("reused_prompt_tokens") == 0
        cold, batched, both = cold + was_cold, batched + busy, both + (was_cold and busy)
        if spec.kind == "follow-up":
            follow_ups += 1
            restored += r.extension.get("checkpoint") is not None
        if (r.text, r.tokens) != (want.text, want.tokens):
            at = next((i for i, (a, b) in enumerate(zip(r.text, want.text)) if a != b), min(len(r.text),
                                                                                          len(want.text)))
            differ.append({"index": spec.index, "first_difference_at": at, "tokens": r.tokens,
                           "solo_tokens": want.tokens, "cold": was_cold, "among_others": busy})
    how = (f"{compared} compared, {cold} prefilled cold, {batched} prefilled while others were in flight, "
           f"{both} both; {follow_ups} follow-ups, {restored} of them resumed from a prefix checkpoint")
    if differ:
        detail = f"{len(differ)} of {compared} greedy answers differ from their solo answers ({how}): {differ[:10]}"
    tested = both if clients > 1 else cold
    if differ:
        detail = f"{len(differ)} of {compared} greedy answers differ from their solo answers ({how}): {differ[:10]}"
    elif not tested:
        detail = f"no greedy answer was compared that was prefilled cold{' among others' * (clients > 1)} ({how})"
    else:
        detail = f"every greedy answer equals its solo answer ({how})"
    return {"greedy_equal_solo": check(not differ and tested > 0, detail),
            "follow_ups_restored": check(restored > 0 and not differ,
                                         f"{restored} of {follow_ups} follow-ups compared resumed from a prefix "
                                         "checkpoint" + (", and some answers differ" if differ else ""))}


def check_accounting(before: dict, after: dict, accepted: int, left: int) -> dict:
    """The server's own counters over the concurrent phase."""
    def delta(name):
        return after.get(name, float("nan")) - before.get(name, float("nan"))

    run, failed, cancelled = (delta(f"dflash_{n}_total") for n in ("requests", "requests_failed",
                                                                  "requests_cancelled"))
    ok = run == accepted and failed == 0 and 0 <= cancelled <= left
    return {"server_counters": check(ok, f"requests run {run:g} (accepted {accepted}), failed {failed:g}, "
                                         f"cancelled {cancelled:g} (clients that left: {left})")}


def memory_less_checkpoints(metrics: dict) -> Optional[float]:
    """Resident bytes less what the prefix checkpoints hold (on a CPU both places are host
    memory; elsewhere this counts the device's share out too, which only loosens the check)."""
    rss = metrics.get("process_resident_memory_bytes")
    if rss is None:
        return None
    return rss - sum(v for k, v in metrics.items() if k.startswith("dflash_checkpoint_bytes"))


def check_rss(samples: List[dict], warmed_after: int, tolerance: float) -> dict:
    """samples: {"done": requests finished, "net": memory_less_checkpoints} in time order. The
    level is the first sample taken once `warmed_after` requests had finished; every later one
    must stay within `tolerance` of it. The detail gives the trend too (least squares, KiB
    per request), which shows a creep the tolerance has not caught yet."""
    if any(s["net"] is None for s in samples):
        return {"rss_flat": check(False, "/metrics has no process_resident_memory_bytes")}
    after = [s for s in samples if s["done"] >= warmed_after]
    if len(after) < 2:
        return {"rss_flat": check(False, f"fewer than 2 memory samples after warm-up ({warmed_after} requests)")}
    level, peak = after[0]["net"], max(s["net"] for s in after)
    growth = peak / level - 1
    trend = ""
    if len({s["done"] for s in after}) > 1:
        slope = statistics.linear_regression([s["done"] for s in after], [s["net"] for s in after]).slope
        trend = f", trend {slope / 2**10:+.2f} KiB per request"
    return {"rss_flat": check(growth <= tolerance,
                              f"RSS less checkpoints {level / 2**20:.1f} MiB after warm-up ({warmed_after} "
                              f"requests), peak {peak / 2**20:.1f} MiB ({growth:+.2%}; tolerance {tolerance:.0%}), "
                              f"last {after[-1]['net'] / 2**20:.1f} MiB{trend}")}


# -- the run ----------------------------------------------------------------------------------------

@dataclass
class Sampler:
    """/metrics read every `every` seconds on a thread of its own, with the number of
    requests finished at that moment."""

    http: httpx.Client
    url: str
    every: float
    done: int = 0
    samples: List[dict] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def finished(self) -> None:
        """A request has finished (called from the clients' threads)."""
        with self._lock:
            self.done += 1

    def sample(self) -> None:
        m = serve_load.parse_metrics(self.http.get(self.url + "/metrics").text)
        self.samples.append({"t": time.monotonic(), "done": self.done, "net": memory_less_checkpoints(m),
                             "rss": m.get("process_resident_memory_bytes"),
                             "checkpoint_bytes": sum(v for k, v in m.items()
                                                     if k.startswith("dflash_checkpoint_bytes"))})

    def __enter__(self):
        def loop():
            while not self._stop.wait(self.every):
                try:
                    self.sample()
                except httpx.HTTPError:
                    pass  # a server that died is the liveness check's to report
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def metrics(http: httpx.Client, url: str) -> dict:
    return serve_load.parse_metrics(http.get(url + "/metrics").text)


def soak(url: str, specs: List[Spec], clients: int, args) -> tuple:
    """The concurrent phase and its checks but the solo one: (result, replies)."""
    deadline = time.monotonic() + (args.duration or MAX_DURATION)
    with httpx.Client(trust_env=False, timeout=args.timeout, limits=httpx.Limits(max_connections=clients + 2)) as http:
        before = metrics(http, url)
        log(f"{len(specs)} requests from {clients} clients at once"
            + (f", for {args.duration:g} s at most" if args.duration else ""))
        with Sampler(http, url, args.sample_every) as sampler:
            sampler.sample()

            conversations = Conversations(specs, args.timeout)

            def run(spec: Spec) -> serve_load.Reply:
                reply = None
                try:
                    conversations.prompt(spec)
                    reply = serve_load.complete(http, url, spec.body, spec.leave_after, spec.path)
                finally:
                    conversations.answered(spec, reply)  # never leave a follow-up waiting
                sampler.finished()
                return reply

            t0 = time.perf_counter()
            replies = serve_load.drain(specs, clients, run, deadline)
            wall = time.perf_counter() - t0
        accepted = sum(r is not None and r.status == 200 for r in replies)
        left = sum(r is not None and r.left for r in replies)
        try:
            # a cancelled request is counted when the engine reaches a step boundary: let them settle
            serve_load.poll_until(lambda: metrics(http, url).get("dflash_requests_total", 0)
                                  - before.get("dflash_requests_total", 0) >= accepted, args.settle)
            serve_load.poll_until(lambda: http.get(url + "/health").json().get("running", 0) == 0, args.settle)
            sampler.sample()
            after = metrics(http, url)
            healthy = http.get(url + "/health").status_code == 200
        except httpx.HTTPError:  # the server is gone: every check below reports what that cost
            after, healthy = {}, False
    sent = sum(r is not None for r in replies)
    checks = {"server_up": check(healthy, "/health answers 200 after the soak" if healthy
                                 else "/health does not answer 200 after the soak")}
    checks.update(check_outcomes(specs, replies, by_time=args.duration is not None))
    checks.update(check_accounting(before, after, accepted, left))
    warmed = int(sent * args.warmup)
    checks.update(check_rss(sampler.samples, warmed, args.rss_tolerance))
    kinds = {k: sum(s.kind == k for s, r in zip(specs, replies) if r is not None) for k in KINDS}
    return {"checks": checks, "wall_seconds": round(wall, 3), "sent": sent, "kinds": kinds,
            "left_before_first_token": sum(r is not None and r.left and r.ttft is None for r in replies),
            "left_mid_stream": sum(r is not None and r.left and r.ttft is not None for r in replies),
            "generated_tokens": sum(r.tokens or 0 for r in replies if r is not None and r.complete),
            "metrics_before": before, "metrics_after": after, "memory_samples": sampler.samples,
            "warmed_after_requests": warmed}, replies


def solo_answers(url: str, specs: List[Spec], replies: List[Optional[serve_load.Reply]], args) -> dict:
    """{index: the answer alone} of every greedy request answered in the soak, one at a time."""
    greedy = [s for s, r in zip(specs, replies) if s.kind in GREEDY and r is not None and r.complete]
    log(f"{len(greedy)} greedy requests and follow-ups alone (their solo answers, computed whole)")
    with httpx.Client(trust_env=False, timeout=args.timeout) as http:
        solo = {s.index: serve_load.complete(http, url, {**s.body, "stream": False, "cache_prompt": False})
                for s in greedy}
    bad = [i for i, r in solo.items() if not r.complete]
    if bad:
        raise RuntimeError(f"solo requests {bad[:10]} got no answer: {solo[bad[0]].error}")
    return solo


def request_records(specs: List[Spec], replies: List[Optional[serve_load.Reply]]) -> List[dict]:
    """What each request got, without its body or text (the plan is reproducible from the
    seed and settings, and a long soak's bodies would fill the file)."""
    out = []
    for s, r in zip(specs, replies):
        rec = {"index": s.index, "kind": s.kind, "path": s.path, "leave_after": s.leave_after}
        if s.parent is not None:
            rec.update(parent=s.parent, turn=s.turn)
        if r is not None:
            rec.update(status=r.status, tokens=r.tokens, seconds=round(r.seconds, 4),
                       ttft=None if r.ttft is None else round(r.ttft, 4), finish_reason=r.finish_reason,
                       finals=r.finals, dones=r.dones, after_done=r.after_done, left=r.left, error=r.error,
                       reused_prompt_tokens=r.extension.get("reused_prompt_tokens"),
                       checkpoint_position=(r.extension.get("checkpoint") or {}).get("position"))
        out.append(rec)
    return out


def start(cmd: List[str], log_path: Path) -> serve_load.ServerProcess:
    """The server command on a free loopback port."""
    port = serve_load.free_port()
    return serve_load.ServerProcess([*cmd[:5], "--port", str(port), *cmd[5:]], port, log_path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-bench soak", description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="soak a running server (loopback only) instead of starting the demo server")
    p.add_argument("--requests", type=int,
                   help=f"requests in all (default 200, with --duration {MAX_REQUESTS}; at most {MAX_REQUESTS})")
    p.add_argument("--duration", type=float,
                   help=f"seconds to send requests in (at most {MAX_DURATION:.0f}); without it every request is sent, "
                        f"within {MAX_DURATION:.0f} s")
    p.add_argument("--slots", type=int, default=4,
                   help="concurrent clients, and dflash-server's -np when it takes one (default 4)")
    p.add_argument("--max-tokens", type=int, default=160, help="max_tokens are drawn from 1..N (default 160)")
    p.add_argument("--long-prompt-chars", type=int, default=6000,
                   help="prompts of clients leaving early have N/2..N characters (default 6000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request plan (default 0)")
    p.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="threads of the server started (default: the CPUs this process may use)")
    p.add_argument("--timeout", type=float, default=300, help="per-request timeout in seconds (default 300)")
    p.add_argument("--settle", type=float, default=60, help="seconds for the server to account for every request")
    p.add_argument("--warmup", type=float, default=0.2,
                   help="share of the concurrent requests after which memory must stay flat (default 0.2)")
    p.add_argument("--rss-tolerance", type=float, default=0.01,
                   help="growth allowed to the resident memory less checkpoints after warm-up (default 0.01: 1%%)")
    p.add_argument("--sample-every", type=float, default=0.25, help="seconds between /metrics reads (default 0.25)")
    p.add_argument("-o", "--output", type=Path,
                   help="results JSON (a bare file name goes under results/; default results/soak-<UTC time>.json)")
    p.add_argument("server_args", nargs="*",
                   help="more flags for the dflash-server started, after -- (it gets -c 4096 -ub 64 first: "
                        "long prompts take many chunks)")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.requests is None:
        args.requests = MAX_REQUESTS if args.duration else 200
    if not 1 <= args.requests <= MAX_REQUESTS or not 1 <= args.slots <= MAX_CLIENTS:
        p.error(f"--requests must be 1..{MAX_REQUESTS}, --slots 1..{MAX_CLIENTS}")
    if args.duration is not None and not 0 < args.duration <= MAX_DURATION:
        p.error(f"--duration must be in (0, {MAX_DURATION:.0f}] seconds")
    if args.max_tokens < 1 or args.long_prompt_chars < 2 or args.timeout <= 0 or args.threads < 1:
        p.error("--max-tokens, --long-prompt-chars, --timeout and -t must be positive")
    if not 0 <= args.warmup < 1 or args.rss_tolerance < 0 or args.sample_every <= 0:
        p.error("--warmup must be in [0, 1), --rss-tolerance >= 0, --sample-every > 0")
    if args.url:
        try:
            url = serve_load.loopback_url(args.url)
        except ValueError as e:
            p.error(str(e))
        if args.server_args:
            p.error("server flags go to a server this script starts, not to --url")
    specs = plan(args.requests, args.seed, args.max_tokens, args.long_prompt_chars)
    started, load_before = _dt.datetime.now(_dt.timezone.utc), provenance.load_average()
    server, np_flag, cmd = None, None, None
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        try:
            if not args.url:
                np_flag = serve_load.accepts_flag(serve_load.dflash_server_help(), "-np")
                cmd = [sys.executable, "-m", "dflash_gguf.serving.server", "--host", "127.0.0.1", "--metrics",
                       "-t", str(args.threads), "--queue", str(args.slots), "-ub", "64",
                       # 4096 positions a sequence: -np's slots share -c
                       "-c", str(4096 * (args.slots if np_flag else 1)),
                       *(["-np", str(args.slots)] if np_flag else []), *args.server_args]
                log(f"dflash-server {'with -np ' + str(args.slots) if np_flag else 'without -np (requests queue)'}")
                server = start(cmd, Path(tmp) / "server.log")
                url = server.url
            result, replies = soak(url, specs, args.slots, args)
        except (RuntimeError, OSError, httpx.HTTPError) as e:
            print(f"soak: error: {e}" + (f" (server log: {server.log_tail()})" if server else ""), file=sys.stderr)
            if server:
                server.stop()
            return 1
        if server:
            status = server.stop()
            text = server.log_text()
            result["checks"]["server_exit"] = check(
                status == 0 and "Traceback" not in text,
                f"exit status {status}" + ("; a traceback in its log" if "Traceback" in text else ""))
            result["server_log_tail"] = text[-4000:]
        reference = None
        try:
            if not args.url:  # a fresh server of the same command: the solo answers prefilled cold, alone
                reference = start(cmd, Path(tmp) / "reference.log")
            solo = solo_answers(reference.url if reference else url, specs, replies, args)
        except (RuntimeError, OSError, httpx.HTTPError) as e:
            print(f"soak: error while taking the solo answers: {e}", file=sys.stderr)
            return 1
        finally:
            if reference:
                reference.stop()
        result["checks"].update(check_solo(specs, replies, solo, args.slots))
        result["solo_answers_from"] = "the same server, after the soak" if args.url else "a fresh server"
        result["requests"] = request_records(specs, replies)
    load_after = provenance.load_average()
    out = {"tool": "soak", "started": started.isoformat(timespec="seconds"),
           "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "checkout": provenance.checkout(), "versions": provenance.versions(),
           "machine": provenance.machine(args.threads, "CPU"), "load_average": {"before": load_before, "after": load_after},
           "server": {"url": args.url, "command": cmd, "np_flag": np_flag, "clients": args.slots},
           "settings": {k: v for k, v in vars(args).items() if k not in ("output", "url")},
           "passed": all(c["ok"] for c in result["checks"].values()), **result}
    path = args.output or Path(f"soak-{started:%Y-%m-%d-%H%M}.json")
    path = Path("results") / path if path.parent == Path(".") else path
    provenance.write_results(path, out)
    for name, c in out["checks"].items():
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {name:20} {c['detail']}")
    print(f"{out['sent']} requests ({', '.join(f'{n} {k}' for k, n in out['kinds'].items())}) from {args.slots} "
          f"clients in {out['wall_seconds']:.1f} s; load average {load_before[0]:.2f} before, {load_after[0]:.2f} "
          f"after; wrote {path}")
    return 0 if out["passed"] else 1

