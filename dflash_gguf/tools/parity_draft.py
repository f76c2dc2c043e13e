"""A drafter tensor by tensor against llama.cpp's: where does it first differ?

    python -m dflash_gguf.tools.parity_draft -m target.gguf -md draft.gguf --spec-type draft-dflash -p "def f(x):"
    python -m dflash_gguf.tools.parity_draft -m target.gguf --spec-type draft-mtp -p "def f(x):"   # its MTP layer

llama.cpp prints no drafter's tensors with its own tools, so this runs ours beside it:
`dflash-draft-eval` (scripts/llama-cpp-tools/, built by `scripts/llama_cpp_build.py
dflash-draft-eval`) sets up the pair as llama-speculative-simple does and prints, as
llama-eval-callback does, every named tensor of the drafter's graphs while it runs what our
engine runs before its first verify: the prompt through the target, the drafter fed it
(the "prompt" phase: a DFlash drafter's keys and values of the target's features, an
EAGLE3 drafter's encoder), the target's greedy token, and one draft from that token (the
"draft" phase). Our engine runs the same tokens with the same drafter, dumping its first
drafter graph of each phase (DFLASH_DUMP_DRAFT_FILE, csrc/dfl_dump.h) by the names that
llama.cpp's first graph of that phase prints and no earlier phase does. Each phase is
compared as dflash_gguf.tools.parity compares a target (the printed elements, its tolerance).

Both sides run the caches in f32 and llama.cpp without flash attention, as the token-level
oracle of the drafters does (tests/helpers/speculative_simple.py): those are the settings
in which llama.cpp's drafts are the same as ours.
"""
from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Optional

from . import llama_cpp_tree
from .parity import (ATOL, RTOL, Printed, by_name, compare, dump_env, parse_eval_callback, read_dump_tensors,
                     run_printer, summary as target_summary)

TOOL = "dflash-draft-eval"
PHASES = ("prompt", "draft")
_MARKER = re.compile(r"^dflash_draft_eval: phase (\w+)\s*$", re.M)
_FIRST = re.compile(r"^dflash_draft_eval: first token (-?\d+)", re.M)
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
# the settings under which llama.cpp drafts as ours does: f32 caches, no flash attention
EXACT = ["-ctk", "f32", "-ctv", "f32", "-ctkd", "f32", "-ctvd", "f32", "-fa", "off"]
# where our rows sit a row later than llama.cpp's: our EAGLE3 encoder writes the target's
# features of position P at row P + 1 (the row that reads them, token P + 1's), and a zero
# row first; llama.cpp's at row P
ROW_SHIFT = {"draft-eagle3": {"fc_out": 1}}


def llama_draft_log(target, draft: Optional[str], spec_type: str, prompt: str, n_max: int, threads: int,
                    n_ctx: int = 512, tool: Optional[Path] = None) -> str:
    """One run of dflash-draft-eval: its log (stdout and stderr)."""
    proc = run_printer(TOOL, ["-m", str(target), *(["-md", str(draft)] if draft else []), "--spec-type", spec_type,
                              "--spec-draft-n-max", str(n_max), "--spec-draft-p-min", "0", "-t", str(threads),
                              "-c", str(n_ctx), *EXACT, "-p", prompt], tool)
    if proc.returncode != 0:
        if "layer input tensor is null" in proc.stderr:
            # src/models/<arch>.cpp of llama.cpp records no layer inputs (qwen2, gemma3 in this version)
            raise RuntimeError(f"llama.cpp cannot run this pair: its graph of {Path(target).name}'s architecture "
                               "gives a drafter no layer inputs (the target's features)")
        raise RuntimeError(f"{TOOL} failed ({proc.returncode}): " + proc.stderr.strip()[-2000:])
    return proc.stderr + "\n" + proc.stdout


def steps(tensors: list, end: str, name=lambda t: t.name) -> list[list]:
    """Tensors cut into drafted tokens' steps, each ending at the name `end` (the head's
    output): llama.cpp runs a graph per drafted token, ours may run several in one graph
    and catch the drafter up in it first; the log marks neither. What follows the last
    `end` (a step whose output was not needed) is left out."""
    out, cur = [], []
    for t in tensors:
        cur.append(t)
        if name(t) == end:
            out.append(cur)
            cur = []
    return out


def llama_phases(log: str) -> tuple[list[int], int, dict[str, list[Printed]]]:
    """The prompt tokens, the target's first token and each phase's printed tensors."""
    marks = list(_MARKER.finditer(log))
    first = _FIRST.search(log)
    tokens, _ = parse_eval_callback(log[:marks[0].start()] if marks else log)
    if [m.group(1) for m in marks] != list(PHASES) or not tokens or first is None:
        raise RuntimeError(f"{TOOL}'s log lacks its prompt tokens or phase lines (was it cut short?)")
    phases = {m.group(1): parse_eval_callback(log[m.end():end])[1]
              for m, end in zip(marks, [*(n.start() for n in marks[1:]), len(log)])}
    return tokens, int(first.group(1)), phases


def dump_pattern(names) -> str:
    """An anchored extended regex matching exactly these names."""
    return "^(" + "|".join(re.escape(n) for n in sorted(names)) + ")$"


def dump_graph(target, draft: Optional[str], spec_type: str, tokens: list[int], names, n_max: int, threads: int,
               skip: int = 0, n_ctx: int = 512) -> tuple[list[dict], list[int]]:
    """Our drafter's first graph holding one of `names` after `skip` such graphs, its
    tensors in order of computation, and the tokens the run generated (dumping changes
    no token)."""
    from ..engine.engine import Engine

    with tempfile.TemporaryDirectory(prefix="dflash-draft-parity-") as tmp:
        path = Path(tmp) / "dump.bin"
        with dump_env(dump_pattern(names), path, "DFLASH_DUMP_DRAFT_FILE", skip), \
                Engine(str(target), draft, n_ctx=n_ctx, n_threads=threads, kv_type="f32", spec_type=spec_type,
                       spec_draft_n_max=n_max, draft_p_min=0.0) as engine:
            generated = engine.generate(tokens, n_max + 2, stop_tokens=()).tokens
        return (read_dump_tensors(path) if path.is_file() else []), list(generated)


def draft_parity(target, draft: Optional[str], spec_type: str, prompt: str, n_max: int = 7, threads: int = 2,
                 atol: float = ATOL, rtol: float = RTOL, tool: Optional[Path] = None,
                 our_tokens: Optional[list[int]] = None) -> dict:
    """Both drafters compared, phase by phase: the prompt phase, then each drafted
    token's graph ("draft 1", "draft 2", ...); the first divergence is the first tensor
    past tolerance in that order.

    Our first drafter graph with a name llama.cpp printed is its prompt phase's pair when
    some of them pair in shape (it stores the prompt's keys and values); our draft graph
    is then the next graph with a name of the draft phase (the first, when the prompt's
    graph has none of them), else that first graph itself. Both sides' draft graphs are
    cut into drafted tokens' steps (steps()), paired in order. our_tokens: feed our side
    other tokens than llama.cpp's (a deliberate perturbation, to test that a divergence
    is found)."""
    tokens, first, theirs = llama_phases(llama_draft_log(target, draft, spec_type, prompt, n_max, threads,
                                                         tool=tool))
    names = {phase: {t.name for t in tensors if _SAFE_NAME.match(t.name) and not t.name.startswith("node_")}
             for phase, tensors in theirs.items()}
    if not names["prompt"] | names["draft"]:
        raise RuntimeError(f"{TOOL} printed no named tensor of the drafter")
    shift = ROW_SHIFT.get(spec_type)
    fed = list(tokens if our_tokens is None else our_tokens)
    dumped, generated = dump_graph(target, draft, spec_type, fed, names["prompt"] | names["draft"], n_max, threads)
    ours_first = by_name(dumped)
    phases = {"prompt": compare(ours_first, theirs["prompt"], atol, rtol, shift)}
    if phases["prompt"]["n_compared"]:
        skip = 1 if names["draft"] & set(ours_first) else 0
        dumped, _ = dump_graph(target, draft, spec_type, fed, names["draft"], n_max, threads, skip=skip)
    # a step ends at the last name both sides compute (the head's output)
    end = next((t.name for t in reversed(theirs["draft"]) if any(o["name"] == t.name for o in dumped)), None)
    ours_steps = steps(dumped, end, name=lambda t: t["name"])
    for k, (ours, graph) in enumerate(zip(ours_steps, steps(theirs["draft"], end)), 1):
        phases[f"draft {k}"] = compare(by_name(ours), graph, atol, rtol, shift)
    firsts = [f"{p}: {r['first_divergence']}" for p, r in phases.items() if r["first_divergence"]]
    return {"target": str(target), "draft": draft, "spec_type": spec_type, "prompt": prompt, "tokens": tokens,
            "our_tokens": None if our_tokens is None else fed, "n_max": n_max, "threads": threads, "tool": str(tool or llama_cpp_tree.tool(TOOL)),
            "first_token_llama": first, "first_token_ours": generated[0] if generated else None,
            "atol": atol, "rtol": rtol, "phases": phases, "first_divergence": next(iter(firsts), None),
            "n_compared": sum(r["n_compared"] for r in phases.values())}


def summary(result: dict) -> str:
    lines = []
    for phase, r in result["phases"].items():
        lines.append(f"-- {phase} phase --")
        lines.append(target_summary({**r, "truncated": False}))
    lines.append(f"first token: llama.cpp {result['first_token_llama']}, ours {result['first_token_ours']}; "
                 f"{result['n_compared']} drafter tensors compared; first divergence: "
                 f"{result['first_divergence'] or 'none'}")
    return "\n".join(lines)


def to_json(result: dict) -> str:
    """The result as JSON (summaries per tensor, no values)."""
    return json.dumps(result, indent=1) + "\n"


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True, help="the target GGUF")
    p.add_argument("-md", "--model-draft", help="the drafter GGUF (DFlash, DSpark, EAGLE3); none for draft-mtp")
    p.add_argument("--spec-type", required=True, help="draft-dflash, draft-dspark, draft-eagle3 or draft-mtp")
    p.add_argument("--spec-draft-n-max", type=int, default=7, help="tokens per draft (default 7)")
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--atol", type=float, default=ATOL)
    p.add_argument("--rtol", type=float, default=RTOL)
    p.add_argument("--out", help="write the result (summaries, no values) as JSON here")
    args = p.parse_args(argv)
    for path in filter(None, (args.model, args.model_draft)):
        if not Path(path).is_file():
            p.error(f"no such file: {path}")
    if args.spec_draft_n_max < 1:
        p.error("--spec-draft-n-max must be 1 or more")
    try:
        result = draft_parity(args.model, args.model_draft, args.spec_type, args.prompt, args.spec_draft_n_max,
                              args.threads, args.atol, args.rtol)
    except (FileNotFoundError, RuntimeError, ValueError) as e:  # DflashError and ConfigError among them
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary(result))
    if args.out:
        Path(args.out).write_text(to_json(result))
    return 1 if result["first_divergence"] else 0


if __name__ == "__main__":
    sys.exit(main())
