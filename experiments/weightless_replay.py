#!/usr/bin/env python3
"""The weightless kinds replayed over plain greedy replies, with no timing noise: each
session of a workload is decoded once plainly (every turn asked with the earlier turns'
replies), then every arm's proposer (dflash_gguf.speculation.weightless, the code of this checkout)
drafts over those replies step by step as it would while decoding, each draft walked
against the known greedy continuation. A step's time is the target's measured verify
cost by rows at the step's depth (verify_cost.VerifyCost, this machine's cached table,
the table decoding prices its drafts with), plus the proposer's own time as this replay
measures it (drafting and learning from the verdict run on the host between verifies, as
they do while decoding); the modelled speed is plain decoding's time (one row a token,
each at its depth) over the arm's. It counts target passes, drafted and accepted tokens
exactly, and leaves out what a served request adds (the server, sampling, the step's
other host work): a comparison of drafting policies, not of engines; dflash-bench
workload times those. Three arms are
bounds, not proposers: `oracle` (a drafter that always knows the reply), `copy-oracle`
(one that always finds the longest copy of the reply's next tokens in the text already
there) and `match-oracle` (one that copies from where the context's last two tokens
occurred before, always choosing the occurrence the reply goes on with: the bound for
drafters keyed on a match, as suffix and the n-gram kinds are).

    .venv/bin/python experiments/weightless_replay.py -n 128 --arm suffix --arm ngram-simple \\
        --out results/weightless-replay-DATE.json [--arm oracle --arm copy-oracle --arm match-oracle] \\
        [--cost-from FILE] \\
        [--one-server]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import dflash_gguf
from dflash_gguf.tools import real_models
from dflash_gguf.bench.serving import workload
from dflash_gguf.bench.provenance import machine, results_doc, versions, write_results
from dflash_gguf.decoding.proposal import Plan
from dflash_gguf.engine.engine import Engine
from dflash_gguf.speculation.kinds import WEIGHTLESS, parse_spec_types
from dflash_gguf.speculation.pricing import RunHazards, walk_depth
from dflash_gguf.speculation.suffix import SuffixConfig, SuffixCorpora, is_chain, likeliest_path
from dflash_gguf.speculation.proposers import WeightlessProposer
from dflash_gguf.speculation.verify_cost import CostTable
from dflash_gguf.speculation.weightless import WeightlessKinds

ORACLE = "oracle"  # an --arm: the bound any drafter could reach (oracle())
COPY_ORACLE = "copy-oracle"  # an --arm: the bound any drafter that copies could reach (copy_oracle())
MATCH_ORACLE = "match-oracle"  # an --arm: the bound for drafters that copy after a match (match_oracle())
MATCH = 2  # the match's tokens match_oracle keys on: suffix's shortest (SuffixConfig.min_match)
WORKLOAD = Path(dflash_gguf.__file__).parent / "data" / "workloads" / "stdlib.jsonl"


def plain_replies(engine: Engine, session, cap: int) -> list:
    """Each turn's prompt tokens and plain greedy reply tokens."""
    messages = [{"role": "system", "content": session.system}] if session.system is not None else []
    turns = []
    for turn in session.turns:
        messages.append({"role": "user", "content": turn.user})
        prompt = engine.render_messages(messages)
        got = engine.generate(prompt, min(cap, turn.max_tokens), speculative=False)
        messages.append({"role": "assistant", "content": got.text})
        turns.append((engine.encode(prompt), list(got.tokens)))
    return turns


def oracle(turns, cost, n_max: int) -> dict:
    """The bound: a drafter that always knows the reply, each step as many tokens as pay
    best at the verify cost (all n_max on a device where rows are cheap)."""
    return _bounded(turns, cost, n_max, lambda text, want: len(want))


def copy_oracle(turns, cost, n_max: int) -> dict:
    """The bound for drafters that copy: each step drafts the longest run of the reply's
    next tokens that occurs somewhere in the text already there (the prompt, which holds
    the session's earlier turns, and the reply so far), cut to the size that pays best at
    the verify cost. Every such draft is kept; no drafter that copies finds more (one
    that splices copies, as the copy cursor's learnt substitutions do, can; a few tokens)."""
    return _bounded(turns, cost, n_max, longest_copy)


def match_oracle(turns, cost, n_max: int) -> dict:
    """The bound for drafters that copy after a match, as suffix and the n-gram kinds do:
    each step drafts, of the places where the context's last MATCH tokens occurred
    before, the continuation that agrees longest with the reply's next tokens, cut to
    the size that pays best at the verify cost. Unlike copy_oracle it cannot start a copy
    before its first MATCH tokens are out (a real drafter also has to guess the
    occurrence, and drafts that miss)."""
    return _bounded(turns, cost, n_max, copy_after_match)


def _bounded(turns, cost, n_max: int, known) -> dict:
    """A drafter whose every draft is kept: each step it may draft known(text, want) of the
    reply's next tokens `want` (those before the target's own next token), and drafts
    as many of them as pay best at the verify cost."""
    passes = drafted = 0
    seconds = 0.0
    for prompt, out in turns:
        text = list(prompt) + out[:1]
        i = 1
        while i < len(out):
            k = known(text, out[i:min(i + n_max, len(out) - 1)])
            depth = len(text) - 1  # the bonus is not in the context yet
            rows = np.arange(1, k + 2)
            m = int(np.argmax(rows / cost.chain(rows, depth)))
            seconds += float(cost.chain(1 + m, depth))
            text.extend(out[i:i + m + 1])
            passes, drafted, i = passes + 1, drafted + m, i + m + 1
    return {"passes": passes, "drafted": drafted, "accepted": drafted, "seconds": seconds}


def longest_copy(text: list, want: list) -> int:
    """How many of `want`'s first tokens occur, in order and together, somewhere in `text`."""
    if not want:
        return 0
    return _longest_from(text, np.flatnonzero(np.asarray(text) == want[0]), want)


def _longest_from(text: list, starts, want: list) -> int:
    """The most of `want`'s first tokens that `text` holds from any of `starts` on."""
    best = 0
    for start in starts:
        n = 0
        while n < len(want) and start + n < len(text) and text[start + n] == want[n]:
            n += 1
        best = max(best, n)
        if best == len(want):
            break
    return best


def copy_after_match(text: list, want: list) -> int:
    """How many of `want`'s first tokens follow, in order, some earlier occurrence of
    `text`'s last MATCH tokens (the longest such continuation)."""
    if not want or len(text) <= MATCH:
        return 0
    arr = np.asarray(text)
    # ends e of the earlier occurrences: text[e - MATCH:e] is the tail, and text[e] exists
    hits = np.ones(len(arr) - MATCH, dtype=bool)
    for j in range(MATCH):
        hits &= arr[j:len(arr) - MATCH + j] == arr[len(arr) - MATCH + j]
    return _longest_from(text, np.flatnonzero(hits) + MATCH, want)


def proposer_of(kinds, cost, n_max: int) -> WeightlessProposer:
    """An arm's proposer: one corpus and one set of hazards, as one server key."""
    ngram = [WEIGHTLESS[k] for k in kinds if k in WEIGHTLESS and WEIGHTLESS[k].source is not None]
    return WeightlessProposer(WeightlessKinds(
        (lambda: [kind.source(kind.options()) for kind in ngram]) if ngram else None,
        SuffixCorpora(SuffixConfig()) if "suffix" in kinds else None, None, n_max, RunHazards()), cost)


def replay(proposer: WeightlessProposer, turns, cost) -> dict:
    """One arm (its proposer) over a session's turns: target passes, drafted and accepted
    tokens, modelled seconds (of which draft_seconds the proposer's own, timed)."""
    passes = drafted = accepted = 0
    seconds = draft_seconds = 0.0
    for prompt, out in turns:
        text = list(prompt) + out[:1]  # the first token comes with the prompt's pass
        seq = SimpleNamespace(tokens=SimpleNamespace(text=text, prompt=prompt, bonus=out[0], n_past=len(prompt)),
                              stats=SimpleNamespace(generated_tokens=1), sampler=SimpleNamespace(guide=None),
                              room=1 << 30, remaining=len(out) - 1)
        seq.draft_room = lambda n_max, seq=seq: max(0, min(n_max, seq.remaining - 1))  # as Sequence.draft_room
        seq.proposing = proposer.start(seq)
        i = 1
        while i < len(out):
            seq.remaining, seq.tokens.bonus, seq.tokens.n_past = len(out) - i, text[-1], len(text) - 1
            depth = seq.tokens.n_past
            plan = Plan()
            t0 = time.perf_counter()
            p = proposer.propose(seq, plan)
            draft_seconds += time.perf_counter() - t0
            if p.tree is not None and not is_chain(p.tree):
                rows, kept = len(p.tree.tokens), walk_depth(p.tree, out[i:])
                seconds += float(cost(rows, depth))
            else:
                drafts = p.tokens[1:] if p.tree is None else likeliest_path(p.tree)
                rows, kept = 1 + len(drafts), 0
                while kept < len(drafts) and i + kept < len(out) and drafts[kept] == out[i + kept]:
                    kept += 1
                seconds += float(cost.chain(rows, depth))
            emitted = out[i:i + kept + 1]
            text.extend(emitted)
            i += len(emitted)
            seq.stats.generated_tokens = i
            passes, drafted, accepted = passes + 1, drafted + rows - 1, accepted + kept
            t0 = time.perf_counter()
            proposer.verified(seq, p.plan or plan, p, None, emitted, 0.0)
            draft_seconds += time.perf_counter() - t0
        proposer.finish(seq)
    return {"passes": passes, "drafted": drafted, "accepted": accepted, "seconds": seconds + draft_seconds,
            "draft_seconds": draft_seconds}


BOUNDS = {ORACLE: oracle, COPY_ORACLE: copy_oracle, MATCH_ORACLE: match_oracle}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b", help="a real_models name")
    p.add_argument("--workload", type=Path, default=WORKLOAD)
    p.add_argument("--sessions", help="comma list (default: all)")
    p.add_argument("--arm", action="append", required=True, help="a --spec-type of weightless kinds, or a bound: oracle, copy-oracle, "
                   "match-oracle (repeat)")
    p.add_argument("-n", type=int, default=128, help="tokens a turn at most (dflash-bench workload's -n)")
    p.add_argument("--spec-draft-n-max", type=int, default=48)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--cost-from", type=Path, help="price by the verify cost table this earlier results file "
                   "recorded (default: this build's, measured once and cached)")
    p.add_argument("--one-server", action="store_true",
                   help="each arm's corpus and hazards carried from session to session in the workload's order, "
                        "as in one dflash-server (a repetition of dflash-bench workload); default: each session "
                        "replayed alone")
    args = p.parse_args(argv)
    arms = [(a,) if a in BOUNDS else parse_spec_types(a) for a in args.arm]
    wl = workload.load(args.workload)
    wanted = args.sessions.split(",") if args.sessions else [s.name for s in wl.sessions]
    doc = results_doc("weightless_replay", sys.argv, machine=machine(args.threads, "CPU"), versions=versions(),
                      workload={"path": str(args.workload), "sha256": wl.sha256}, rows=[])
    with Engine(str(real_models.path(args.model)), spec_type="ngram-simple", n_ctx=8192,
                n_threads=args.threads, spec_draft_n_max=args.spec_draft_n_max) as engine:
        if args.cost_from:
            cost = CostTable.from_record(json.loads(args.cost_from.read_text())["verify_cost_s"])
            doc["verify_cost_note"] = f"the table {args.cost_from} recorded"
        else:
            engine.prepare_auto()
            cost = engine.choice.verify_cost
        doc["verify_cost_s"] = cost.record()
        doc["one_server"] = args.one_server
        servers = {}  # each arm's proposer, carried across sessions (--one-server)
        for session in (s for s in wl.sessions if s.name in wanted):
            turns = plain_replies(engine, session, args.n)
            tokens = sum(len(out) for _, out in turns)
            # plain decoding's steps, each at its own depth
            plain_s = sum(float(np.sum(cost.chain(1, len(prompt) + np.arange(len(out)))))
                          for prompt, out in turns)
            for kinds in arms:
                bound = BOUNDS.get(kinds[0]) if len(kinds) == 1 else None
                if bound:
                    got = bound(turns, cost, args.spec_draft_n_max)
                else:
                    proposer = servers.get(kinds) or proposer_of(kinds, cost, args.spec_draft_n_max)
                    if args.one_server:
                        servers[kinds] = proposer
                    got = replay(proposer, turns, cost)
                row = {"session": session.name, "arm": ",".join(kinds), "tokens": tokens, **got,
                       "modelled_speedup": plain_s / got["seconds"]}
                doc["rows"].append(row)
                print(f"{session.name:26} {row['arm']:22} {row['modelled_speedup']:.2f}x  passes {got['passes']:4}"
                      f"  drafted {got['drafted']:4}  accepted {got['accepted']:4}"
                      f"  drafting {got.get('draft_seconds', 0.0) * 1e3:.0f} ms", flush=True)
            write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
