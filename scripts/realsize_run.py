#!/usr/bin/env python3
"""The real-size run: Qwen3.5-27B Q4_K_M (random weights, published shapes) with its DFlash
drafter q8_0 on the CPU: load time and peak RSS against the memory plan, prefill, plain
and speculative steps, and the same target file under llama.cpp's `llama-bench`.

    .venv/bin/python scripts/realsize_run.py --make --outdir /tmp/realsize       # build, run, delete
    .venv/bin/python scripts/realsize_run.py --target t.gguf --draft d.gguf      # given files, kept
    .venv/bin/python scripts/realsize_run.py --make --layers 16 --outtype q4_0   # a smaller stand-in

--make writes the files with scripts/make_shape_model.py (random quant blocks; see there)
and deletes them at the end unless --keep. With --layers N the target keeps its hybrid
pattern with N layers and the drafter reads N-proportional layers.

Memory: before each process that holds the model, MemAvailable (/proc/meminfo) must be at
least --min-avail-gib; the script polls once a minute until it is, or gives up at
--wait-until (HH:MM UTC). One model process at a time.

Ours runs in a child process (so that its peak RSS is its own): VmRSS before loading
(interpreter, libraries), then Engine(...) timed, a warm-up (graphs built), --tokens
plain steps, --tokens speculative (chain) steps and a 512-token prefill, greedy. Peak RSS
is VmHWM of that process; the plan is dflash_gguf.memory.plan_memory for the same options
(the CPU device's total). Theirs: `llama-bench -m TARGET -n TOKENS -p 0 -r 1` and
`llama-bench -m TARGET -p 512 -n 0 -r 1 --no-warmup` (its warm-up would be a whole second
prefill; ours is timed on its first 512-token prefill too), the same thread count, peak
RSS from wait4. Random weights: tokens are noise, the drafter's acceptance means nothing,
only times and memory do. Timings on a shared machine are noisy: the load average is
recorded with every figure.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_cpp_build import build_llama  # noqa: E402  (scripts/llama_cpp_build.py)

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
    from dflash_gguf.engine import Engine, EngineSetup
    from dflash_gguf.memory import plan_memory

    options = dict(n_ctx=a["ctx"], n_threads=a["threads"], kv_type=a["kv"], draft_window=0)
    setup = EngineSetup.of(a["target"], a["draft"], **options)
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
    res = engine.generate(prompt_ids(32, seed=1), max_tokens=a["tokens"], speculative=False)
    out["plain"] = {"tokens": res.stats.generated_tokens, "seconds": res.stats.decode_seconds,
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
                              "commit_seconds": st.commit_seconds, "block": engine.block_size,
                              "loadavg": loadavg()}
    out["compute_bytes"] = engine.target.info()["compute_bytes"] + (
        engine.draft.info()["compute_bytes"] if engine.draft is not None else 0)
    out["status_end"] = status()
    engine.close()
    return out


def run_ours(a: dict) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(a)]
    log("ours: " + " ".join(cmd[:2]) + " --worker ...")
    res = subprocess.run(cmd, capture_output=True, text=True, errors="replace", cwd="/")
    if res.returncode != 0:
        raise SystemExit(f"ours failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("@@"))
    return json.loads(line[2:])


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

    sys.path.insert(0, str(ROOT / "scripts"))
    from make_shape_model import main as make

    n = layers or QWEN35_27B["layers"]
    tag = f"{n}l-" if layers else ""
    target = outdir / f"qwen35-27b-{tag}{outtype}.gguf"
    draft = outdir / f"qwen35-27b-dflash-{tag}q8_0.gguf"
    if not target.exists():
        log(f"writing {target}")
        make(["qwen35-27b", "--outtype", outtype, "--outfile", str(target),
              *(["--layers", str(layers)] if layers else [])])
    if not draft.exists():
        # the drafter reads the same relative depths of a shorter target
        full = QWEN35_27B["layers"]
        ids = [max(1, min(n - 1, round(t * n / full))) for t in QWEN35_27B_DFLASH["target_layers"]]
        log(f"writing {draft}")
        make(["qwen35-27b-dflash", "--outtype", "q8_0", "--outfile", str(draft),
              *(["--set", "target_layers=" + ",".join(map(str, ids))] if layers else [])])
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
              f"Load: {o['load_seconds']:.1f} s (load average {o['loadavg_load']}).", "",
              "## Speed (random weights: times only)", "",
              "| | ours | llama-bench |", "|---|---:|---:|"]
    lb_pp = next(x for x in r["llama_bench_pp"]["results"] if x["n_prompt"])
    lb_tg = next(x for x in r["llama_bench_tg"]["results"] if x["n_gen"])
    lines.append(f"| prefill {o['prefill']['tokens']} tokens, tok/s | {o['prefill']['tps']:.2f} | "
                 f"{lb_pp['avg_ts']:.2f} |")
    lines.append(f"| plain step (1 token), s | {o['plain']['seconds'] / max(1, o['plain']['tokens']):.2f} | "
                 f"{1 / lb_tg['avg_ts']:.2f} |")
    sp = o.get("speculative")
    if sp:
        lines.append(f"| speculative step (draft {sp['block']} + verify + commit), s | {sp['step_seconds']:.2f} | |")
    lines += ["", f"llama-bench peak RSS: {r['llama_bench_tg']['max_rss'] / MIB:.0f} MiB (-n), "
              f"{r['llama_bench_pp']['max_rss'] / MIB:.0f} MiB (-p 512).", "",
              "Commands:", "", f"    {r['command']}", f"    {r['llama_bench_tg']['cmd']}",
              f"    {r['llama_bench_pp']['cmd']}", "",
              f"Load averages: ours prefill {o['prefill']['loadavg']}, plain {o['plain']['loadavg']}"
              + (f", speculative {sp['loadavg']}" if sp else "")
              + f"; llama-bench -n {r['llama_bench_tg']['loadavg']}, -p {r['llama_bench_pp']['loadavg']}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print("@@" + json.dumps(worker(json.loads(sys.argv[2]))), flush=True)
        return 0
    if len(sys.argv) == 3 and sys.argv[1] == "--report":  # the markdown of a saved run
        print(report(json.loads(Path(sys.argv[2]).read_text())))
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
    p.add_argument("--no-llama-bench", action="store_true")
    a = p.parse_args()
    if not a.make and not a.target:
        p.error("give --target (and --draft) or --make")
    until = None
    if a.wait_until:
        h, m = map(int, a.wait_until.split(":"))
        now = _dt.datetime.now(_dt.timezone.utc)
        until = now.replace(hour=h, minute=m, second=0, microsecond=0)
    exe = None
    if a.make:
        target, draft = make_files(a.outdir, a.layers, a.outtype)
    else:
        target, draft = Path(a.target), Path(a.draft) if a.draft else None
    r = {"date": f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC", "target": str(target),
         "embedding_bytes": embedding_bytes(target),
         "draft": str(draft) if draft else None, "threads": a.threads, "ctx": a.ctx, "kv": a.kv,
         "loadavg_start": loadavg(), "command": " ".join([Path(sys.executable).name, *sys.argv])}
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d-%H%M")
    out = ROOT / "results" / f"realsize-{stamp}"
    try:
        wait_for_memory(int(a.min_avail_gib * GIB), until)
        r["ours"] = run_ours({"target": str(target), "draft": str(draft) if draft else None, "ctx": a.ctx,
                              "kv": a.kv, "threads": a.threads, "prompt": a.prompt, "tokens": a.tokens})
        log(f"ours: load {r['ours']['load_seconds']:.1f} s, peak RSS {r['ours']['status_end']['VmHWM'] / GIB:.2f} GiB")
        out.with_suffix(".json").write_text(json.dumps(r, indent=1))  # kept should llama-bench not run
        if not a.no_llama_bench:
            exe, note = build_llama("llama-bench")
            if exe is None:
                raise SystemExit(f"llama-bench: {note}")
            wait_for_memory(int(a.min_avail_gib * GIB), until)
            r["llama_bench_tg"] = run_llama_bench(exe, str(target), ["-n", str(a.tokens), "-p", "0"], a.threads)
            wait_for_memory(int(a.min_avail_gib * GIB), until)
            # no warm-up run: llama-bench's would be a whole second prefill (ours is timed on its first)
            r["llama_bench_pp"] = run_llama_bench(exe, str(target), ["-p", str(a.prompt), "-n", "0", "--no-warmup"],
                                                  a.threads)
    finally:
        if a.make and not a.keep:
            for f in (target, draft):
                f.unlink(missing_ok=True)
            log("deleted the shape models")
    out.with_suffix(".json").write_text(json.dumps(r, indent=1))
    if exe:
        text = report(r)
        out.with_suffix(".md").write_text(text)
        print(text)
    else:
        print(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
