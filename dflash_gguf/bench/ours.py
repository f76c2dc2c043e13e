"""Our decoding modes, measured through the public API (Engine.generate), as a user runs
them: plain decoding, the drafter's chain, DDTrees of fixed budgets and `auto`."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Union

from ..engine import Engine
from .prompts import WARMUP
from .runs import Run, Sampling

MODE_NAMES = ("plain", "chain", "tree", "auto")


@dataclass(frozen=True)
class Mode:
    name: str                                 # plain, chain, tree N, auto
    speculative: bool = True
    tree_budget: Union[int, str, None] = None  # None: the chain
    p_min: Optional[float] = None             # the greedy chain's confidence cut (None: the engine's default)
    chain_rule: Optional[str] = None          # a sampled chain's accept rule (None: the engine's default)


def modes(names: Sequence[str], budgets: Sequence[int], p_mins: Sequence[float], with_draft: bool,
          chain_rules: Sequence[str] = ()) -> List[Mode]:
    """The modes named (MODE_NAMES): "tree" once per budget, "chain" once per confidence cut
    in p_mins (the first of which auto's chain takes; none given: the engine's default)
    and per sampled chain accept rule in chain_rules. Without a drafter only plain."""
    first = p_mins[0] if p_mins else None
    out = []
    for name in names:
        if name == "plain":
            out.append(Mode("plain", speculative=False))
        elif not with_draft:
            continue
        elif name == "chain":
            for p in p_mins if len(p_mins) > 1 else [first]:
                for rule in chain_rules or [None]:
                    label = "chain" + (f" p-min {p:g}" if len(p_mins) > 1 else "") + \
                        (f" {rule} rule" if len(chain_rules) > 1 else "")
                    out.append(Mode(label, p_min=p, chain_rule=rule))
        elif name == "tree":
            out += [Mode(f"tree {b}", tree_budget=b, p_min=first) for b in budgets]
        elif name == "auto":
            out.append(Mode("auto", tree_budget="auto", p_min=first))
    return out


def open_engine(mode: Mode, target: str, draft: Optional[str], options: dict) -> Engine:
    """An engine for the mode (plain decoding loads no drafter), warmed up: its graphs,
    caches and (auto) verify cost table exist before anything is timed."""
    rule = {"chain_rule": mode.chain_rule} if mode.chain_rule else {}
    engine = Engine(target, draft if mode.speculative else None, tree_budget=mode.tree_budget,
                    draft_p_min=mode.p_min, **rule, **options)
    try:
        engine.generate(WARMUP, max_tokens=16, stop_tokens=())
    except BaseException:
        engine.close()
        raise
    return engine


def generate(engine: Engine, mode: Mode, prompt: str, ids: List[int], n: int, sampling: Sampling,
             rep: int) -> Run:
    """One prompt, stopping at max_tokens or the model's end of generation (as llama.cpp's
    tools do without --ignore-eos)."""
    result = engine.generate(ids, max_tokens=n, sampling=sampling.params(rep))
    s = result.stats
    tokens = max(s.generated_tokens - 1, 0)  # the first comes from the prefill
    passes = len(s.accepted_lengths) if engine.draft is not None else tokens
    shown = result.tokens[:-1] if result.tokens and result.tokens[-1] in engine.tokenizer.eog_ids else result.tokens
    extra = {"stop_reason": s.stop_reason, "draft_s": s.draft_seconds, "verify_s": s.verify_seconds,
             "other_s": s.other_seconds, "device": engine.target.info()["device"]}
    if s.tree_sizes:
        extra.update(tree_steps=len(s.tree_sizes), tree_nodes_mean=sum(s.tree_sizes) / len(s.tree_sizes),
                     chain_steps=s.chain_steps)
    return Run(engine="ours", mode=mode.name, sampling=sampling.label, rep=rep, prompt=prompt,
               prompt_tokens=s.prompt_tokens, tokens=tokens, decode_s=s.decode_seconds, passes=passes,
               prefill_s=s.prefill_seconds, text=engine.tokenizer.decode(shown), token_ids=result.tokens, extra=extra)


def run_modes(modes: Sequence[Mode], target: str, draft: Optional[str], options: dict, prompts: Sequence[tuple],
              n: int, samplings: Sequence[Sampling], reps: int, interleave: bool,
              on_run: Callable[[Run], None]) -> None:
    """Every mode x sampling x repetition x prompt, each run handed to on_run as it ends.

    One mode at a time (one model in memory): an engine is loaded, warmed up and runs all
    its repetitions. With `interleave`, every mode's engine is loaded at once and the modes
    take turns prompt by prompt in a shuffled (seeded) order, so that a slow spell of a
    shared machine weighs on all of them alike."""
    if interleave:
        engines: Dict[Mode, Engine] = {}
        try:
            for mode in modes:
                engines[mode] = open_engine(mode, target, draft, options)
            ids = {name: engines[modes[0]].encode(text) for name, text in prompts}
            order, shuffle = list(modes), random.Random(0).shuffle
            for sampling in samplings:
                for rep in range(reps):
                    for name, _ in prompts:
                        shuffle(order)
                        for mode in order:
                            on_run(generate(engines[mode], mode, name, ids[name], n, sampling, rep))
        finally:
            for engine in engines.values():
                engine.close()
        return
    for mode in modes:
        with open_engine(mode, target, draft, options) as engine:
            ids = {name: engine.encode(text) for name, text in prompts}
            for sampling in samplings:
                for rep in range(reps):
                    for name, _ in prompts:
                        on_run(generate(engine, mode, name, ids[name], n, sampling, rep))
