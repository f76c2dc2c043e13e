"""From runs to rows: per repetition, a row's decode tok/s is all its prompts' timed tokens
over their decode seconds and its AL their tokens over their target passes; a row reports
the median and the spread over repetitions, its ratios to the plain decoders run with the
same sampling, and (greedy) how many prompts gave the plain decoder's output."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from .runs import Run
from .stats import Spread, ratio

OURS_PLAIN = ("ours", "plain")
LLAMA_PLAIN = ("llama.cpp", "plain (llama-completion)")


@dataclass
class Row:
    engine: str
    mode: str
    sampling: str
    tok_s: Optional[Spread]
    al: Optional[Spread]
    same: Optional[tuple] = None           # (prompts with the plain decoder's output, prompts compared)
    vs_ours_plain: Optional[float] = None
    vs_llama_plain: Optional[float] = None
    note: str = ""

    def to_json(self) -> dict:
        return {"engine": self.engine, "mode": self.mode, "sampling": self.sampling,
                "decode_tok_s": self.tok_s.to_json() if self.tok_s else None,
                "al": self.al.to_json() if self.al else None, "same_output": list(self.same) if self.same else None,
                "vs_ours_plain": self.vs_ours_plain, "vs_llama_cpp_plain": self.vs_llama_plain, "note": self.note}


def per_rep(runs: Sequence[Run]) -> tuple:
    """(tok/s, AL) Spreads over the repetitions of one row."""
    reps = defaultdict(list)
    for r in runs:
        reps[r.rep].append(r)
    tps, al = [], []
    for rs in reps.values():
        seconds, tokens, passes = sum(r.decode_s for r in rs), sum(r.tokens for r in rs), sum(r.passes for r in rs)
        tps.append(tokens / seconds if seconds > 0 else None)
        al.append(tokens / passes if passes > 0 else None)
    return Spread.of(tps), Spread.of(al)


def same_text(theirs: Optional[str], plain: Run) -> bool:
    """llama.cpp's text is our plain decoder's; where ours stopped at -n tokens it may go on
    (llama-speculative-simple finishes its last drafted block past -n)."""
    if theirs is None:
        return False
    ours = plain.text.rstrip()
    return theirs.rstrip() == ours or (plain.extra.get("stop_reason") == "length" and theirs.startswith(ours))


def same_output(runs: Sequence[Run], plain: Sequence[Run]) -> Optional[tuple]:
    """Prompts of the first repetition whose output is the plain decoder's: token ids for
    ours, text for llama.cpp (whose tools print text)."""
    ref = {r.prompt: r for r in plain if r.rep == 0}
    pairs = [(r, ref[r.prompt]) for r in runs if r.rep == 0 and r.prompt in ref]
    if not pairs:
        return None
    if runs[0].engine == "ours":
        same = [r.token_ids == p.token_ids for r, p in pairs]
    else:
        same = [same_text(r.text, p) for r, p in pairs]
    return sum(same), len(same)


def note(runs: Sequence[Run]) -> str:
    steps = sum(r.extra.get("tree_steps", 0) for r in runs)
    if not steps:
        return ""
    nodes = sum(r.extra["tree_nodes_mean"] * r.extra["tree_steps"] for r in runs if r.extra.get("tree_steps"))
    chain = sum(r.extra.get("chain_steps", 0) for r in runs)  # steps `auto` verified the chain (counted in steps)
    text = f"{nodes / steps:.1f} nodes below the root a step"
    return text + (f"; the chain on {chain} of {steps} steps" if chain else "")


def rows(runs: Sequence[Run]) -> List[Row]:
    grouped: Dict[tuple, List[Run]] = defaultdict(list)
    for r in runs:
        grouped[r.row].append(r)
    out = []
    for (engine, mode, sampling), rs in grouped.items():
        tps, al = per_rep(rs)
        out.append(Row(engine, mode, sampling, tps, al, note=note(rs)))
    by = {(r.engine, r.mode, r.sampling): r for r in out}
    for row in out:
        ours_plain, llama_plain = by.get((*OURS_PLAIN, row.sampling)), by.get((*LLAMA_PLAIN, row.sampling))
        row.vs_ours_plain = ratio(row.tok_s, ours_plain.tok_s) if ours_plain else None
        row.vs_llama_plain = ratio(row.tok_s, llama_plain.tok_s) if llama_plain else None
        if row.sampling == "greedy" and ours_plain and (row.engine, row.mode) != OURS_PLAIN:
            row.same = same_output(grouped[(row.engine, row.mode, row.sampling)],
                                   grouped[(*OURS_PLAIN, row.sampling)])
    return out


def headline(table: Sequence[Row]) -> List[str]:
    """Per sampling: our fastest speculative mode against llama.cpp's fastest DFlash run."""
    lines = []
    for sampling in dict.fromkeys(r.sampling for r in table):
        ours = [r for r in table if r.sampling == sampling and r.engine == "ours" and r.mode != "plain" and r.tok_s]
        theirs = [r for r in table if r.sampling == sampling and r.mode.startswith("DFlash") and r.tok_s]
        if ours and theirs:
            a, b = max(ours, key=lambda r: r.tok_s.median), max(theirs, key=lambda r: r.tok_s.median)
            lines.append(f"{sampling}: ours {a.mode} {a.tok_s.median:.1f} tok/s (AL {a.al.median:.2f}) / llama.cpp "
                         f"{b.mode} {b.tok_s.median:.1f} tok/s (AL {b.al.median:.2f}) = "
                         f"{ratio(a.tok_s, b.tok_s):.2f}x")
    return lines


def _x(v: Optional[float]) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def table_text(table: Sequence[Row], reps: int) -> str:
    lines = [f"| engine | mode | sampling | AL | decode tok/s, median [min-max] of {reps} reps | vs ours plain | "
             "vs llama.cpp plain | same output | notes |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in table:
        same = f"{r.same[0]}/{r.same[1]}" if r.same else "-"
        lines.append(f"| {r.engine} | {r.mode} | {r.sampling} | {r.al.text('.2f') if r.al else '-'} | "
                     f"{r.tok_s.text() if r.tok_s else '-'} | {_x(r.vs_ours_plain)} | {_x(r.vs_llama_plain)} | "
                     f"{same} | {r.note} |")
    return "\n".join(lines)
