#!/usr/bin/env python3
"""dflash-gguf on a CUDA GPU against llama.cpp's own CUDA tools (issue 31), built from the
same ggml by scripts/cuda/build.sh. Writes one results file, cuda-<gpu>-<date>.{json,md},
into $OUT when set (the lent machine's return folder), else .cuda-build/results/.

    python scripts/cuda/bench.py [--part 1,2,3] [--commit SHA]   # on the GPU machine
    python scripts/cuda/bench.py --smoke                         # here: the CPU, tiny sizes
    python scripts/cuda/bench.py --merge A.json B.json           # parts run in separate calls

Run it with the venv's Python (.cuda-build/<mode>/venv/bin/python) by its path.

Parts:
  1  both bundled pairs (the q8_0 demo target with the demo drafter and with the weak one)
     end to end, greedy and sampled (T 0.6, top-k 20, top-p 0.95, min-p 0): ours plain,
     chain, tree 8, tree 16 and auto against llama-speculative-simple --spec-type
     draft-dflash (draft p-min 0 and 0.5: the better counts) and plain llama-completion,
     every engine fully on the device; tok/s and AL (tokens per target pass)
  2  the Qwen3.5-27B shape in Q4_K_M and its DFlash drafter's shape in q8_0, random weights
     written by dflash_gguf.convert.shape_model into --models: plain decode against llama-bench
     -n; verify of k = 1..32 against llama-bench -p k (llama-bench computes the LM head on
     the last row, our verify on all k: our plain batches of k with last-row and with
     all-row logits are given beside it); tree verify of 16 and 32 nodes against a chain
     verify of as many; prefill of 512 tokens after 512 against llama-bench -p 512 -d 512;
     device memory used
     against the memory plan; graph nodes and host synchronisations per step (chain and
     tree 16 decoding of the pair)
  3  the same target at a 32K context with q8_0 and with q4_0 KV: decode and verify
Method: ours runs in child processes (a crash is recorded and the rest goes on), the
context prefilled once per model (not timed), warm graphs, each figure the median of
--reps reps; llama-bench one run per model and KV type, the median of its -r samples;
flash attention on and f16 KV everywhere unless stated. The JSON is rewritten after each
section, so a call cut off at its time limit keeps what ran.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "dflash_gguf" / "data"
PAIRS = {"demo": "demo-draft.gguf", "weak": "demo-draft-weak.gguf"}
ARMS = ("plain", "chain", "tree 8", "tree 16", "auto")
SAMPLED = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0}
SPEC_P_MIN = ("0", "0.5")
PROMPTS = [  # code in the demo pair's style (Python's standard library)
    "def read_lines(path, encoding='utf-8'):\n    \"\"\"Return the lines of a text file.\"\"\"\n",
    "class Stack:\n    \"\"\"A last-in, first-out container.\"\"\"\n\n    def __init__(self):\n",
    "import argparse\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.ArgumentParser(",
    "    # If the buffer is full, flush it to the underlying stream before",
]
WARMUP = "import os\nimport sys\n\n\ndef main():\n"
# tiny shapes for --smoke (tests/convert/test_shape_model.py's: every row whole K-quant blocks)
TINY = ["--layers", "4", "--set", "hidden=256", "--set", "vocab=4096", "--set", "heads=4", "--set", "kv_heads=2",
        "--set", "head_dim=64", "--set", "rot=16", "--set", "sections=3,3,2,0", "--set", "lin_k_heads=2",
        "--set", "lin_v_heads=4", "--set", "lin_dim=64", "--set", "ffn=512"]
TINY_DRAFT = ["--layers", "1", "--set", "hidden=256", "--set", "vocab=4096", "--set", "ffn=512", "--set", "heads=4",
              "--set", "kv_heads=2", "--set", "head_dim=64", "--set", "target_layers=1,3"]


def log(msg: str) -> None:
    print(f"[cuda-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ---- ours, in child processes --------------------------------------------------------------

def worker_probe(a: dict) -> dict:
    """Devices, the directory of the ggml this process loaded, drafter block sizes."""
    from dflash_gguf import list_devices, read_draft_metadata

    maps = Path("/proc/self/maps").read_text()
    lib = next((line.split()[-1] for line in maps.splitlines() if "/libggml-base.so" in line), None)
    return {"devices": list_devices(), "ggml_dir": str(Path(lib).resolve().parent) if lib else None,
            "blocks": {p: read_draft_metadata(p)["block_size"] for p in a["drafts"]}}


def _io(models) -> dict:
    infos = [m.info() for m in models]
    return {k: sum(i[k] for i in infos) for k in ("n_graphs", "n_host_reads", "n_host_writes")}


def worker_e2e(a: dict) -> dict:
    """Per arm and prompt: tok/s of the decoding steps, AL, host synchronisations per step."""
    from dflash_gguf import Engine, SamplingParams

    out = {}
    for arm in a["arms"]:
        budget = arm if arm == "auto" else int(arm.split()[1]) if arm.startswith("tree") else None
        eng = Engine(a["target"], None if arm == "plain" else a["draft"], n_ctx=a["n_ctx"], kv_type="f16",
                     device=a["device"], tree_budget=budget)
        try:
            sampling = SamplingParams(**a["sampling"], seed=0) if a["sampling"] else None
            eng.generate(WARMUP, max_tokens=16, stop_tokens=(), sampling=sampling)
            models = [eng.target] + ([eng.draft] if eng.draft is not None else [])
            runs = []
            for k, text in enumerate(a["prompts"]):
                for rep in range(a["reps"]):
                    sampling = SamplingParams(**a["sampling"], seed=100 * k + rep) if a["sampling"] else None
                    io0 = _io(models)
                    r = eng.generate(text, max_tokens=a["n"], stop_tokens=(), sampling=sampling)
                    io1 = _io(models)
                    s = r.stats
                    passes = len(s.accepted_lengths) if arm != "plain" else max(s.generated_tokens - 1, 1)
                    # the first token is the prefill's; the timed steps make the rest
                    runs.append({"prompt": k, "tps": (s.generated_tokens - 1) / s.decode_seconds,
                                 "al": s.mean_accepted if arm != "plain" else 1.0,
                                 **({"text": r.text} if rep == 0 else {}),
                                 **{k2: (io1[k2] - io0[k2]) / max(passes, 1) for k2 in io0}})
            out[arm] = runs
        finally:
            eng.close()
    return out


def worker_steps(a: dict) -> dict:
    """The target alone (no drafter features, as llama-bench): decode, verify of each k,
    plain batches, tree against chain verifies, prefill; memory used against the plan."""
    import numpy as np

    from dflash_gguf import Target, TargetConfig
    from dflash_gguf.speculation.ddtree import build_tree
    from dflash_gguf.engine.memory import plan_memory
    from dflash_gguf.runtime.target import LOGITS_ALL, LOGITS_LAST, LOGITS_NONE

    ks, trees, reps = a["ks"], a["trees"], a["reps"]
    cfg = TargetConfig(n_ctx=a["n_ctx"], n_ubatch=512, n_verify=max(ks + trees), kv_type=a["kv"],
                       device=a["device"])
    free0 = _device_free(plan_memory(a["target"], None, cfg), a["device"])
    t0 = time.perf_counter()
    t = Target(a["target"], cfg)
    out = {"load_s": time.perf_counter() - t0, "info": t.info(), "depth": a["depth"], "tokens": a["tokens"]}
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, t.n_vocab, max(a["depth"], 2 * a["prefill"])).tolist()
    cands = rng.integers(100, t.n_vocab, max(ks + trees)).tolist()
    builds = lambda: t.info()["n_graph_builds"]  # noqa: E731

    def at_depth():
        """A fresh context of `depth` tokens, the last through the one-row graph."""
        t.reset()  # drops the cached graphs too: a timed call never follows it unwarmed
        t0 = time.perf_counter()
        t.prefill(prompt[:a["depth"] - 1], LOGITS_NONE)
        t.decode(prompt[a["depth"] - 1:a["depth"]], LOGITS_LAST)
        return time.perf_counter() - t0

    out["prefill_depth_s"] = at_depth()
    out["graph_builds_timed"] = {}  # graphs built inside timed calls, per figure (should be none)

    def timed(name, fn, n, prep=None):
        """The median time of n calls of fn after two warm ones (the first carries the
        previous figure's commit, whose graph may differ); prep, untimed, before each."""
        xs, built = [], 0
        for i in range(n + 2):
            if prep:
                prep()
            b0, s = builds(), time.perf_counter()
            fn()
            if i >= 2:
                xs.append(time.perf_counter() - s)
                built += builds() - b0
        if built:
            out["graph_builds_timed"][name] = built
        return median(xs)

    tok = [int(t.choices(0, 1)[0])]

    def decode_steps():
        for _ in range(a["tokens"]):
            t.decode(tok, LOGITS_LAST)
            tok[0] = int(t.choices(0, 1)[0])

    out["decode_s"] = timed("decode", decode_steps, reps)  # the context grows by tokens * (reps + 1): kept small
    out["decode_tps"] = a["tokens"] / out["decode_s"]
    out["decode_nodes"] = t.info()["n_last_nodes"]

    def verify(k):
        t.verify(cands[:k])
        t.choices(0, k)
        t.commit(0)

    out["verify_ms"] = {k: 1e3 * timed(f"verify {k}", lambda: verify(k), reps) for k in ks}
    out["verify_nodes"] = t.info()["n_last_nodes"]
    if a["batches"]:
        for key, mode in (("batch_last_ms", LOGITS_LAST), ("batch_all_ms", LOGITS_ALL)):
            out[key] = {}
            for k in ks:
                def back_to_depth():
                    # plain batches extend the context: a fresh one (and an untimed batch
                    # to build the graph again) once it has grown by 256
                    if t.n_past + k > a["depth"] + 256:
                        at_depth()
                        t.decode(cands[:k], mode)
                out[key][k] = 1e3 * timed(f"{key} {k}", lambda: t.decode(cands[:k], mode), reps, back_to_depth)
        at_depth()
    out["tree_ms"] = {}
    for n in trees:
        row = {"chain": 1e3 * timed(f"chain {n}", lambda: verify(n), reps)}
        for shape, probs in (("ddtree", (0.6, 0.2, 0.1, 0.05)), ("bushy", (0.3, 0.25, 0.2, 0.15))):
            tree = build_tree(cands[0], np.arange(60).reshape(15, 4) + 200, np.log(np.tile(probs, (15, 1))), n - 1)

            def tree_verify():
                t.verify_tree(tree.tokens, tree.parents)
                t.choices(0, n)
                t.commit_path([0])
            row[shape] = 1e3 * timed(f"{shape} {n}", tree_verify, reps)
        out["tree_ms"][n] = row
    if trees:
        out["tree_nodes"] = t.info()["n_last_nodes"]
    if a["prefill"]:  # `prefill` tokens after as many (llama-bench -p N -d N), the graph warm
        n = a["prefill"]

        def first():
            t.reset()
            t.prefill(prompt[:n], LOGITS_LAST)
        out["prefill_tps"] = n / timed("prefill", lambda: t.prefill(prompt[n:2 * n], LOGITS_LAST), reps, first)
    out["memory"] = _memory(plan_memory(a["target"], None, cfg), a["device"], free0)
    t.close()
    return out


def worker_pair(a: dict) -> dict:
    """The pair through the Engine: chain and tree decoding of random-weight tokens (their
    AL means nothing), graph nodes and host synchronisations per step, memory against plan."""
    from dflash_gguf import Engine
    from dflash_gguf.engine.memory import plan_memory

    out = {}
    for arm, budget in (("chain", None), ("tree 16", 16)):
        eng = Engine(a["target"], a["draft"], n_ctx=a["n_ctx"], kv_type="f16", device=a["device"],
                     tree_budget=budget)
        try:
            nodes = {"target": [], "drafter": []}

            def hook(stage):
                if stage == "drafted":
                    nodes["drafter"].append(eng.draft.info()["n_last_nodes"])
                elif stage == "verified":
                    nodes["target"].append(eng.target.info()["n_last_nodes"])

            prompt = [(13 * i) % 4000 + 5 for i in range(a["depth"])]
            eng.generate(prompt, max_tokens=16, stop_tokens=())
            eng.stage_hook = hook
            io0 = _io([eng.target, eng.draft])
            r = eng.generate(prompt, max_tokens=a["tokens"], stop_tokens=())
            io1 = _io([eng.target, eng.draft])
            passes = max(len(r.stats.accepted_lengths), 1)
            dev = next(d for d in eng.memory_plan.devices if d.name == a["device"])
            setup = eng.setup
            out[arm] = {"tps": (r.stats.generated_tokens - 1) / r.stats.decode_seconds, "al": r.stats.mean_accepted,
                        "target_nodes": median(nodes["target"]), "drafter_nodes": median(nodes["drafter"]),
                        **{k: (io1[k] - io0[k]) / passes for k in io0},
                        "memory": _memory(plan_memory(a["target"], a["draft"], setup.target_config,
                                                      setup.draft_config), a["device"], dev.free)}
        finally:
            eng.close()
    return out


def _device_free(plan, device: str) -> int:
    return next(d.free for d in plan.devices if d.name == device)


def _memory(plan_now, device: str, free0: int) -> dict:
    """Device memory the process took since free0, by ggml's report of the device's free
    memory (weights, caches, compute buffers, the backend's pools and library workspaces;
    not its context, made before free0), against the plan's need on that device (plan_now:
    the same configuration planned again, which reads the free memory now)."""
    dev = next(d for d in plan_now.devices if d.name == device)
    used = free0 - dev.free
    return {"used": used, "plan": dev.need, "ratio": used / dev.need if dev.need else None}


def run_worker(kind: str, args: dict, timeout: float = 1800) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, json.dumps(args)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"{kind} timed out after {timeout:.0f} s"}
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("@@")), None)
    if res.returncode != 0 or line is None:
        tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-3:]
        return {"error": f"{kind} failed (exit {res.returncode}): " + " | ".join(tail)}
    return json.loads(line[2:])


# ---- llama.cpp's tools -----------------------------------------------------------------------

class Tools:
    def __init__(self, directory: Path, ggml_dir: str, on_device: bool, threads: int):
        self.dir, self.threads = directory, str(threads)
        self.ngl = "99" if on_device else "0"
        # the ggml the Python side loads, then the tools' own libllama-common, then whatever
        # the caller set (build.sh's env.sh: where this machine keeps cuBLAS and the runtime)
        inherited = os.environ.get("LD_LIBRARY_PATH")
        self.env = {**os.environ, "LD_LIBRARY_PATH": ":".join(filter(None, (ggml_dir, str(directory), inherited)))}

    def run(self, name: str, args: list, timeout: float = 900, want: str | None = None) -> tuple[str | None, str, str]:
        """(error or None, stdout, log); run again, up to twice more, while the log lacks
        `want`: llama.cpp logs from a worker thread, which now and then loses the last
        lines at exit."""
        for _ in range(3):
            err, out, log_text = self._run(name, args, timeout)
            if err or want is None or re.search(want, log_text):
                break
        return err, out, log_text

    def _run(self, name: str, args: list, timeout: float) -> tuple[str | None, str, str]:
        cmd = [str(self.dir / name), *args]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout, env=self.env)
        except subprocess.TimeoutExpired:
            return f"{name} timed out", "", ""
        if res.returncode != 0:
            tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-2:]
            return f"{name} failed (exit {res.returncode}): " + " | ".join(tail), res.stdout, res.stderr
        return None, res.stdout, res.stderr

    def gen_flags(self, n: int, n_ctx: int, sampling: dict | None, seed: int) -> list:
        samp = (["--temp", str(sampling["temperature"]), "--top-k", str(sampling["top_k"]), "--top-p",
                 str(sampling["top_p"]), "--min-p", str(sampling["min_p"])] if sampling else ["--temp", "0"])
        return ["-n", str(n), "-c", str(n_ctx), "-ngl", self.ngl, "-fa", "on", "-ctk", "f16", "-ctv", "f16",
                "-t", self.threads, "--ignore-eos", "--seed", str(seed), *samp]

    def completion(self, target: str, text: str, n: int, n_ctx: int, sampling, seed: int) -> dict:
        eval_time = r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs"
        err, out, log_text = self.run("llama-completion", ["-m", target, "-p", text, "-no-cnv", "--no-display-prompt",
                                                           *self.gen_flags(n, n_ctx, sampling, seed)], want=eval_time)
        m = re.search(eval_time, log_text)
        if err or not m:
            return {"error": err or f"no eval time in llama-completion's log: {log_text[-200:]}"}
        return {"tps": int(m.group(2)) / (float(m.group(1)) / 1e3), "al": 1.0, "text": out.rstrip("\n")}

    def speculative(self, target: str, draft: str, block: int, p_min: str, text: str, n: int, n_ctx: int,
                    sampling, seed: int) -> dict:
        """Timed without debug logging; AL from a second run at -lv 5, which logs each
        checkpoint restore (a partly accepted draft on a hybrid target is evaluated again:
        a second target pass)."""
        args = ["-m", target, "-md", draft, "--spec-type", "draft-dflash", "--spec-draft-n-max", str(block - 1),
                "--spec-draft-n-min", "0", "--spec-draft-p-min", p_min, "-ngld", self.ngl, "-td", self.threads,
                "-p", text, *self.gen_flags(n, n_ctx, sampling, seed)]
        summary = r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"
        err, _, log_text = self.run("llama-speculative-simple", args, want=summary)
        m = re.search(summary, log_text)
        if err or not m:
            return {"error": err or f"no summary in llama-speculative-simple's log: {log_text[-200:]}"}
        r = {"tps": int(m.group(1)) / float(m.group(2))}
        err, _, debug = self.run("llama-speculative-simple", [*args, "-lv", "5"], want=summary)
        rounds = len(re.findall(r"accepted \d+/\d+ draft tokens", debug))
        n_tok = re.search(r"decoded\s+(\d+) tokens", debug)
        if not err and rounds and n_tok:
            r["al"] = int(n_tok.group(1)) / (rounds + len(re.findall(r"partial acceptance: ", debug)))
        return r

    def bench(self, model: str, prompts: list, n_gen: int, depth: int, reps: int, kv: str = "f16") -> dict:
        """One llama-bench run (-o json, flash attention on, as llama.cpp's "auto" picks on a
        GPU and as our runtime always computes): a batch of each of `prompts` and `n_gen`
        single-token decodes, each at `depth` (llama-bench prefills the depth once and
        restores it before every rep). Per test "n_prompt/n_gen/n_depth", the median of
        its rep times in seconds."""
        err, out, _ = self.run("llama-bench", [
            "-m", model, "-ngl", self.ngl, "-t", self.threads, "-fa", "1", "-ctk", kv, "-ctv", kv, "-o", "json",
            "-p", ",".join(map(str, prompts)), "-n", str(n_gen), "-d", str(depth), "-r", str(reps)], timeout=1800)
        if err:
            return {"error": err}
        return {"s": {f"{t['n_prompt']}/{t['n_gen']}/{t['n_depth']}": median(t.get("samples_ns") or [t["avg_ns"]]) / 1e9
                      for t in json.loads(out)}}


# ---- the parts --------------------------------------------------------------------------------

def part_pairs(a, tools: Tools | None, blocks: dict) -> dict:
    target = str(DATA / "demo-target.gguf")
    res = {}
    for pair, drafter in PAIRS.items():
        draft = str(DATA / drafter)
        for mode, sampling in (("greedy", None), ("sampled", SAMPLED)):
            key = f"{pair} {mode}"
            log(f"part 1: {key}: ours")
            ours = run_worker("e2e", {"target": target, "draft": draft, "device": a.device, "arms": list(ARMS),
                                      "prompts": a.prompts, "n": a.n, "n_ctx": a.n_ctx, "reps": a.reps,
                                      "sampling": sampling})
            row = {"ours": ours}
            if tools:
                log(f"part 1: {key}: llama.cpp")
                row["llama-completion"] = [tools.completion(target, p, a.n, a.n_ctx, sampling, k)
                                           for k, p in enumerate(a.prompts)]
                for p_min in SPEC_P_MIN:
                    row[f"llama-spec p-min {p_min}"] = [
                        tools.speculative(target, draft, blocks[draft], p_min, p, a.n, a.n_ctx, sampling, k)
                        for k, p in enumerate(a.prompts)]
            res[key] = row
    return res


def make_models(a) -> dict:
    """The 27B shape's target (Q4_K_M) and drafter (q8_0), written once into --models."""
    a.models.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, config, outtype, extra in (("target", "qwen35-27b", "q4_k_m", TINY if a.smoke else []),
                                         ("draft", "qwen35-27b-dflash", "q8_0", TINY_DRAFT if a.smoke else [])):
        path = a.models / f"{config}{'-tiny' if a.smoke else ''}-{outtype}.gguf"
        t0 = time.perf_counter()
        if not path.exists():
            subprocess.run([sys.executable, "-m", "dflash_gguf.convert.shape_model", config, "--outtype", outtype,
                            "--outfile", str(path), "--quiet", *extra], check=True, cwd="/")
            out[f"{name}_write_s"] = time.perf_counter() - t0
        out[name] = str(path)
        out[f"{name}_bytes"] = path.stat().st_size
    return out


def part_shape(a, tools: Tools | None, models: dict, keep=lambda res: None) -> dict:
    """Part 2; `keep(res)` is called after each section, so that a call cut off at its
    time limit still returns the sections that ran."""
    ks = list(range(1, 33)) if not a.smoke else [1, 2, 4, 8]
    trees = [16, 32] if not a.smoke else [8]
    depth = 512 if not a.smoke else 64  # the prefill measured is `depth` tokens at that depth
    args = {"target": models["target"], "device": a.device, "kv": "f16", "depth": depth, "n_ctx": depth + 1024,
            "tokens": a.tokens, "reps": a.reps, "ks": ks, "trees": trees, "batches": True, "prefill": depth}
    log("part 2: ours, target alone")
    res = {"models": models, "ours": run_worker("steps", args)}
    keep(res)
    log("part 2: ours, the pair")
    res["pair"] = run_worker("pair", {"target": models["target"], "draft": models["draft"], "device": a.device,
                                      "n_ctx": 2048, "depth": depth, "tokens": 64 if not a.smoke else 16})
    keep(res)
    if tools:
        log("part 2: llama-bench")
        res["llama-bench"] = tools.bench(models["target"], [*ks, depth], a.tokens, depth, a.reps)
    return res


def part_long(a, tools: Tools | None, models: dict) -> dict:
    depth = 32768 if not a.smoke else 512
    ks = [1, 8, 16, 32] if not a.smoke else [1, 8]
    res = {}
    for kv in ("q8_0", "q4_0"):
        log(f"part 3: {kv} KV at {depth}")
        row = {"ours": run_worker("steps", {"target": models["target"], "device": a.device, "kv": kv, "depth": depth,
                                            "n_ctx": depth + 1024, "tokens": a.tokens, "reps": a.reps, "ks": ks,
                                            "trees": [], "batches": False, "prefill": 0})}
        if tools:
            row["llama-bench"] = tools.bench(models["target"], ks, a.tokens, depth, a.reps, kv)
        res[kv] = row
    return res


# ---- report ----------------------------------------------------------------------------------

def fmt(x, spec=".2f"):
    return "–" if x is None else format(x, spec)


def ratio(a, b):
    return a / b if a is not None and b else None


def e2e_summary(runs) -> dict:
    if isinstance(runs, dict) and "error" in runs:
        return {"error": runs["error"]}
    per_prompt = {}
    for r in runs:
        per_prompt.setdefault(r.get("prompt", len(per_prompt)), []).append(r)
    pick = lambda f: median([median([r.get(f) for r in rs]) for rs in per_prompt.values()])  # noqa: E731
    return {"tps": pick("tps"), "al": pick("al"), "syncs": pick("n_host_reads"),
            "errors": [r["error"] for r in runs if "error" in r]}


def greedy_agreement(row: dict) -> str:
    """How many prompts' greedy texts agree: each speculative arm with our plain decoding
    (lossless on the device), and our plain decoding with llama-completion's."""
    ours = row["ours"]
    plain = {r["prompt"]: r["text"] for r in ours.get("plain", []) if "text" in r}
    parts = [f"{arm} = plain on {sum(r['text'] == plain.get(r['prompt']) for r in ours.get(arm, []) if 'text' in r)}"
             f"/{len(plain)}" for arm in ARMS[1:]]
    theirs = row.get("llama-completion", [])
    if theirs:
        same = sum(r.get("text") == plain.get(k) for k, r in enumerate(theirs))
        parts.append(f"ours plain = llama-completion on {same}/{len(theirs)}")
    return "greedy texts: " + ", ".join(parts)


def render(res: dict) -> str:
    h = res["header"]
    lines = [f"# dflash-gguf on {h['device_description']} ({h['device']}) against llama.cpp's tools", "",
             f"{h['date']}, commit {h['commit']}, driver {h['driver']}, {h['gpu']}; {h['cpu_count']} CPU cores", "",
             "```", h["build"], "```", ""]
    if "pairs" in res:
        lines += ["## 1. Bundled pairs end to end (q8_0, every engine on the device)", "",
                  f"{h['n']} new tokens, {len(h['prompts'])} prompts, median over prompts of the median of "
                  f"{h['reps']} reps; AL = tokens per target pass; syncs = host reads per step (ours)", "",
                  "| pair | sampling | engine | tok/s | AL | syncs | ours chain / this |", "|---|---|---|---:|---:|---:|---:|"]
        for key, row in res["pairs"].items():
            pair, mode = key.split()
            ours = row["ours"]
            chain = e2e_summary(ours.get("chain", [])) if "error" not in ours else {}
            for arm in ARMS:
                s = {"error": ours["error"]} if "error" in ours else e2e_summary(ours.get(arm, []))
                lines.append(f"| {pair} | {mode} | ours {arm} | {fmt(s.get('tps'), '.1f')} | {fmt(s.get('al'))} | "
                             f"{fmt(s.get('syncs'), '.1f')} | {fmt(ratio(chain.get('tps'), s.get('tps')))} |"
                             + (f" {s['error']}" if "error" in s else ""))
            for tool in [k for k in row if k.startswith("llama")]:
                s = e2e_summary(row[tool])
                lines.append(f"| {pair} | {mode} | {tool} | {fmt(s.get('tps'), '.1f')} | {fmt(s.get('al'))} | – | "
                             f"{fmt(ratio(chain.get('tps'), s.get('tps')))} |")
        lines.append("")
        for key, row in res["pairs"].items():
            if key.endswith("greedy") and "error" not in row["ours"]:
                lines.append(f"- {key}: " + greedy_agreement(row))
        lines.append("")
    if "shape" in res:
        lines += render_steps("2. Qwen3.5-27B shape, Q4_K_M, random weights", res["shape"])
        pair = res["shape"].get("pair", {})
        if "error" in pair:
            lines += [f"pair: {pair['error']}", ""]
        elif pair:
            lines += ["The pair through the Engine (random weights: AL means nothing):", "",
                      "| arm | tok/s | target nodes | drafter nodes | graphs/step | host reads/step | host writes/step | "
                      "device memory used / plan |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
            for arm, p in pair.items():
                m = p["memory"]
                lines.append(f"| {arm} | {fmt(p['tps'], '.1f')} | {fmt(p['target_nodes'], '.0f')} | "
                             f"{fmt(p['drafter_nodes'], '.0f')} | {fmt(p['n_graphs'])} | {fmt(p['n_host_reads'])} | "
                             f"{fmt(p['n_host_writes'])} | {m['used'] / 2**20:.0f} / {m['plan'] / 2**20:.0f} MiB "
                             f"({fmt(m['ratio'], '.3f')}) |")
            lines.append("")
    if "long" in res:
        for kv, row in res["long"].items():
            lines += render_steps(f"3. Long context, {kv} KV", row)
    return "\n".join(lines) + "\n"


def render_steps(title: str, row: dict) -> list:
    ours, theirs = row["ours"], row.get("llama-bench", {})
    out = [f"## {title}", ""]
    if "error" in ours:
        return out + [f"ours: {ours['error']}", ""]
    depth, lb = ours["depth"], theirs.get("s", {})
    tg = lb.get(f"0/{ours['tokens']}/{depth}")
    theirs_tps = ours["tokens"] / tg if tg else None
    builds = ", ".join(f"{k} {v}" for k, v in ours["graph_builds_timed"].items()) or "none"
    out += [f"At a context of {depth} tokens. Plain decode: ours {ours['decode_tps']:.1f} tok/s, llama-bench "
            f"{fmt(theirs_tps, '.1f')} (ours / theirs {fmt(ratio(ours['decode_tps'], theirs_tps))}); graph nodes: "
            f"decode {ours['decode_nodes']}, verify {ours['verify_nodes']}, tree verify {ours.get('tree_nodes', '–')}; "
            f"graphs built inside timed calls: {builds}", ""]
    step = 1e3 / ours["decode_tps"]
    out += ["| k | ours verify ms | / decode step | ours batch, last row | ours batch, all rows | llama-bench -p k "
            "| theirs / ours verify |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for k, ms in ours["verify_ms"].items():
        th = lb.get(f"{k}/0/{depth}")
        th = th * 1e3 if th else None
        out.append(f"| {k} | {ms:.2f} | {ms / step:.2f} | {fmt(ours.get('batch_last_ms', {}).get(k))} | "
                   f"{fmt(ours.get('batch_all_ms', {}).get(k))} | {fmt(th)} | {fmt(ratio(th, ms))} |")
    out.append("")
    if ours.get("tree_ms"):
        out += ["| nodes | chain verify ms | DDTree (confident) ms | / chain | bushy tree ms | / chain |",
                "|---:|---:|---:|---:|---:|---:|"]
        for n, r in ours["tree_ms"].items():
            out.append(f"| {n} | {r['chain']:.2f} | {r['ddtree']:.2f} | {r['ddtree'] / r['chain']:.3f} | "
                       f"{r['bushy']:.2f} | {r['bushy'] / r['chain']:.3f} |")
        out.append("")
    if ours.get("prefill_tps"):
        pp = lb.get(f"{depth}/0/{depth}")
        theirs_pp = depth / pp if pp else None
        out += [f"Prefill of {depth} tokens: ours {ours['prefill_tps']:.0f} tok/s, llama-bench {fmt(theirs_pp, '.0f')} "
                f"(ours / theirs {fmt(ratio(ours['prefill_tps'], theirs_pp))})", ""]
    m = ours["memory"]
    out += [f"Device memory (target alone): used {m['used'] / 2**20:.0f} MiB, planned {m['plan'] / 2**20:.0f} MiB "
            f"(used / plan {fmt(m['ratio'], '.3f')}); load {ours['load_s']:.1f} s, prefill of the context "
            f"{ours['prefill_depth_s']:.1f} s", ""]
    return out + ([f"llama-bench: {theirs['error']}", ""] if "error" in theirs else [])


# ---- main ------------------------------------------------------------------------------------

def header(a, probe: dict) -> dict:
    dev = next((d for d in probe["devices"] if d["name"] == a.device), {"description": a.device})
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        gpu = ""
    info = ROOT / ".cuda-build" / ("cpu" if a.smoke else "cuda") / "build-info.txt"
    return {"date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"), "commit": a.commit, "device": a.device,
            "device_description": dev["description"], "gpu": gpu or "no nvidia-smi",
            "driver": gpu.split(", ")[1] if gpu.count(", ") >= 2 else "–",
            "build": info.read_text().strip() if info.exists() else "–", "ggml_dir": probe["ggml_dir"],
            "prompts": a.prompts, "n": a.n, "reps": a.reps, "tokens": a.tokens, "smoke": a.smoke,
            "cpu_count": os.cpu_count()}


def results_name(res: dict) -> str:
    h = res["header"]
    gpu = "cpu-smoke" if h["smoke"] else re.sub(r"[^a-z0-9]", "", (h["device_description"].split() or ["gpu"])[
        1 if h["device_description"].startswith("NVIDIA") else 0].lower())
    return f"cuda-{gpu}-{h['date'].replace(' ', '-').replace(':', '')}"


def write(res: dict, out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    from dflash_gguf.bench.provenance import write_results  # the form results/ keeps

    write_results(out_dir / f"{name}.json", res)
    (out_dir / f"{name}.md").write_text(render(res))
    return out_dir / f"{name}.md"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="1,2,3", help="parts to run, comma-separated (default 1,2,3)")
    p.add_argument("--smoke", action="store_true", help="the CPU, tiny models and counts: a plumbing check")
    p.add_argument("--device", help="ggml device (default: the first GPU; CPU with --smoke)")
    p.add_argument("--commit", default=None, help="commit of the tree measured (default: git rev-parse HEAD)")
    p.add_argument("--tools", type=Path, help="llama.cpp tools (default: $DFLASH_CUDA_TOOLS, else .cuda-build/)")
    p.add_argument("--models", type=Path, default=ROOT / ".cuda-build" / "models", help="where part 2's models go")
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT")
                   else ROOT / ".cuda-build" / "results")
    p.add_argument("--reps", type=int, default=None, help="reps per figure (default 3; --smoke 1)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"part 1's prompts (1..{len(PROMPTS)})")
    p.add_argument("--merge", nargs="+", type=Path, metavar="JSON", help="combine part files into one results file")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.reps = a.reps or (1 if a.smoke else 3)
    if not 1 <= a.prompts <= len(PROMPTS):
        p.error(f"--prompts must be 1..{len(PROMPTS)}")
    a.prompts = PROMPTS[:1 if a.smoke else a.prompts]
    a.n, a.n_ctx, a.tokens = (16, 512, 8) if a.smoke else (128, 1024, 32)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        print("@@" + json.dumps(globals()[f"worker_{a.worker[0]}"](json.loads(a.worker[1]))), flush=True)
        return 0
    if a.merge:
        from dflash_gguf.bench import slim  # a part is a results file (slim.write's form)

        parts = [slim.read(p) for p in a.merge]
        res = {"header": parts[0]["header"]}
        for part in parts:
            res.update({k: v for k, v in part.items() if k != "header"})
        print(render(res))
        print(write(res, a.out, results_name(res)), file=sys.stderr)
        return 0
    parts = {int(x) for x in a.part.split(",")}
    probe = run_worker("probe", {"drafts": [str(DATA / d) for d in PAIRS.values()]})
    if "error" in probe:
        print(f"error: dflash_gguf does not load: {probe['error']}", file=sys.stderr)
        return 1
    gpus = [d["name"] for d in probe["devices"] if d["type"] == "gpu"]
    a.device = a.device or ("CPU" if a.smoke else (gpus[0] if gpus else None))
    if a.device is None:
        print(f"error: no GPU among ggml's devices {[d['name'] for d in probe['devices']]}", file=sys.stderr)
        return 1
    a.commit = a.commit or git_commit()
    tools_dir = a.tools or Path(os.environ.get("DFLASH_CUDA_TOOLS") or
                                ROOT / ".cuda-build" / ("cpu" if a.smoke else "cuda") / "tools")
    tools = None
    if all((tools_dir / t).is_file() for t in ("llama-bench", "llama-completion", "llama-speculative-simple")):
        tools = Tools(tools_dir, probe["ggml_dir"], a.device != "CPU", os.cpu_count())
    else:
        log(f"llama.cpp's tools are not in {tools_dir}: ours only")
    res = {"header": header(a, probe)}
    name = results_name(res) + ("" if parts == {1, 2, 3} else "-part" + "".join(map(str, sorted(parts))))
    t0 = time.perf_counter()
    if 1 in parts:
        res["pairs"] = part_pairs(a, tools, probe["blocks"])
        write(res, a.out, name)
    if parts & {2, 3}:
        log("writing the 27B shape models" if not a.smoke else "writing tiny shape models")
        models = make_models(a)
        if 2 in parts:
            res["shape"] = part_shape(a, tools, models, keep=lambda part: write({**res, "shape": part}, a.out, name))
            write(res, a.out, name)
        if 3 in parts:
            res["long"] = part_long(a, tools, models)
    res["header"]["seconds"] = time.perf_counter() - t0
    path = write(res, a.out, name)
    print(render(res))
    log(f"results: {path} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
