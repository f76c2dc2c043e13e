"""dflash-bench: measure a target/drafter pair in every decoding mode, greedy and sampled,
beside llama.cpp's own tools on the same GGUF, and keep every repetition.

    dflash-bench                                      # the bundled demo pair
    dflash-bench -m target.gguf -md draft.gguf -n 256 -r 5 --temp 0,0.6 --top-k 20 --top-p 0.95
    dflash-bench -m target.gguf -md draft.gguf --json -o my-gpu.json   # results/my-gpu.json
    dflash-bench serve|soak|concurrency --help        # the server: load test, soak, beside llama-server
    dflash-bench workload [FILE] --help               # multi-turn chat sessions, every arm checked against plain

Each of our modes, and each llama.cpp tool at each setting, is an arm; every arm runs in
every repetition before the next repetition starts, each repetition of a cell generating
every prompt (again, until it decoded --min-seconds; the cells of a repetition take
turns a round of prompts at a time, in an order shuffled each round, so that a machine
changing speed changes it for all of them alike), stopping at -n tokens or at the
model's end of generation (llama.cpp's tools are run without --ignore-eos, so
both decode by the same rule). Both sides sweep
their draft cut and length (ours --draft-p-min x --block-size, llama.cpp's
--spec-draft-p-min x --spec-draft-n-max) beside their defaults, and are compared at their
best and at their defaults: such a run is a sweep, and --arms-from SWEEP.json (the
headline run) measures again, in a run of its own, only the arms the sweep chose. A cell
that starts with the 1-minute load average above --max-load per thread is marked loaded
(or waited for, --wait-idle). Rows give medians
over every repetition and their range; comparisons add the median and range of the
per-repetition ratios, each over the rounds both rows ran. Decode tok/s counts the timed decode steps (the
prefill and its token apart); AL is tokens per target pass. llama.cpp's tools run when
built (python scripts/llama_cpp_build.py) with the same threads, cache type, context,
prompts and sampling.

--spec-type draft-simple (a -md model of the target's vocabulary, found from the file
too), ngram-simple or ngram-mod (no -md) run the same comparison for those kinds, each
engine at its default and over its settings (kinds.py): draft-simple over p-min x n-max,
ours as chain and tree; the n-gram kinds over --ngram-size x n-max. --spec-type suffix (no
-md) sweeps our n-max; llama.cpp has no suffix kind, so its n-gram kinds run at their
defaults and its best of them is the drafting row compared (no default vs default). --ignore-eos makes
every run decode -n tokens (both engines), for lengths that do not depend on where each
one's output ends.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import random
import sys
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

from .. import DflashError
from ..engine.args import add_constraint_flags, check_p_min_flags, check_sampling_flags, constraint_of, constraint_texts
from ..runtime.demo import demo_paths
from ..runtime.drafter_kinds import DRAFTERS, listed
from ..speculation.drafting import CHAIN_RULES
from ..speculation.kinds import DEFAULT_MTP_DRAFTS, DEFAULT_SIMPLE_N_MAX, SIMPLE, SPEC_TYPES, TARGET_KINDS, WEIGHTLESS
from ..tools import llama_cpp_tree
from . import arms_from, kinds, llama_cpp, method, ours, provenance, report
from .prompts import PROMPTS
from .runs import Run, Sampling

RESULTS = Path("results")
# what llama.cpp's side of a --spec-type suffix run is (its pinned version has no suffix kind)
STAND_IN = ("llama.cpp has no suffix kind: its n-gram kinds ran at their defaults, its best of them the drafting "
            "row compared (best vs best; no default vs default)")
KV_TYPES = ("f16", "bf16", "f32", "q8_0", "q4_0")
SWEEP_P_MIN = (0.0, 0.3, 0.5, 0.75)


def log(msg: str) -> None:
    print(f"[dflash-bench] {msg}", file=sys.stderr, flush=True)


def _list(kind, name: str):
    """An argparse type: a comma-separated list of `kind` (llama-bench's style)."""
    def parse(text: str):
        try:
            values = [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: a comma-separated list is expected, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{name}: empty list")
        return values
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-bench", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", help="target GGUF (default: the bundled demo pair)")
    p.add_argument("-md", "--model-draft",
                   help=f"drafter GGUF: {listed(k.title for k in DRAFTERS if not k.in_target)}, or a smaller model "
                        "of the target's vocabulary (draft-simple) (without it: plain decoding only, -m's own MTP "
                        "layer with --spec-type draft-mtp, or an n-gram kind)")
    p.add_argument("--spec-type", choices=SPEC_TYPES,
                   help="what drafts, for both engines (default: the -md GGUF's kind, draft-simple for a model "
                        "GGUF; draft-mtp drafts with -m's own MTP layer; the weightless kinds ("
                        f"{', '.join(WEIGHTLESS)}) from the prompt and output, no -md (a kind llama.cpp lacks, "
                        "suffix: llama.cpp runs its n-gram kinds instead); llama-speculative-simple runs the same "
                        "--spec-type)")
    p.add_argument("-p", "--prompt", action="append", help="a prompt (repeatable; default: the built-in prompts)")
    p.add_argument("-f", "--file", action="append", type=Path, help="a file whose text is a prompt (repeatable)")
    p.add_argument("--prompts", type=int, help=f"the first N of the {len(PROMPTS)} built-in prompts")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens per prompt at most (default 128)")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="repetitions of every prompt (default 3)")
    p.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="CPU threads for every engine (default: the CPUs this process may use)")
    p.add_argument("--modes", type=_list(str, "--modes"),
                   help="of plain, chain, tree, auto (default: all the kind runs; the n-gram kinds: plain and "
                        "chain)")
    p.add_argument("--tree-budgets", type=_list(int, "--tree-budgets"), default=[4, 8, 16, 32],
                   help="tree budgets of the tree mode (default 4,8,16,32)")
    p.add_argument("--draft-p-min", type=_list(float, "--draft-p-min"), default=list(SWEEP_P_MIN),
                   help="our chain's confidence cuts to sweep, a chain row each beside the default one (default "
                        "0,0.3,0.5,0.75)")
    p.add_argument("--block-size", type=_list(int, "--block-size"),
                   help="our chain's blocks to sweep (the bonus token and n-max drafts; default: the drafter's "
                        "block and half of it; draft-simple: n-max 2,4,6, n-gram kinds: 8,16,32)")
    p.add_argument("--ngram-size", type=_list(int, "--ngram-size"),
                   help="n-gram kinds: the lookup sizes to sweep in both engines (ngram-simple's size-n, "
                        "ngram-mod's n-match; default 4,8 and 8,16, beside the defaults 12 and 24)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="decode -n tokens in every run, past the model's end of generation (llama.cpp's tools get "
                        "--ignore-eos, which bans those tokens: outputs are compared up to our first one)")
    p.add_argument("--chain-rule", type=_list(str, "--chain-rule"), default=[],
                   help="our sampled chain's accept rule, argmax or reject; both: a chain row each (default: as "
                        "dflash-run)")
    p.add_argument("--temp", type=_list(float, "--temp"), default=[0.0, 0.6],
                   help="temperatures, 0 for greedy (default 0,0.6)")
    p.add_argument("--top-k", type=int, default=20, help="top-k of sampled runs (default 20; 0: off)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p of sampled runs (default 0.95; 1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p of sampled runs (default 0: off)")
    p.add_argument("-s", "--seed", type=int, default=1, help="seed of sampled runs' first repetition; repetition r draws with seed + r, in both engines (default 1)")
    p.add_argument("-ctk", "--cache-type-k", default="f16", choices=KV_TYPES,
                   help="attention cache type of both engines (default f16)")
    p.add_argument("--device", help="ggml device of our engine (default: the first GPU, else the CPU)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, help="target layers on the GPU, for both engines")
    p.add_argument("--reload", action="store_true",
                   help="load each of our modes' engines anew for each of its cells (memory for one model, not one "
                        "per mode; the loading is not timed; a cell's rounds then run together instead of taking "
                        "turns with the other cells)")
    p.add_argument("--min-seconds", type=float, default=method.MIN_SECONDS,
                   help="decoding time a cell's repetition must reach; its prompts run again until it does (default 1)")
    method.add_load_flags(p)
    p.add_argument("--llama-cpp", type=Path, metavar="DIR",
                   help="directory of llama.cpp's tools (default: where scripts/llama_cpp_build.py builds them)")
    p.add_argument("--no-llama-cpp", action="store_true", help="do not run llama.cpp's tools")
    p.add_argument("--spec-draft-p-min", type=_list(float, "--spec-draft-p-min"), default=list(SWEEP_P_MIN),
                   help="llama.cpp DFlash's draft cuts to sweep, a row each beside its default one (default "
                        "0,0.3,0.5,0.75)")
    p.add_argument("--spec-draft-n-max", type=_list(int, "--spec-draft-n-max"),
                   help="llama.cpp DFlash's draft counts to sweep (default: the drafter's block less the bonus token, "
                        "and half the block less it; draft-simple and n-gram kinds: as --block-size's n-max, the "
                        "n-gram kinds' as --spec-ngram-simple-size-m / --spec-ngram-mod-n-max)")
    p.add_argument("--spec-draft-vocab", type=_list(int, "--spec-draft-vocab"), default=[], metavar="N[,N...]",
                   help="draft-simple: our chain at its default n-max with the drafter's head cut to each N tokens "
                        "(a row each; dflash-run's --spec-draft-vocab)")
    p.add_argument("--spec-draft-vocab-from", action="append", default=[], metavar="PATH",
                   help="with --spec-draft-vocab: the cut keeps the tokens commonest in this text (repeatable)")
    add_constraint_flags(p)
    p.add_argument("--grammar-drafting", type=_list(str, "--grammar-drafting"), default=["on"],
                   help="under --grammar or --json-schema: on (drafts cut and filled by the grammar, as dflash-run "
                        "drafts), off (verified as drafted), or on,off (a row each; default on)")
    p.add_argument("--arms-from", type=Path, metavar="SWEEP.json",
                   help="the headline run: measure again, in a run of its own, only the arms a sweep (a plain "
                        "dflash-bench run's results file) chose: each engine's best, default and fastest rows, its "
                        "plain decoders and llama-bench; its arm settings are the sweep's, its workload must be. "
                        "It waits for an idle machine (--wait-idle), takes no --max-load above the default and no "
                        "checkout with uncommitted changes (unless --force)")
    p.add_argument("--force", action="store_true",
                   help="--arms-from: run from a checkout with uncommitted changes (recorded in the file)")
    p.add_argument("--json", action="store_true", help="print one JSON object (provenance, rows, every run)")
    p.add_argument("-o", "--output", type=Path,
                   help="also write the JSON to FILE (a bare file name goes under results/), in the form results/ "
                        "keeps: each run's text and token ids as their sha256 and length")
    p.add_argument("--keep-raw", action="store_true",
                   help="with -o: also write the whole JSON, texts and token ids too, gzipped beside it as "
                        "<name>.raw.json.gz (git ignores it)")
    return p


def check(p: argparse.ArgumentParser, args) -> None:
    if args.model_draft and not args.model:
        p.error("-md needs -m (the target its drafter was converted for)")
    for f in (args.model, args.model_draft, *(args.file or ())):
        if f and not Path(f).is_file():
            p.error(f"{f}: no such file")
    if args.n_predict < 2:
        p.error("-n must be at least 2 (the first token is the prefill's)")
    if args.repetitions < 1 or args.threads < 1:
        p.error("-r and -t must be at least 1")
    if args.prompts is not None and not 1 <= args.prompts <= len(PROMPTS):
        p.error(f"--prompts must be 1..{len(PROMPTS)}")
    unknown = set(args.modes or ()) - set(ours.MODE_NAMES)
    if unknown:
        p.error(f"unknown mode(s) {', '.join(sorted(unknown))} (of {', '.join(ours.MODE_NAMES)})")
    if any(not 1 <= b <= 63 for b in args.tree_budgets):
        p.error("tree budgets must be 1..63")
    check_sampling_flags(p, args.temp, args.top_k, args.top_p, args.min_p)
    check_p_min_flags(p, args.draft_p_min)
    if any(rule not in CHAIN_RULES for rule in args.chain_rule):
        p.error(f"--chain-rule values must be of {', '.join(CHAIN_RULES)}")
    if any(not 0 <= x <= 1 for x in args.spec_draft_p_min):
        p.error("--spec-draft-p-min values must be in [0, 1]")
    if any(b < 1 for b in args.block_size or ()) or any(n < 1 for n in args.spec_draft_n_max or ()):
        p.error("--block-size and --spec-draft-n-max values must be at least 1")
    if (args.spec_draft_vocab or args.spec_draft_vocab_from) and (args.spec_type != SIMPLE or not args.spec_draft_vocab
                                                                 or min(args.spec_draft_vocab) < 1):
        p.error("--spec-draft-vocab takes token counts of at least 1, with --spec-type draft-simple; "
                "--spec-draft-vocab-from goes with it")
    if args.ngram_size is not None and (args.spec_type not in kinds.SIZE_OPTION or any(n < 1 for n in args.ngram_size)):
        p.error(f"--ngram-size takes sizes of at least 1, with --spec-type {' or '.join(kinds.SIZE_OPTION)}")
    if args.min_seconds < 0 or args.max_load < 0 or args.wait_idle_max < 0:
        p.error("--min-seconds, --max-load and --wait-idle-max must be >= 0")
    if args.llama_cpp is not None and not args.llama_cpp.is_dir():
        p.error(f"--llama-cpp {args.llama_cpp}: no such directory")
    if not args.grammar_drafting or set(args.grammar_drafting) - {"on", "off"}:
        p.error("--grammar-drafting takes on, off or on,off")
    if args.arms_from is not None:
        if args.max_load > method.MAX_LOAD_PER_THREAD:
            p.error(f"--arms-from: a headline run waits for an idle machine (--wait-idle) instead of taking a "
                    f"--max-load above {method.MAX_LOAD_PER_THREAD}")
        if not args.arms_from.is_file():
            p.error(f"--arms-from {args.arms_from}: no such file")
    elif args.force:
        p.error("--force goes with --arms-from")
    if args.keep_raw and args.output is None:
        p.error("--keep-raw keeps the raw record beside -o FILE: give -o")


def prompts_of(p: argparse.ArgumentParser, args) -> List[tuple]:
    """(name, text) of the prompts given, else of the built-in ones."""
    given = [(f"prompt {i + 1}", text) for i, text in enumerate(args.prompt or ())]
    for f in args.file or ():
        try:
            given.append((f.name, f.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as e:
            p.error(f"{f}: {e}")
    if any(not text.strip() for _, text in given):
        p.error("a prompt is empty")
    return given or PROMPTS[: args.prompts or len(PROMPTS)]


def output_path(path: Path) -> Path:
    return RESULTS / path if path.parent == Path(".") else path


def chain_lengths(given: Optional[List[int]], block: int) -> List[int]:
    """Blocks to sweep: those given, else the drafter's whole block and half of it."""
    return given if given else list(dict.fromkeys(b for b in (block, block // 2) if b >= 2))


def pick_cells(cells: List[tuple], only: set) -> tuple:
    """The cells of `only` and their arms (ValueError: one of `only` is not among the cells)."""
    key = {(arm.side, arm.name, s.label if s else "-"): (arm, s) for arm, s in cells}
    missing = sorted(only - key.keys())
    if missing:
        raise ValueError("--arms-from: these flags and the tools found make no arm of the sweep's "
                         + "; ".join(" ".join(m) for m in missing))
    picked = [c for k, c in key.items() if k in only]
    return picked, list(dict.fromkeys(arm for arm, _ in picked))


def llama_cpp_arms(args, info: dict, setup: llama_cpp.Setup, prompts: List[tuple], mean_prompt: int,
                   kind: Optional[str], drafting: bool, block: int, their_n: Optional[list],
                   sizes: Optional[list]) -> list:
    """llama.cpp's arms beside ours: llama-bench (decoding after the prompts' mean length;
    it takes no grammar), llama-completion, and llama-speculative-simple at its settings
    for the kind (or, for suffix, its n-gram kinds standing in); the tools found and
    missing go into `info`."""
    arms: list = []
    tools = llama_cpp.Tools.find(args.llama_cpp)
    info["tools"] = {name: str(exe) for name, exe in tools.found.items()}
    info["missing"] = tools.missing
    for why in tools.missing.values():
        log(why)
    if "llama-bench" in tools.found and not setup.constraint_flags:
        arms.append(llama_cpp.BenchArm(tools.found["llama-bench"], setup, mean_prompt))
    if "llama-completion" in tools.found:
        arms.append(llama_cpp.CompletionArm(tools.found["llama-completion"], setup, prompts))
    if kind in kinds.OURS_ONLY and "llama-speculative-simple" in tools.found:
        info["stand_in"] = STAND_IN
        arms += [llama_cpp.SpeculativeArm(tools.found["llama-speculative-simple"], replace(setup, spec_type=k),
                                          prompts, None, None, stand_in=True) for k in kinds.THEIRS]
    elif kind is not None and "llama-speculative-simple" in tools.found:
        arms += [llama_cpp.SpeculativeArm(tools.found["llama-speculative-simple"], setup, prompts, p, n, size)
                 for p, n, size in kinds.their_settings(kind, args.spec_draft_p_min, their_n, sizes)]
    elif drafting and "llama-speculative-simple" in tools.found:
        exe = tools.found["llama-speculative-simple"]
        n_maxes = args.spec_draft_n_max or [b - 1 for b in chain_lengths(None, block)]
        arms.append(llama_cpp.SpeculativeArm(exe, setup, prompts, None, None))
        arms += [llama_cpp.SpeculativeArm(exe, setup, prompts, p, n) for p in args.spec_draft_p_min
                 for n in n_maxes]
    return arms


def run_cells(args, cells: list, arms: list, gate, failed: dict, keep) -> list:
    """Every repetition of every cell, taking turns (method.taking_turns); a llama.cpp arm
    that fails is recorded in `failed` and left out from then on. The names of our
    engines in the order they were loaded."""
    loads: dict = {}  # the load record of each cell of the repetition under way

    def one_round(cell: tuple, rnd: int, rep: int) -> Optional[List[Run]]:
        """A round of a cell (None: its arm failed, and is left out from now on)."""
        arm, sampling = cell
        if arm.name in failed:
            return None
        label = sampling.label if sampling else "-"
        if rnd == 0:
            loads[arm.name, label] = gate.enter(f"{arm.side} {arm.name}, {label}, rep {rep + 1}")
        try:
            got = arm.one_round(sampling, rep, rnd)
        except llama_cpp.ToolError as e:
            log(f"llama.cpp {arm.name}: {e}; its other cells are left out")
            failed[arm.name] = str(e)
            return None
        for run in got:
            run.load_1m, run.loaded = loads[arm.name, label]["load_1m"], loads[arm.name, label]["loaded"]
            keep(run)
        return got

    # our engines are loaded in an order drawn anew each run (and recorded): where an
    # engine lies in memory may change its speed (of two identical ones in one process,
    # the second loaded ran 0.998x the first by median over six processes, 0.989-1.009:
    # results/engine-order-2026-11-25.json), and a fixed order would give that to the
    # same mode every run
    loading = [a for a in arms if isinstance(a, ours.Arm)]
    random.Random(int.from_bytes(os.urandom(8), "little")).shuffle(loading)
    try:
        for arm in loading:
            arm.open()
        for rep in range(args.repetitions):
            # the cells take turns a round at a time, in an order shuffled each round
            # (--reload: a cell's rounds together, its engine loaded for them)
            for (arm, _), _, done in method.taking_turns(
                    cells, lambda cell, rnd: one_round(cell, rnd, rep), lambda runs: sum(r.decode_s for r in runs),
                    args.min_seconds, random.Random(rep), consecutive=args.reload):
                if done and args.reload and isinstance(arm, ours.Arm):
                    arm.close()
    finally:
        for arm in arms:
            if isinstance(arm, ours.Arm):
                arm.close()
    return [a.name for a in loading]


def measure(args, target: str, draft: Optional[str], prompts: List[tuple], samplings: List[Sampling],
            constraint_flags: tuple = (), only: Optional[set] = None) -> tuple:
    """Every run, every arm (ours and llama.cpp's) interleaved within each repetition
    (method.py); llama.cpp's build info; the cells' load records; the order our engines
    were loaded in. only: the (engine, mode, sampling) cells to run (arms_from.chosen),
    all of them if None."""
    from ..runtime.drafter import read_draft_metadata
    from ..runtime.tokenizer import Tokenizer

    kind = args.spec_type if args.spec_type in kinds.KINDS else None  # draft-simple, ngram-*, suffix: kinds.py's
    mtp = args.spec_type in TARGET_KINDS  # draft-mtp: the drafter is -m's own layer
    meta = read_draft_metadata(target if mtp else draft) if (draft or mtp) and kind is None else None
    drafting = meta is not None or kind is not None
    # an autoregressive drafter (EAGLE3) has no block of its own: its drafts per step, the
    # largest swept, and the bonus
    block = (int(meta["block_size"]) or max(args.spec_draft_n_max or [DEFAULT_MTP_DRAFTS]) + 1) if meta else 1
    spec_type = f"draft-{meta['kind']}" if meta else kind  # as --spec-type says (bench_main checks it)
    blocks = chain_lengths(args.block_size, block) if meta else []
    if any(b > block for b in blocks):
        raise ValueError(f"--block-size values must be at most the drafter's block ({block})")
    tokenizer = Tokenizer(target)
    ids = {name: tokenizer.encode(text) for name, text in prompts}
    lengths = [len(x) for x in ids.values()]
    longest = max(lengths)
    widest = max([block, *(b + 1 for b in args.tree_budgets)]) if meta else 1
    their_n = sizes = None  # llama.cpp's draft lengths and n-gram sizes for a kind of kinds.py
    if kind is not None:
        our_n = [b - 1 for b in args.block_size] if args.block_size else list(kinds.SWEEP_N_MAX[kind])
        their_n = args.spec_draft_n_max or list(kinds.SWEEP_N_MAX[kind])
        sizes = args.ngram_size or list(kinds.SWEEP_SIZE.get(kind, ()))
        if min(our_n) < 1:
            raise ValueError("--block-size values must be at least 2 (the bonus token and a draft)")
        longest_draft = max(our_n + their_n + [DEFAULT_SIMPLE_N_MAX if kind == SIMPLE else 64])
        widest = 2 * longest_draft + 2 if kind == SIMPLE else longest_draft + 1  # draft-simple's tree: 1 + 2 n-max
    n_ctx = -(-(longest + args.n_predict + 2 * widest + 64) // 256) * 256  # both engines get this context

    runs: List[Run] = []

    def keep(run: Run) -> None:
        runs.append(run)
        cell = run.cell
        log(f"{cell.engine} {cell.mode}, {cell.sampling}, rep {run.rep + 1}, {run.prompt or 'random tokens'}: "
            f"{run.tokens / run.decode_s if run.decode_s > 0 else 0:.1f} tok/s, AL "
            f"{run.tokens / run.passes if run.passes else 0:.2f}")

    # our engine picks the drafter's kind from its file, as spec_type says
    options = {"n_ctx": n_ctx, "n_threads": args.threads, "kv_type": args.cache_type_k, "device": args.device}
    if args.n_gpu_layers is not None:
        options["n_gpu_layers"] = args.n_gpu_layers
    if mtp or kind is not None:
        options["spec_type"] = args.spec_type
    if kind is not None:
        modes = kinds.our_modes(kind, args.modes, args.draft_p_min, our_n, sizes, args.spec_draft_vocab,
                                args.spec_draft_vocab_from)
    else:
        modes = ours.modes(args.modes, args.tree_budgets, args.draft_p_min, drafting,
                           args.chain_rule, blocks, plain_drafting=bool(constraint_flags) and "off" in args.grammar_drafting)
    if constraint_flags and "on" not in args.grammar_drafting:
        modes = [m for m in modes if not (m.speculative and m.grammar_drafting)]
    arms: list = [ours.Arm(m, target, draft, options, ids, args.n_predict, args.reload, args.ignore_eos) for m in modes]

    info: dict = {"tools": {}}
    if not args.no_llama_cpp:
        setup = llama_cpp.Setup(target, args.threads, n_ctx, args.n_predict, args.cache_type_k, draft,
                                args.n_gpu_layers, constraint_flags, spec_type or "draft-dflash", args.ignore_eos)
        arms += llama_cpp_arms(args, info, setup, prompts, round(sum(lengths) / len(lengths)), kind, drafting, block,
                               their_n, sizes)

    cells = [(arm, None) if isinstance(arm, llama_cpp.BenchArm) else (arm, s) for arm in arms
             for s in ([None] if isinstance(arm, llama_cpp.BenchArm) else samplings)]
    if only is not None:
        cells, arms = pick_cells(cells, only)
    gate = method.LoadGate.per_thread(args.max_load, args.threads, wait=args.wait_idle, cap_s=args.wait_idle_max,
                                      log=log)
    failed: dict = {}
    loading = run_cells(args, cells, arms, gate, failed, keep)
    bench = next((a for a in arms if isinstance(a, llama_cpp.BenchArm)), None)
    if bench is not None and bench.info:
        info["llama_bench"] = bench.info
    if failed:
        info["errors"] = failed
    return runs, info, gate.cells, loading


def settings_of(args, prompts: List[tuple], samplings: List[Sampling], constraint_flags: tuple) -> dict:
    """The run's settings as its results file records them."""
    return {"prompts": [name for name, _ in prompts],
            # the texts themselves, built-in, inline or from files that may be in no commit
            "prompt_sha256": {name: hashlib.sha256(text.encode("utf-8")).hexdigest() for name, text in prompts},
            "n_predict": args.n_predict,
            "repetitions": args.repetitions, "threads": args.threads, "cache_type": args.cache_type_k,
            "modes": args.modes, "tree_budgets": args.tree_budgets, "draft_p_min": args.draft_p_min,
            "block_size": args.block_size, "chain_rule": args.chain_rule,
            "samplings": [s.label for s in samplings], "reload": args.reload,
            "interleaved": "within a repetition the cells take turns "
                           + ("with their rounds together (--reload)" if args.reload else "a round at a time")
                           + ", in an order shuffled by random.Random(repetition)",
            "min_seconds": args.min_seconds, "max_load_per_thread": args.max_load,
            "load_threshold_1m": args.max_load * args.threads, "wait_idle": args.wait_idle,
            "wait_idle_max": args.wait_idle_max,
            "llama_cpp_sampler_order": llama_cpp.SAMPLER_ORDER, "spec_draft_p_min": args.spec_draft_p_min,
            "spec_draft_n_max": args.spec_draft_n_max,
            "constraint": dict(zip(constraint_flags[::2], constraint_flags[1::2])),
            "grammar_drafting": args.grammar_drafting, "spec_type": args.spec_type, "ngram_size": args.ngram_size,
            "spec_draft_vocab": args.spec_draft_vocab, "spec_draft_vocab_from": args.spec_draft_vocab_from,
            "ignore_eos": args.ignore_eos}


def headline_arms(p: argparse.ArgumentParser, args, settings: dict, models: dict) -> tuple:
    """--arms-from: (the sweep's document, the cells it chose), args set to its arm
    settings and to wait for an idle machine; an error exit for a sweep that is not one,
    a checkout with uncommitted changes (without --force) or another workload."""
    try:
        sweep = arms_from.read_sweep(args.arms_from)
    except (OSError, ValueError) as e:
        p.error(str(e))
    arms_from.apply(args, sweep)
    args.wait_idle = True
    where = provenance.checkout()
    if where and where["uncommitted_changes"] and not args.force:
        p.error(f"--arms-from: {where['path']} has uncommitted changes; a headline run measures a commit "
                "(--force runs it anyway, recorded in the file)")
    if where and where["untracked"]:
        log(f"untracked files in {where['path']} (recorded in the file): {', '.join(where['untracked'])}")
    differ = arms_from.mismatches(sweep, settings, models)
    if differ:
        p.error(f"--arms-from {args.arms_from}: another workload than the sweep's: " + "; ".join(differ))
    return sweep, arms_from.chosen(sweep["rows"])


def check_kind(p: argparse.ArgumentParser, spec_type: Optional[str], target: str, draft: Optional[str]) -> str:
    """The kind both engines draft with: --spec-type checked against the files as our
    engine checks it (config.resolve_spec_types: -md missing, a drafter file given to
    draft-simple, -md given to an n-gram kind), else the -md file's own; draft-simple's
    vocabulary checked against the target's. An error exit says what is wrong."""
    from ..engine.setup import resolve_spec_types
    from ..runtime.errors import ConfigError
    from ..speculation.draft_simple import vocab_difference

    try:
        (kind,) = resolve_spec_types(spec_type, target, draft)
    except ConfigError as e:
        p.error(str(e))
    if kind == SIMPLE:
        why = vocab_difference(target, draft)
        if why is not None:
            p.error(f"--spec-type {SIMPLE}: -md {draft} does not share the vocabulary of -m {target}: {why}")
    return kind


def bench_main(argv) -> int:
    p = parser()
    args = p.parse_args(argv)
    check(p, args)
    target, draft = (args.model, args.model_draft) if args.model else demo_paths()
    if args.spec_type in TARGET_KINDS and args.model_draft:
        p.error(f"--spec-type {args.spec_type} drafts with {TARGET_KINDS[args.spec_type].what} of -m itself; "
                f"drop -md {args.model_draft}")
    if args.spec_type in TARGET_KINDS and not args.model:
        target, draft = demo_paths()[0], None  # the demo target's own MTP head
    if args.spec_type in WEIGHTLESS and not args.model:
        target, draft = demo_paths()[0], None  # the demo target, drafting from its own history
    if args.spec_type == SIMPLE and not args.model:
        p.error(f"--spec-type {SIMPLE} needs -m and -md: a target and a smaller model of its vocabulary")
    if args.spec_type in kinds.KINDS or (args.spec_type is None and draft):
        args.spec_type = check_kind(p, args.spec_type, target, draft)
    if args.spec_type and args.spec_type not in (*TARGET_KINDS, *kinds.KINDS) and draft:
        from ..runtime.drafter import read_draft_metadata

        try:
            kind = f"draft-{read_draft_metadata(draft)['kind']}"
        except ValueError as e:
            p.error(str(e))
        if kind != args.spec_type:
            p.error(f"--spec-type {args.spec_type}: -md {draft} is a {kind[6:]} drafter (--spec-type {kind})")
    prompts = prompts_of(p, args)
    texts = constraint_texts(args, "dflash-bench")
    constraint = constraint_of(args, "dflash-bench")
    constraint_flags = tuple(f for flag, text in (("--grammar", texts["--grammar"]),
                                                  ("--json-schema", texts["-j/--json-schema"]))
                             if text is not None for f in (flag, text))
    samplings = [Sampling(t, args.top_k, args.top_p, args.min_p, args.seed, constraint) if t > 0
                 else Sampling(constraint=constraint) for t in dict.fromkeys(args.temp)]
    models = {"target": str(Path(target).resolve()), "draft": str(Path(draft).resolve()) if draft else None,
              "demo": args.model is None}
    if args.modes is not None and args.spec_type in kinds.KINDS and kinds.unsupported(args.spec_type, args.modes):
        p.error(f"--modes {','.join(kinds.unsupported(args.spec_type, args.modes))}: not run by --spec-type "
                f"{args.spec_type} (it runs {', '.join(kinds.MODES[args.spec_type])})")
    if args.modes is None:
        args.modes = list(kinds.MODES[args.spec_type] if args.spec_type in kinds.KINDS else ours.MODE_NAMES)
    sweep, only = None, None
    if args.arms_from is not None:
        sweep, only = headline_arms(p, args, settings_of(args, prompts, samplings, constraint_flags), models)

    started, load_before = _dt.datetime.now(_dt.timezone.utc), provenance.load_average()
    log(f"load average {load_before[0]:.2f} on {os.cpu_count()} CPUs"
        + (": other processes are running, timings will show it" if load_before[0] > 0.5 else ""))
    try:
        runs, llama_info, cells, load_order = measure(args, target, draft, prompts, samplings, constraint_flags, only)
    except (DflashError, ValueError, OSError) as e:
        print(f"dflash-bench: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dflash-bench: interrupted", file=sys.stderr)
        return 130
    load_after = provenance.load_average()

    table = report.rows(runs)
    devices = sorted({r.extra["device"] for r in runs if "device" in r.extra})
    result = {
        "tool": "dflash-bench", "kind": "headline" if sweep else "sweep",
        **({"arms_from": arms_from.record(args.arms_from, sweep, only), "force": args.force} if sweep else {}),
        "started": started.isoformat(timespec="seconds"),
        "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "checkout": provenance.checkout(), "versions": provenance.versions(),
        "llama_cpp": {**llama_info, "sources": str(llama_cpp_tree.sdist_dir())},
        "machine": provenance.machine(args.threads, ", ".join(devices)),
        "load_average": {"before": load_before, "after": load_after},
        "models": models,
        "settings": {**settings_of(args, prompts, samplings, constraint_flags), "load_order": load_order},
        "cells": cells,
        "rows": [r.to_json() for r in table],
        "comparisons": report.each_sampling(table, report.comparisons),
        "auto_comparisons": report.each_sampling(table, report.auto_comparisons),
        "headline": report.headline(table),
        "peer_reruns": llama_cpp.peer_reruns(runs),
        "runs": [r.to_json() for r in runs],
    }
    if args.output is not None:
        path = output_path(args.output)
        raw = provenance.write_results(path, result, keep_raw=args.keep_raw)
        log(f"wrote {path}" + (f" and {raw}" if raw else ""))
    if args.json:
        print(json.dumps(result))
        return 0
    machine = result["machine"]
    kind = f"headline, the arms {args.arms_from} chose" if sweep else "sweep: every setting of both engines"
    print(f"dflash-bench ({kind}): {Path(target).name} + {Path(draft).name if draft else 'no drafter'}"
          f"{' (the bundled demo pair)' if args.model is None else ''}; {len(prompts)} prompts x at most "
          f"{args.n_predict} tokens, {args.repetitions} reps; {args.threads} threads on {machine['cpu']} "
          f"({result['machine']['device']}); load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
          f"{sum(c['loaded'] for c in cells)} of {len(cells)} cells started above {args.max_load * args.threads:.2f}")
    print()
    print(report.table_text(table, args.repetitions))
    print()
    print(report.comparisons_text(table))
    if "stand_in" in llama_info:
        print(f"({llama_info['stand_in']})")
    if report.auto_text(table):
        print()
        print(report.auto_text(table))
    return 0


SUBCOMMANDS = {"serve": "dflash_gguf.bench.serving.serve", "soak": "dflash_gguf.bench.serving.soak",
               "concurrency": "dflash_gguf.bench.serving.concurrency", "workload": "dflash_gguf.bench.serving.multiturn",
               "workload-from-log": "dflash_gguf.bench.serving.workload"}


def main(argv=None) -> int:
    """dflash-bench [flags] measures a pair; dflash-bench serve|soak|concurrency [flags]
    measure and soak the server, dflash-bench workload [FILE] replays multi-turn sessions
    through it and workload-from-log makes such a FILE from logged requests (their
    modules' main)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # auto starts from what this process learns only, so that a run does not depend on
    # what ran before it (auto_store); DFLASH_AUTO_MEMORY=PATH measures a remembering one
    os.environ.setdefault("DFLASH_AUTO_MEMORY", "off")
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    return bench_main(argv)
