#!/usr/bin/env python3
"""Per turn, an arm's decode rate over plain decoding's in the same session and
repetition, from a `dflash-bench workload` results file and its records, split by first
turn against later turns and by which of the two arms ran the session first (the tool
rotates the arms' order by repetition and session, so that a server often runs two
cells back to back). Reads files already on file; times nothing.

    .venv/bin/python experiments/turn_order.py results/workload-...json [more files] [--arm NAME]

For each file: the median ratio (plain's seconds a token over the arm's: above 1, the
arm is faster) and the count, in four groups, and every first turn's pair in run order."""
from __future__ import annotations

import argparse
import json
import lzma
import statistics
import sys
from pathlib import Path

PLAIN = "plain"


def cells_in_order(doc: dict) -> list:
    """(arm, session, repetition from 0) of every cell, in the order they ran."""
    out = []
    for c in doc["cells"]:
        head, rep = c["cell"].rsplit(", rep ", 1)
        arm, session = head.split(", ", 1)
        out.append((arm, session, int(rep) - 1))
    return out


def records_of(results: Path) -> dict:
    """{(arm, session, rep, turn): record} of the file's records beside it."""
    path = results.with_name(results.name.replace(".json", ".records.jsonl.xz"))
    with lzma.open(path, "rt") as f:
        return {(r["arm"], r["session"], r["rep"], r["turn"]): r for r in map(json.loads, f)}


def per_token(r: dict) -> float:
    return r["decode_s"] / r["completion_tokens"]


def turn_ratios(doc: dict, records: dict, arm: str) -> tuple:
    """({(first turn?, arm ran first?): [plain's seconds a token over the arm's]}, the first
    turns' pairs in run order)."""
    first_arm = {}
    for a, session, rep in cells_in_order(doc):
        first_arm.setdefault((session, rep), a)
    groups, firsts = {}, []
    for (a, session, rep, turn), r in records.items():
        plain = records.get((PLAIN, session, rep, turn))
        if a != arm or plain is None or not r["completion_tokens"] or not plain["completion_tokens"]:
            continue
        ratio = per_token(plain) / per_token(r)
        ran_first = first_arm[(session, rep)] == arm
        groups.setdefault((turn == 0, ran_first), []).append(ratio)
        if turn == 0:
            firsts.append((rep, session, ran_first, ratio))
    return groups, sorted(firsts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, nargs="+", help="dflash-bench workload results files (.json)")
    p.add_argument("--arm", help="the arm set against plain (default: the file's one other arm)")
    a = p.parse_args(argv)
    for path in a.results:
        doc = json.loads(path.read_text())
        others = [x for x in doc["settings"]["arms"] if x != PLAIN]
        arm = a.arm or (others[0] if len(others) == 1 else None)
        if arm not in others:
            p.error(f"{path}: name the arm with --arm (one of {', '.join(others)})")
        groups, firsts = turn_ratios(doc, records_of(path), arm)
        print(f"{path.name}: {arm} against {PLAIN}, plain's time a token over {arm}'s, median (n)")
        for first_turn in (True, False):
            for ran_first in (True, False):
                got = groups.get((first_turn, ran_first), [])
                rate = f"{statistics.median(got):.3f}" if got else "-"
                print(f"  {'first turn' if first_turn else 'later turns'}, {arm} "
                      f"{'first' if ran_first else 'second'} in its session: {rate} ({len(got)})")
        for rep, session, ran_first, ratio in firsts:
            print(f"    rep {rep + 1} {session:28} {arm + ' first' if ran_first else 'plain first':>20} {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
