"""dflash-bench workload: multi-turn chat sessions replayed through dflash-server, greedy,
once per arm (plain decoding and each --spec-type), with every arm's replies checked
against plain decoding's, token for token, as lossless speculation must give them.

    dflash-bench workload                                  # the bundled stdlib workload, demo target
    dflash-bench workload my-sessions.jsonl -m target.gguf --spec-type ngram-simple --spec-type suffix
    dflash-bench workload --sessions rename-wrap-chunks,prose -n 64 -r 1 -o mine.json
    dflash-bench workload -m target.gguf --spec-type suffix --llama-spec-type ngram-mod --llama-spec-type none

Each turn is a /v1/chat/completions request holding the whole session so far: the
workload's user messages and the server's own earlier replies (temperature 0). Every arm
is a dflash-server of its own, started anew for each repetition (so that nothing a
server learns from one repetition's sessions, such as a corpus of earlier replies, drafts
the next repetition's identical ones) and warmed up by one short request before any
session is timed. Within a repetition every session runs on every arm before the next
session starts, the arms' order rotated by one for each repetition and session.
--llama-spec-type adds llama.cpp's llama-server as arms of the same run (its own --spec-type,
or `none` for its plain decoding), on the same GGUF and threads, for the comparison with
llama.cpp on the same requests; its replies are compared with our plain decoding's and
the differences reported, not failed (another engine's rounding may part at a near tie).

Per arm and session the rows give decode tok/s (completion tokens over the server's
decode seconds, summed over the session's turns), wall seconds, completion tokens and,
for the arms that draft, the target's passes and the drafts they accepted: medians over
the repetitions with their min-max; against plain decoding, the median and min-max of the
per-repetition ratios and their verdict (stats.verdict: "no difference measured" where that
range holds 1, "too few repetitions for a verdict" near 1 under 5 of them). Any arm whose
reply differs from plain decoding's in the same repetition fails the run (exit status 1).
The results file (-o; default results/workload-<UTC time>.json) records the workload
file's sha256, the commit and whether the checkout has uncommitted changes (refused
without --force), the machine, versions and the load average at every cell. Servers
listen on loopback only.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import httpx

from ...runtime.demo import DATA
from ...speculation.kinds import FILE_KINDS, SIMPLE
from ...tools import llama_cpp_tree
from .. import method, provenance, stats
from ..stats import Spread
from . import serve_load
from .workload import Session, WorkloadError, load

BUNDLED = DATA / "workloads" / "stdlib.jsonl"
PLAIN = "plain"
CONTROL = "plain-control"  # --control: a second plain arm, the run's own A/A spread
LLAMA = "llama-server"
LLAMA_PLAIN = "none"  # --llama-spec-type none: llama-server decoding without drafts
DEFAULT_ARMS = ("ngram-simple", "ngram-mod")
WARMUP = [{"role": "user", "content": "Say hello."}]


def log(msg: str) -> None:
    print(f"[bench-workload] {msg}", file=sys.stderr, flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-bench workload", usage="%(prog)s [FILE] [flags] [-- server flags]",
                                description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", nargs="?", type=Path, default=BUNDLED,
                   help="a workload file, JSON or JSONL (docs/workloads.md; default: the bundled "
                        "dflash_gguf/data/workloads/stdlib.jsonl)")
    p.add_argument("-m", "--model", help="target GGUF (default: the bundled demo target)")
    p.add_argument("-md", "--model-draft", help="drafter GGUF, for the arms whose --spec-type drafts with one")
    p.add_argument("--spec-type", action="append", metavar="KINDS",
                   help="an arm beside plain decoding: dflash-server's --spec-type, passed as it is (a comma list "
                        "is one arm drafting with several kinds); repeatable (default: ngram-simple, ngram-mod and, "
                        "with -md, the drafter file's own kind)")
    p.add_argument("--control", action="store_true",
                   help=f"add a second plain-decoding arm ({CONTROL}), timed and compared with plain like the "
                        "others: how far plain against itself strays in this run (an A/A test), the yardstick "
                        "for the other arms' ratios")
    p.add_argument("--llama-spec-type", action="append", metavar="KINDS",
                   help="an arm of llama.cpp's llama-server with this --spec-type (`none`: its plain decoding); "
                        "repeatable; needs -m and a built llama-server (python scripts/llama_cpp_build.py "
                        "llama-server)")
    p.add_argument("--llama-cpp", type=Path, metavar="DIR",
                   help="the directory holding llama-server (default: where scripts/llama_cpp_build.py builds it)")
    p.add_argument("--sessions", metavar="NAME[,NAME...]", help="run only these sessions of the workload")
    p.add_argument("-n", "--n-predict", type=int, help="cap every turn's max_tokens at N (default: the workload's)")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="repetitions of every session (default 3)")
    p.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="CPU threads of every server (default: the CPUs this process may use)")
    p.add_argument("-c", "--ctx-size", type=int, default=0,
                   help="every server's context (default 0: the model's trained context)")
    method.add_load_flags(p)
    p.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout in seconds (default 1800)")
    p.add_argument("--force", action="store_true",
                   help="run from a checkout with uncommitted changes (recorded in the file)")
    p.add_argument("-o", "--output", type=Path,
                   help="results JSON (a bare file name goes under results/; default results/workload-<UTC time>.json)")
    p.add_argument("--keep-raw", action="store_true",
                   help="also write the whole record, every reply's text too, gzipped beside it as <name>.raw.json.gz")
    p.add_argument("--json", action="store_true", help="print the results JSON instead of the table")
    return p


def parse_args(p: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """The flags, and in server_args what follows `--`: flags for every started server. Split
    here rather than by argparse, which would take the first of them for the optional
    workload file when none is given."""
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.server_args = argv[cut + 1:]
    return args


# -- arms and their servers ------------------------------------------------------------------------

@dataclass(frozen=True)
class Arm:
    """A server decoding one way: plain (spec_type None) or drafting by --spec-type;
    dflash-server, or llama.cpp's llama-server for the comparison with it."""

    spec_type: Optional[str] = None
    engine: str = "ours"
    control: bool = False  # a second plain arm: what plain against itself looks like in this run

    @property
    def name(self) -> str:
        if self.engine == LLAMA:
            return f"{LLAMA}:{self.spec_type}" if self.spec_type else LLAMA
        return CONTROL if self.control else self.spec_type or PLAIN

    @property
    def ours(self) -> bool:
        return self.engine != LLAMA

    @property
    def reads_drafter(self) -> bool:
        """Whether its kinds draft with the -md file (the others draft from text or -m itself)."""
        return any(k.strip() in (*FILE_KINDS, SIMPLE) for k in (self.spec_type or "").split(","))


def default_kinds(model: Optional[str], draft: Optional[str]) -> List[str]:
    """The arms without --spec-type: the n-gram kinds, and the -md file's own kind when one
    is given (what the server drafts with when given it alone)."""
    from ...engine.setup import resolve_spec_types

    return [*DEFAULT_ARMS, *(resolve_spec_types(None, model, draft) if draft else ())]


def arms_of(spec_types: Sequence[str], llama_spec_types: Sequence[str] = (), control: bool = False) -> List[Arm]:
    """Plain decoding first (every other arm is checked against it), the control arm when
    asked, then each kind once, then llama-server's."""
    llama = [Arm(None if k == LLAMA_PLAIN else k, LLAMA) for k in dict.fromkeys(llama_spec_types)]
    return [Arm(), *([Arm(control=True)] if control else [])] + [Arm(k) for k in dict.fromkeys(spec_types)] + llama


def llama_server_command(arm: Arm, port: int, args) -> List[str]:
    """llama-server at its defaults but for what both engines must share: the GGUF, threads,
    context and one slot (`-c 0` is the model's trained context for both)."""
    t = str(args.threads)
    cmd = [str(args.llama_server), "--host", "127.0.0.1", "--port", str(port), "-m", args.model, "-t", t, "-tb", t,
           "-c", str(args.ctx_size), "-np", "1", "--no-webui"]
    if arm.spec_type:
        cmd += ["--spec-type", arm.spec_type]
        if args.model_draft and arm.reads_drafter:
            cmd += ["-md", args.model_draft, "-td", t, "-tbd", t]
    return cmd


def server_command(arm: Arm, port: int, args) -> List[str]:
    """dflash-server for `arm`. Without -m the server takes the bundled demo pair itself,
    and its drafter only for the kinds that read one. Flags after `--` go to dflash-server
    only: they are its flags."""
    if not arm.ours:
        return llama_server_command(arm, port, args)
    cmd = [sys.executable, "-m", "dflash_gguf.serving.server", "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-c", str(args.ctx_size), "--queue", "1"]
    if args.model:
        cmd += ["-m", args.model]
    if args.model_draft and arm.reads_drafter:
        cmd += ["-md", args.model_draft]
    cmd += ["--spec-type", arm.spec_type] if arm.spec_type else ["--no-spec"]
    return cmd + list(args.server_args)


# -- one turn, one session -------------------------------------------------------------------------

class TurnError(RuntimeError):
    """A turn the server did not answer whole."""


def chat(http: httpx.Client, url: str, messages: List[dict], max_tokens: int) -> dict:
    """One greedy chat-completions request: the reply's text and the figures of its turn.
    Not streamed: the server's own timings (its "dflash" figures) time the decoding, and
    the client's wall time includes the prefill of the session so far."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    try:
        r = http.post(url + "/v1/chat/completions", json=body)
    except httpx.HTTPError as e:
        raise TurnError(f"{type(e).__name__}: {e}") from None
    wall = time.perf_counter() - t0
    try:
        reply = r.json()
    except ValueError:
        raise TurnError(f"status {r.status_code}, not JSON: {r.text[:200]!r}") from None
    if r.status_code != 200 or "error" in reply:
        raise TurnError(f"status {r.status_code}: {json.dumps(reply.get('error', reply))[:300]}")
    choice = reply["choices"][0]
    return {"text": choice["message"].get("content") or "", "finish_reason": choice.get("finish_reason"),
            "completion_tokens": reply["usage"]["completion_tokens"], "prompt_tokens": reply["usage"]["prompt_tokens"],
            "wall_s": wall, **figures_of(reply)}


def figures_of(reply: dict) -> dict:
    """The server's own figures of a turn: dflash-server's `dflash` object, or llama-server's
    `timings` (its predicted_ms times the tokens after the prompt's, as our decode seconds do)."""
    if "dflash" in reply or "timings" not in reply:
        figures = reply.get("dflash") or {}
        passes = figures.get("target_passes") or 0
        return {"reused_prompt_tokens": figures.get("reused_prompt_tokens"), "step_s": figures.get("step_seconds"),
                # suffix's drafts from the corpus of earlier requests: {drafted, accepted}
                "corpus_drafts": figures.get("suffix_corpus_drafts"),
                "decode_s": figures.get("decode_seconds"), "prefill_s": figures.get("prefill_seconds"),
                "target_passes": passes,
                "drafted": sum(d["drafted"] for d in figures["drafts"].values()) if "drafts" in figures else None,
                # each pass makes its accepted drafts and one token of the target's own
                "accepted_drafts": sum(figures.get("accepted_lengths") or ()) - passes}
    t = reply["timings"]
    accepted = t.get("draft_n_accepted") or 0
    return {"reused_prompt_tokens": t.get("cache_n"), "decode_s": t["predicted_ms"] / 1000.0,
            "prefill_s": t["prompt_ms"] / 1000.0,
            # a pass makes its accepted drafts and one token; plain decoding reports no passes
            "target_passes": t["predicted_n"] - accepted if "draft_n" in t else 0,
            "drafted": t.get("draft_n"), "accepted_drafts": accepted}


def run_session(http: httpx.Client, url: str, session: Session, cap: Optional[int]) -> List[dict]:
    """The session's turns, each asked with every earlier turn and the server's replies."""
    messages = [{"role": "system", "content": session.system}] if session.system is not None else []
    out = []
    for i, turn in enumerate(session.turns):
        messages.append({"role": "user", "content": turn.user})
        got = chat(http, url, messages, min(turn.max_tokens, cap or turn.max_tokens))
        messages.append({"role": "assistant", "content": got["text"]})
        out.append({"turn": i, **got})
    return out


# -- the run ---------------------------------------------------------------------------------------

def rotated(arms: List[Arm], k: int) -> List[Arm]:
    k %= len(arms)
    return arms[k:] + arms[:k]


def start_servers(arms: List[Arm], args, log_dir: Path, rep: int, failures: List[dict]) -> Dict[Arm, object]:
    """Every arm's server, started and warmed up; one that does not start is a failure."""
    servers = {}
    for arm in arms:
        port = serve_load.free_port()
        cmd = server_command(arm, port, args)
        try:
            server = serve_load.ServerProcess(cmd, port, log_dir / f"{arm.name}-rep{rep + 1}.log")
        except RuntimeError as e:
            log(f"{arm.name}: {e}")
            failures.append({"arm": arm.name, "rep": rep, "command": cmd, "error": str(e)})
            continue
        servers[arm] = server
        with httpx.Client(trust_env=False, timeout=args.timeout) as http:
            try:  # graphs and caches made before anything is timed
                chat(http, server.url, WARMUP, 4)
            except TurnError as e:
                failures.append({"arm": arm.name, "rep": rep, "command": cmd, "error": f"warm-up: {e}"})
    return servers


def stop_servers(servers: Dict[Arm, object], rep: int, failures: List[dict]) -> None:
    for arm, server in servers.items():
        status = server.stop()
        if status != 0:
            failures.append({"arm": arm.name, "rep": rep, "command": server.cmd,
                             "error": f"exit status {status}: {server.log_tail()}"})


def measure(args, sessions: Sequence[Session], arms: List[Arm], log_dir: Path) -> tuple:
    """(turn records, cells, failures): every repetition's sessions on every arm."""
    # what else runs is read as the CPUs busy over a second before each cell, while every
    # server idles: the 1-minute load average would count the cell that just ended
    gate = method.LoadGate.per_thread(args.max_load, args.threads, wait=args.wait_idle, cap_s=args.wait_idle_max,
                                      log=log, read=method.busy_cpus, key="busy_cpus")
    records, failures = [], []
    for rep in range(args.repetitions):
        servers = start_servers(arms, args, log_dir, rep, failures)
        try:
            for s_index, session in enumerate(sessions):
                for arm in rotated(arms, rep + s_index):
                    if arm not in servers:
                        continue
                    cell = gate.enter(f"{arm.name}, {session.name}, rep {rep + 1}")
                    with httpx.Client(trust_env=False, timeout=args.timeout) as http:
                        try:
                            turns = run_session(http, servers[arm].url, session, args.n_predict)
                        except TurnError as e:
                            log(f"{arm.name} {session.name} rep {rep + 1}: {e}")
                            failures.append({"arm": arm.name, "session": session.name, "rep": rep, "error": str(e)})
                            continue
                    records += [{"arm": arm.name, "session": session.name, "kind": session.kind, "rep": rep, **t,
                                 "busy_cpus": cell["busy_cpus"], "loaded": cell["loaded"]} for t in turns]
                    tokens = sum(t["completion_tokens"] for t in turns)
                    log(f"{arm.name} {session.name} rep {rep + 1}: {tokens} tokens in {len(turns)} turns")
        finally:
            stop_servers(servers, rep, failures)
    return records, gate.cells, failures


# -- the lossless check and the rows ---------------------------------------------------------------

def _by_session(records: List[dict]) -> Dict[tuple, List[dict]]:
    """{(arm, session, rep): its turns in order}."""
    out: Dict[tuple, List[dict]] = {}
    for r in records:
        out.setdefault((r["arm"], r["session"], r["rep"]), []).append(r)
    return {k: sorted(v, key=lambda r: r["turn"]) for k, v in out.items()}


def first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def is_ours(arm_name: str) -> bool:
    return not arm_name.startswith(LLAMA)


def mismatches(records: List[dict], ours: bool = True) -> List[dict]:
    """Each arm's session of a repetition whose replies are not our plain decoding's in that
    repetition: the first turn that differs (every later turn's request differs too). Our
    arms (lossless: a failure), or with ours=False llama-server's (a fact to report)."""
    sessions = _by_session(records)
    out = []
    for (arm, name, rep), turns in sessions.items():
        plain = sessions.get((PLAIN, name, rep))
        if arm == PLAIN or plain is None or is_ours(arm) != ours:
            continue
        for got, ref in zip(turns, plain):
            if got["text"] != ref["text"] or got["completion_tokens"] != ref["completion_tokens"]:
                out.append({"arm": arm, "session": name, "rep": rep, "turn": got["turn"],
                            "first_difference": first_difference(got["text"], ref["text"]),
                            "chars": len(got["text"]), "plain_chars": len(ref["text"]),
                            "tokens": got["completion_tokens"], "plain_tokens": ref["completion_tokens"]})
                break
    return out


def unchecked(records: List[dict], arms: List[Arm], sessions: Sequence[Session], repetitions: int) -> List[dict]:
    """The arm sessions the check could not compare: plain's or their own did not run whole."""
    have = _by_session(records)
    return [{"arm": a.name, "session": s.name, "rep": rep} for rep in range(repetitions) for s in sessions
            for a in arms[1:] if a.ours and ((a.name, s.name, rep) not in have or (PLAIN, s.name, rep) not in have)]


def session_figures(turns: List[dict]) -> dict:
    """One repetition of an arm's session: its totals over the turns."""
    tokens = sum(t["completion_tokens"] for t in turns)
    decode_s = sum(t["decode_s"] or 0.0 for t in turns)
    passes = sum(t["target_passes"] for t in turns)
    return {"tokens": tokens, "decode_s": decode_s, "wall_s": sum(t["wall_s"] for t in turns),
            "decode_tps": tokens / decode_s if decode_s > 0 else None,
            "turn_tps": [t["completion_tokens"] / t["decode_s"] if t["decode_s"] else None for t in turns],
            "target_passes": passes, "accepted_drafts": sum(t["accepted_drafts"] for t in turns),
            "drafted": sum(t.get("drafted") or 0 for t in turns),
            "step_s": _phases([t.get("step_s") for t in turns]),
            "loaded": any(t["loaded"] for t in turns)}


PHASES = ("draft", "verify", "other")


def _phases(turns: List[Optional[dict]]) -> Optional[dict]:
    """The speculative steps' seconds by phase over a session's turns (dflash-server's
    step_seconds); None where a turn has none (llama-server's)."""
    if not turns or any(t is None for t in turns):
        return None
    return {k: sum(t[k] for t in turns) for k in PHASES}


def per_pass(f: dict) -> Optional[dict]:
    """A drafting arm's session per target pass: the rows a pass verified (the pass's own
    token and its drafts), its decode milliseconds, and (ours) their split by phase: the
    step profile beside llama-server's, whose passes are timed whole."""
    passes = f["target_passes"]
    if not passes:
        return None
    out = {"rows": (passes + f["drafted"]) / passes, "ms": 1e3 * f["decode_s"] / passes}
    if f.get("step_s") is not None:
        out.update({f"{k}_ms": 1e3 * f["step_s"][k] / passes for k in PHASES})
    return out


def verdict(ratios: List[float]) -> Optional[str]:
    """What the per-repetition ratios to plain say, by dflash-bench's rule (stats.verdict,
    their median as the ratio); one repetition has no range to say it by."""
    if len(ratios) == 1:
        return "one repetition: no spread"
    return stats.verdict(statistics.median(ratios) if ratios else None, ratios)


def _ratios(reps: Dict[int, dict], base: Dict[int, dict]) -> List[float]:
    """Each repetition's decode tok/s over the base arm's in the same repetition."""
    return [f["decode_tps"] / base[rep]["decode_tps"] for rep, f in reps.items()
            if rep in base and f["decode_tps"] and base[rep]["decode_tps"]]


def best_llama(figures: Dict[str, Dict[int, dict]]) -> Optional[str]:
    """llama-server's fastest arm on a session, by its median decode tok/s."""
    def median_tps(reps):
        tps = [f["decode_tps"] for f in reps.values() if f["decode_tps"]]
        return statistics.median(tps) if tps else 0.0

    llama = [a for a in figures if not is_ours(a) and a != LLAMA]  # its drafting kinds
    return max(llama, key=lambda a: median_tps(figures[a]), default=None)


def rows(records: List[dict], arms: List[Arm], sessions: Sequence[Session]) -> List[dict]:
    """A row per session and arm: medians and min-max over the repetitions; against plain,
    the ratio of each repetition's decode tok/s to plain's in the same repetition; for our
    arms, when llama-server drafted too, the same ratio to its best drafting arm there."""
    have = _by_session(records)
    out = []
    for s in sessions:
        figures = {arm.name: {rep: session_figures(t) for (a, name, rep), t in have.items()
                              if a == arm.name and name == s.name} for arm in arms}
        plain, llama = figures[PLAIN], best_llama(figures)
        for arm in arms:
            reps = figures[arm.name]
            if not reps:
                continue
            ratios = _ratios(reps, plain) if arm.name != PLAIN else []
            per_turn = [Spread.of(tps) for tps in zip(*(f["turn_tps"] for f in reps.values()))]
            spread = Spread.of(ratios)
            vs_llama = Spread.of(_ratios(reps, figures[llama])) if llama and arm.ours else None

            def of(key: str) -> Optional[dict]:
                got = Spread.of(f[key] for f in reps.values())
                return got.to_json() if got else None

            steps = [p for p in map(per_pass, reps.values()) if p is not None]
            profile = {k: Spread.of(p[k] for p in steps).to_json() for k in steps[0]} if steps else None

            out.append({"session": s.name, "kind": s.kind, "arm": arm.name, "repetitions": len(reps),
                        "decode_tps": of("decode_tps"), "wall_s": of("wall_s"), "tokens": of("tokens"),
                        "target_passes": of("target_passes"), "drafted": of("drafted"),
                        "accepted_drafts": of("accepted_drafts"), "per_pass": profile,
                        "turn_decode_tps_median": [t.median if t else None for t in per_turn],
                        "vs_plain": spread.to_json() if spread else None, "verdict": verdict(ratios),
                        "vs_llama": vs_llama.to_json() if vs_llama else None,
                        "llama_arm": llama if vs_llama else None,
                        "loaded": any(f["loaded"] for f in reps.values())})
    return out


def _columns(lines: List[List[str]]) -> str:
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines)


def _spread_text(s: Optional[dict], fmt: str) -> str:
    return "-" if s is None else Spread(s["median"], s["min"], s["max"], s["q1"], s["q3"], s["n"]).text(fmt)


def table_text(table: List[dict]) -> str:
    lines = [["session", "kind", "arm", "decode tok/s median [min-max]", "x plain per rep", "",
              "x llama-server's best", "wall s", "tokens", "passes", "drafted", "drafts accepted",
              "tok/s per turn (medians)",
              "loaded"]]
    for r in table:
        turns = " / ".join("-" if x is None else f"{x:.1f}" for x in r["turn_decode_tps_median"])
        lines.append([r["session"], r["kind"], r["arm"], _spread_text(r["decode_tps"], ".1f"),
                      _spread_text(r["vs_plain"], ".3f") + ("x" if r["vs_plain"] else ""), r["verdict"] or "",
                      _spread_text(r.get("vs_llama"), ".3f") + ("x" if r.get("vs_llama") else ""),
                      _spread_text(r["wall_s"], ".2f"), _spread_text(r["tokens"], ".0f"),
                      _spread_text(r["target_passes"], ".0f"), _spread_text(r.get("drafted"), ".0f"),
                      _spread_text(r["accepted_drafts"], ".0f"), turns,
                      "yes" if r["loaded"] else "no"])
    return _columns(lines)


def profile_text(table: List[dict]) -> str:
    """Each drafting arm's step per target pass: rows verified, milliseconds, and ours by phase."""
    lines = [["session", "arm", "rows a pass", "ms a pass", "draft ms", "verify ms", "other ms"]]
    for r in table:
        p = r.get("per_pass")
        if p:
            lines.append([r["session"], r["arm"], _spread_text(p["rows"], ".2f"), _spread_text(p["ms"], ".1f"),
                          *(_spread_text(p.get(f"{k}_ms"), ".1f") for k in PHASES)])
    return _columns(lines) if len(lines) > 1 else ""


def mismatch_text(found: List[dict], head: str = "LOSSLESS CHECK FAILED") -> str:
    return "\n".join(f"{head}: {m['arm']} {m['session']} rep {m['rep'] + 1} turn {m['turn'] + 1}: "
                     f"its reply ({m['tokens']} tokens, {m['chars']} chars) parts from plain decoding's "
                     f"({m['plain_tokens']} tokens, {m['plain_chars']} chars) at character {m['first_difference']}"
                     for m in found)


# -- the command -----------------------------------------------------------------------------------

def check(p: argparse.ArgumentParser, args) -> None:
    if args.model_draft and not args.model:
        p.error("-md needs -m (the target its drafter drafts for)")
    for f in (args.model, args.model_draft):
        if f and not Path(f).is_file():
            p.error(f"{f}: no such file")
    if args.repetitions < 1 or args.threads < 1:
        p.error("-r and -t must be at least 1")
    if args.n_predict is not None and args.n_predict < 1:
        p.error("-n must be at least 1")
    if args.ctx_size < 0 or args.max_load < 0 or args.wait_idle_max < 0 or args.timeout <= 0:
        p.error("-c, --max-load and --wait-idle-max must be >= 0, --timeout > 0")
    for kind in args.spec_type or ():
        if not kind.strip() or kind.strip() == PLAIN:
            p.error(f"--spec-type {kind!r}: name a kind the server drafts with (plain decoding always runs)")
        if args.model and not args.model_draft and Arm(kind).reads_drafter:
            p.error(f"--spec-type {kind} drafts with a drafter file: give -md")
    args.llama_server = None
    if args.llama_spec_type:
        if not args.model:
            p.error("--llama-spec-type needs -m: llama-server and ours decode the same GGUF")
        for kind in args.llama_spec_type:
            if not kind.strip():
                p.error("--llama-spec-type '': name llama-server's kind, or `none` for its plain decoding")
            if not args.model_draft and Arm(kind, LLAMA).reads_drafter:
                p.error(f"--llama-spec-type {kind} drafts with a drafter file: give -md")
        args.llama_server = llama_cpp_tree.tool(LLAMA, args.llama_cpp)
        if args.llama_server is None:
            p.error(f"llama-server is not in {args.llama_cpp or llama_cpp_tree.build_dir() / 'bin'} "
                    "(python scripts/llama_cpp_build.py llama-server builds it)")


def sessions_of(p: argparse.ArgumentParser, args) -> tuple:
    """(the workload, the sessions to run); an error exit for a bad file or name."""
    try:
        workload = load(args.workload)
    except (WorkloadError, OSError) as e:
        p.error(str(e))
    if args.sessions is None:
        return workload, list(workload.sessions)
    wanted = [n.strip() for n in args.sessions.split(",") if n.strip()]
    names = {s.name for s in workload.sessions}
    unknown = [n for n in wanted if n not in names]
    if unknown or not wanted:
        p.error(f"--sessions: {', '.join(unknown) or 'none named'}: not in {args.workload} "
                f"(it has {', '.join(sorted(names))})")
    return workload, [s for s in workload.sessions if s.name in wanted]


def output_path(path: Optional[Path], started: _dt.datetime) -> Path:
    path = path or Path(f"workload-{started:%Y-%m-%d-%H%M}.json")
    return Path("results") / path if path.parent == Path(".") else path


def main(argv=None) -> int:
    p = parser()
    args = parse_args(p, sys.argv[1:] if argv is None else argv)
    check(p, args)
    workload, sessions = sessions_of(p, args)
    where = provenance.checkout()
    if where and where["uncommitted_changes"] and not args.force:
        p.error(f"{where['path']} has uncommitted changes; a workload run measures a commit (--force runs it "
                "anyway, recorded in the file)")
    try:
        arms = arms_of(args.spec_type or default_kinds(args.model, args.model_draft), args.llama_spec_type or (),
                       args.control)
    except ValueError as e:  # config.ConfigError: a -md file that is no drafter's
        p.error(str(e))
    started, load_before = _dt.datetime.now(_dt.timezone.utc), provenance.load_average()
    log(f"{len(sessions)} sessions x {len(arms)} arms ({', '.join(a.name for a in arms)}) x {args.repetitions} "
        f"reps; load average {load_before[0]:.2f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="bench-workload-") as tmp:
        try:
            records, cells, failures = measure(args, sessions, arms, Path(tmp))
        except KeyboardInterrupt:
            print("dflash-bench workload: interrupted", file=sys.stderr)
            return 130
    found, missing = mismatches(records), unchecked(records, arms, sessions, args.repetitions)
    llama_differs = mismatches(records, ours=False)
    table = rows(records, arms, sessions)
    result = {
        "tool": "dflash-bench workload", "started": started.isoformat(timespec="seconds"),
        "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else list(argv), "checkout": where, "force": args.force,
        "versions": provenance.versions(), "machine": provenance.machine(args.threads, "CPU"),
        "load_average": {"before": load_before, "after": provenance.load_average()},
        "workload": {"path": str(Path(args.workload).resolve()), "sha256": workload.sha256, "name": workload.name,
                     "sessions": [s.name for s in sessions]},
        "models": {"target": str(Path(args.model).resolve()) if args.model else "bundled demo target",
                   "draft": str(Path(args.model_draft).resolve()) if args.model_draft else None},
        "settings": {"arms": [a.name for a in arms], "repetitions": args.repetitions, "threads": args.threads,
                     "ctx_size": args.ctx_size, "n_predict_cap": args.n_predict, "temperature": 0,
                     "server_args": args.server_args, "max_load_per_thread": args.max_load,
                     "wait_idle": args.wait_idle,
                     "interleaved": "each repetition starts every arm's server anew; each session runs on every "
                                    "arm before the next session, the arms' order rotated by repetition + session"},
        "lossless": {"equal": not found and not missing, "mismatches": found, "unchecked": missing},
        "llama_server": {"path": str(args.llama_server), "version": serve_load.version_of(args.llama_server),
                         "sources": str(llama_cpp_tree.sdist_dir()),
                         # another engine: its replies may part from ours at a near tie, and
                         # then its later turns answer another conversation
                         "differs_from_our_plain": llama_differs} if args.llama_server else None,
        "cells": cells,
        "rows": table,
        "failures": failures,
        "runs": records,
    }
    path = output_path(args.output, started)
    raw = provenance.write_results(path, result, keep_raw=args.keep_raw)
    log(f"wrote {path}" + (f" and {raw}" if raw else ""))
    if args.json:
        print(json.dumps(result))
    else:
        print(table_text(table))
        profile = profile_text(table)
        if profile:
            print("\nper target pass:\n" + profile)
    for f in failures:
        print(f"FAILED {f['arm']}{' ' + f['session'] if 'session' in f else ''} rep {f['rep'] + 1}: {f['error']}")
    if llama_differs:
        print(mismatch_text(llama_differs, "llama-server differs from our plain decoding (not a failure)"))
    if found:
        print(mismatch_text(found))
        print(mismatch_text(found), file=sys.stderr)
    return 1 if found or failures else 0
