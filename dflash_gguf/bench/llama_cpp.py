"""llama.cpp's own C++ tools as the benchmark's peers, run on the same GGUF with the same
threads, cache type, prompts and sampling settings, and their logs read back:

  llama-bench               plain decoding (`-n N` at a depth of the prompts' length), one
                            sample per run (`-r 1`) from its JSON output
  llama-completion          plain end-to-end generation of each prompt: its "eval time"
                            (the decode steps) and its sampling of their tokens (timed
                            apart there; ours is part of each step's graph)
  llama-speculative-simple  `--spec-type draft-dflash` (llama.cpp's DFlash; or the -md
                            drafter's kind, draft-simple's small model, or ngram-simple /
                            ngram-mod, no -md): its "decoded" timer and its draft counts

The tools are those `scripts/llama_cpp_build.py` builds from the installed llama-cpp-python's
sdist (dflash_gguf.tools.llama_cpp_tree), or any directory given.
"""
from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from ..runtime.drafter_kinds import DRAFTERS
from ..speculation.kinds import WEIGHTLESS
from ..tools import llama_cpp_tree
from .runs import Cell, Run, Sampling

TOOLS = ("llama-bench", "llama-completion", "llama-speculative-simple")
# The order dflash_gguf.decoding.sampling applies its truncations in: llama.cpp's default chain less
# the samplers we do not have (DRY, top-n-sigma, typical, XTC) and the penalties the bench
# leaves off, given explicitly so that both engines draw from one distribution.
SAMPLER_ORDER = "top_k;top_p;min_p;temperature"
END_OF_TEXT = " [end of text]"  # llama-completion's mark of an end-of-generation token


class ToolError(RuntimeError):
    pass


@dataclass
class Tools:
    """The tools found, and why the others are missing."""

    found: dict = field(default_factory=dict)
    missing: dict = field(default_factory=dict)

    @classmethod
    def find(cls, directory: Optional[Path]) -> "Tools":
        tools = cls()
        for name in TOOLS:
            exe = llama_cpp_tree.tool(name, directory)
            if exe is not None:
                tools.found[name] = exe
            else:
                where = directory or llama_cpp_tree.build_dir() / "bin"
                tools.missing[name] = f"{name} is not in {where} (build it: python scripts/llama_cpp_build.py)"
        return tools


@dataclass
class Setup:
    """What every llama.cpp run shares with ours."""

    target: str
    threads: int
    n_ctx: int
    n_predict: int
    kv_type: str
    draft: Optional[str] = None
    n_gpu_layers: Optional[int] = None
    constraint_flags: tuple = ()  # ("--grammar", GBNF) or ("--json-schema", schema): what our runs are held to
    spec_type: str = "draft-dflash"  # the drafter's kind (--spec-type); draft-mtp, ngram-*: no draft
    ignore_eos: bool = False  # decode -n tokens whatever the model says (--ignore-eos)

    def common(self) -> List[str]:
        t = str(self.threads)
        args = ["-m", self.target, "-c", str(self.n_ctx), "-b", "512", "-ub", "512", "-t", t, "-tb", t,
                "-fa", "on", "-ctk", self.kv_type, "-ctv", self.kv_type, "-n", str(self.n_predict),
                *self.constraint_flags, *(["--ignore-eos"] if self.ignore_eos else [])]
        if self.n_gpu_layers is not None:
            args += ["-ngl", str(self.n_gpu_layers)]
        return args


def sampling_flags(s: Sampling, rep: int) -> List[str]:
    if s.greedy:
        return ["--temp", "0"]
    return ["--temp", repr(s.temperature), "--top-k", str(s.top_k), "--top-p", repr(s.top_p),
            "--min-p", repr(s.min_p), "--seed", str(s.seed_at(rep)), "--samplers", SAMPLER_ORDER]


def run_tool(cmd: List[str], timeout: float = 3600) -> tuple:
    """(stdout, stderr) of one run; ToolError with the last lines of its log on failure."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ToolError(f"{Path(cmd[0]).name} timed out after {timeout:.0f} s") from None
    if res.returncode != 0:
        how = f"signal {-res.returncode}" if res.returncode < 0 else f"exit status {res.returncode}"
        tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-2:]
        raise ToolError(f"{Path(cmd[0]).name} failed ({how}): " + " | ".join(tail))
    return res.stdout, res.stderr


def peer_reruns(runs) -> dict:
    """How many of llama.cpp's runs had to be made again (run_parsed), of how many kept."""
    attempts = [r.extra["attempts"] for r in runs if r.cell.engine == "llama.cpp" and "attempts" in r.extra]
    return {"runs": len(attempts), "reruns": sum(a - 1 for a in attempts)}


# runs of a tool until one logs its summary: llama.cpp logs from a worker thread that its
# exit does not wait for (common/log.cpp), and on a busy machine most runs of a tiny model
# lose the last lines (4 runs of llama-speculative-simple in a row lost them here)
ATTEMPTS = 10


def run_parsed(cmd: List[str], parse, needed: str, attempts: Optional[int] = None) -> tuple:
    """(stdout, parsed log) of a run whose log has `needed`, retried when it has not
    (at most `attempts` runs, default ATTEMPTS): llama.cpp logs from a worker thread,
    which sometimes loses the last lines at exit (its tools then exit 0 with their
    output cut). The parsed log's "attempts" counts the runs it took, which results
    files keep (peer_reruns)."""
    attempts = attempts or ATTEMPTS
    for attempt in range(1, attempts + 1):
        stdout, log = run_tool(cmd)
        parsed = parse(log)
        if needed in parsed:
            parsed["attempts"] = attempt
            return stdout, parsed
    raise ToolError(f"{Path(cmd[0]).name} logged no summary in {attempts} runs: {log[-300:]}")


# ---- reading the logs ---------------------------------------------------------------------

def parse_completion(log: str) -> dict:
    """llama-completion's own timings (common_perf_print): the decode steps ("eval time",
    one run per token after the prompt's), the prompt and the sampling."""
    out = {}
    m = re.search(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs", log)
    if m:
        out["decode_s"], out["runs"] = float(m.group(1)) / 1e3, int(m.group(2))
    m = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", log)
    if m:
        out["prefill_s"], out["prompt_tokens"] = float(m.group(1)) / 1e3, int(m.group(2))
    m = re.search(r"sampling time =\s*([\d.]+) ms", log)
    if m:
        out["sampling_s"] = float(m.group(1)) / 1e3
    return out


def completion_decode_seconds(r: dict) -> float:
    """llama-completion's decode steps with the sampling of the tokens they produced, as
    ours are timed (each step's graph chooses its token): it times the two apart, "eval
    time" up to the logits and "sampling time" (the logits' copy and the sampler chain)
    over every token it sampled, the prompt's first among them."""
    runs = r["runs"]
    return r["decode_s"] + r.get("sampling_s", 0.0) * runs / (runs + 1)


def parse_speculative(log: str) -> dict:
    """llama-speculative-simple's summary. Each committed round is one target pass and
    yields its accepted drafts plus one token, so rounds = n_predict - n_accept; a round
    whose partial acceptance restores a checkpoint (logged at -lv 5 only) evaluates again."""
    out = {}
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    if m:
        out["tokens"], out["decode_s"] = int(m.group(1)), float(m.group(2))
    m = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    if m:
        out["prompt_tokens"], out["prefill_s"] = int(m.group(1)), float(m.group(2))
    for key in ("n_drafted", "n_accept", "n_predict"):
        m = re.search(rf"{key}\s*=\s*(\d+)", log)
        if m:
            out[key] = int(m.group(1))
    if "n_predict" in out and "n_accept" in out:
        out["rounds"] = out["n_predict"] - out["n_accept"]
    out["checkpoints"] = "will use checkpoints" in log
    out["restores"] = len(re.findall(r"partial acceptance: ", log))
    return out


def completion_text(stdout: str) -> str:
    """The generated text llama-completion printed (--no-display-prompt)."""
    text = stdout.rstrip("\n")
    return text[:-len(END_OF_TEXT)] if text.endswith(END_OF_TEXT) else text


def speculative_text(stdout: str, prompt: str) -> Optional[str]:
    """llama-speculative-simple prints the prompt, then the generated text."""
    i = stdout.find(prompt)
    return stdout[i + len(prompt):].rstrip("\n") if i >= 0 else None


# ---- the arms ------------------------------------------------------------------------------
# Each is one row maker of the interleaved benchmark (method.py): one_round() runs a round
# of a cell, every prompt once (llama-bench: one run of -r 1).

class CompletionArm:
    """llama-completion: plain decoding of each prompt."""

    side, name, speculative, default = "llama.cpp", "plain (llama-completion)", False, False

    def __init__(self, exe: Path, setup: Setup, prompts):
        self.exe, self.setup, self.prompts = exe, setup, prompts

    def command(self, text: str, sampling: Sampling, rep: int) -> List[str]:
        return [str(self.exe), *self.setup.common(), "-p", text, "-no-cnv", "--no-display-prompt",
                *sampling_flags(sampling, rep)]

    def one_round(self, sampling: Sampling, rep: int, rnd: int) -> List[Run]:
        runs = []
        for name, text in self.prompts:
            stdout, r = run_parsed(self.command(text, sampling, rep), parse_completion, "decode_s")
            runs.append(Run(Cell("llama.cpp", self.name, sampling.label), rep=rep, round=rnd,
                            prompt=name, prompt_tokens=r.get("prompt_tokens", 0), tokens=r["runs"],
                            decode_s=completion_decode_seconds(r), passes=r["runs"], prefill_s=r.get("prefill_s"),
                            text=completion_text(stdout),
                            extra={"eval_s": r["decode_s"], "sampling_s": r.get("sampling_s"),
                                   "attempts": r["attempts"]}))
        return runs


KIND_NAMES = {**{k.spec_type: k.title for k in DRAFTERS}, "draft-simple": "draft-simple",
              **{k: k for k in WEIGHTLESS}}


class SpeculativeArm(CompletionArm):
    """llama-speculative-simple's DFlash (or another kind: setup.spec_type) at a draft cut (--spec-draft-p-min) and a number of
    drafts (--spec-draft-n-max; the drafter's block less the bonus token is the whole block);
    a weightless kind at a lookup size and a longest draft (its own flags, common/arg.cpp's:
    Kind.their_flags; it drafts up to its own m-gram / n-max, not --spec-draft-n-max) instead;
    all None: the tool's defaults, no draft flag given (stand_in: not its default, its
    kind standing in for one it lacks, cli.STAND_IN). When the target needs checkpoints
    (it cannot drop a rejected tail), each run is made again at -lv 5 to count the restores,
    each a second target pass (the timing stays the quiet run's; the same seed draws the same)."""

    speculative = True

    def __init__(self, exe: Path, setup: Setup, prompts, p_min: Optional[float], n_max: Optional[int],
                 size: Optional[int] = None, stand_in: bool = False):
        super().__init__(exe, setup, prompts)
        self.p_min, self.n_max, self.size = p_min, n_max, size
        defaults = p_min is None and n_max is None and size is None
        self.default = defaults and not stand_in
        settings = ([f"p-min {p_min:g}"] if p_min is not None else []) + \
            ([f"size {size}"] if size is not None else []) + ([f"n-max {n_max}"] if n_max is not None else [])
        self.name = f"{KIND_NAMES[setup.spec_type]} (llama-speculative-simple, " + (
            "default)" if defaults else ", ".join(settings) + ")")

    def draft_flags(self) -> List[str]:
        flags = []
        weightless = WEIGHTLESS.get(self.setup.spec_type)
        if weightless is not None:
            flags += weightless.their_flags(self.size, self.n_max)
        elif self.n_max is not None:
            flags += ["--spec-draft-n-max", str(self.n_max), "--spec-draft-n-min", "0"]
        if self.p_min is not None:
            flags += ["--spec-draft-p-min", repr(self.p_min)]
        return flags

    def command(self, text: str, sampling: Sampling, rep: int) -> List[str]:
        t = str(self.setup.threads)
        draft = ["-md", self.setup.draft] if self.setup.draft else []  # draft-mtp, ngram-*: no other model
        return [str(self.exe), *self.setup.common(), *draft, "-td", t, "-tbd", t,
                "--spec-type", self.setup.spec_type, *self.draft_flags(), "-p", text, *sampling_flags(sampling, rep)]

    def one_round(self, sampling: Sampling, rep: int, rnd: int) -> List[Run]:
        runs = []
        for name, text in self.prompts:
            cmd = self.command(text, sampling, rep)
            stdout, r = run_parsed(cmd, parse_speculative, "rounds")
            if r["checkpoints"]:
                r["restores"] = run_parsed(cmd + ["-lv", "5"], parse_speculative, "rounds")[1]["restores"]
            runs.append(Run(Cell("llama.cpp", self.name, sampling.label, speculative=True, default=self.default),
                            rep=rep, round=rnd, prompt=name, prompt_tokens=r.get("prompt_tokens", 0),
                            tokens=r["tokens"], decode_s=r["decode_s"], passes=r["rounds"] + r["restores"],
                            prefill_s=r.get("prefill_s"), text=speculative_text(stdout, text),
                            extra={k: r.get(k) for k in ("n_drafted", "n_accept", "restores", "attempts")}))
        return runs


class BenchArm:
    """llama-bench's plain decoding: `-n` tokens after `depth` tokens of context, one
    sample a round (a run of `-r 1`); no sampling settings (its rows say "-"). With
    n_prompt, its prefill instead (`-p n_prompt -n 0`, its ppN): the run's tokens are the
    prompt's and its decode_s the prefill's time."""

    side, speculative, default = "llama.cpp", False, False

    def __init__(self, exe: Path, setup: Setup, depth: int, n_prompt: int = 0):
        self.exe, self.setup, self.depth, self.n_prompt = exe, setup, depth, n_prompt
        self.name = f"prefill (llama-bench -p {n_prompt})" if n_prompt else \
            f"plain (llama-bench -n {setup.n_predict} -d {depth})"
        self.info: dict = {}

    def command(self) -> List[str]:
        t = str(self.setup.threads)
        n_gen = 0 if self.n_prompt else self.setup.n_predict
        cmd = [str(self.exe), "-m", self.setup.target, "-p", str(self.n_prompt), "-n", str(n_gen), "-d",
               str(self.depth), "-r", "1", "-t", t, "-fa", "1", "-ctk", self.setup.kv_type, "-ctv",
               self.setup.kv_type, "-o", "json"]
        if self.setup.n_gpu_layers is not None:
            cmd += ["-ngl", str(self.setup.n_gpu_layers)]
        return cmd

    def one_round(self, sampling: Optional[Sampling], rep: int, rnd: int) -> List[Run]:
        stdout, _ = run_tool(self.command())
        try:
            (test,) = json.loads(stdout)
        except ValueError:
            raise ToolError(f"llama-bench printed no JSON test result: {stdout[-300:]}") from None
        self.info = {k: test.get(k) for k in ("build_commit", "build_number", "cpu_info", "gpu_info", "backends")}
        if self.n_prompt:
            return [Run(Cell("llama.cpp", self.name, "-"), rep=rep, round=rnd, prompt="",
                        prompt_tokens=test["n_prompt"], tokens=test["n_prompt"], decode_s=ns / 1e9, passes=1,
                        prefill_s=ns / 1e9) for ns in test["samples_ns"]]
        return [Run(Cell("llama.cpp", self.name, "-"), rep=rep, round=rnd, prompt="",
                    prompt_tokens=self.depth, tokens=test["n_gen"], decode_s=ns / 1e9, passes=test["n_gen"])
                for ns in test["samples_ns"]]
