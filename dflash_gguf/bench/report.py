"""From runs to rows: per repetition, a row's decode tok/s is all its prompts' timed tokens
(every round) over their decode seconds and its AL their tokens over their target passes;
a row reports the median and the range (min-max) over every repetition, never the best
one, its ratios of medians to the plain decoders run with the same sampling, (greedy) how
many prompts gave the plain decoder's output, the load its cells started at, and whether
it is its side's default or best setting. Comparisons pit each side's best against the
other's best and default against default (method.pairings)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from statistics import median
from typing import Dict, List, Optional, Sequence

from ..speculation.auto import describe
from . import method, slim
from .runs import OURS_PLAIN, Cell, Run
from .stats import Spread, ratio, verdict

LLAMA_PLAIN = ("llama.cpp", "plain (llama-completion)")
NO_SAMPLING = "-"  # llama-bench's rows: random tokens, no sampling


@dataclass
class Row:
    cell: Cell  # its runs' (engine, mode, sampling) and what the mode is
    tok_s: Optional[Spread]
    al: Optional[Spread]
    same: Optional[tuple] = None           # (prompts with the plain decoder's output, prompts compared)
    vs_ours_plain: Optional[float] = None
    vs_llama_plain: Optional[float] = None
    note: str = ""
    rep_tok_s: Dict[int, Optional[float]] = field(default_factory=dict)  # each repetition's tok/s
    rounds: method.Rounds = field(default_factory=dict)  # each repetition's (tokens, decode seconds) by round
    load_1m: List[Optional[float]] = field(default_factory=list)      # each repetition's cell's load at its start
    loaded: bool = False           # some repetition started above the load threshold
    best: bool = False             # its side's fastest drafting row (median tok/s) with this sampling
    auto: Optional[dict] = None    # `auto`'s choices and its cost model's figures per arm (auto_summary)

    def role(self) -> str:
        return ", ".join(w for w, on in (("default", self.cell.default), ("best", self.best)) if on)

    def to_json(self) -> dict:
        return {"engine": self.cell.engine, "mode": self.cell.mode, "sampling": self.cell.sampling,
                "decode_tok_s": self.tok_s.to_json() if self.tok_s else None,
                "decode_tok_s_per_rep": [self.rep_tok_s[k] for k in sorted(self.rep_tok_s)],
                "al": self.al.to_json() if self.al else None, "same_output": list(self.same) if self.same else None,
                "vs_ours_plain": self.vs_ours_plain, "vs_llama_cpp_plain": self.vs_llama_plain,
                "load_1m_at_start": self.load_1m, "loaded": self.loaded, "default": self.cell.default,
                "best": self.best, "auto": self.auto, "note": self.note}


def per_rep(runs: Sequence[Run]) -> tuple:
    """(tok/s, AL) Spreads over the repetitions of one row, {rep: tok/s}, each
    repetition's load at its start, and its rounds (method.Rounds)."""
    reps = defaultdict(list)
    for r in runs:
        reps[r.rep].append(r)
    tps, al, loads, rounds = {}, [], [], {}
    for rep in sorted(reps):
        rs = reps[rep]
        seconds, tokens, passes = sum(r.decode_s for r in rs), sum(r.tokens for r in rs), sum(r.passes for r in rs)
        tps[rep] = tokens / seconds if seconds > 0 else None
        al.append(tokens / passes if passes > 0 else None)
        loads.append(rs[0].load_1m)
        by_round = defaultdict(lambda: [0.0, 0.0])
        for r in rs:
            by_round[r.round][0] += r.tokens
            by_round[r.round][1] += r.decode_s
        rounds[rep] = [tuple(by_round[k]) for k in sorted(by_round)]
    return Spread.of(tps.values()), Spread.of(al), tps, loads, rounds


def same_text(theirs, plain: Run) -> bool:
    """llama.cpp's text is our plain decoder's; where ours stopped at -n tokens it may go on
    (llama-speculative-simple finishes its last drafted block past -n). Texts raw or, from
    a slim results file, as digests (slim.py): compared by the hashes of either."""
    ours, theirs_key = slim.text_key(plain.text), slim.text_key(theirs)
    if ours is None or theirs_key is None:
        return False
    return theirs_key == ours or (plain.extra.get("stop_reason") == "length"
                                  and slim.text_prefix_key(theirs, ours[1]) == ours[0])


def same_output(runs: Sequence[Run], plain: Sequence[Run]) -> Optional[tuple]:
    """Prompts of the first repetition whose output is the plain decoder's: token ids for
    ours, text for llama.cpp (whose tools print text)."""
    ref = {r.prompt: r for r in plain if r.rep == 0 and r.round == 0}
    pairs = [(r, ref[r.prompt]) for r in runs if r.rep == 0 and r.round == 0 and r.prompt in ref]
    if not pairs:
        return None
    if runs[0].cell.engine == "ours":
        same = [slim.ids_key(r.token_ids) == slim.ids_key(p.token_ids) for r, p in pairs]
    else:
        same = [same_text(r.text, p) for r, p in pairs]
    return sum(same), len(same)


def auto_summary(runs: Sequence[Run]) -> Optional[dict]:
    """`auto`'s choices over a row's runs: per arm the steps that ran it and the tokens a
    step they made, beside its cost model's expected tokens and milliseconds a step (the
    median over the runs' reports, each taken as its request ended)."""
    reports = [r.extra["auto"] for r in runs if r.extra.get("auto")]
    if not reports:
        return None
    arms = {}
    for name in reports[0]["arms"]:
        each = [rep["arms"][name] for rep in reports]
        steps = sum(a["steps"] for a in each)
        made = sum(a["tokens_per_step"] * a["steps"] for a in each if a["steps"])
        model = {k: [a[k] for a in each if a[k] is not None] for k in ("expected_tokens", "expected_ms")}
        arms[name] = {"steps": steps, "tokens_per_step": made / steps if steps else None,
                      **{k: median(v) if v else None for k, v in model.items()}}
    return {"arms": arms}


def note(runs: Sequence[Run]) -> str:
    summary = auto_summary(runs)
    if summary is not None:
        return "auto: " + describe(summary)
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
        grouped[r.cell.key].append(r)
    out = []
    for rs in grouped.values():
        tps, al, rep_tps, loads, rounds = per_rep(rs)
        out.append(Row(rs[0].cell, tps, al, note=note(rs), rep_tok_s=rep_tps, rounds=rounds, load_1m=loads,
                       loaded=any(r.loaded for r in rs), auto=auto_summary(rs)))
    by = {r.cell.key: r for r in out}
    for row in out:
        sampling = row.cell.sampling
        ours_plain, llama_plain = by.get((*OURS_PLAIN, sampling)), by.get((*LLAMA_PLAIN, sampling))
        row.vs_ours_plain = ratio(row.tok_s, ours_plain.tok_s) if ours_plain else None
        row.vs_llama_plain = ratio(row.tok_s, llama_plain.tok_s) if llama_plain else None
        if sampling == "greedy" and ours_plain and (row.cell.engine, row.cell.mode) != OURS_PLAIN:
            row.same = same_output(grouped[row.cell.key], grouped[(*OURS_PLAIN, sampling)])
    for engine, sampling in {(r.cell.engine, r.cell.sampling) for r in out}:
        best = method.pick(drafting(out, engine, sampling), _median, lambda r: r.cell.default)["best"]
        if best is not None:
            best.best = True
    return out


def _median(row: Row) -> Optional[float]:
    return row.tok_s.median if row.tok_s else None


def _rounds(row: Row) -> method.Rounds:
    return row.rounds


def drafting(table: Sequence[Row], engine: str, sampling: str) -> List[Row]:
    return [r for r in table if r.cell.engine == engine and r.cell.sampling == sampling and r.cell.speculative]


def comparisons(table: Sequence[Row], sampling: str) -> List[dict]:
    """Ours against llama.cpp with one sampling: each side's fastest row of any mode
    (what a user who tried every setting would run; llama.cpp's includes llama-bench, its
    plain decoding's own figure, whose random tokens have no sampling: a row of every
    sampling's), drafting best vs best and default vs default, and plain decoding
    against llama-completion."""
    fastest = method.pairings([r for r in table if r.cell.engine == "ours" and r.cell.sampling == sampling],
                              [r for r in table if r.cell.engine == "llama.cpp"
                               and r.cell.sampling in (sampling, NO_SAMPLING)],
                              _median, _rounds, lambda r: False)
    for p in fastest:
        p.name = "fastest vs fastest"
    pairs = fastest + method.pairings(drafting(table, "ours", sampling), drafting(table, "llama.cpp", sampling),
                                      _median, _rounds, lambda r: r.cell.default)
    by = {r.cell.key: r for r in table}
    ours_plain, llama_plain = by.get((*OURS_PLAIN, sampling)), by.get((*LLAMA_PLAIN, sampling))
    if ours_plain and llama_plain:
        pairs += method.pairings([ours_plain], [llama_plain], _median, _rounds, lambda r: True)[:1]
        pairs[-1].name = "plain vs plain"
    return [{"sampling": sampling, "pairing": p.name, "ours": p.ours.cell.mode, "llama_cpp": p.theirs.cell.mode,
             "ours_tok_s_median": _median(p.ours), "llama_cpp_tok_s_median": _median(p.theirs),
             "ours_tok_s_range": _span(p.ours), "llama_cpp_tok_s_range": _span(p.theirs),
             **_ratios(p), "loaded": p.ours.loaded or p.theirs.loaded} for p in pairs]


def _span(row: Row) -> Optional[list]:
    return [row.tok_s.low, row.tok_s.high] if row.tok_s else None


def _ratios(p: method.Pairing) -> dict:
    """A pairing's ratio of medians, its per-repetition ratios' median, range and count,
    and what they say (stats.verdict)."""
    return {"ratio_of_medians": p.ratio, "per_rep_ratio_median": p.paired_median,
            "per_rep_ratio_range": list(p.paired) if p.paired else None, "per_rep_ratio_n": len(p.per_rep),
            "verdict": verdict(p.ratio, p.per_rep)}


def auto_comparisons(table: Sequence[Row], sampling: str) -> List[dict]:
    """Our auto row against each of our fixed rows (plain and every drafting setting) with
    one sampling, the fastest by median first: auto's bar is the fastest fixed arm."""
    ours = [r for r in table if r.cell.engine == "ours" and r.cell.sampling == sampling]
    auto = next((r for r in ours if r.cell.mode == "auto"), None)
    if auto is None or auto.tok_s is None:
        return []
    out = []
    for fixed in sorted((r for r in ours if r is not auto and r.tok_s), key=_median, reverse=True):
        p = method.pairings([auto], [fixed], _median, _rounds, lambda r: True)[0]
        out.append({"sampling": sampling, "fixed": fixed.cell.mode, "auto_tok_s_median": _median(auto),
                    "fixed_tok_s_median": _median(fixed), "auto_tok_s_range": _span(auto),
                    "fixed_tok_s_range": _span(fixed), **_ratios(p), "loaded": auto.loaded or fixed.loaded})
    return out


def _paired_text(c: dict) -> str:
    span = c["per_rep_ratio_range"]
    return (f"{c['ratio_of_medians']:.2f}x (median over median"
            + (f"; per repetition median {c['per_rep_ratio_median']:.3f}x, {span[0]:.2f}-{span[1]:.2f}x over "
               f"{c['per_rep_ratio_n']}" if span else "")
            + ")" + (f": {c['verdict']}" if c["verdict"] else "") + (" [loaded]" if c["loaded"] else ""))


def _tok_s(median: Optional[float], span: Optional[list]) -> str:
    """A median decode tok/s beside its per-repetition range."""
    if median is None:
        return "-"
    return f"{median:.1f}" + (f" [{span[0]:.1f}-{span[1]:.1f}]" if span and span[0] != span[1] else "")


def headline(table: Sequence[Row]) -> List[str]:
    """Per sampling: each comparison in a line (ratio of medians, the per-repetition
    ratios' median and range), and auto against our fastest fixed row."""
    lines = []
    for sampling in dict.fromkeys(r.cell.sampling for r in table):
        for c in comparisons(table, sampling):
            lines.append(f"{sampling}, {c['pairing']}: ours {c['ours']} "
                         f"{_tok_s(c['ours_tok_s_median'], c['ours_tok_s_range'])} tok/s / llama.cpp {c['llama_cpp']} "
                         f"{_tok_s(c['llama_cpp_tok_s_median'], c['llama_cpp_tok_s_range'])} tok/s = "
                         + _paired_text(c))
        for c in auto_comparisons(table, sampling)[:1]:
            lines.append(f"{sampling}, auto vs the fastest fixed row: auto "
                         f"{_tok_s(c['auto_tok_s_median'], c['auto_tok_s_range'])} tok/s / {c['fixed']} "
                         f"{_tok_s(c['fixed_tok_s_median'], c['fixed_tok_s_range'])} tok/s = " + _paired_text(c))
    return lines


def _x(v: Optional[float]) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def _range(s: Optional[Spread], fmt: str = ".1f") -> str:
    return f"{s.low:{fmt}}-{s.high:{fmt}}" if s else "-"


def table_text(table: Sequence[Row], reps: int) -> str:
    """Markdown: medians over the repetitions beside their range, ratios of medians."""
    lines = [f"| engine | mode | sampling | setting | AL median [min-max] | decode tok/s median ({reps} reps) | "
             "decode tok/s min-max | vs ours plain (medians) | vs llama.cpp plain (medians) | same output | "
             "load 1m at start, max | loaded | notes |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in table:
        same = f"{r.same[0]}/{r.same[1]}" if r.same else "-"
        loads = [x for x in r.load_1m if x is not None]
        lines.append(f"| {r.cell.engine} | {r.cell.mode} | {r.cell.sampling} | {r.role() or '-'} | "
                     f"{r.al.text('.2f') if r.al else '-'} | "
                     f"{format(r.tok_s.median, '.1f') if r.tok_s else '-'} | {_range(r.tok_s)} | "
                     f"{_x(r.vs_ours_plain)} | {_x(r.vs_llama_plain)} | {same} | "
                     f"{format(max(loads), '.2f') if loads else '-'} | {'yes' if r.loaded else 'no'} | {r.note} |")
    return "\n".join(lines)


def each_sampling(table: Sequence[Row], of) -> List[dict]:
    """of(table, sampling)'s comparisons for every sampling of the table, in its order."""
    return [c for s in dict.fromkeys(r.cell.sampling for r in table) for c in of(table, s)]


def _ratio_table(head: str, rows: List[dict], lead) -> str:
    """Markdown of comparisons: `head`'s columns (lead(c) fills them), then the ratios'."""
    lines = [f"| {head} | ratio of medians | per-repetition ratio median | per-repetition ratio min-max | "
             "repetitions | verdict | loaded |",
             "|" + "---|" * (head.count("|") + 1) + "---:|---:|---:|---:|---|---|"]
    for c in rows:
        span, median = c["per_rep_ratio_range"], c["per_rep_ratio_median"]
        lines.append(f"| {lead(c)} | {_x(c['ratio_of_medians'])} | {f'{median:.3f}x' if median else '-'} | "
                     f"{f'{span[0]:.2f}-{span[1]:.2f}x' if span else '-'} | {c['per_rep_ratio_n']} | "
                     f"{c['verdict'] or '-'} | {'yes' if c['loaded'] else 'no'} |")
    return "\n".join(lines)


def comparisons_text(table: Sequence[Row]) -> str:
    """Markdown: ours against llama.cpp, best vs best and default vs default, per sampling."""
    rows = each_sampling(table, comparisons)
    if not rows:
        return "(no comparison with llama.cpp: its tools did not run)"
    return _ratio_table("sampling | pairing | ours | llama.cpp | ours tok/s median [min-max] | "
                        "llama.cpp tok/s median [min-max]", rows,
                        lambda c: f"{c['sampling']} | {c['pairing']} | {c['ours']} | {c['llama_cpp']} | "
                                  f"{_tok_s(c['ours_tok_s_median'], c['ours_tok_s_range'])} | "
                                  f"{_tok_s(c['llama_cpp_tok_s_median'], c['llama_cpp_tok_s_range'])}")


def auto_text(table: Sequence[Row]) -> str:
    """Markdown: auto against each of our fixed rows, per sampling, the fastest first."""
    rows = each_sampling(table, auto_comparisons)
    return _ratio_table("sampling | auto against | auto tok/s median [min-max] | its tok/s median [min-max]", rows,
                        lambda c: f"{c['sampling']} | {c['fixed']} | "
                                  f"{_tok_s(c['auto_tok_s_median'], c['auto_tok_s_range'])} | "
                                  f"{_tok_s(c['fixed_tok_s_median'], c['fixed_tok_s_range'])}") if rows else ""
