#!/usr/bin/env python3
"""A real pair on this machine, ours against llama.cpp's own tools on the same files and
threads, greedy, every arm once per repetition in a shuffled order (arms taking turns).

    .venv/bin/python experiments/real_pair_bench.py [--pair qwen|qwen-plain|qwen-prefill|qwen-trained|gemma3|gemma3-plain] [-r 3] [-n 64] [-t 2] [--out PATH]

--pair qwen (default; results/real-pair-DATE.json): the published Qwen2.5-Coder 1.5B alone
and with its 0.5B sibling drafting (draft-simple). Arms: our plain decoding; our
draft-simple chain at llama.cpp's default n-max (3) and at 4; our draft-simple tree;
llama-completion; llama-speculative-simple --spec-type draft-simple at its default and at
n-max 4; llama-bench's plain decoding (-n N after the prompts' mean length).

--pair qwen-plain (results/real-pair-qwen-plain-DATE.json): the 1.5B alone, our plain
decoding against llama-completion and llama-bench tg128.

--pair qwen-prefill (results/real-pair-qwen-prefill-DATE.json): prefill of a 512- and a
2048-token prompt on the 1.5B, ours against llama-bench pp512 and pp2048.

--pair qwen-trained --draft PATH (results/real-pair-qwen-trained-DATE.json): a DFlash
drafter dflash-train made for the 1.5B (issue 55's report), ours only: its chain at its
default block (16) and at 8, against our plain decoding, our draft-simple with the 0.5B
and our ngram-simple, each at its default, on the code prompts.

--pair gemma3-plain (results/real-pair-gemma3-plain-DATE.json): the first two items of
--pair gemma3 below, nothing drafting.

--pair gemma3 (results/real-pair-gemma3-DATE.json): issue 51's comparisons on the
published Gemma 3 270M Q4_K_M and an f16 copy of it (our re-typing, made once:
dflash_gguf.tools.real_models.retyped):
- plain decoding of the Q4_K_M: ours against llama-bench tg128 and llama-completion;
- prefill of a 512- and a 2048-token prompt on the Q4_K_M: ours against llama-bench
  pp512 and pp2048;
- draft-simple, the f16 target with the Q4_K_M drafting: ours against
  llama-speculative-simple's, each side at its default (n-max 3, p-min 0) and at every
  --sweep-n-max x --sweep-p-min setting, whose fastest is that side's best; our tree, and
  both engines' plain decoding of the f16 for reference.

Each figure is decode tok/s (the prefill apart; a prefill arm's: prompt tokens per second
of prefill), and for drafting arms the tokens per target pass (AL). The file keeps every
run and the load average at every cell; a cell that starts above --max-load per core
waits (up to a minute) first. Ratios are medians over repetitions of each repetition's
ratio.
"""
from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import sys
import time
from pathlib import Path

from dflash_gguf import Engine
from dflash_gguf.tools import real_models
from dflash_gguf.bench import llama_cpp, provenance
from dflash_gguf.bench.runs import Cell, Run, Sampling

QWEN_PROMPTS = [  # code, the pair's own domain
    ("quicksort", "def quicksort(xs):\n    \"\"\"Sort a list of numbers with quicksort.\"\"\"\n"),
    ("read_config", "import json\n\n\ndef read_config(path):\n    \"\"\"Load a JSON config file and fill in "
                    "defaults.\"\"\"\n"),
    ("stack", "class Stack:\n    \"\"\"A last-in, first-out container.\"\"\"\n\n    def __init__(self):\n"),
]


GEMMA_PROMPTS = [  # a base model: code, prose and a list to continue
    ("fibonacci", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("france", "The capital of France is"),
    ("planets", "The planets of the solar system, in order from the Sun, are"),
]
PREFILL_TOKENS = (512, 2048)  # llama-bench's pp512 and pp2048


class Ours:
    """One of our engines, kept loaded: plain, or draft-simple chain/tree."""

    side, speculative = "ours", False

    def __init__(self, name: str, target: str, draft, threads: int, n: int, prompts, **options):
        self.name, self.n, self.prompts = name, n, prompts
        self.speculative = draft is not None or "spec_type" in options  # an n-gram kind drafts without a file
        self.engine = Engine(target, draft, n_ctx=1024, n_threads=threads, **options)
        self.engine.generate(prompts[0][1], max_tokens=8, stop_tokens=())  # graphs built, caches touched

    def one_round(self, rep: int) -> list:
        runs = []
        for name, text in self.prompts:
            r = self.engine.generate(text, max_tokens=self.n, stop_tokens=())
            s = r.stats
            passes = len(s.accepted_lengths) if self.speculative else max(s.generated_tokens - 1, 1)
            runs.append(Run(Cell("ours", self.name, "greedy", speculative=self.speculative), rep=rep, prompt=name,
                            prompt_tokens=len(self.engine.encode(text)), tokens=s.generated_tokens - 1,
                            decode_s=s.decode_seconds, passes=passes, token_ids=list(r.tokens), text=r.text))
        return runs


class OursPrefill:
    """Our prefill of an n-token prompt (token ids, the first one fixed: BOS where the
    tokenizer adds one, as Gemma's does), then one token: the run's
    tokens are the prompt's, its decode_s the prefill's time."""

    side, speculative = "ours", False

    def __init__(self, target: str, threads: int, n_tokens: int, filler: str):
        self.name, self.n_tokens = f"prefill {n_tokens}", n_tokens
        self.engine = Engine(target, n_ctx=n_tokens + 64, n_threads=threads)
        ids = self.engine.encode(filler)  # BOS first where the tokenizer adds it (Gemma's; not Qwen's)
        body = ids[1:]
        self.tokens = ids[:1] + (body * (n_tokens // len(body) + 1))[:n_tokens - 1]
        self.period = len(body)  # the tokens after the first repeat with this period
        self.engine.generate(self.prompt(-1)[:64], max_tokens=1, stop_tokens=())  # graphs built

    def prompt(self, rep: int) -> list:
        """BOS and the filler rotated by rep + 1 (mod its period): each round a prompt of
        its own, so that nothing of it is reused from the slot or a checkpoint (a reused
        part would show as reused_tokens and not be counted)."""
        body = self.tokens[1:]
        k = (rep + 1) % self.period
        return self.tokens[:1] + body[k:] + body[:k]

    def one_round(self, rep: int) -> list:
        s = self.engine.generate(self.prompt(rep), max_tokens=1, stop_tokens=()).stats
        return [Run(Cell("ours", self.name, "greedy"), rep=rep, prompt=f"{self.n_tokens} tokens",
                    prompt_tokens=s.prompt_tokens, tokens=s.prompt_tokens - s.reused_tokens,
                    decode_s=s.prefill_seconds, passes=1, prefill_s=s.prefill_seconds,
                    extra={"reused_tokens": s.reused_tokens})]


class Theirs:
    """A llama.cpp arm of dflash-bench (its command lines and log parsing)."""

    side = "llama.cpp"

    def __init__(self, arm):
        self.arm, self.name, self.speculative = arm, arm.name, arm.speculative

    def one_round(self, rep: int) -> list:
        return self.arm.one_round(None if isinstance(self.arm, llama_cpp.BenchArm) else Sampling(), rep, 0)


def named(arm, name) -> Theirs:
    """A llama.cpp arm with a row of its own: two files' runs of the same tool."""
    arm.name = name
    return Theirs(arm)


def wait_for_quiet(max_load: float, threads: int) -> float:
    t0 = time.time()
    while provenance.load_average()[0] > max_load * threads and time.time() - t0 < 60:
        time.sleep(5)
    return provenance.load_average()[0]


def qwen_arms(a, tools) -> tuple[dict, list, list]:
    """The Qwen2.5-Coder pair's files, arms and comparisons (label, arm, baseline)."""
    target, small = str(real_models.path("qwen2.5-coder-1.5b")), str(real_models.path("qwen2.5-coder-0.5b"))
    setup = llama_cpp.Setup(target, a.threads, 1024, a.n_predict, "f16", small, None, (), "draft-simple")
    p, spec = QWEN_PROMPTS, tools.found["llama-speculative-simple"]
    depth = 40  # about the prompts' mean length in tokens
    arms = [
        Ours("plain", target, None, a.threads, a.n_predict, p),
        Ours("draft-simple chain (n-max 3, default)", target, small, a.threads, a.n_predict, p),
        Ours("draft-simple chain (n-max 4)", target, small, a.threads, a.n_predict, p, spec_draft_n_max=4),
        Ours("draft-simple tree (n-max 3)", target, small, a.threads, a.n_predict, p, tree_budget=8),
        Theirs(llama_cpp.CompletionArm(tools.found["llama-completion"], setup, p)),
        Theirs(llama_cpp.SpeculativeArm(spec, setup, p, None, None)),
        Theirs(llama_cpp.SpeculativeArm(spec, setup, p, None, 4)),
        Theirs(llama_cpp.BenchArm(tools.found["llama-bench"], setup, depth)),
    ]
    return {"target": target, "draft": small}, arms, []


def plain_arms(a, tools, model: str, prompts, prefill: bool, arms: bool = True) -> tuple[dict, list, list]:
    """A published Q4_K_M alone: plain decoding against llama-bench tg128 and
    llama-completion, and (prefill) prefill of 512 and 2048 tokens against llama-bench
    pp512 and pp2048 (arms False: the comparisons only, nothing loaded)."""
    q4 = str(real_models.path(model))
    t, n, bench = a.threads, a.n_predict, tools.found["llama-bench"]
    plain_q4, tg128 = llama_cpp.Setup(q4, t, 4096, n, "f16"), llama_cpp.Setup(q4, t, 4096, 128, "f16")
    filler = " ".join(text for _, text in prompts)
    completion, tg = "plain Q4_K_M (llama-completion)", "plain Q4_K_M (llama-bench tg128)"
    ks = PREFILL_TOKENS if prefill else ()
    compare = [("plain Q4_K_M vs llama-bench tg128", "plain Q4_K_M", [tg]),
               ("plain Q4_K_M vs llama-completion", "plain Q4_K_M", [completion]),
               *[(f"prefill {k} vs llama-bench pp{k}", f"prefill {k}", [f"prefill (llama-bench -p {k})"])
                 for k in ks]]
    if not arms:
        return {"target": q4}, [], compare
    return {"target": q4}, [
        Ours("plain Q4_K_M", q4, None, t, n, prompts),
        named(llama_cpp.CompletionArm(tools.found["llama-completion"], plain_q4, prompts), completion),
        named(llama_cpp.BenchArm(bench, tg128, 0), tg),
        *[OursPrefill(q4, t, k, filler) for k in ks],
        *[Theirs(llama_cpp.BenchArm(bench, plain_q4, 0, n_prompt=k)) for k in ks],
    ], compare


def gemma3_plain_arms(a, tools, arms: bool = True) -> tuple[dict, list, list]:
    """The published Gemma 3 270M Q4_K_M alone, decoding and prefill."""
    return plain_arms(a, tools, "gemma-3-270m", GEMMA_PROMPTS, True, arms)


def qwen_plain_arms(a, tools) -> tuple[dict, list, list]:
    """The published Qwen2.5-Coder 1.5B Q4_K_M alone, decoding (its prefill: --pair qwen-prefill)."""
    return plain_arms(a, tools, "qwen2.5-coder-1.5b", QWEN_PROMPTS, False)


def gemma3_arms(a, tools) -> tuple[dict, list, list]:
    """Issue 51's Gemma 3 arms (see the module's doc) and comparisons."""
    q4 = str(real_models.path("gemma-3-270m"))
    f16 = str(real_models.retyped("gemma-3-270m", "f16"))
    p, t, n = GEMMA_PROMPTS, a.threads, a.n_predict
    spec = tools.found["llama-speculative-simple"]
    pair = llama_cpp.Setup(f16, t, 1024, n, "f16", q4, None, (), "draft-simple")
    sweep = [(n_max, p_min) for n_max in a.sweep_n_max for p_min in a.sweep_p_min if (n_max, p_min) != (3, 0.0)]

    def ours_simple(n_max, p_min):
        return Ours(f"draft-simple chain (n-max {n_max}, p-min {p_min:g})", f16, q4, t, n, p, spec_draft_n_max=n_max,
                    draft_p_min=p_min)

    arms = [
        *gemma3_plain_arms(a, tools)[1],
        Ours("plain f16", f16, None, t, n, p),
        named(llama_cpp.CompletionArm(tools.found["llama-completion"], pair, p), "plain f16 (llama-completion)"),
        Ours("draft-simple chain (n-max 3, default)", f16, q4, t, n, p),
        Ours("draft-simple tree (n-max 3)", f16, q4, t, n, p, tree_budget=8),
        *[ours_simple(n_max, p_min) for n_max, p_min in sweep],
        Theirs(llama_cpp.SpeculativeArm(spec, pair, p, None, None)),
        *[Theirs(llama_cpp.SpeculativeArm(spec, pair, p, p_min, n_max)) for n_max, p_min in sweep],
    ]
    their_spec = [x.name for x in arms if x.side == "llama.cpp" and x.speculative]
    our_spec = [x.name for x in arms if x.side == "ours" and x.speculative and "tree" not in x.name]
    compare = [
        *gemma3_plain_arms(a, tools, arms=False)[2],
        ("draft-simple default vs llama.cpp's default", "draft-simple chain (n-max 3, default)", [their_spec[0]]),
        ("draft-simple best vs llama.cpp's best", our_spec, their_spec),
    ]
    return {"target": f16, "draft": q4, "plain": q4}, arms, compare


def qwen_prefill_arms(a, tools) -> tuple[dict, list, list]:
    """Prefill of a 512- and a 2048-token prompt on the Qwen2.5-Coder 1.5B: ours against
    llama-bench pp512 and pp2048 (issue 54's prefill row)."""
    target = str(real_models.path("qwen2.5-coder-1.5b"))
    setup = llama_cpp.Setup(target, a.threads, 4096, a.n_predict, "f16")
    filler = " ".join(text for _, text in QWEN_PROMPTS)
    arms = [*[OursPrefill(target, a.threads, k, filler) for k in PREFILL_TOKENS],
            *[Theirs(llama_cpp.BenchArm(tools.found["llama-bench"], setup, 0, n_prompt=k)) for k in PREFILL_TOKENS]]
    compare = [(f"prefill {k} vs llama-bench pp{k}", f"prefill {k}", [f"prefill (llama-bench -p {k})"])
               for k in PREFILL_TOKENS]
    return {"target": target}, arms, compare


def qwen_trained_arms(a, tools) -> tuple[dict, list, list]:
    """A dflash-train drafter for the 1.5B against the other drafters we run for it."""
    if not a.draft:
        raise SystemExit("error: --pair qwen-trained needs --draft PATH (a dflash-train GGUF for the 1.5B)")
    target, small = str(real_models.path("qwen2.5-coder-1.5b")), str(real_models.path("qwen2.5-coder-0.5b"))
    p, t, n, trained = QWEN_PROMPTS, a.threads, a.n_predict, "dflash (trained) chain (block 16, default)"
    arms = [Ours("plain", target, None, t, n, p),
            Ours(trained, target, a.draft, t, n, p),
            Ours("dflash (trained) chain (block 8)", target, a.draft, t, n, p, block_size=8),
            Ours("draft-simple chain (n-max 3, default)", target, small, t, n, p),
            Ours("ngram-simple (default)", target, None, t, n, p, spec_type="ngram-simple")]
    compare = [(f"trained vs {other}", trained, [other])
               for other in ("plain", "draft-simple chain (n-max 3, default)", "ngram-simple (default)")]
    return {"target": target, "draft": a.draft, "simple": small}, arms, compare


PAIRS = {"qwen": (qwen_arms, "real-pair"), "qwen-trained": (qwen_trained_arms, "real-pair-qwen-trained"), "qwen-prefill": (qwen_prefill_arms, "real-pair-qwen-prefill"),
         "gemma3": (gemma3_arms, "real-pair-gemma3"), "gemma3-plain": (gemma3_plain_arms, "real-pair-gemma3-plain"),
         "qwen-plain": (qwen_plain_arms, "real-pair-qwen-plain")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", choices=sorted(PAIRS), default="qwen")
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("--draft", help="qwen-trained: the dflash-train drafter GGUF")
    p.add_argument("-n", "--n-predict", type=int, default=64)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--sweep-n-max", type=lambda v: [int(x) for x in v.split(",")], default=[2, 4, 6, 8],
                   help="gemma3: the n-max values each side's draft-simple sweeps (default 2,4,6,8)")
    p.add_argument("--sweep-p-min", type=lambda v: [float(x) for x in v.split(",")], default=[0.0, 0.5],
                   help="gemma3: the p-min values swept at each n-max (default 0,0.5)")
    p.add_argument("--max-load", type=float, default=0.5, help="per thread, at each cell's start (default 0.5)")
    p.add_argument("--out", type=Path, default=None, help="default results/<pair's name>-DATE.json")
    a = p.parse_args(argv)
    make_arms, stem = PAIRS[a.pair]
    out = a.out or Path("results") / f"{stem}-{dt.date.today()}.json"
    tools = llama_cpp.Tools.find(None)
    missing = [t for t in ("llama-completion", "llama-speculative-simple", "llama-bench") if t not in tools.found]
    if missing:
        print(f"error: llama.cpp's {', '.join(missing)} not built (scripts/llama_cpp_build.py {' '.join(missing)})",
              file=sys.stderr)
        return 2
    models, arms, compare = make_arms(a, tools)
    doc = provenance.results_doc("experiments/real_pair_bench.py", sys.argv[1:] if argv is None else argv,
                                 models=models, n_predict=a.n_predict,
                                 threads=a.threads, repetitions=a.repetitions, load_average={"before":
                                 provenance.load_average()}, runs=[])
    for rep in range(a.repetitions):
        order = list(range(len(arms)))
        random.Random(rep).shuffle(order)
        for i in order:
            load = wait_for_quiet(a.max_load, a.threads)
            for run in arms[i].one_round(rep):
                run.load_1m, run.loaded = load, load > a.max_load * a.threads
                run.extra = {**run.extra, "side": arms[i].side}
                doc["runs"].append(run.to_json())
            last = doc["runs"][-1]
            print(f"rep {rep + 1} {arms[i].side} {arms[i].name}: {last['tokens'] / last['decode_s']:.1f} tok/s "
                  f"(load {load:.2f})", file=sys.stderr, flush=True)
    doc["load_average"]["after"] = provenance.load_average()

    def tps(mode, rep):
        rs = [r for r in doc["runs"] if r["mode"] == mode and r["rep"] == rep]
        return sum(r["tokens"] for r in rs) / sum(r["decode_s"] for r in rs) if rs else None

    def ratio(per_rep, base):
        return statistics.median([x / tps(base, rep) for rep, x in enumerate(per_rep)]) if tps(base, 0) else None

    # the rows every row is also set against: the pair's target decoding plainly, ours and llama.cpp's
    plain = {"gemma3": "plain f16", "gemma3-plain": "plain Q4_K_M", "qwen-plain": "plain Q4_K_M"}.get(a.pair, "plain")
    completion = f"{plain} (llama-completion)"
    rows = {}
    for arm in arms:
        per_rep = [tps(arm.name, rep) for rep in range(a.repetitions)]
        rs = [r for r in doc["runs"] if r["mode"] == arm.name]
        rows[f"{arm.side} {arm.name}"] = {
            "tok_s_median": statistics.median(per_rep), "tok_s_per_rep": per_rep,
            "al": None if arm.name.startswith("prefill") else
            sum(r["tokens"] for r in rs) / sum(r["passes"] for r in rs),
            f"vs_ours_{plain.replace(' ', '_')}": ratio(per_rep, plain),
            "vs_llama_completion": ratio(per_rep, completion)}
    doc["rows"] = rows

    def best(names):  # the fastest of a side's settings, by median tok/s
        return max(names, key=lambda m: statistics.median(tps(m, rep) for rep in range(a.repetitions)))

    doc["comparisons"] = {}
    for label, ours, theirs in compare:
        ours, theirs = (best(ours) if isinstance(ours, list) else ours), best(theirs)
        per_rep = [tps(ours, rep) / tps(theirs, rep) for rep in range(a.repetitions)]
        doc["comparisons"][label] = {"ours": ours, "theirs": theirs, "ratio": statistics.median(per_rep),
                                     "ratio_min_max": [min(per_rep), max(per_rep)], "ratio_per_rep": per_rep}
    # lossless: every arm of ours on the pair's target gives one output a prompt, greedy
    prompts = sorted({r["prompt"] for r in doc["runs"] if r["engine"] == "ours" and r["token_ids"]})
    doc["ours_distinct_outputs"] = {name: len({tuple(r["token_ids"]) for r in doc["runs"] if r["engine"] == "ours"
                                               and r["prompt"] == name and r["mode"] != "plain Q4_K_M"})
                                    for name in prompts}
    path = provenance.write_results(out, doc)
    for name, row in rows.items():
        vs = row[f"vs_ours_{plain.replace(' ', '_')}"]
        print(f"{name:>70}: {row['tok_s_median']:8.2f} tok/s" + (f"  AL {row['al']:.2f}" if row["al"] else "")
              + (f"  x ours {plain} {vs:.3f}" if vs else ""))
    for label, c in doc["comparisons"].items():
        lo, hi = c["ratio_min_max"]
        print(f"{label}: {c['ratio']:.3f} ({lo:.3f}-{hi:.3f}) ({c['ours']} / {c['theirs']})")
    print(f"results: {path or out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
