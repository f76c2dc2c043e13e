#!/usr/bin/env python3
"""dflash-gguf against llama.cpp's own C++ tools, on llama.cpp's ground: the same GGUFs,
threads and prompts, every figure of issue #13 printed as a ratio with its threshold.

    cd /tmp && /work/main/.venv/bin/python /work/main/scripts/bench.py                 # full run, < 20 min idle
    cd /tmp && /work/main/.venv/bin/python /work/main/scripts/bench.py --write-readme  # and README's tables
    .venv/bin/python scripts/bench.py --quick         # plumbing check: a few minutes
    .venv/bin/python scripts/bench.py --build-llama-cpp   # only build llama.cpp's tools
    .venv/bin/python scripts/bench.py -m target.gguf -md draft.gguf   # your own pair

(Run it from outside the checkout's root, or by its path as above: the repository root on
sys.path would shadow the installed package with the source tree, which lacks the
compiled library.)

Models. Two pairs over one target, each with the target in f32 and q8_0:
  demo   the bundled demo pair's drafter (dflash_gguf/data/demo-draft.gguf), chain AL ~3.5
  weak   dflash_gguf/data/demo-draft-weak.gguf (an early-stopped drafter of the same recipe,
         scripts/train_weak_drafter.py, blended halfway with the demo drafter by
         scripts/mix_drafters.py), chain AL ~2: the fixed cost per step decides
The q8_0 target is the bundled demo-target.gguf; the f32 one is converted (once, cached in
.cache/bench/) from its bf16 HF copy in tests/data/demo-hf/target. Both drafters are q8_0.
Figures 1 and 2 add the Qwen3.5-0.8B shape (random weights, q4_k_m, written once into
.cache/bench/ by scripts/make_shape_model.py's writer): speed there depends on shapes only.
With -m TARGET [-md DRAFT] the bench runs on that target and drafter instead (one pair
named "given", the target under its file name; no 0.8B shape): every row and figure as
above, the chain and tree rows only with a drafter.

Peers, all built from the pinned llama-cpp-python sdist by scripts/llama_cpp_build.py:
  llama-bench               -n (plain decode) and -p k (one batch of k tokens), through
                            scripts/bench_ar.py; run with flash attention off and on, the
                            faster setting counts per test
  llama-completion          end-to-end greedy decoding (--temp 0 --ignore-eos, -no-cnv);
                            its own "eval time" (decode steps only: sampling, which it
                            times apart, is left out in its favour)
  llama-speculative-simple  --spec-type draft-dflash --spec-draft-n-max <block-1>, once per
                            --spec-p-min value (llama.cpp stops a draft at the first token
                            below that probability); the best of them counts
f16 KV cache and the same thread count everywhere; flash attention on for our runtime,
llama-completion and llama-speculative-simple (llama.cpp's CPU default, "auto", turns it on).

Figures (issue #13), each a ratio with pass/fail (times of figures 1, 2 and 4: the lower
quartile of the reps, both engines alike; other processes only ever add time):
  1  plain decode tok/s, ours / llama-bench -n, every target          >= 1.00
  2  verify time of k tokens with its commit, llama-bench -p k / ours, k = 1..32, every
     target; the LM head over the k-1 rows llama-bench skips is given as a share of the gap
                                                                      >= 1.00
  3  chain tok/s, ours / llama.cpp DFlash, both pairs, f32 and q8_0   >= 1.00
  4  tree verify of N nodes / chain verify of N tokens (scripts/verify_count.py; the
     DDTree shapes of a confident and of an unsure drafter), N up to 32 <= 1.05
  5  --tree-budget auto tok/s / the best of the chain and every fixed budget, both pairs,
     f32 and q8_0, measured side by side (scripts/auto_compare.py: one process, an
     engine per arm, the arms taking turns prompt by prompt, --runs rounds)  >= 0.97
Besides: graph nodes per target and drafter graph and host synchronisations per step
(our runtime's counters; llama.cpp's graph nodes from its own log), and the load average
at the start and the end.

End-to-end method. Every run of a row is a fresh child process that loads the models,
warms up on a separate prompt, then generates every prompt once (greedy, end-of-generation
ignored); the rows of a target take turns run by run (order rotated) so that load changes
hit all alike. Reported: the median over runs per prompt, then the median over prompts.
AL = generated tokens per target pass (a llama.cpp checkpoint restore, which re-evaluates
the accepted tokens in a second pass, counts as a pass). "same" counts prompts whose output
equals our plain greedy output (llama.cpp: by text).

Results: markdown on stdout, results/bench-<date>[-quick].md and .json, results/latest.md,
and with --write-readme the block between the bench markers of README.md. A plot of tok/s
and AL per tree budget goes to results/bench-<date>.png when matplotlib is installed.
Timing on a busy machine is noise: the load average is printed and recorded.
"""
from __future__ import annotations

import argparse
import collections
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
import bench_ar  # noqa: E402  (scripts/bench_ar.py)
from llama_cpp_build import LLAMA_CPP_PYTHON_VERSION, build_llama, llama_binary  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "dflash_gguf" / "data"
HF_DEMO = ROOT / "tests" / "data" / "demo-hf"
RESULTS = ROOT / "results"
README = ROOT / "README.md"
CACHE = ROOT / ".cache" / "bench"
LLAMA_TOOLS = ("llama-bench", "llama-completion", "llama-speculative-simple")
PAIRS = {"demo": DATA / "demo-draft.gguf", "weak": DATA / "demo-draft-weak.gguf"}
GIVEN = "given"  # the pair of -m/-md
TYPES = ("f32", "q8_0")
BUDGETS = ("4", "8", "16", "32", "auto")
SPEC_P_MIN = ("0", "0.5")
WARMUP_TEXT = "import os\nimport sys\n\n\ndef main():\n"
README_BEGIN, README_END = "<!-- bench.py --write-readme: begin -->", "<!-- bench.py --write-readme: end -->"
# thresholds of issue #13
DECODE_MIN, VERIFY_MIN, CHAIN_MIN, TREE_MAX, AUTO_MIN = 1.0, 1.0, 1.0, 1.05, 0.97

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


# ---- llama.cpp's tools -------------------------------------------------------------------

def parse_graph_nodes(log_text: str) -> list[tuple[int, int]]:
    """(batch graph, one-token graph) nodes of each graph reservation llama.cpp logged
    ("graph: nodes = N", or "nodes = PP / TG" when they differ), in order (seen at -lv 4).
    A context reserves again when its outputs change (llama-speculative-simple: target,
    drafter, target again once feature capture is on, drafter again): the first line is
    the target's, the last one the drafter's final graph."""
    return [(int(m.group(1)), int(m.group(2) or m.group(1)))
            for m in re.finditer(r"graph[^\n]*?: nodes = (\d+)(?: / (\d+))?", log_text)]


def parse_completion(err: str) -> dict:
    """llama-completion's own timings: eval (decode steps), prompt eval, sampling."""
    out = {}
    m = re.search(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs", err)
    if m:
        out["decode_s"], out["runs"] = float(m.group(1)) / 1e3, int(m.group(2))
        out["tps"] = out["runs"] / out["decode_s"] if out["decode_s"] > 0 else None
    m = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", err)
    if m:
        out["prefill_s"], out["prompt_tokens"] = float(m.group(1)) / 1e3, int(m.group(2))
    m = re.search(r"sampling time =\s*([\d.]+) ms", err)
    if m:
        out["sampling_s"] = float(m.group(1)) / 1e3
    nodes = parse_graph_nodes(err)
    if nodes:
        out["target_nodes"] = nodes[0][1]  # plain decoding runs the one-token graph
    return out


def parse_spec(err: str) -> dict:
    """llama-speculative-simple's summary (and, at -lv 5, its rounds and restores)."""
    out = {}
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", err)
    if m:
        out["tokens"], out["decode_s"] = int(m.group(1)), float(m.group(2))
        out["tps"] = out["tokens"] / out["decode_s"] if out["decode_s"] > 0 else None
    m = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", err)
    if m:
        out["prompt_tokens"], out["prefill_s"] = int(m.group(1)), float(m.group(2))
    for key in ("n_drafted", "n_accept", "n_predict"):
        m = re.search(rf"{key}\s*=\s*(\d+)", err)
        if m:
            out[key] = int(m.group(1))
    nodes = parse_graph_nodes(err)
    if len(nodes) > 1:  # verify batches and drafted blocks: batch graphs
        out["target_nodes"], out["drafter_nodes"] = nodes[0][0], nodes[-1][0]
    rounds = len(re.findall(r"accepted \d+/\d+ draft tokens", err))
    if rounds:
        restores = len(re.findall(r"partial acceptance: ", err))
        out.update(rounds=rounds, restores=restores, passes=rounds + restores)
        if "tokens" in out:
            out["al"] = out["tokens"] / out["passes"]
            out["tokens_per_round"] = out["tokens"] / rounds
    return out


def run_tool(cmd: list[str], timeout: float = 1800) -> tuple[str | None, str, str]:
    """(error or None, stdout, stderr) of one llama.cpp tool run."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{Path(cmd[0]).name} timed out", "", ""
    if res.returncode != 0:
        how = f"signal {-res.returncode}" if res.returncode < 0 else f"exit code {res.returncode}"
        tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-2:]
        return f"{Path(cmd[0]).name} failed ({how}): " + " | ".join(tail), res.stdout, res.stderr
    return None, res.stdout, res.stderr


def common_flags(a: dict) -> list[str]:
    t = str(a["threads"])
    return ["-c", str(a["n_ctx"]), "-b", "512", "-ub", "512", "-t", t, "-tb", t, "-fa", "on", "-ctk", "f16",
            "-ctv", "f16", "--temp", "0", "--seed", "0", "--ignore-eos", "-n", str(a["n"])]


def run_parsed(cmd: list, parse, attempts: int):
    """run_tool(cmd) until parse(log) has its timings ("tps"): llama.cpp logs from a worker
    thread, which sometimes loses the last lines at exit. Returns (error, parsed, stdout, log)."""
    for _ in range(attempts):
        err, out, log_text = run_tool(cmd)
        if err:
            return err, {}, out, log_text
        r = parse(log_text)
        if "tps" in r:
            break
    return None, r, out, log_text


def run_completion(exe: Path, a: dict, text: str, attempts: int = 3) -> dict:
    """One llama-completion run on one prompt, retried when its timings are missing
    (llama.cpp logs from a worker thread, which sometimes loses the last lines at exit)."""
    # -lv 4 logs the graph reservations (nodes); nothing more is logged while decoding
    cmd = [str(exe), "-m", a["target"], "-p", text, "-no-cnv", "--no-display-prompt", "-lv", "4", *common_flags(a)]
    err, r, out, log_text = run_parsed(cmd, parse_completion, attempts)
    if err:
        return {"error": err}
    if "tps" not in r:
        return {"error": f"no 'eval time' line in llama-completion's output: {log_text[-300:]}"}
    r["text"] = out.rstrip("\n")
    return r


def run_spec(exe: Path, a: dict, text: str, debug: bool, attempts: int = 3) -> dict:
    """One llama-speculative-simple run on one prompt; a debug run (-lv 5) also counts
    target passes. Retried when the summary is missing: llama.cpp logs from a worker
    thread, and under heavy debug logging its last lines are sometimes lost."""
    cmd = [str(exe), "-m", a["target"], "-md", a["draft"], "--spec-type", "draft-dflash",
           "--spec-draft-n-max", str(a["block"] - 1), "--spec-draft-n-min", "0", "--spec-draft-p-min", a["p_min"],
           "-p", text, "-td", str(a["threads"]), "-tbd", str(a["threads"]), *common_flags(a)]
    if debug:
        cmd += ["-lv", "5"]
    err, r, out, log_text = run_parsed(cmd, parse_spec, attempts)
    if err:
        return {"error": err}
    if "tps" not in r:
        return {"error": f"no 'decoded N tokens' line in the output: {log_text[-300:]}"}
    # stdout: "\n\n" + prompt pieces + generated pieces + "\n\n"
    i = out.find(text)
    r["text"] = out[i + len(text):].rstrip("\n") if i >= 0 else None
    return r


# ---- models ------------------------------------------------------------------------------

def convert_f32_target() -> Path:
    """The demo target in f32, from its bf16 HF copy (cached)."""
    out = CACHE / "demo-target-f32.gguf"
    if out.exists():
        return out
    from dflash_gguf.convert.cli import main as convert

    CACHE.mkdir(parents=True, exist_ok=True)
    log(f"converting {HF_DEMO / 'target'} to {out} (f32) ...")
    tmp = out.with_suffix(".tmp.gguf")
    if convert([str(HF_DEMO / "target"), "--outtype", "f32", "--outfile", str(tmp), "--force"]) != 0:
        raise SystemExit("converting the demo target to f32 failed")
    tmp.rename(out)
    return out


def demo_targets(types) -> dict[str, Path]:
    paths = {"q8_0": DATA / "demo-target.gguf"}
    if "f32" in types:
        paths["f32"] = convert_f32_target()
    return {t: paths[t] for t in types}


def gguf_file_type(path: Path) -> str:
    """The tensor type a GGUF declares (general.file_type), as llama.cpp names it: q4_k_m, f16, ..."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    if field is None:
        return "unknown type"
    value = int(field.parts[-1][0])
    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_").lower()
    except ValueError:
        return f"file type {value}"


def bench_targets(args) -> list[tuple[str, str, Path]]:
    """(type, name in the figures, GGUF) of every target benched: the demo targets, or -m."""
    if args.model is not None:
        return [(gguf_file_type(args.model), args.model.name, args.model)]
    return [(t, f"demo target {t}", path) for t, path in demo_targets(args.types).items()]


def shape_08b() -> Path:
    """The Qwen3.5-0.8B shape, random weights, q4_k_m (cached)."""
    out = CACHE / "qwen35-0.8b-shape-q4_k_m.gguf"
    if not out.exists():
        import make_shape_model  # scripts/make_shape_model.py
        from dflash_gguf.convert.shapes import QWEN35_0_8B

        CACHE.mkdir(parents=True, exist_ok=True)
        log(f"writing the Qwen3.5-0.8B shape to {out} ...")
        make_shape_model.write_model(QWEN35_0_8B, "q4_k_m", out, progress=False)
    return out


# ---- our rows (child processes) ----------------------------------------------------------

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
            # tokens the timed steps produced: the first one is the prefill's (llama-completion
            # divides by its decode runs, llama-speculative-simple times the pass that makes it)
            tps = (s.generated_tokens - 1) / s.decode_seconds if s.decode_seconds > 0 else 0.0
            out.append({"tokens": r.tokens, "n": s.generated_tokens, "decode_s": s.decode_seconds, "tps": tps,
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


def worker_zlab(a: dict) -> dict:
    import torch
    import dflash.model as ref
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from reference_loop import RecomputingTarget, exact_reference

    torch.set_num_threads(a["threads"])
    exact_reference(ref)
    target = AutoModelForCausalLM.from_pretrained(a["hf_target"], dtype=torch.float32).eval()
    draft = ref.DFlashDraftModel.from_pretrained(a["hf_draft"], dtype=torch.float32).eval()
    wrapped = RecomputingTarget(target)
    out = []
    for ids in a["prompts"]:
        res = ref.dflash_generate(draft, wrapped, torch.tensor([ids]), a["n"], None, temperature=0.0,
                                  return_stats=True)
        lens = list(res.acceptance_lengths)
        toks = res.output_ids[0, len(ids):].tolist()
        out.append({"tokens": toks, "n": len(toks), "al": sum(lens) / len(lens) if lens else None,
                    "passes": len(lens)})
    return {"prompts": out}


def worker_auto(a: dict) -> dict:
    """Figure 5 side by side (scripts/auto_compare.py): one process, an engine per arm,
    the arms taking turns prompt by prompt."""
    import auto_compare

    res = auto_compare.compare(a["target"], a["draft"], a["arms"], a["rounds"], a["n"], a["threads"], a["texts"])
    return {"tps": {str(k): v for k, v in res["tps"].items()}, "ratio": res["ratio"],
            "choices": res["choices"]}


WORKERS = {"ours": worker_ours, "zlab": worker_zlab, "auto": worker_auto}


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


# ---- end-to-end decoding -------------------------------------------------------------------

class Row:
    """One decoder on one target type (and pair): its runs, each a list of per-prompt dicts."""

    def __init__(self, key: str, label: str, kind: str, pair: str | None = None, extra: dict | None = None,
                 timed: bool = True):
        self.key, self.label, self.kind, self.pair = key, label, kind, pair
        self.extra, self.timed = extra or {}, timed
        self.runs: list[list[dict]] = []
        self.error: str | None = None
        self.same: tuple[int, int] | None = None
        self.debug: list[dict] = []  # llama.cpp DFlash: the -lv 5 run per prompt (pass counts)

    def per_prompt(self, field: str) -> list:
        """Median over runs of `field`, per prompt."""
        if not self.runs:
            return []
        return [median([run[i].get(field) for run in self.runs]) for i in range(len(self.runs[0]))]

    def tps(self):
        return median(self.per_prompt("tps")) if self.timed else None

    def al(self):
        return median(self.per_prompt("al"))

    def to_json(self) -> dict:
        return {"key": self.key, "label": self.label, "kind": self.kind, "pair": self.pair, "error": self.error,
                "tps": self.tps(), "al": self.al(), "same": self.same, "runs": self.runs, "debug": self.debug}


def encode_prompts(target: str, texts: list[str]) -> list[list[int]]:
    from dflash_gguf.tokenizer import Tokenizer

    tok = Tokenizer(target)
    return [tok.encode(t) for t in texts]


def decode_tokens(target: str, seqs: list[list[int]]) -> list[str]:
    from dflash_gguf.tokenizer import Tokenizer

    tok = Tokenizer(target)
    return [tok.decode(s) for s in seqs]


def e2e_rows(args, block: int, pairs: list[str], tools: dict) -> list[Row]:
    from dflash_gguf.speculative import DEFAULT_DRAFT_P_MIN

    rows = [Row("ours-ar", "ours AR", "ours"),
            Row("llama-ar", "llama.cpp AR (llama-completion)", "completion")]
    for pair in pairs:
        draft = {"draft": str(args.pair_files[pair])}
        rows.append(Row(f"{pair}/ours-chain", f"ours chain (block {block}, p-min {DEFAULT_DRAFT_P_MIN})", "ours",
                        pair, draft))
        for b in args.budgets:
            rows.append(Row(f"{pair}/ours-tree-{b}", f"ours tree, budget {b}", "ours", pair, {**draft, "budget": b}))
        for p in args.spec_p_min:
            rows.append(Row(f"{pair}/llama-dflash-{p}", f"llama.cpp DFlash (n-max {block - 1}, p-min {p})", "spec",
                            pair, {**draft, "block": block, "p_min": p}))
    if args.zlab and "demo" in pairs:
        rows.append(Row("demo/zlab", "z-lab reference loop (AL only)", "zlab", "demo",
                        {"hf_target": str(HF_DEMO / "target"), "hf_draft": str(HF_DEMO / "draft")}, timed=False))
    for r in rows:
        if r.kind in ("completion", "spec"):
            exe = tools.get("llama-completion" if r.kind == "completion" else "llama-speculative-simple")
            if isinstance(exe, str):
                r.error = exe  # why it is missing
    return rows


def run_e2e(args, ttype: str, target: Path) -> dict:
    """Every decoder on one target type: both pairs, same prompts, rotated runs."""
    from dflash_gguf.draft import read_draft_metadata

    prompts = PROMPTS[: args.prompts]
    texts = [t for _, t in prompts]
    ids = encode_prompts(str(target), texts)
    blocks = {int(read_draft_metadata(str(args.pair_files[p]))["block_size"]) for p in args.pairs}
    if len(blocks) > 1:
        raise SystemExit(f"the pairs' drafters have different block sizes: {sorted(blocks)}")
    block = blocks.pop() if blocks else 1  # no drafter: plain decoding rows only
    n_ctx = max(len(x) for x in ids) + args.n_predict + 2 * max(block, 64) + 16
    common = {"target": str(target), "threads": args.threads, "n": args.n_predict, "n_ctx": n_ctx, "prompts": ids}
    rows = e2e_rows(args, block, args.pairs, args.tools)

    for row in rows:  # one -lv 5 run per prompt counts llama.cpp DFlash's target passes
        if row.kind == "spec" and not row.error:
            exe = args.tools["llama-speculative-simple"]
            for text in texts:
                r = run_spec(exe, {**common, **row.extra}, text, debug=True)
                if "error" in r:
                    row.error = r["error"]
                    break
                row.debug.append(r)

    timed = [r for r in rows if r.timed]
    for run in range(args.runs):
        order = timed[run % len(timed):] + timed[:run % len(timed)]
        t_run = time.perf_counter()
        for row in order:
            if row.error:
                continue
            if row.kind in ("completion", "spec"):
                res = []
                for i, text in enumerate(texts):
                    a = {**common, **row.extra}
                    r = (run_completion(args.tools["llama-completion"], a, text) if row.kind == "completion"
                         else run_spec(args.tools["llama-speculative-simple"], a, text, debug=False))
                    if "error" in r:
                        row.error = r["error"]
                        break
                    if row.kind == "spec":  # greedy: the debug run made the same passes
                        r.update({k: row.debug[i].get(k) for k in ("al", "passes", "rounds", "restores",
                                                                    "tokens_per_round")})
                    else:
                        r["al"] = 1.0
                    res.append(r)
                if not row.error:
                    row.runs.append(res)
                continue
            r = run_worker(row.kind, {**common, **row.extra})
            if "error" in r:
                row.error = r["error"]
                continue
            row.runs.append(r["prompts"])
        log(f"{ttype}: run {run + 1}/{args.runs} done in {time.perf_counter() - t_run:.0f} s "
            f"(load average {os.getloadavg()[0]:.2f})")

    auto = {}
    if "auto" in args.budgets:
        arms = ["auto", "chain"] + [int(b) for b in args.budgets if b != "auto"]
        for pair in args.pairs:
            log(f"{ttype}: figure 5 side by side, {pair} pair ...")
            auto[pair] = run_worker("auto", {"target": str(target), "draft": str(args.pair_files[pair]),
                                             "arms": arms, "rounds": args.runs, "n": args.n_predict,
                                             "threads": args.threads, "texts": texts})

    zlab = next((r for r in rows if r.kind == "zlab"), None)
    if zlab is not None and not zlab.error:
        log("z-lab reference loop (AL only) ...")
        r = run_worker("zlab", {**common, **zlab.extra})
        if "error" in r:
            zlab.error = r["error"]
        else:
            zlab.runs.append(r["prompts"])

    # same output as our AR, per prompt
    ref = rows[0].runs[0] if rows[0].runs else None
    ref_text = decode_tokens(str(target), [p["tokens"] for p in ref]) if ref else None
    for row in rows:
        if not row.runs or ref is None:
            continue
        if row.kind in ("completion", "spec"):
            same = [r.get("text") is not None and (r["text"].startswith(t) or t.startswith(r["text"]))
                    for r, t in zip(row.runs[0], ref_text)]
        else:
            same = [r["tokens"][: len(p["tokens"])] == p["tokens"] for r, p in zip(row.runs[0], ref)]
        row.same = (sum(same), len(same))
    return {"type": ttype, "target": str(target), "rows": rows, "block": block, "ids": ids, "n_ctx": n_ctx,
            "auto": auto}


# ---- figures ---------------------------------------------------------------------------------

def figure(num: int, case: str, value, threshold: float, higher_is_better: bool, detail: str = "") -> dict:
    if value is None:
        ok = None
    else:
        ok = value >= threshold if higher_is_better else value <= threshold
    return {"figure": num, "case": case, "value": value, "threshold": threshold,
            "op": ">=" if higher_is_better else "<=", "pass": ok, "detail": detail}


def e2e_figures(e2e: list[dict]) -> list[dict]:
    """Figures 3 (chain vs llama.cpp DFlash) and 5 (auto vs the best fixed choice: from
    the side-by-side run where there is one, else from the end-to-end rows, whose
    per-process spread drowns a 3% figure)."""
    out = []
    for res in e2e:
        by = {r.key: r for r in res["rows"]}
        pairs = list(dict.fromkeys(r.pair for r in res["rows"] if r.pair))  # in row order
        for pair in pairs:
            case = f"{pair} pair, {res['type']} target"
            chain = by.get(f"{pair}/ours-chain")
            specs = [r for r in res["rows"] if r.pair == pair and r.kind == "spec" and r.tps()]
            best = max(specs, key=lambda r: r.tps(), default=None)
            c = chain.tps() if chain else None
            out.append(figure(3, case, c / best.tps() if c and best else None, CHAIN_MIN, True,
                              f"ours {c:.1f} vs {best.tps():.1f} tok/s ({best.label})" if c and best else
                              "missing: " + "; ".join(r.error for r in (chain, *specs) if r and r.error)))
            side = res.get("auto", {}).get(pair)
            if side is not None:
                out.append(auto_figure(case, side))
                continue
            auto = by.get(f"{pair}/ours-tree-auto")
            fixed = [r for r in res["rows"] if r.pair == pair and r.kind == "ours" and r.key != f"{pair}/ours-tree-auto"
                     and r.tps()]
            top = max(fixed, key=lambda r: r.tps(), default=None)
            a = auto.tps() if auto else None
            out.append(figure(5, case, a / top.tps() if a and top else None, AUTO_MIN, True,
                              f"auto {a:.1f} vs {top.tps():.1f} tok/s ({top.label})" if a and top else "missing"))
    return out


def auto_figure(case: str, side: dict) -> dict:
    """Figure 5 from a side-by-side run (worker_auto's result)."""
    if "error" in side:
        return figure(5, case, None, AUTO_MIN, True, "missing: " + side["error"])
    tps = side["tps"]
    best = max((a for a in tps if a != "auto"), key=tps.get)
    steps = collections.Counter(side["choices"])
    ran = ", ".join(f"{'chain' if a == 0 else a}: {n}" for a, n in sorted(steps.items()))
    return figure(5, case, side["ratio"], AUTO_MIN, True,
                  f"side by side: auto {tps['auto']:.1f} vs {tps[best]:.1f} tok/s ({best}); auto's steps {ran}")


def ar_figures(ar: dict) -> list[dict]:
    """Figures 1 (decode) and 2 (verify of k, the worst k) per target, from bench_ar."""
    out = []
    for name, sm in ar["summaries"]:
        out.append(figure(1, name, sm["decode"], DECODE_MIN, True, "ours / llama-bench -n"))
        ks = [k for k, v in sm["verify"].items() if v]
        if not ks:
            out.append(figure(2, name, None, VERIFY_MIN, True, "missing"))
            continue
        worst = min(ks, key=lambda k: sm["verify"][k])
        failing = [k for k in ks if sm["verify"][k] < VERIFY_MIN]
        lm, gap = sm["lm_gap"].get(worst, (None, None))
        lm_note = (f"; LM head over the other rows {1000 * lm:.2f} ms of the {1000 * gap:.2f} ms gap"
                   if lm is not None and gap and gap > 0 else "")
        out.append(figure(2, name, sm["verify"][worst], VERIFY_MIN, True,
                          f"worst k={worst}; below 1 at k={','.join(map(str, failing)) or 'none'}{lm_note}"))
    return out


def tree_figures(trees: dict) -> list[dict]:
    """Figure 4: tree verify of N nodes over chain verify of N tokens, the worst N and shape."""
    out = []
    for name, rows in trees.items():
        if isinstance(rows, str):
            out.append(figure(4, name, None, TREE_MAX, False, rows))
            continue
        chain = {r["n"]: r["wall_ms"] for r in rows if r["shape"] == "chain"}
        ratios = [(r["wall_ms"] / chain[r["n"]], r["shape"], r["n"]) for r in rows
                  if r["shape"] != "chain" and chain.get(r["n"])]
        if not ratios:
            out.append(figure(4, name, None, TREE_MAX, False, "missing"))
            continue
        worst = max(ratios)
        over = sorted({n for v, _, n in ratios if v > TREE_MAX})
        out.append(figure(4, name, worst[0], TREE_MAX, False,
                          f"worst {worst[1]} N={worst[2]}; over at N={','.join(map(str, over)) or 'none'}"))
    return out


# ---- tree vs chain verify (scripts/verify_count.py) --------------------------------------------

def run_tree_vs_chain(gguf: Path, args) -> list[dict] | str:
    cmd = [sys.executable, str(ROOT / "scripts" / "verify_count.py"), str(gguf), "--n", args.tree_n,
           "--shapes", "chain,ddtree,bushy", "--reps", str(args.tree_reps), "--threads", str(args.threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, errors="replace", cwd=tempfile.gettempdir())
    if res.returncode != 0:
        tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-1:] or [""]
        return f"verify_count.py failed (exit {res.returncode}): {tail[0][:300]}"
    return [json.loads(ln[5:]) for ln in res.stdout.splitlines() if ln.startswith("@row ")]


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


def figures_table(figs: list[dict]) -> list[str]:
    names = {1: "plain decode, ours / llama-bench -n", 2: "verify k=1..32 with commit, llama-bench -p k / ours",
             3: "chain, ours / llama.cpp DFlash", 4: "tree verify N nodes / chain verify N, N<=32",
             5: "tree-budget auto / best of chain and fixed budgets"}
    L = ["| # | figure | case | ratio | threshold | result | detail |", "|---:|---|---|---:|---:|---|---|"]
    for f in figs:
        res = {True: "pass", False: "**FAIL**", None: "not measured"}[f["pass"]]
        L.append(f"| {f['figure']} | {names[f['figure']]} | {f['case']} | {fmt(f['value'], '.2fx')} | "
                 f"{f['op']} {f['threshold']:.2f} | {res} | {f['detail']} |")
    return L


def e2e_table(res: dict) -> list[str]:
    rows = res["rows"]
    ar = next((r.tps() for r in rows if r.key == "ours-ar"), None)
    lar = next((r.tps() for r in rows if r.key == "llama-ar"), None)
    L = ["| pair | decoder | AL | decode tok/s | vs ours AR | vs llama.cpp AR | same output | notes |",
         "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        pair = r.pair or "–"
        if r.error and not r.runs:
            L.append(f"| {pair} | {r.label} | | | | | | {r.error} |")
            continue
        tps, al = r.tps(), r.al()
        L.append(f"| {pair} | {r.label} | {fmt(al)} | {fmt(tps, '.1f')} | {fmt(tps / ar if tps and ar else None, '.2fx')}"
                 f" | {fmt(tps / lar if tps and lar else None, '.2fx')} | "
                 f"{f'{r.same[0]}/{r.same[1]}' if r.same else '–'} | {'; '.join(row_notes(r))} |")
    return L


def row_notes(r: Row) -> list[str]:
    notes = []
    if r.error:
        notes.append(f"incomplete: {r.error}")
    if r.kind == "ours" and r.runs:
        trees = [x for x in r.per_prompt("tree") if x is not None]
        if trees:
            notes.append(f"mean tree {statistics.mean(trees):.1f} nodes")
        d, v, dec = (median(r.per_prompt(k)) for k in ("draft_s", "verify_s", "decode_s"))
        if d is not None and dec and (d + v) > 0:
            # the commit runs inside the next verify graph: it is part of "verify"
            notes.append(f"draft/verify/other {100 * d / dec:.0f}/{100 * v / dec:.0f}/{100 * (dec - d - v) / dec:.0f}%")
        graphs = sum(x or 0 for x in r.per_prompt("graphs"))
        if graphs:
            builds = sum(x or 0 for x in r.per_prompt("builds"))
            notes.append(f"target graphs built {100 * builds / graphs:.0f}% of {graphs}")
    if r.kind == "spec" and r.debug:
        tpr = median([d.get("tokens_per_round") for d in r.debug])
        restores = sum(d.get("restores", 0) for d in r.debug)
        rounds = sum(d.get("rounds", 0) for d in r.debug)
        if tpr is not None:
            notes.append(f"{tpr:.2f} tokens per drafted block; {restores} of {rounds} blocks needed a checkpoint "
                         "restore + second target pass")
    if r.kind == "completion" and r.runs:
        s, dec = median(r.per_prompt("sampling_s")), median(r.per_prompt("decode_s"))
        if s is not None and dec:
            notes.append(f"its sampling ({1000 * s:.1f} ms, {100 * s / dec:.0f}% of the decode time) left out")
    if r.kind == "zlab":
        notes.append("transformers f32 from the bf16 HF copies, target recomputed from history")
    return notes


def sync_table(e2e: list[dict]) -> list[str]:
    """Graph nodes and host synchronisations per step, ours beside llama.cpp's."""
    L = ["| target | pair | decoder | target graph nodes | drafter graph nodes | graphs / step | host reads / step | "
         "host writes / step |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for res in e2e:
        for r in res["rows"]:
            if not r.runs or r.kind == "zlab" or (r.kind == "ours" and "tree-" in r.key and not r.key.endswith("auto")):
                continue
            src = r.debug if r.kind == "spec" else [p for run in r.runs for p in run]
            tn, dn = median([p.get("target_nodes") for p in src]), median([p.get("drafter_nodes") for p in src])
            c, rd, w = (median(r.per_prompt(k)) for k in ("computes_per_step", "reads_per_step", "writes_per_step"))
            L.append(f"| {res['type']} | {r.pair or '–'} | {r.label} | {fmt(tn, '.0f')} | {fmt(dn, '.0f')} | "
                     f"{fmt(c, '.1f')} | {fmt(rd, '.1f')} | {fmt(w, '.1f')} |")
    return L


def ar_table(summaries: list) -> list[str]:
    ks = sorted({k for _, sm in summaries for k in sm["verify"]})
    L = ["| target | decode | " + " | ".join(f"verify k={k}" for k in ks) + " | like for like k=8 | k=32 |",
         "|---|---:|" + "---:|" * len(ks) + "---:|---:|"]
    for name, sm in summaries:
        L.append(f"| {name} | {fmt(sm['decode'], '.2fx')} | " + " | ".join(fmt(sm["verify"].get(k), ".2fx") for k in ks)
                 + f" | {fmt(sm['like'].get(8), '.2fx')} | {fmt(sm['like'].get(32), '.2fx')} |")
    return L


def trees_table(trees: dict) -> list[str]:
    L = ["| target | N | chain verify, ms | ddtree / chain | bushy / chain | graph nodes chain / ddtree / bushy |",
         "|---|---:|---:|---:|---:|---|"]
    for name, rows in trees.items():
        if isinstance(rows, str):
            L.append(f"| {name} | | | | | {rows} |")
            continue
        for n in sorted({r["n"] for r in rows}):
            at = {r["shape"]: r for r in rows if r["n"] == n}
            ch = at.get("chain", {}).get("wall_ms")
            rel = lambda s: fmt(at[s]["wall_ms"] / ch if s in at and ch else None, ".2fx")  # noqa: E731
            nodes = " / ".join(str(at.get(s, {}).get("nodes", "–")) for s in ("chain", "ddtree", "bushy"))
            L.append(f"| {name} | {n} | {fmt(ch)} | {rel('ddtree')} | {rel('bushy')} | {nodes} |")
    return L


def report(args, started, load0, load1, e2e, ar, trees, figs) -> tuple[str, str]:
    """(the full markdown report, the part that goes into the README)."""
    L = [f"## dflash-gguf vs llama.cpp, {started:%Y-%m-%d %H:%M}" + (" (--quick)" if args.quick else ""), ""]
    L.append(f"Machine: {cpu_name()}, {os.cpu_count()} CPUs; load average (1 min) **{load0:.2f} at the start, "
             f"{load1:.2f} at the end**. {args.threads} threads everywhere. dflash-gguf {git_describe()}; "
             f"llama.cpp tools built from the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist "
             f"(build {ar['info'].get('build_commit', '?')}). {len(args.prompt_names)} prompts "
             f"({', '.join(args.prompt_names)}), {args.n_predict} greedy tokens each, {args.runs} run(s) per row.")
    L.append("")
    L.append("### Figures (issue #13)")
    L.append("")
    L += figures_table(figs)
    for res in e2e:
        L += ["", f"### End-to-end decoding, {res['type']} target (`{Path(res['target']).name}`)", ""]
        L += e2e_table(res)
    L += ["", "AL and tok/s: median over runs per prompt, then over prompts. Decode time excludes the prefill "
          "(llama-completion: its \"eval time\"; llama-speculative-simple: its \"decoded\" timer); ours counts the "
          "tokens its timed steps produce (not the first, which is the prefill's)."]
    L += ["", "### Graph nodes and host synchronisations per step", ""]
    L += sync_table(e2e)
    L += ["", "Ours: the runtime's counters (n_last_nodes of the last target/drafter graph; graphs computed, "
          "results read and inputs written per step, target and drafter together). llama.cpp: the graph nodes it "
          "logs for each context (target, then drafter); its host transfers are not counted by the tool."]
    L += ["", "### Plain decode and verify, speed ratios ours / llama-bench", ""]
    L += ar_table(ar["summaries"])
    L += ["", "Decode: tok/s over `llama-bench -d 64 -n N`. Verify k: ours verify of k tokens + argmax of every row + "
          "the commit (all-row LM head, as speculative decoding needs) against `llama-bench -d 64 -p k` (one batch, "
          "last-row logits only); like for like: our plain batch of k with last-row logits. llama-bench runs with "
          "flash attention off and on, the faster counts."]
    # inside README's "## Benchmarks": every heading one level down
    readme = "\n".join("#" + ln if ln.startswith("##") else ln for ln in L) + "\n"
    L += ["", "### Tree verify against chain verify (scripts/verify_count.py)", ""]
    L += trees_table(trees)
    L += ["", f"Typical wall time (the lower quartile: other processes only ever add time) of {args.tree_reps} verifies ({min(args.tree_reps, 5)} on the 0.8B shape; + argmax "
          "of every row, the previous step's commit inside) after 2 untimed ones, the shapes taking turns (one "
          "target each); ddtree / bushy = best-first trees of a confident / unsure drafter with exactly N nodes "
          "(scripts/verify_count.py)."]
    L += ["", ar["text"]]
    return "\n".join(L) + "\n", readme


def write_readme(block: str, started, args) -> None:
    text = README.read_text()
    i, j = text.find(README_BEGIN), text.find(README_END)
    if i < 0 or j < i:
        raise SystemExit(f"README.md has no {README_BEGIN} ... {README_END} block")
    body = (f"{README_BEGIN}\n<!-- generated by scripts/bench.py{' --quick' if args.quick else ''} --write-readme "
            f"on {started:%Y-%m-%d %H:%M}; do not edit by hand -->\n\n{block.strip()}\n\n")
    README.write_text(text[:i] + body + text[j:])
    log(f"updated {README}")


def plot(e2e: list[dict], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (`.venv/bin/pip install matplotlib`; not a runtime dependency)"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for res in e2e:
        by = {r.key: r for r in res["rows"]}
        for pair in sorted({r.pair for r in res["rows"] if r.pair}):
            labels, tps, al = ["chain"], [by[f"{pair}/ours-chain"].tps()], [by[f"{pair}/ours-chain"].al()]
            for r in res["rows"]:
                if r.pair == pair and r.key.startswith(f"{pair}/ours-tree-"):
                    labels.append(r.key.rsplit("-", 1)[1])
                    tps.append(r.tps())
                    al.append(r.al())
            for ax, ys in ((ax1, tps), (ax2, al)):
                pts = [(x, y) for x, y in enumerate(ys) if y is not None]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{pair}, {res['type']}")
                ax.set_xticks(range(len(labels)))
                ax.set_xticklabels(labels)
    for ax, ylabel in ((ax1, "decode tokens / s"), (ax2, "AL (tokens / target pass)")):
        ax.set_xlabel("ours: chain, then tree budget (nodes)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("dflash-gguf: chain and DDTree budgets per pair and target type (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


# ---- main ------------------------------------------------------------------------------

def find_tools(build: bool, jobs: int) -> dict:
    """name -> binary, or -> the reason it is missing (a string)."""
    out = {}
    for name in LLAMA_TOOLS:
        exe = llama_binary(name)
        if exe is None and build:
            exe, note = build_llama(name, jobs)
            out[name] = exe or f"{name} unavailable: {note}"
        else:
            out[name] = exe or f"{name} not built (run scripts/bench.py --build-llama-cpp)"
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", type=Path, help="your target GGUF instead of the demo targets")
    p.add_argument("-md", "--draft", type=Path, help="your DFlash drafter GGUF for -m (without it: plain decoding "
                   "rows and figures 1, 2 and 4 only)")
    p.add_argument("--pairs", help=f"of {', '.join(PAIRS)} (default both; not with -m)")
    p.add_argument("--types", help="demo target types (default f32,q8_0; not with -m)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens generated per prompt (default 128)")
    p.add_argument("-t", "--threads", type=int, default=2, help="CPU threads for every engine (default 2)")
    p.add_argument("--runs", type=int, default=3, help="runs per end-to-end row (default 3)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    p.add_argument("--budgets", default=",".join(BUDGETS), help="tree budgets (default 4,8,16,32,auto)")
    p.add_argument("--spec-p-min", default=",".join(SPEC_P_MIN),
                   help="llama.cpp DFlash --spec-draft-p-min values, one row each (default 0,0.5)")
    p.add_argument("--ar-runs", type=int, default=5, help="bench_ar rounds per target (default 5)")
    p.add_argument("--ar-runs-08b", type=int, default=2, help="bench_ar rounds on the 0.8B shape (default 2)")
    p.add_argument("--ks-08b", default="1,2,4,8,16,32", help="verify sizes on the 0.8B shape (default 1,2,4,8,16,32)")
    p.add_argument("--no-08b", action="store_true", help="leave the Qwen3.5-0.8B shape out of figures 1 and 2")
    p.add_argument("--tree-n", default="4,8,16,32", help="figure 4's node counts (default 4,8,16,32)")
    p.add_argument("--tree-reps", type=int, default=7, help="timed verifies per shape and N (default 7)")
    p.add_argument("--zlab", action="store_true", help="also run z-lab's reference loop for AL (demo pair)")
    p.add_argument("--quick", action="store_true",
                   help="plumbing check: 1 prompt, 1 run, 32 tokens, budgets 4,auto, the first --spec-p-min, "
                        "short bench_ar and trees")
    p.add_argument("--build-llama-cpp", action="store_true", help="only build llama.cpp's tools and exit")
    p.add_argument("--no-build", action="store_true", help="never build llama.cpp's tools (rows without them say so)")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for that build (default 2)")
    p.add_argument("--write-readme", action="store_true", help="replace README.md's generated benchmark block")
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory (default results/)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("worker_args", nargs="?", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker or args.build_llama_cpp:
        return args
    if args.quick:
        args.prompts, args.runs, args.n_predict = 1, 1, min(args.n_predict, 32)
        args.budgets, args.ar_runs, args.ar_runs_08b = "4,auto", 1, 1
        args.ks_08b, args.tree_n, args.tree_reps = "1,8,32", "4,32", 2
    if args.model is None:
        if args.draft is not None:
            p.error("-md needs -m (the target its drafter was converted for)")
        args.pair_files = PAIRS
        args.pairs = [x.strip() for x in (args.pairs or ",".join(PAIRS)).split(",") if x.strip()]
        args.types = [x.strip() for x in (args.types or ",".join(TYPES)).split(",") if x.strip()]
    else:
        if args.pairs is not None or args.types is not None:
            p.error("--pairs and --types choose among the demo pairs; -m/-md bench your own pair")
        for f in (args.model, args.draft):
            if f is not None and not f.is_file():
                p.error(f"{f} does not exist")
        args.model = args.model.resolve()
        args.pair_files = {GIVEN: args.draft.resolve()} if args.draft is not None else {}
        args.pairs, args.types, args.no_08b = list(args.pair_files), [], True
    args.budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    args.spec_p_min = [x.strip() for x in args.spec_p_min.split(",") if x.strip()][: 1 if args.quick else None]
    for x in args.pairs:
        if x not in args.pair_files:
            p.error(f"unknown pair {x!r} (of {', '.join(PAIRS)})")
        if not args.pair_files[x].exists():
            p.error(f"{args.pair_files[x]} is missing"
                    + (" (dflash_gguf/data/README.md says how it is made)" if x == "weak" else ""))
    for x in args.types:
        if x not in TYPES:
            p.error(f"unknown target type {x!r} (of {', '.join(TYPES)})")
    for b in args.budgets:
        if b != "auto" and not (b.isdigit() and 1 <= int(b) <= 63):
            p.error(f"bad tree budget {b!r} (1..63 or auto)")
    for x in args.spec_p_min:
        try:
            if not 0 <= float(x) <= 1:
                raise ValueError
        except ValueError:
            p.error(f"bad --spec-p-min value {x!r} (0..1)")
    if not 1 <= args.prompts <= len(PROMPTS):
        p.error(f"--prompts must be 1..{len(PROMPTS)}")
    args.ks_08b = bench_ar.parse_ks(args.ks_08b, p.error)
    args.prompt_names = [n for n, _ in PROMPTS[: args.prompts]]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        a = json.loads(Path(args.worker_args).read_text())
        print("@@" + json.dumps(WORKERS[args.worker](a)), flush=True)
        return 0
    if args.build_llama_cpp:
        tools = find_tools(True, args.jobs)
        for name, exe in tools.items():
            print(exe)
        return 0 if all(isinstance(x, Path) for x in tools.values()) else 1

    started = _dt.datetime.now()
    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    log(f"load average {load0:.2f} on {os.cpu_count()} CPUs"
        + (" -- the machine is busy: timings will be noise" if load0 > 0.5 else ""))
    args.tools = find_tools(not (args.quick or args.no_build), args.jobs)
    for name, exe in args.tools.items():
        if not isinstance(exe, Path):
            log(exe)
    targets = bench_targets(args)

    e2e = []
    for ttype, _, target in targets:
        log(f"end-to-end, {ttype} target: {len(args.pairs)} pair(s), {args.runs} run(s) ...")
        e2e.append(run_e2e(args, ttype, target))

    log("figures 1 and 2: plain decode and verify against llama-bench ...")
    bench_exe = args.tools["llama-bench"] if isinstance(args.tools["llama-bench"], Path) else None
    base = {"threads": args.threads, "tokens": 16 if args.quick else 64, "prompt": 64, "reps": 3 if args.quick else 5,
            "fa": "0,1", "llama_bench_note": args.tools["llama-bench"] if bench_exe is None else "cached"}
    sections, summaries, raw, info = [], [], {}, {}
    for t, name, path in targets:
        s1, sm1, raw1, info1 = bench_ar.bench_targets(
            bench_exe, [(name, f"{name}, {t}", path)],
            {**base, "runs": args.ar_runs, "ks": list(bench_ar.VERIFY_KS), "outtype": t})
        sections, summaries, raw, info = sections + s1, summaries + sm1, {**raw, **raw1}, info1 or info
    log("figure 4: tree verify against chain verify ...")
    trees = {name: run_tree_vs_chain(path, args) for _, name, path in targets}
    if not args.no_08b:
        g = shape_08b()
        s2, sm2, raw2, info2 = bench_ar.bench_targets(
            bench_exe, [("Qwen3.5-0.8B shape", "Qwen3.5-0.8B shape, random weights", g)],
            {**base, "runs": args.ar_runs_08b, "reps": 3, "ks": args.ks_08b, "outtype": "q4_k_m"})
        sections, summaries, raw, info = sections + s2, summaries + sm2, {**raw, **raw2}, info2 or info
        if not args.quick:  # a tree verify on the 0.8B shape takes seconds on a loaded machine
            log("figure 4 on the 0.8B shape ...")
            trees["Qwen3.5-0.8B shape"] = run_tree_vs_chain(
                g, argparse.Namespace(**{**vars(args), "tree_reps": min(args.tree_reps, 5)}))
    ar = {"summaries": summaries, "info": info,
          "text": "## Plain decode and verify against llama-bench (scripts/bench_ar.py)\n\n" + "\n".join(sections)}

    figs = sorted(ar_figures(ar) + tree_figures(trees) + e2e_figures(e2e), key=lambda f: f["figure"])
    load1 = os.getloadavg()[0]
    full, readme = report(args, started, load0, load1, e2e, ar, trees, figs)
    print(full)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{started:%Y-%m-%d-%H%M}" + ("-quick" if args.quick else "")
    (args.out / f"{stem}.md").write_text(full)
    (args.out / "latest.md").write_text(full)
    dump = {"args": {k: (str(v) if not isinstance(v, (int, float, list, bool)) else v)
                     for k, v in vars(args).items() if k != "tools"},
            "load": [load0, load1], "figures": figs, "trees": trees, "bench_ar": raw,
            "e2e": [{**{k: v for k, v in res.items() if k != "rows"}, "rows": [r.to_json() for r in res["rows"]]}
                    for res in e2e]}
    (args.out / f"{stem}.json").write_text(json.dumps(dump, indent=1, default=str))
    log(f"wrote {args.out / (stem + '.md')}, .json and {args.out / 'latest.md'}")
    log(plot(e2e, args.out / f"{stem}.png"))
    if args.write_readme:
        write_readme(readme, started, args)
    log(f"done in {(time.perf_counter() - t_start) / 60:.1f} min; load average {load0:.2f} at the start, "
        f"{load1:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
