"""Our decoding modes, measured through the public API (Engine.generate), as a user runs
them: plain decoding, the drafter's chain, DDTrees of fixed budgets and `auto`."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Sequence, Union

from ..engine.engine import Engine, freeze_loaded_objects
from .prompts import WARMUP
from .runs import Cell, Run, Sampling

MODE_NAMES = ("plain", "chain", "tree", "auto")


@dataclass(frozen=True)
class Mode:
    name: str                                 # plain, chain (default), chain p-min 0.3 n-max 7, tree N, auto
    speculative: bool = True
    tree_budget: Union[int, str, None] = None  # None: the chain
    p_min: Optional[float] = None             # the greedy chain's confidence cut (None: the engine's default)
    chain_rule: Optional[str] = None          # a sampled chain's accept rule (None: the engine's default)
    block_size: Optional[int] = None          # the chain's block, the bonus token and n-max drafts (None: the drafter's)
    grammar_drafting: bool = True             # under a constraint, drafts are cut and filled by the grammar
    options: tuple = ()                       # further Engine options as (name, value) pairs (kinds.py's sweeps)

    @property
    def default(self) -> bool:
        """What dflash-run does with a drafter and no decoding flag: the chain at its defaults."""
        return self.name == "chain (default)"


def modes(names: Sequence[str], budgets: Sequence[int], p_mins: Sequence[float], with_draft: bool,
          chain_rules: Sequence[str] = (), blocks: Sequence[int] = (), plain_drafting: bool = False) -> List[Mode]:
    """The modes named (MODE_NAMES): "chain" at its defaults and once per confidence cut in
    p_mins x block size in blocks (the sweep; none given: the default only) x sampled chain
    accept rule in chain_rules; "tree" once per budget and "auto", both at the default cut.
    Without a drafter only plain. plain_drafting: each drafting mode also without
    grammar-aware drafting (its drafts verified as drafted, under a constraint)."""
    out = []
    for name in names:
        if name == "plain":
            out.append(Mode("plain", speculative=False))
        elif not with_draft:
            continue
        elif name == "chain":
            out.append(Mode("chain (default)"))
            sweep = [(p, b) for p in p_mins or [None] for b in blocks or [None]] if p_mins or blocks else []
            for p, b in sweep:
                for rule in chain_rules or [None]:
                    label = "chain" + (f" p-min {p:g}" if p is not None else "") + \
                        (f" n-max {b - 1}" if b is not None else "") + (f" {rule} rule" if rule else "")
                    out.append(Mode(label, p_min=p, chain_rule=rule, block_size=b))
        elif name == "tree":
            out += [Mode(f"tree {b}", tree_budget=b) for b in budgets]
        elif name == "auto":
            out.append(Mode("auto", tree_budget="auto"))
    if plain_drafting:
        out += [replace(m, name=m.name + ", drafts not grammar-aware", grammar_drafting=False)
                for m in out if m.speculative]
    return out


def open_engine(mode: Mode, target: str, draft: Optional[str], options: dict) -> Engine:
    """An engine for the mode (plain decoding loads no drafter), warmed up: its graphs,
    caches and (auto) verify cost table exist before anything is timed."""
    rule = {"chain_rule": mode.chain_rule} if mode.chain_rule else {}
    block = {"block_size": mode.block_size} if mode.block_size else {}
    if not mode.speculative:  # plain decoding loads no drafter, not even -m's own MTP layer
        options = {k: v for k, v in options.items() if k != "spec_type"}
    engine = Engine(target, draft if mode.speculative else None, tree_budget=mode.tree_budget,
                    draft_p_min=mode.p_min, **rule, **block, **options, **dict(mode.options))
    engine.grammar_drafting = mode.grammar_drafting
    try:
        engine.generate(WARMUP, max_tokens=16, stop_tokens=())
    except BaseException:
        engine.close()
        raise
    freeze_loaded_objects()  # as dflash-run and dflash-server do after loading
    return engine


def generate(engine: Engine, mode: Mode, prompt: str, ids: List[int], n: int, sampling: Sampling,
             rep: int, rnd: int = 0, ignore_eos: bool = False) -> Run:
    """One prompt, stopping at max_tokens or the model's end of generation (as llama.cpp's
    tools do without --ignore-eos); ignore_eos: at max_tokens only. Its text then ends
    before the first end-of-generation token: llama.cpp's --ignore-eos bans those tokens,
    so its text follows ours only that far (report.same_text compares the prefix)."""
    result = engine.generate(ids, max_tokens=n, sampling=sampling.params(rep), stop_tokens=() if ignore_eos else None)
    s = result.stats
    tokens = max(s.generated_tokens - 1, 0)  # the first comes from the prefill
    # draft-simple and the n-gram kinds draft without engine.draft: every drafting mode counts its steps
    passes = len(s.accepted_lengths) if mode.speculative else tokens
    eog = next((i for i, t in enumerate(result.tokens) if t in engine.tokenizer.eog_ids), len(result.tokens))
    shown = result.tokens[:eog]
    extra = {"stop_reason": s.stop_reason, "draft_s": s.draft_seconds, "verify_s": s.verify_seconds,
             "other_s": s.other_seconds, "device": engine.target.info()["device"],
             "draft_p_min": engine.draft_p_min if engine.draft is not None else None,
             "block_size": (engine.block_size or engine.draft.block_size) if engine.draft is not None else None}
    simple, weightless = engine.setup.simple, engine.setup.weightless
    if simple is not None and mode.speculative:  # draft-simple's own settings (llama.cpp's meanings)
        extra.update(draft_p_min=simple.p_min, n_max=simple.n_max, tree=simple.tree)
    elif weightless.chains and mode.speculative:  # each n-gram kind's own options
        extra.update(n_max=weightless.spec_draft_n_max,
                     ngram={k: asdict(o) for k, o in weightless.kinds if k in weightless.chains})
    if s.trees.sizes:
        extra.update(tree_steps=len(s.trees.sizes), tree_nodes_mean=s.trees.mean_nodes,
                     chain_steps=s.trees.chain_steps)
    if s.trees.auto is not None:
        extra["auto"] = s.trees.auto  # auto's choices per arm beside its cost model's figures
    return Run(Cell("ours", mode.name, sampling.label, mode.speculative, mode.default), rep=rep, prompt=prompt,
               prompt_tokens=s.prompt_tokens, tokens=tokens, decode_s=s.decode_seconds, passes=passes,
               prefill_s=s.prefill_seconds, text=engine.tokenizer.decode(shown), token_ids=result.tokens, extra=extra,
               round=rnd)


class Arm:
    """One of our modes as an arm of the interleaved benchmark. Its engine is loaded once
    and kept (every arm's at once: memory for one model per arm), or with `reload` loaded
    and warmed up anew for each of its cells (memory for one model; the loading is not
    timed; the caller closes it when the cell is done, and runs a cell's rounds one after
    another)."""

    side = "ours"

    def __init__(self, mode: Mode, target: str, draft: Optional[str], options: dict, ids: Dict[str, List[int]],
                 n: int, reload: bool, ignore_eos: bool = False):
        self.mode, self.target, self.draft, self.options = mode, target, draft, options
        self.ids, self.n, self.reload, self.ignore_eos = ids, n, reload, ignore_eos
        self.engine: Optional[Engine] = None

    @property
    def name(self) -> str:
        return self.mode.name

    def open(self) -> None:
        if not self.reload:
            self.engine = open_engine(self.mode, self.target, self.draft, self.options)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def one_round(self, sampling: Sampling, rep: int, rnd: int) -> List[Run]:
        """A round of a cell: every prompt once."""
        if self.engine is None:  # reload: the cell's first round
            self.engine = open_engine(self.mode, self.target, self.draft, self.options)
        return [generate(self.engine, self.mode, name, ids, self.n, sampling, rep, rnd, self.ignore_eos)
                for name, ids in self.ids.items()]
