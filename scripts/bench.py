#!/usr/bin/env python3
"""Speculative decoding benchmark: dflash-gguf against its peers on one target/drafter
GGUF pair, with the same prompts, the same thread count, several runs and medians.

    cd /tmp && /work/main/.venv/bin/python /work/main/scripts/bench.py            # the demo pair
    .venv/bin/python scripts/bench.py --quick                 # 1 prompt, 1 run, 32 tokens
    .venv/bin/python scripts/bench.py -m target.gguf -md draft.gguf --hf-target T --hf-draft D
    .venv/bin/python scripts/bench.py --tiny                  # a tiny random pair (plumbing only)
    .venv/bin/python scripts/bench.py --ar-0.8b               # also scripts/bench_ar.py's tables
    .venv/bin/python scripts/bench.py --build-llama-cpp       # only build llama.cpp's decoder

(Run it from outside the checkout's root, or by its path as above: the repository root on
sys.path would shadow the installed package with the source tree, which lacks the
compiled library.)

Rows (each one the same greedy continuation of the same prompt token ids):
  ours AR           dflash_gguf Engine(target) - plain decoding on our runtime
  ours chain        Engine(target, draft) - one drafted block verified as a chain
  ours tree N/auto  Engine(target, draft, tree_budget=N|"auto") - DDTree verification
  llama.cpp AR      llama-cpp-python (same pinned version): eval + argmax loop, flash
                    attention, f16 KV cache, its default weight repacking
  llama.cpp DFlash  llama.cpp's own DFlash speculative decoding: `llama-speculative-simple
                    --spec-type draft-dflash`, built once from the llama-cpp-python sdist
                    into .cache/llama-cpp-build/ (skipped, with a note, when the build fails;
                    --quick never starts the build)
  z-lab reference   dflash.model.dflash_generate (transformers target + reference drafter),
                    acceptance length only; needs --hf-target/--hf-draft (the HF checkpoints
                    of the pair). Its target recomputes from the token history (see
                    tests/test_speculative.py: transformers' cache crop does not roll back
                    Gated DeltaNet state)

Measured per row: AL = generated tokens per target forward pass (AR: 1), and decode
tokens/second = generated tokens / decode wall time (prefill excluded; for llama.cpp's
decoder its own "decoded N tokens in T seconds" line). Every run of a row is a fresh child
process that loads the models, warms up on a separate prompt, then generates every prompt
once; the rows take turns run by run (order rotated) so that load changes on a shared
machine hit all alike. Reported: the median over runs per prompt, then the median over
prompts; speed-ups are ratios of those medians. Our rows also note the time split (draft /
verify / other; a commit runs inside the next verify graph, so it counts as verify), the
graph nodes of the target's verify (or decode) and of the drafter's propose, and the host
synchronisations per step: graphs computed, results read back and inputs written (each a
blocking transfer on a device), target and drafter together. "same output" counts the prompts whose
continuation equals our AR output token for token (llama.cpp DFlash: by text). Generation
never stops early: ours and llama.cpp AR ignore end-of-generation tokens; llama.cpp's
decoder runs with --ignore-eos (which bans them instead, so a prompt whose greedy
continuation contains one differs there).

Results: a markdown table on stdout, written to results/bench-<date>.md and
results/latest.md, and a plot of tok/s and AL per tree budget to results/bench-<date>.png
(needs matplotlib, not a runtime dependency: `.venv/bin/pip install matplotlib`).
Timing on a busy machine is noise: the load average is printed and recorded.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_cpp_build import build_llama, llama_binary  # noqa: E402  (scripts/llama_cpp_build.py)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "dflash_gguf" / "data"
RESULTS = ROOT / "results"
CACHE = ROOT / ".cache" / "bench"
TINY = CACHE / "tiny-pair"
LLAMA_SPEC_TARGET = "llama-speculative-simple"
BUDGETS = ("4", "8", "16", "32", "auto")
WARMUP_TEXT = "import os\nimport sys\n\n\ndef main():\n"

# Python code completion in the style of the standard library (what the demo pair is
# trained on), and two prose-like docstring/comment openings.
PROMPTS = [
    ("split", 'def split_words(text, sep=None, maxsplit=-1):\n    """Split text into a list of words.\n\n'
              '    If sep is None, runs of whitespace are separators.\n    """\n'),
    ("class", "class Stack:\n    \"\"\"A last-in, first-out container.\"\"\"\n\n    def __init__(self):\n"
              "        self._items = []\n\n    def push(self, item):\n"),
    ("main", "import argparse\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.ArgumentParser("
             "description='Count lines in files.')\n"),
    ("files", "def read_lines(path, encoding='utf-8'):\n    \"\"\"Return the lines of a text file without "
              "their line endings.\"\"\"\n    with open(path"),
    ("docstring", '"""Utilities for reading and writing configuration files.\n\nThis module provides '),
    ("comment", "    # If the buffer is full, flush it to the underlying stream before"),
]


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ---- llama.cpp's own speculative decoder (built from the pinned llama-cpp-python sdist) ------

def llama_spec_binary() -> Path | None:
    """The cached llama-speculative-simple binary, or None when not built yet."""
    return llama_binary(LLAMA_SPEC_TARGET)


def build_llama_spec(jobs: int = 2) -> tuple[Path | None, str]:
    """Builds llama-speculative-simple once (scripts/llama_cpp_build.py: nice 10, `jobs`
    parallel compiles, into .cache/llama-cpp-build/<version>-<flags hash>/, the build
    directory llama-bench shares). Returns (binary or None, note)."""
    return build_llama(LLAMA_SPEC_TARGET, jobs)


def run_llama_spec_prompts(exe: Path, a: dict, texts: list, debug: bool):
    """run_llama_spec on every prompt: (results, None), or (those before, the error)."""
    out = []
    for text in texts:
        r = run_llama_spec(exe, a, text, debug)
        if "error" in r:
            return out, r["error"]
        out.append(r)
    return out, None


def run_llama_spec(exe: Path, a: dict, text: str, debug: bool, attempts: int = 3) -> dict:
    """run_llama_spec_once, again when the summary is missing: llama.cpp logs from a
    worker thread, and under heavy debug logging its last lines are sometimes lost."""
    for _ in range(attempts):
        out = run_llama_spec_once(exe, a, text, debug)
        if not out.get("error", "").startswith("no 'decoded N tokens'"):
            break
    return out


def run_llama_spec_once(exe: Path, a: dict, text: str, debug: bool) -> dict:
    """One llama-speculative-simple run on one prompt. Timing runs parse its own summary;
    a debug run (-lv 5) also counts target passes: one per committed round plus one per
    checkpoint restore (a hybrid target cannot drop rejected rows, so llama.cpp restores a
    checkpoint and re-evaluates the accepted tokens in a second pass)."""
    cmd = [str(exe), "-m", a["target"], "-md", a["draft"], "--spec-type", "draft-dflash",
           "--spec-draft-n-max", str(a["block"] - 1), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0",
           "-p", text, "-n", str(a["n"]), "-c", str(a["n_ctx"]), "-b", "512", "-ub", "512",
           "-t", str(a["threads"]), "-tb", str(a["threads"]), "-td", str(a["threads"]), "-tbd", str(a["threads"]),
           "-fa", "on", "--temp", "0", "--top-k", "1", "--seed", "0", "--ignore-eos"]
    if debug:
        cmd += ["-lv", "5"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=1800)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    err = res.stderr
    if res.returncode != 0:
        how = f"signal {-res.returncode}" if res.returncode < 0 else f"exit code {res.returncode}"
        tail = [ln for ln in err.strip().splitlines() if ln.strip()][-2:]
        return {"error": f"{LLAMA_SPEC_TARGET} failed ({how}): " + " | ".join(tail)}
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", err)
    if not m:
        return {"error": f"no 'decoded N tokens' line in the output: {err[-300:]}"}
    out = {"tokens": int(m.group(1)), "decode_s": float(m.group(2))}
    out["tps"] = out["tokens"] / out["decode_s"] if out["decode_s"] > 0 else None
    m = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", err)
    if m:
        out["prompt_tokens"], out["prefill_s"] = int(m.group(1)), float(m.group(2))
    for key in ("n_drafted", "n_accept", "n_predict"):
        m = re.search(rf"{key}\s*=\s*(\d+)", err)
        if m:
            out[key] = int(m.group(1))
    # the continuation: stdout holds "\n\n" + prompt pieces + generated pieces + "\n\n"
    text_out = res.stdout
    i = text_out.find(text)
    out["text"] = text_out[i + len(text):].rstrip("\n") if i >= 0 else None
    if debug:
        rounds = len(re.findall(r"accepted \d+/\d+ draft tokens", err))
        restores = len(re.findall(r"partial acceptance: ", err))
        out["rounds"], out["restores"] = rounds, restores
        out["passes"] = rounds + restores
        if out["passes"]:
            out["al"] = out["tokens"] / out["passes"]
            out["tokens_per_round"] = out["tokens"] / rounds if rounds else None
    return out


# ---- the pair --------------------------------------------------------------------------

def build_tiny_pair() -> dict:
    """A tiny random Qwen3.5 target (our converter, f32) and DFlash drafter (llama.cpp's
    converter, f32), as in tests/test_speculative.py, cached in .cache/bench/tiny-pair/.
    Random weights: AL stays near 1; it exercises every row, it measures nothing."""
    paths = {"target": TINY / "target-f32.gguf", "draft": TINY / "draft-f32.gguf",
             "hf_target": TINY / "target-hf", "hf_draft": TINY / "draft-hf"}
    if all(p.exists() for p in paths.values()):
        return {k: str(v) for k, v in paths.items()}
    log(f"building the tiny test pair in {TINY} ...")
    sys.path.insert(0, str(ROOT / "tests"))
    from draft_fixtures import convert_dflash_llama_cpp, make_dflash
    from fixtures import make_qwen35

    from dflash_gguf.convert.cli import main as convert

    TINY.mkdir(parents=True, exist_ok=True)
    if not (paths["hf_target"] / "config.json").exists():
        make_qwen35(paths["hf_target"], hidden=128, layers=4, seed=3)
    if not (paths["hf_draft"] / "config.json").exists():
        make_dflash(paths["hf_draft"], paths["hf_target"], target_layer_ids=(0, 2), block_size=8, seed=4)
    if not paths["target"].exists():
        rc = convert([str(paths["hf_target"]), "--outtype", "f32", "--outfile", str(paths["target"]), "--force"])
        if rc != 0:
            raise SystemExit(f"converting the tiny target failed ({rc})")
    if not paths["draft"].exists():
        convert_dflash_llama_cpp(paths["hf_draft"], paths["hf_target"], paths["draft"])
    return {k: str(v) for k, v in paths.items()}


def resolve_pair(args) -> dict:
    if args.tiny:
        pair, name = build_tiny_pair(), "tiny random test pair"
    elif args.model:
        if not args.draft:
            raise SystemExit("-m needs -md (the DFlash drafter GGUF)")
        pair, name = {"target": str(Path(args.model).resolve()), "draft": str(Path(args.draft).resolve())}, "given"
    else:
        t, d = DATA / "demo-target.gguf", DATA / "demo-draft.gguf"
        if t.exists() and d.exists():
            pair, name = {"target": str(t), "draft": str(d)}, "bundled demo pair"
            hf = ROOT / "tests" / "data" / "demo-hf"  # bf16 copies of its HF checkpoints
            if (hf / "target").is_dir() and (hf / "draft").is_dir():
                pair["hf_target"], pair["hf_draft"] = str(hf / "target"), str(hf / "draft")
        else:
            log(f"the demo pair ({t.name}, {d.name} in {DATA}) is not there yet: using the tiny random test pair "
                "(plumbing only; pass -m/-md for another pair)")
            pair, name = build_tiny_pair(), "tiny random test pair (demo pair absent)"
    for k, v in (("hf_target", args.hf_target), ("hf_draft", args.hf_draft)):
        if v:
            pair[k] = str(Path(v).resolve())
    for k in ("target", "draft"):
        if not Path(pair[k]).is_file():
            raise SystemExit(f"{k} GGUF not found: {pair[k]}")
    pair["name"] = name
    return pair


# ---- workers (child processes) -----------------------------------------------------------------

def worker_ours(a: dict) -> dict:
    from dflash_gguf.engine import Engine

    budget = a.get("budget")
    budget = int(budget) if budget not in (None, "auto") else budget
    t0 = time.perf_counter()
    eng = Engine(a["target"], a.get("draft"), n_ctx=a["n_ctx"], n_threads=a["threads"], tree_budget=budget)
    load_s = time.perf_counter() - t0
    try:
        eng.generate(WARMUP_TEXT, max_tokens=min(16, a["n"]), stop_tokens=())  # graphs, caches, verify cost
        nodes = {"target": [], "drafter": []}

        def graph_nodes(stage):
            # the graph each stage just ran: the drafter's propose, the target's verify or decode
            if stage == "drafted":
                nodes["drafter"].append(eng.draft.info()["n_last_nodes"])
            elif stage in ("verified", "decoded"):
                nodes["target"].append(eng.target.info()["n_last_nodes"])

        eng.stage_hook = graph_nodes
        out = []
        models = lambda: [eng.target] + ([eng.draft] if eng.draft is not None else [])  # noqa: E731
        for ids in a["prompts"]:
            before = eng.target.info()
            io0 = [m.info() for m in models()]
            r = eng.generate(ids, max_tokens=a["n"], stop_tokens=())
            after = eng.target.info()
            io1 = [m.info() for m in models()]
            s = r.stats
            passes = len(s.accepted_lengths) if a.get("draft") else max(s.generated_tokens - 1, 0)
            # AL counts tokens per target pass after the prefill (whose token is not a pass)
            al = s.mean_accepted if a.get("draft") else 1.0
            # host synchronisations per step: graphs computed, result reads and input writes
            # (each blocking on a device), target and drafter together, prefill included
            io = {k: sum(y[k] - x[k] for x, y in zip(io0, io1)) / max(passes, 1)
                  for k in ("n_graphs", "n_host_reads", "n_host_writes")}
            out.append({"tokens": r.tokens, "n": s.generated_tokens, "decode_s": s.decode_seconds, "tps": s.decode_tps,
                        "prefill_s": s.prefill_seconds, "al": al, "passes": passes,
                        "draft_s": s.draft_seconds, "verify_s": s.verify_seconds, "other_s": s.other_seconds,
                        "tree": (sum(s.tree_sizes) / len(s.tree_sizes)) if s.tree_sizes else None,
                        "graphs": after["n_graphs"] - before["n_graphs"],
                        "builds": after["n_graph_builds"] - before["n_graph_builds"],
                        "target_nodes": statistics.median(nodes["target"]) if nodes["target"] else None,
                        "drafter_nodes": statistics.median(nodes["drafter"]) if nodes["drafter"] else None,
                        "computes_per_step": io["n_graphs"], "reads_per_step": io["n_host_reads"],
                        "writes_per_step": io["n_host_writes"]})
            nodes = {"target": [], "drafter": []}
    finally:
        eng.close()
    return {"prompts": out, "load_s": load_s}


def open_llama(path: str, n_ctx: int, threads: int, logits_all: bool):
    """llama-cpp-python on `path` (flash attention, f16 KV cache, the same threads for
    decode and batches): (llm, last_argmax(), load seconds)."""
    import numpy as np
    import llama_cpp
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                flash_attn=True, logits_all=logits_all, verbose=False)
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()
    ctx = llm._ctx.ctx

    def last_argmax() -> int:
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

    return llm, last_argmax, load_s


def worker_llama(a: dict) -> dict:
    llm, last_argmax, load_s = open_llama(a["target"], a["n_ctx"], a["threads"], logits_all=False)

    def run(ids, n):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        toks = [last_argmax()]  # timed like ours: from the end of the prefill to the n-th token
        while len(toks) < n:
            llm.eval([toks[-1]])
            toks.append(last_argmax())
        decode_s = time.perf_counter() - t0
        return {"tokens": toks, "n": len(toks), "decode_s": decode_s, "tps": len(toks) / decode_s,
                "prefill_s": prefill_s, "al": 1.0, "passes": len(toks) - 1}

    run(llm.tokenize(WARMUP_TEXT.encode(), add_bos=False, special=True), min(16, a["n"]))
    return {"prompts": [run(ids, a["n"]) for ids in a["prompts"]], "load_s": load_s}


def worker_zlab(a: dict) -> dict:
    import torch
    import dflash.model as ref
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from reference_loop import RecomputingTarget, exact_reference

    torch.set_num_threads(a["threads"])
    exact_reference(ref)
    target = AutoModelForCausalLM.from_pretrained(a["hf_target"], dtype=torch.float32).eval()
    arch = (json.loads((Path(a["hf_draft"]) / "config.json").read_text()).get("architectures") or [""])[0]
    cls = ref.DFlash2DraftModel if arch == "DFlash2DraftModel" else ref.DFlashDraftModel
    draft = cls.from_pretrained(a["hf_draft"], dtype=torch.float32).eval()
    wrapped = RecomputingTarget(target)
    out = []
    for ids in a["prompts"]:
        t0 = time.perf_counter()
        res = ref.dflash_generate(draft, wrapped, torch.tensor([ids]), a["n"], None, temperature=0.0,
                                  return_stats=True)
        lens = list(res.acceptance_lengths)
        toks = res.output_ids[0, len(ids):].tolist()
        out.append({"tokens": toks, "n": len(toks), "al": sum(lens) / len(lens) if lens else None,
                    "passes": len(lens), "wall_s": time.perf_counter() - t0})
    return {"prompts": out}


WORKERS = {"ours": worker_ours, "llama": worker_llama, "zlab": worker_zlab}


def run_worker(kind: str, args: dict, timeout: float = 3600) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(args, fh)
        arg_file = fh.name
    try:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, arg_file]
        res = subprocess.run(cmd, capture_output=True, text=True, errors="replace", cwd=tempfile.gettempdir(),
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"{kind} worker timed out"}
    finally:
        os.unlink(arg_file)
    if res.returncode != 0:
        how = f"signal {-res.returncode}" if res.returncode < 0 else f"exit code {res.returncode}"
        tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-1:] or [""]
        return {"error": f"{kind} worker failed ({how}): {tail[0][:300]}"}
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("@@")), None)
    if line is None:
        return {"error": f"{kind} worker printed no result: {res.stderr[-300:]}"}
    return json.loads(line[2:])


# ---- the benchmark ---------------------------------------------------------------------

class Row:
    def __init__(self, key: str, label: str, kind: str, extra: dict | None = None, timed: bool = True):
        self.key, self.label, self.kind, self.extra, self.timed = key, label, kind, extra or {}, timed
        self.runs: list[list[dict]] = []  # per run: per prompt results
        self.error: str | None = None
        self.note = ""
        self.load_s: list[float] = []

    def per_prompt(self, field: str) -> list:
        """Median over runs of `field`, per prompt."""
        if not self.runs:
            return []
        return [median([run[i].get(field) for run in self.runs]) for i in range(len(self.runs[0]))]

    def tps(self):
        return median(self.per_prompt("tps")) if self.timed else None

    def al(self):
        return median(self.per_prompt("al"))


def read_draft_block(draft: str) -> int:
    from dflash_gguf.draft import read_draft_metadata

    return int(read_draft_metadata(draft)["block_size"])


def encode_prompts(target: str, texts: list[str]) -> list[list[int]]:
    from dflash_gguf.tokenizer import Tokenizer

    tok = Tokenizer(target)
    return [tok.encode(t) for t in texts]


def decode_tokens(target: str, seqs: list[list[int]]) -> list[str]:
    from dflash_gguf.tokenizer import Tokenizer

    tok = Tokenizer(target)
    return [tok.decode(s) for s in seqs]


def run_bench(args, pair: dict) -> dict:
    prompts = PROMPTS[: args.prompts]
    texts = [t for _, t in prompts]
    ids = encode_prompts(pair["target"], texts)
    block = read_draft_block(pair["draft"])
    n_ctx = max(len(x) for x in ids) + args.n_predict + 2 * max(block, 64) + 16
    common = {"target": pair["target"], "threads": args.threads, "n": args.n_predict, "n_ctx": n_ctx, "prompts": ids}

    rows = [Row("ours-ar", "ours AR", "ours"),
            Row("ours-chain", f"ours chain (block {block})", "ours", {"draft": pair["draft"]})]
    for b in args.budgets:
        rows.append(Row(f"ours-tree-{b}", f"ours tree, budget {b}", "ours", {"draft": pair["draft"], "budget": b}))
    rows.append(Row("llama-ar", "llama.cpp AR (llama-cpp-python)", "llama"))
    spec = Row("llama-dflash", f"llama.cpp DFlash (block {block}, chain)", "spec")
    rows.append(spec)
    zlab = Row("zlab", "z-lab reference loop (AL only)", "zlab", timed=False)
    rows.append(zlab)

    exe = None
    if args.no_llama_spec:
        spec.error = "skipped (--no-llama-spec)"
    else:
        exe = llama_spec_binary()
        if exe is None and args.quick:
            spec.error = f"skipped: not built yet and --quick does not build it (run with --build-llama-cpp)"
        elif exe is None:
            exe, note = build_llama_spec(args.jobs)
            if exe is None:
                spec.error = f"skipped: {note}"
    spec_args = {**common, "draft": pair["draft"], "block": block}
    if exe is not None:
        log("llama.cpp DFlash: one debug run per prompt to count target passes ...")
        spec.stats, spec.error = run_llama_spec_prompts(exe, spec_args, texts, debug=True)

    if not (pair.get("hf_target") and pair.get("hf_draft")):
        zlab.error = "skipped: needs --hf-target and --hf-draft (the HF checkpoints of the pair)"

    timed = [r for r in rows if r.timed]
    for run in range(args.runs):
        order = timed[run % len(timed):] + timed[:run % len(timed)]
        t_run = time.perf_counter()
        for row in order:
            if row.error:
                continue
            if row.kind == "spec":
                res, row.error = run_llama_spec_prompts(exe, spec_args, texts, debug=False)
                if row.error:
                    continue
                for r, st in zip(res, spec.stats):  # passes come from the debug run (greedy: the same)
                    r.update({k: st.get(k) for k in ("al", "passes", "rounds", "restores", "tokens_per_round")})
                row.runs.append(res)
                continue
            r = run_worker(row.kind, {**common, **row.extra})
            if "error" in r:
                row.error = r["error"]
                continue
            row.runs.append(r["prompts"])
            row.load_s.append(r["load_s"])
        log(f"run {run + 1}/{args.runs} done in {time.perf_counter() - t_run:.0f} s "
            f"(load average {os.getloadavg()[0]:.2f})")

    if not zlab.error:
        log("z-lab reference loop (AL only) ...")
        r = run_worker("zlab", {**common, "hf_target": pair["hf_target"], "hf_draft": pair["hf_draft"]})
        if "error" in r:
            zlab.error = r["error"]
        else:
            zlab.runs.append(r["prompts"])

    # same output as our AR, per prompt
    ref = rows[0].runs[0] if rows[0].runs else None
    ref_text = decode_tokens(pair["target"], [p["tokens"] for p in ref]) if ref else None
    for row in rows:
        if not row.runs or ref is None:
            row.same = None
            continue
        if row.kind == "spec":
            same = [r.get("text") is not None and (r["text"].startswith(t) or t.startswith(r["text"]))
                    for r, t in zip(row.runs[0], ref_text)]
        else:
            same = [r["tokens"][: len(p["tokens"])] == p["tokens"] for r, p in zip(row.runs[0], ref)]
        row.same = (sum(same), len(same))
    return {"rows": rows, "block": block, "ids": ids, "prompts": prompts, "n_ctx": n_ctx}


# ---- report ----------------------------------------------------------------------------

def fmt(x, spec=".2f", none="–"):
    if x is None:
        return none
    return format(x, spec[:-1]) + "x" if spec.endswith("x") else format(x, spec)


def git_describe() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except OSError:
        return "?"


def cpu_name() -> str:
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def report(args, pair, res, load_start, load_end, started: _dt.datetime, ar08: str | None) -> str:
    import llama_cpp

    rows = res["rows"]
    by = {r.key: r for r in rows}
    ar, lar = by["ours-ar"].tps(), by["llama-ar"].tps()
    size = lambda p: Path(p).stat().st_size / 2**20
    L = []
    L.append(f"## dflash-gguf benchmark, {started:%Y-%m-%d %H:%M}" + (" (--quick)" if args.quick else ""))
    L.append("")
    L.append(f"Pair ({pair['name']}): target `{Path(pair['target']).name}` ({size(pair['target']):.1f} MiB), "
             f"drafter `{Path(pair['draft']).name}` ({size(pair['draft']):.1f} MiB, block {res['block']}). "
             f"{len(res['prompts'])} prompts ({', '.join(n for n, _ in res['prompts'])}; "
             f"{min(map(len, res['ids']))}..{max(map(len, res['ids']))} tokens), {args.n_predict} greedy tokens each, "
             f"{args.runs} run(s), {args.threads} threads; f16 KV cache, flash attention everywhere.")
    L.append(f"Machine: {cpu_name()}, {os.cpu_count()} CPUs; load average {load_start[0]:.2f} at the start, "
             f"{load_end[0]:.2f} at the end (1-minute). dflash-gguf {git_describe()}, llama-cpp-python "
             f"{llama_cpp.__version__}.")
    L.append("")
    L.append("| decoder | AL (tokens / target pass) | decode tok/s | vs ours AR | vs llama.cpp AR | same output as ours AR |"
             " notes |")
    L.append("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if r.error and not r.runs:
            L.append(f"| {r.label} | | | | | | {r.error} |")
            continue
        tps, al = r.tps(), r.al()
        notes = []
        if r.error:
            notes.append(f"incomplete: {r.error}")
        if r.kind == "ours" and r.runs:
            trees = [x for x in r.per_prompt("tree") if x is not None]
            if trees:
                notes.append(f"mean tree {statistics.mean(trees):.1f} nodes")
            d, v = (median(r.per_prompt(k)) for k in ("draft_s", "verify_s"))
            dec = median(r.per_prompt("decode_s"))
            if d is not None and dec and (d + v) > 0:
                # the commit runs inside the next verify graph: it is part of "verify"
                notes.append(f"draft/verify/other {100 * d / dec:.0f}/{100 * v / dec:.0f}/"
                             f"{100 * (dec - d - v) / dec:.0f}%")
            tn, dn = median(r.per_prompt("target_nodes")), median(r.per_prompt("drafter_nodes"))
            if tn is not None:
                notes.append(f"graph nodes target {tn:.0f}" + (f", drafter {dn:.0f}" if dn is not None else ""))
            c, rd, w = (median(r.per_prompt(k)) for k in ("computes_per_step", "reads_per_step", "writes_per_step"))
            if c is not None:
                notes.append(f"per step {c:.1f} graphs, {rd:.1f} reads, {w:.1f} input writes")
            graphs = sum(x or 0 for x in r.per_prompt("graphs"))
            if graphs:
                builds = sum(x or 0 for x in r.per_prompt("builds"))
                notes.append(f"target graphs built {100 * builds / graphs:.0f}% of {graphs}")
        if r.kind == "spec" and r.runs:
            tpr = median(r.per_prompt("tokens_per_round"))
            restores = sum(x or 0 for x in r.per_prompt("restores"))
            rounds = sum(x or 0 for x in r.per_prompt("rounds"))
            notes.append(f"{tpr:.2f} tokens per drafted block; {restores} of {rounds} blocks needed a checkpoint "
                         "restore + second target pass" if tpr is not None else "")
        if r.kind == "zlab":
            notes.append("transformers f32, target recomputed from history; AL should equal ours chain")
        same = f"{r.same[0]}/{r.same[1]}" if getattr(r, "same", None) else "–"
        L.append(f"| {r.label} | {fmt(al)} | {fmt(tps, '.1f')} | {fmt(tps / ar if tps and ar else None, '.2fx')} | "
                 f"{fmt(tps / lar if tps and lar else None, '.2fx')} | {same} | {'; '.join(n for n in notes if n)} |")
    L.append("")
    L.append("AL and tok/s: median over runs per prompt, then median over prompts. AR rows have AL 1 by definition. "
             "Decode time excludes the prefill (llama.cpp DFlash: its own 'decoded' timer, which also covers the "
             "last prompt token, evaluated together with the first draft).")
    # per-prompt detail
    L.append("")
    L.append("Per prompt, decode tok/s (AL):")
    L.append("")
    L.append("| decoder | " + " | ".join(n for n, _ in res["prompts"]) + " |")
    L.append("|---|" + "---:|" * len(res["prompts"]))
    for r in rows:
        if not r.runs:
            continue
        tps, al = r.per_prompt("tps"), r.per_prompt("al")
        cells = [(f"{t:.1f}" if t is not None else "–") + (f" ({a:.2f})" if a is not None else "")
                 for t, a in zip(tps or [None] * len(al), al)]
        L.append(f"| {r.label} | " + " | ".join(cells) + " |")
    if ar08:
        L.append("")
        L.append("### AR decode and verify cost vs llama-bench on the Qwen3.5-0.8B shape (scripts/bench_ar.py)")
        L.append("")
        lines = ar08.strip().splitlines()
        if lines and lines[0].startswith("## "):  # bench_ar's own title: replaced by the one above
            lines = lines[1:]
        L.append("\n".join(("#" + ln if ln.startswith("### ") else ln) for ln in lines).strip())
    return "\n".join(L) + "\n"


def plot(res, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (`.venv/bin/pip install matplotlib`; not a runtime dependency)"
    by = {r.key: r for r in res["rows"]}
    budgets = [k[len("ours-tree-"):] for k in by if k.startswith("ours-tree-")]
    xs = list(range(len(budgets)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    refs = [("ours-chain", "ours chain", "C0", "--"), ("ours-ar", "ours AR", "C0", ":"),
            ("llama-dflash", "llama.cpp DFlash", "C3", "--"), ("llama-ar", "llama.cpp AR", "C3", ":"),
            ("zlab", "z-lab reference", "C2", "-.")]
    for ax, what, ylabel in ((ax1, "tps", "decode tokens / s"), (ax2, "al", "AL (tokens / target pass)")):
        ys = [(by[f"ours-tree-{b}"].tps() if what == "tps" else by[f"ours-tree-{b}"].al()) for b in budgets]
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color="C1", label="ours tree")
        for key, label, color, style in refs:
            r = by.get(key)
            if r is None or not r.runs or (what == "al" and key.endswith("-ar")):
                continue
            y = r.tps() if what == "tps" else r.al()
            if y is not None:
                ax.axhline(y, color=color, linestyle=style, label=label)
        ax.set_xticks(xs)
        ax.set_xticklabels(budgets)
        ax.set_xlabel("tree budget (nodes)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("dflash-gguf: DDTree budget vs chain and peers (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def run_ar_08b(args) -> str:
    """scripts/bench_ar.py (AR ours vs llama-bench on the random-weight Qwen3.5-0.8B shape,
    q4_k_m, plus the verify cost curve): its markdown tables."""
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_ar.py"), "--arch", "qwen35", "--no-save",
           "-t", str(args.threads)]
    if args.quick:  # llama-bench only if already built, as llama.cpp's decoder
        cmd += ["--runs", "2", "--tokens", "24", "--reps", "3", "--no-build"]
    log("running scripts/bench_ar.py (Qwen3.5-0.8B shape) ...")
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if res.returncode != 0:
        return f"scripts/bench_ar.py failed (exit {res.returncode}): {res.stderr.strip()[-500:]}"
    return res.stdout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", help="target GGUF (qwen35); default: the bundled demo pair")
    p.add_argument("-md", "--draft", help="DFlash drafter GGUF")
    p.add_argument("--hf-target", help="HF checkpoint of the target (for the z-lab reference row)")
    p.add_argument("--hf-draft", help="HF checkpoint of the drafter (for the z-lab reference row)")
    p.add_argument("--tiny", action="store_true", help="use a tiny random pair (built and cached in .cache/bench)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens generated per prompt (default 128)")
    p.add_argument("-t", "--threads", type=int, default=2, help="CPU threads for every engine (default 2)")
    p.add_argument("--runs", type=int, default=3, help="runs per row (default 3)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    p.add_argument("--budgets", default=",".join(BUDGETS), help="tree budgets (default 4,8,16,32,auto)")
    p.add_argument("--no-llama-spec", action="store_true", help="skip llama.cpp's DFlash decoder")
    p.add_argument("--build-llama-cpp", action="store_true", help="only build llama.cpp's decoder and exit")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for that build (default 2)")
    p.add_argument("--ar-0.8b", dest="ar08", action="store_true",
                   help="also run scripts/bench_ar.py (Qwen3.5-0.8B shape) and include its tables")
    p.add_argument("--quick", action="store_true",
                   help="1 prompt, 1 run, 32 tokens; llama.cpp's decoder only if already built")
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory (default results/)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("worker_args", nargs="?", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        a = json.loads(Path(args.worker_args).read_text())
        print("@@" + json.dumps(WORKERS[args.worker](a)), flush=True)
        return 0
    if args.build_llama_cpp:
        exe, note = build_llama_spec(args.jobs)
        print(exe or note)
        return 0 if exe else 1

    if args.quick:
        args.prompts, args.runs, args.n_predict = 1, 1, min(args.n_predict, 32)
    args.budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    for b in args.budgets:
        if b != "auto" and not (b.isdigit() and 1 <= int(b) <= 63):
            p.error(f"bad tree budget {b!r} (1..63 or auto)")
    if not 1 <= args.prompts <= len(PROMPTS):
        p.error(f"--prompts must be 1..{len(PROMPTS)}")

    started = _dt.datetime.now()
    load_start = os.getloadavg()
    log(f"load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} on {os.cpu_count()} CPUs")
    if load_start[0] > 0.5:
        log(f"WARNING: the machine is busy (1-minute load {load_start[0]:.2f} > 0.5): timings will be noisy")
    pair = resolve_pair(args)
    log(f"pair: {pair['target']} + {pair['draft']}")
    res = run_bench(args, pair)
    ar08 = run_ar_08b(args) if args.ar08 else None
    load_end = os.getloadavg()
    text = report(args, pair, res, load_start, load_end, started, ar08)
    print(text)

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{started:%Y-%m-%d-%H%M}" + ("-quick" if args.quick else "")
    md = args.out / f"{stem}.md"
    md.write_text(text)
    (args.out / "latest.md").write_text(text)
    log(f"wrote {md} and {args.out / 'latest.md'}")
    log(plot(res, args.out / f"{stem}.png"))
    if load_end[0] > 0.5 or load_start[0] > 0.5:
        log(f"note: load average was {load_start[0]:.2f} at the start and {load_end[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
