#!/usr/bin/env python3
"""The real-size run: Qwen3.5-27B Q4_K_M (random weights, published shapes) with its DFlash
drafter q8_0 on the CPU: load time and peak RSS against the memory plan, prefill, plain
and speculative steps, and the same target file under llama.cpp's `llama-bench`.

    .venv/bin/python experiments/realsize_run.py --make --outdir /tmp/realsize       # build, run, delete
    .venv/bin/python experiments/realsize_run.py --target t.gguf --draft d.gguf      # given files, kept
    .venv/bin/python experiments/realsize_run.py --make --layers 16 --outtype q4_0   # a smaller stand-in

--make writes the files with dflash_gguf.convert.shape_model (random quant blocks; see there)
and deletes them at the end unless --keep. With --layers N the target keeps its hybrid
pattern with N layers and the drafter reads N-proportional layers.

Memory: before each process that holds the model, MemAvailable (/proc/meminfo) must be at
least --min-avail-gib; the script polls once a minute until it is, or gives up at
--wait-until (HH:MM UTC). One model process at a time.

Ours runs in a child process (so that its peak RSS is its own): VmRSS before loading
(interpreter, libraries), then Engine(...) timed, a warm-up (graphs built), --tokens
plain steps, --tokens speculative (chain) steps and a 512-token prefill, greedy. Peak RSS
is VmHWM of that process; the plan is dflash_gguf.engine.memory.plan_memory for the same options
(the CPU device's total). Theirs: `llama-bench -m TARGET -n TOKENS -p 0 -r 1` and
`llama-bench -m TARGET -p 512 -n 0 -r 1 --no-warmup` (its warm-up would be a whole second
prefill; ours is timed on its first 512-token prefill too), the same thread count, peak
RSS from wait4. Random weights: tokens are noise, the drafter's acceptance means nothing,
only times and memory do. Timings on a shared machine are noisy: the load average is
recorded with every figure. Writes results/realsize-<date>-<HHMM>.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dflash_gguf.bench import slim
from dflash_gguf.bench.provenance import write_results
from dflash_gguf.tools.llama_cpp_tree import tool

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
MIB = 1 << 20


def log(msg: str) -> None:
    print(f"[realsize {_dt.datetime.now(_dt.timezone.utc):%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def meminfo() -> dict:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def status(pid: str = "self") -> dict:
    """VmRSS, VmHWM, RssAnon, RssFile of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def wait_for_memory(min_bytes: int, until: _dt.datetime | None) -> None:
    while True:
        avail = meminfo()["MemAvailable"]
        if avail >= min_bytes:
            log(f"MemAvailable {avail / GIB:.1f} GiB >= {min_bytes / GIB:.1f} GiB: go")
            return
        now = _dt.datetime.now(_dt.timezone.utc)
        if until and now >= until:
            raise SystemExit(f"MemAvailable stayed below {min_bytes / GIB:.1f} GiB until {until:%H:%M} UTC "
                             f"(now {avail / GIB:.1f} GiB): not running")
        log(f"MemAvailable {avail / GIB:.1f} GiB < {min_bytes / GIB:.1f} GiB: waiting a minute")
        time.sleep(60)


# ---- ours (child process) ---------------------------------------------------------------------

def prompt_ids(n: int, seed: int = 0) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(10, 1000, size=n).tolist()  # ids of real tokens


def worker(a: dict) -> dict:
    before = status()
    from dflash_gguf.engine.engine import Engine, EngineOptions, EngineSetup
    from dflash_gguf.engine.memory import plan_memory

    options = dict(n_ctx=a["ctx"], n_threads=a["threads"], kv_type=a["kv"], draft_window=0)
    setup = EngineSetup.of(a["target"], a["draft"], EngineOptions.of(**options))
    plan = plan_memory(a["target"], a["draft"], setup.target_config, setup.draft_config)
    imported = status()
    t0 = time.perf_counter()
    engine = Engine(a["target"], a["draft"], **options)
    load_s = time.perf_counter() - t0
    loaded = status()
    out = {"plan": plan.to_json(), "status_start": before, "status_imported": imported, "status_loaded": loaded,
           "load_seconds": load_s, "loadavg_load": loadavg()}

    # warm-up, untimed: the decode, verify and drafter graphs are built, the mapped weights
    # paged in
    engine.generate(prompt_ids(16, seed=3), max_tokens=2, speculative=False)
    if engine.draft is not None:
        engine.generate(prompt_ids(16, seed=4), max_tokens=2, speculative=True)
    out["status_warm"] = status()
    # --tokens decode steps: the first generated token is the prefill's (llama-bench -n N
    # times N decode calls; dividing our N-1 steps' time by N tokens flattered us N/(N-1))
    res = engine.generate(prompt_ids(32, seed=1), max_tokens=a["tokens"] + 1, speculative=False)
    out["plain"] = {"tokens": res.stats.generated_tokens, "steps": res.stats.generated_tokens - 1,
                    "seconds": res.stats.decode_seconds,
                    "tps": res.stats.decode_tps, "loadavg": loadavg()}
    res = engine.generate(prompt_ids(a["prompt"]), max_tokens=1, speculative=False)
    out["prefill"] = {"tokens": res.stats.prompt_tokens, "seconds": res.stats.prefill_seconds,
                      "tps": res.stats.prefill_tps, "loadavg": loadavg()}
    if engine.draft is not None:
        res = engine.generate(prompt_ids(32, seed=2), max_tokens=a["tokens"], speculative=True)
        st = res.stats
        steps = len(st.accepted_lengths)
        out["speculative"] = {"tokens": st.generated_tokens, "seconds": st.decode_seconds, "tps": st.decode_tps,
                              "steps": steps, "mean_accepted": st.mean_accepted,
                              "step_seconds": st.decode_seconds / steps if steps else None,
                              "draft_seconds": st.draft_seconds, "verify_seconds": st.verify_seconds,
                              "other_seconds": st.other_seconds, "block": engine.block_size,
                              "loadavg": loadavg()}
    out["compute_bytes"] = engine.target.info()["compute_bytes"] + (
        engine.draft.info()["compute_bytes"] if engine.draft is not None else 0)
    out["status_end"] = status()
    engine.close()
    return out


# ---- theirs --------------------------------------------------------------------------------------

def run_llama_bench(exe: Path, target: str, args: list[str], threads: int) -> dict:
    cmd = [str(exe), "-m", target, *args, "-t", str(threads), "-r", "1", "-o", "json"]
    log("llama-bench: " + " ".join(cmd))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.stdout.read(), proc.stderr.read()
    _, rc, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(rc)
    if proc.returncode != 0:
        raise SystemExit(f"llama-bench failed ({proc.returncode}): {err.decode(errors='replace')[-2000:]}")
    rows = json.loads(out)
    return {"cmd": " ".join(cmd), "wall_seconds": time.perf_counter() - t0, "max_rss": usage.ru_maxrss * 1024,
            "results": [{k: r.get(k) for k in ("n_prompt", "n_gen", "avg_ts", "avg_ns", "n_threads", "type_k",
                                               "flash_attn", "model_size", "model_n_params")} for r in rows],
            "loadavg": loadavg()}


# ---- files -----------------------------------------------------------------------------------------

def make_files(outdir: Path, layers: int | None, outtype: str) -> tuple[Path, Path]:
    from dflash_gguf.convert.shapes import QWEN35_27B, QWEN35_27B_DFLASH

    from dflash_gguf.convert.shape_model import main as make

    n = layers or QWEN35_27B["layers"]
    tag = f"{n}l-" if layers else ""
    target = outdir / f"qwen35-27b-{tag}{outtype}.gguf"
    draft = outdir / f"qwen35-27b-dflash-{tag}q8_0.gguf"
    if not target.exists():
        log(f"writing {target}")
        if make(["qwen35-27b", "--outtype", outtype, "--outfile", str(target),
                 *(["--layers", str(layers)] if layers else [])]) != 0:
            raise SystemExit(f"writing {target} failed")
    if not draft.exists():
        # the drafter reads the same relative depths of a shorter target
        full = QWEN35_27B["layers"]
        ids = [max(1, min(n - 1, round(t * n / full))) for t in QWEN35_27B_DFLASH["target_layers"]]
        log(f"writing {draft}")
        if make(["qwen35-27b-dflash", "--outtype", "q8_0", "--outfile", str(draft),
                 *(["--set", "target_layers=" + ",".join(map(str, ids))] if layers else [])]) != 0:
            raise SystemExit(f"writing {draft} failed")
    return target, draft


def embedding_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return int(next(t.n_bytes for t in GGUFReader(str(path)).tensors if t.name == "token_embd.weight"))


# ---- report ----------------------------------------------------------------------------------------

def report(r: dict) -> str:
    o, plan = r["ours"], r["ours"]["plan"]["devices"][0]
    base = o["status_imported"]["VmRSS"]
    peak = o["status_end"]["VmHWM"]
    need = plan["need"]
    r.setdefault("embedding_bytes", embedding_bytes(Path(r["target"])))
    lines = [f"# Real-size run {r['date']}", "",
             f"target `{r['target']}` ({Path(r['target']).stat().st_size / GIB:.2f} GiB), drafter `{r['draft']}`; "
             f"{r['threads']} threads, context {r['ctx']}, KV {r['kv']}; load average at start {r['loadavg_start']} "
             f"(other jobs were running: times are under load)", "",
             "## Memory (ours, CPU)", "",
             "| | MiB |", "|---|---:|"]
    for key in ("target_weights", "draft_weights", "kv_cache", "recurrent_state", "verify_scratch", "draft_cache",
                "target_compute", "draft_compute"):
        lines.append(f"| plan: {key} | {plan[key] / MIB:.1f} |")
    lines += [f"| plan: total | {need / MIB:.1f} |",
              f"| RSS before loading (interpreter, libraries) | {base / MIB:.1f} |",
              f"| RSS after loading (anon / file) | {o['status_loaded']['VmRSS'] / MIB:.1f} "
              f"({o['status_loaded']['RssAnon'] / MIB:.1f} / {o['status_loaded']['RssFile'] / MIB:.1f}) |",
              f"| peak RSS (VmHWM) | {peak / MIB:.1f} |",
              f"| peak RSS - RSS before loading | {(peak - base) / MIB:.1f} "
              f"({100 * (peak - base - need) / need:+.1f}% against the plan) |",
              f"| plan without the token embedding (kept in the file mapping: only the rows of tokens "
              f"read become resident) | {(need - r['embedding_bytes']) / MIB:.1f} "
              f"({100 * (peak - base - need + r['embedding_bytes']) / (need - r['embedding_bytes']):+.1f}% "
              f"peak against it) |",
              f"| compute buffers held at the end | {o['compute_bytes'] / MIB:.1f} |", "",
              "## Speed (random weights: times only)", ""]
    peer = r.get("peer")
    name = peer["name"] if peer else "llama.cpp (not run)"
    lines += [f"| | ours | {name} |", "|---|---:|---:|"]

    def theirs(key, f):
        return f(peer[key]) if peer and key in peer else ""

    lines.append(f"| load, s | {o['load_seconds']:.1f} | {theirs('load_seconds', lambda v: f'{v:.1f}')} |")
    lines.append(f"| prefill {o['prefill']['tokens']} tokens, tok/s | {o['prefill']['tps']:.2f} | "
                 f"{theirs('pp_tps', lambda v: f'{v:.2f}')} |")
    lines.append(f"| plain step (1 token), s | {o['plain']['seconds'] / max(1, o['plain']['steps']):.2f} | "
                 f"{theirs('tg_tps', lambda v: f'{1 / v:.2f}')} |")
    sp = o.get("speculative")
    if sp:
        lines.append(f"| speculative step (draft {sp['block']} + verify + commit), s | {sp['step_seconds']:.2f} | |")
    lines.append(f"| peak RSS, MiB | {o.get('max_rss', peak) / MIB:.0f} | {theirs('max_rss', lambda v: f'{v / MIB:.0f}')} |")
    cmds = [r["command"]] + ([r.get("command_peer")] if r.get("command_peer") else []) + \
        (peer["cmd"] if peer and "cmd" in peer else [])
    lines += ["", "Commands:", "", *[f"    {c}" for c in cmds], "",
              f"Load averages: ours load {o['loadavg_load']}, plain {o['plain']['loadavg']}"
              + (f", speculative {sp['loadavg']}" if sp else "") + f", prefill {o['prefill']['loadavg']}"
              + (f"; {name} {peer['loadavg']}" if peer else "") + "."]
    return "\n".join(lines) + "\n"


def run_peer(a: argparse.Namespace, target: str) -> dict:
    """llama.cpp on the same file: llama-bench, or (--peer llama-cpp-python) the same ggml
    through llama-cpp-python, timed the same way as ours."""
    wait = lambda: wait_for_memory(int(a.min_avail_gib * GIB), a.until)  # noqa: E731
    if a.peer == "llama-cpp-python":
        wait()
        return {"name": "llama-cpp-python", **run_child(["--peer-worker", json.dumps(
            {"target": target, "ctx": a.ctx, "threads": a.threads, "prompt": a.peer_prompt, "tokens": a.tokens})])}
    exe = tool("llama-bench")
    if exe is None:
        raise SystemExit("llama-bench is not built: .venv/bin/python scripts/llama_cpp_build.py llama-bench")
    wait()
    load = ["-lm", a.peer_load_mode]
    tg = run_llama_bench(exe, target, ["-n", str(a.tokens), "-p", "0", *load], a.threads)
    wait()
    # no warm-up run: llama-bench's would be a whole second prefill (ours is timed on its first)
    pp = run_llama_bench(exe, target, ["-p", str(a.prompt), "-n", "0", "--no-warmup", *load], a.threads)
    return {"name": "llama-bench", "cmd": [tg["cmd"], pp["cmd"]], "max_rss": max(tg["max_rss"], pp["max_rss"]),
            "tg_tps": next(x["avg_ts"] for x in tg["results"] if x["n_gen"]),
            "pp_tps": next(x["avg_ts"] for x in pp["results"] if x["n_prompt"]),
            "loadavg": [tg["loadavg"], pp["loadavg"]], "raw": [tg, pp]}


def peer_worker(a: dict) -> dict:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(a["target"], n_ctx=a["ctx"], n_batch=512, n_ubatch=512, n_threads=a["threads"],
                n_threads_batch=a["threads"], verbose=False)
    out = {"load_seconds": time.perf_counter() - t0}
    log(f"peer: loaded in {out['load_seconds']:.1f} s")
    llm.eval(prompt_ids(16, seed=3))  # warm-up, untimed
    llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    llm.reset()
    llm.eval(prompt_ids(32, seed=1))
    t0 = time.perf_counter()
    for _ in range(a["tokens"]):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    out["tg_tps"] = a["tokens"] / (time.perf_counter() - t0)
    log(f"peer: {a['tokens']} plain steps at {out['tg_tps']:.3f} tok/s (load average {loadavg()})")
    if a["prompt"]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt_ids(a["prompt"]))
        out["pp_tps"] = a["prompt"] / (time.perf_counter() - t0)
    out["loadavg"] = loadavg()
    return out


def run_child(args: list[str]) -> dict:
    """A worker of this script in a child process: its result and its peak RSS."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    log(" ".join(cmd[:3]) + " ...")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/")
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{args[0]} failed (exit {proc.returncode}):\n{err.decode(errors='replace')[-2000:]}")
    line = next(ln for ln in out.decode().splitlines() if ln.startswith("@@"))
    return json.loads(line[2:])


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] in ("--worker", "--peer-worker"):
        work = worker if sys.argv[1] == "--worker" else peer_worker
        result = work(json.loads(sys.argv[2]))
        result["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print("@@" + json.dumps(result), flush=True)
        return 0
    if len(sys.argv) == 3 and sys.argv[1] == "--report":  # the markdown of a saved run
        print(report(slim.read(Path(sys.argv[2]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--make", action="store_true", help="write the shape models into --outdir")
    p.add_argument("--outdir", type=Path, default=Path("/tmp/realsize"))
    p.add_argument("--layers", type=int, help="with --make: a target of N layers")
    p.add_argument("--outtype", default="q4_k_m", help="with --make: the target's type")
    p.add_argument("--keep", action="store_true", help="with --make: keep the files")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--kv", default="f16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--min-avail-gib", type=float, default=19.0)
    p.add_argument("--wait-until", help="HH:MM UTC: give up waiting for memory then")
    p.add_argument("--peer", choices=["llama-bench", "llama-cpp-python", "none"], default="llama-bench",
                   help="llama.cpp measured as: its llama-bench tool (built once), or the same ggml as ours "
                        "through llama-cpp-python, or not at all")
    p.add_argument("--peer-prompt", type=int, help="llama-cpp-python peer: prefill this many tokens (default: "
                   "--prompt; 0: no prefill, when time is short)")
    p.add_argument("--peer-load-mode", default="none", choices=["none", "mmap", "auto"],
                   help="llama-bench -lm (default none: weights read into memory; with a mapping, a model that "
                        "nearly fills RAM has mapped weights evicted and read again every token)")
    p.add_argument("--resume", type=Path, help="a saved run (JSON) whose ours part is kept: run the peer only")
    a = p.parse_args()
    if not (a.make or a.target or a.resume):
        p.error("give --target (and --draft), --make or --resume")
    a.peer_prompt = a.prompt if a.peer_prompt is None else a.peer_prompt
    a.until = None
    if a.wait_until:
        h, m = map(int, a.wait_until.split(":"))
        a.until = _dt.datetime.now(_dt.timezone.utc).replace(hour=h, minute=m, second=0, microsecond=0)
    if a.resume:
        r, out = slim.read(a.resume), a.resume.with_suffix("")
        target, draft = Path(r["target"]), Path(r["draft"]) if r["draft"] else None
        r["command_peer"] = " ".join([Path(sys.executable).name, *sys.argv])
    else:
        target, draft = make_files(a.outdir, a.layers, a.outtype) if a.make else \
            (Path(a.target), Path(a.draft) if a.draft else None)
        r = {"date": f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC", "target": str(target),
             "embedding_bytes": embedding_bytes(target), "draft": str(draft) if draft else None,
             "threads": a.threads, "ctx": a.ctx, "kv": a.kv, "loadavg_start": loadavg(),
             "command": " ".join([Path(sys.executable).name, *sys.argv])}
        out = ROOT / "results" / f"realsize-{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d-%H%M}"
    try:
        if "ours" not in r:
            wait_for_memory(int(a.min_avail_gib * GIB), a.until)
            r["ours"] = run_child(["--worker", json.dumps(
                {"target": str(target), "draft": str(draft) if draft else None, "ctx": a.ctx, "kv": a.kv,
                 "threads": a.threads, "prompt": a.prompt, "tokens": a.tokens})])
            log(f"ours: load {r['ours']['load_seconds']:.1f} s, peak RSS {r['ours']['max_rss'] / GIB:.2f} GiB")
            write_results(out.with_suffix(".json"), r)  # kept should the peer fail
        if a.peer != "none":
            r["peer"] = run_peer(a, str(target))
    finally:
        if a.make and not a.keep:
            for f in (target, draft):
                f.unlink(missing_ok=True)
            log("deleted the shape models")
    write_results(out.with_suffix(".json"), r)
    text = report(r)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
