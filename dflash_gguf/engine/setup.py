"""An Engine's setup, settled before anything is loaded from its typed options
(options.EngineOptions) and the files: what the target and drafter are loaded with
(TargetConfig, DraftConfig), how decoding drafts (block size, tree budget, auto, the
chain's confidence cut, the weightless kinds) and how many sequences it holds at once.
The Engine, the memory plan, dflash-run and dflash-server all take an EngineSetup; the
command lines only translate its ConfigError into their flags' words."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Tuple

from ..runtime.drafter import DraftConfig, read_draft_metadata
from ..runtime.drafter_kinds import reading
from ..runtime.errors import ConfigError
from ..runtime.target import RopeScaling, TargetConfig
from ..speculation.kinds import (AUTOREGRESSIVE, DEFAULT_CHAIN_RULE, DEFAULT_MTP_DRAFTS, DEFAULT_SIMPLE_N_MAX,
                                 DEFAULT_SIMPLE_N_MIN, DEFAULT_SIMPLE_P_MIN, DEFAULT_SPEC_DRAFT_N_MAX, DRAFTER_KINDS,
                                 FILE_KIND_NAMES, FILE_KINDS, SIMPLE, TARGET_KINDS, WEIGHTLESS, parse_spec_types)
from ..speculation.kinds.kind import check_count as _count
from .options import EngineOptions, check_kv, check_window

# the largest tree `--tree-budget auto` grows to
AUTO_MAX_BUDGET = 32


@dataclass(frozen=True)
class SimpleSetup:
    """What draft-simple loads and how it drafts (speculation/draft_simple.py): the small model's
    GGUF, its TargetConfig (n_seq as the target's), n_max / n_min / p_min as llama.cpp's
    --spec-draft-*, and whether a step verifies a tree (the chain and the drafter's
    second choices beside it)."""

    path: str
    config: TargetConfig
    n_max: int = DEFAULT_SIMPLE_N_MAX
    n_min: int = DEFAULT_SIMPLE_N_MIN
    p_min: float = DEFAULT_SIMPLE_P_MIN
    tree: bool = False
    draft_vocab: int = 0  # > 0: the drafter's head cut to that many tokens (draft_simple.kept_tokens)
    auto: bool = False  # --tree-budget auto: each step plain decoding or the chain, as AutoBudget chooses
    draft_vocab_from: Tuple[str, ...] = ()  # text whose commonest tokens the cut keeps (draft_simple.corpus_counts)

    @property
    def lookahead(self) -> int:
        """Rows a step verifies at most: the bonus and its drafts (and their siblings)."""
        return 1 + self.n_max * (2 if self.tree else 1)


def _gguf_arch_and_keys(path: str) -> tuple:
    """(general.architecture, its nextn_predict_layers or 0, the drafter kind that reads it
    from -md as the runtime picks it (drafter_kinds.reading: "dspark" for a dflash GGUF
    with a Markov head), else the architecture) of a GGUF, for the kind checks."""
    from ..runtime.gguf_meta import GGUFMeta

    try:
        meta = GGUFMeta(path)
        arch = str(meta.get("general.architecture"))
        kind = reading(arch, meta.tensor_names)
        return arch, int(meta.get(f"{arch}.nextn_predict_layers", 0)), \
            kind.name if kind is not None and not kind.in_target else arch
    except ValueError as e:  # the reader's own line names the file
        raise ConfigError("spec_type", str(e)) from None
    except Exception as e:  # noqa: BLE001 - any unreadable file is one line
        raise ConfigError("spec_type", f"cannot read {path} as a GGUF: {e}") from None


def resolve_spec_types(spec_type, model: str, draft: Optional[str]) -> tuple:
    """The kinds that draft: --spec-type checked against the files, or, left out, what
    the drafter GGUF is (a dflash drafter: draft-dflash, or draft-dspark when it has a
    Markov head; an eagle3 one: draft-eagle3; none: plain decoding, ()). draft-mtp drafts
    with the MTP (nextn) layer of the model's own GGUF (-m). A drafter under another
    kind's flag is one ConfigError."""
    if spec_type is None:
        if not draft:
            return ()
        try:
            file_kind = _gguf_arch_and_keys(draft)[2]
        except ConfigError:
            file_kind = None  # the drafter's loader says what is wrong with the file
        if file_kind is not None and file_kind not in FILE_KIND_NAMES:
            return (SIMPLE,)  # a model GGUF (a target architecture): it drafts as a small model
        return (next((k for k, v in FILE_KINDS.items() if v == file_kind), "draft-dflash"),)
    kinds = parse_spec_types(spec_type)
    drafters = [k for k in kinds if k in DRAFTER_KINDS]
    if len(drafters) > 1:
        raise ConfigError("spec_type", f"{' and '.join(drafters)}: one drafter at a time")
    for kind in kinds:
        if kind in TARGET_KINDS:
            own = TARGET_KINDS[kind]
            if draft:
                raise ConfigError("spec_type", f"{kind} drafts with {own.what} of the model itself ({model}); "
                                               f"drop -md {draft}")
            arch, n_nextn, _ = _gguf_arch_and_keys(model)
            if n_nextn == 0:
                raise ConfigError("spec_type", f"{kind}: {model} ({arch}) has no nextn ({own.title}) layers; "
                                               "convert the checkpoint without --no-mtp")
            if arch not in own.archs:
                raise ConfigError("spec_type", f"{kind}: the {own.title} layers of {arch} models are not run by this "
                                               f"build (only {', '.join(own.archs)})")
    if SIMPLE in kinds:
        if not draft:
            raise ConfigError("spec_type", f"{SIMPLE} needs the small model that drafts (-md)")
        file_kind = _gguf_arch_and_keys(draft)[2]
        if file_kind in FILE_KIND_NAMES:
            flag = {v: k for k, v in FILE_KINDS.items()}[file_kind]
            raise ConfigError("spec_type", f"{SIMPLE}: -md {draft} is {FILE_KIND_NAMES[file_kind]} (--spec-type "
                                           f"{flag}), not a model that drafts on its own")
        return kinds
    wanted = [k for k in kinds if k in FILE_KINDS]
    for kind in wanted:
        if not draft:
            raise ConfigError("spec_type", f"{kind} needs {FILE_KIND_NAMES[FILE_KINDS[kind]]} (-md)")
    if draft and not wanted:
        arch, _, file_kind = _gguf_arch_and_keys(draft)
        flag = {v: k for k, v in FILE_KINDS.items()}.get(file_kind)
        what = f"{FILE_KIND_NAMES[file_kind]} (--spec-type {flag})" if flag else f"a {arch} GGUF"
        raise ConfigError("spec_type", f"-md {draft} is {what}, and --spec-type {','.join(kinds)} "
                                       f"loads no drafter file; drop -md or add {flag or SIMPLE}")
    if draft:
        arch, n_nextn, file_kind = _gguf_arch_and_keys(draft)
        kind = wanted[0]
        if file_kind != FILE_KINDS[kind]:
            if file_kind in FILE_KIND_NAMES:
                flag = {v: k for k, v in FILE_KINDS.items()}[file_kind]
                raise ConfigError("spec_type", f"{kind}: -md {draft} is {FILE_KIND_NAMES[file_kind]}, not "
                                               f"{FILE_KIND_NAMES[FILE_KINDS[kind]]} (--spec-type {flag})")
            hint = " (--spec-type draft-mtp drafts with the MTP layer of -m itself)" if n_nextn else \
                f" (--spec-type {SIMPLE} drafts with a small model)"
            raise ConfigError("spec_type", f"{kind}: -md {draft} is a {arch} GGUF, not "
                                           f"{FILE_KIND_NAMES[FILE_KINDS[kind]]}{hint}")
    return kinds


@dataclass(frozen=True)
class DraftingSetup:
    """How the drafter (a drafter GGUF's, or the model's own MTP layer) drafts: its block
    (the bonus and the drafts; None without a drafter), the tree it verifies (tree_budget
    nodes; None: chains) or, with auto_budget, each step's choice of plain decoding, the
    chain or a tree of up to tree_budget nodes, the chain's cuts (draft_p_min, None:
    speculative.default_p_min of the loaded target; DSpark's confidence cut
    spec_draft_conf_min, 0: none) and a sampled chain's accept rule
    (speculative.chain_proposer)."""

    block_size: Optional[int] = None
    tree_budget: Optional[int] = None
    auto_budget: bool = False
    draft_p_min: Optional[float] = None
    chain_rule: str = DEFAULT_CHAIN_RULE
    spec_draft_conf_min: float = 0.0


@dataclass(frozen=True)
class WeightlessSetup:
    """The weightless kinds that draft (speculation/kinds/, in --spec-type's order), beside
    the drafter or alone, each with its options, and their longest draft."""

    kinds: Tuple[Tuple[str, Any], ...] = ()
    spec_draft_n_max: int = DEFAULT_SPEC_DRAFT_N_MAX

    @property
    def chains(self) -> Tuple[str, ...]:
        """The kinds that draft chains from each sequence's own text (the n-gram family)."""
        return tuple(k for k, _ in self.kinds if WEIGHTLESS[k].source is not None)

    def sources(self) -> list:
        """Fresh chain sources for one sequence, in the kinds' order."""
        return [WEIGHTLESS[k].source(options) for k, options in self.kinds if WEIGHTLESS[k].source is not None]

    def corpora(self):
        """The engine's shared corpora, of the kind that keeps them (suffix's), or None."""
        return next((WEIGHTLESS[k].corpora(options) for k, options in self.kinds if WEIGHTLESS[k].corpora), None)

    def options(self, kind: str):
        """An enabled kind's options (None: it does not draft)."""
        return dict(self.kinds).get(kind)


@dataclass
class EngineSetup:
    """What an Engine loads, derived and checked from its options (also what the memory
    plan is made of), and how it drafts (drafting: the drafter's; weightless: the n-gram
    kinds' and suffix's)."""

    target_config: TargetConfig
    draft_config: Optional[DraftConfig]
    n_threads: int
    drafting: DraftingSetup
    weightless: WeightlessSetup
    draft_path: Optional[str] = None  # the drafter's GGUF: -md's, or the model's own for draft-mtp
    simple: Optional[SimpleSetup] = None  # draft-simple's small model and settings (draft_path is then None)
    # a DFlash drafter's head cut to that many tokens (draft_simple.kept_tokens; 0: the
    # kept set its file carries, else all), the commonest in draft_vocab_from's text
    draft_vocab: int = 0
    draft_vocab_from: Tuple[str, ...] = ()

    @property
    def n_seq(self) -> int:
        return self.target_config.n_seq

    def with_memory(self, kv_type: str, draft_window: int) -> "EngineSetup":
        """This setup with another KV cache type and drafter window (what memory.settle
        tries), its other options as they were checked once."""
        check_kv("kv_type", kv_type, auto=False)
        check_window(draft_window)
        simple = self.simple
        if simple is not None:
            simple = replace(simple, config=replace(simple.config, kv_type=kv_type))
        draft_config = self.draft_config
        if draft_config is not None:
            draft_config = replace(draft_config, window=draft_window)
        return replace(self, target_config=replace(self.target_config, kv_type=kv_type), draft_config=draft_config,
                       simple=simple)

    @classmethod
    def of(cls, model: str, draft: Optional[str], options: EngineOptions = EngineOptions()) -> "EngineSetup":
        """The setup of the options (checked as their types were made) with the files: the
        kinds against the GGUFs, what a drafter's file allows, what the kinds allow beside
        each other. A KV type or drafter window left "auto" is the memory plan's first
        choice here (f16; the window the drafter was trained on where its file says, else
        the whole context: memory.settle tries the others)."""
        target, drafter, spec = options.target, options.drafter, options.speculation
        kv_type = "f16" if target.kv_type == "auto" else target.kv_type
        kv_type_v = target.kv_type_v
        kinds = resolve_spec_types(spec.spec_type, model, draft)
        n_max = spec.spec_draft_n_max or DEFAULT_SPEC_DRAFT_N_MAX
        weightless = WeightlessSetup(tuple((k, spec.kinds[k]) for k in kinds if k in WEIGHTLESS), n_max)
        simple = SIMPLE in kinds
        vocab_from = drafter.vocab_from()
        draft_path = model if any(k in TARGET_KINDS for k in kinds) else (None if simple else draft)
        meta = read_draft_metadata(draft_path) if draft_path else None
        if drafter.spec_draft_vocab and not simple and (meta is None or meta["kind"] != "dflash"):
            raise ConfigError("spec_draft_vocab", f"the drafter's head is cut for {SIMPLE} and DFlash drafters; "
                                                  f"this run has {'a ' + meta['kind'] + ' drafter' if meta else 'none'}")
        if drafter.spec_draft_conf_min > 0 and (meta is None or meta["kind"] != "dspark"):
            raise ConfigError("spec_draft_conf_min", "draft conf-min cuts a DSpark drafter's chain by its confidence "
                                                     "head; this run has no DSpark drafter")
        block = _block_of(meta, drafter.block_size, spec.spec_draft_n_max)
        auto = drafter.tree_budget == "auto"
        budget = (AUTO_MAX_BUDGET if auto else drafter.tree_budget) if meta else None
        if weightless.chains and budget:
            raise ConfigError("spec_type", f"{','.join(weightless.chains)} beside draft-dflash verifies a chain; "
                                           "leave out --tree-budget")
        corpora_kinds = [k for k, _ in weightless.kinds if k not in weightless.chains]
        if corpora_kinds and budget:
            raise ConfigError("spec_type", f"{corpora_kinds[0]} beside a drafter verifies its tree or the drafter's "
                                           "chain; leave out --tree-budget")
        target_rules = target.placement()
        draft_rules = drafter.placement(target.device)
        n_verify = max(block or 1, (budget or 0) + 1, n_max + 1 if weightless.kinds else 1)
        simple_setup = None
        if simple:
            simple_setup = _simple_setup(draft, drafter.tree_budget, spec.spec_draft_n_max, drafter.spec_draft_n_min,
                                         drafter.draft_p_min, drafter.spec_draft_vocab, vocab_from, TargetConfig(
                                             n_ctx=drafter.n_ctx_draft or target.n_ctx, n_ubatch=target.n_ubatch,
                                             n_threads=target.n_threads, kv_type=kv_type, kv_type_v=kv_type_v,
                                             device=target.device, repack=target.repack,
                                             n_gpu_layers=drafter.n_gpu_layers_draft, n_seq=target.n_seq,
                                             tensor_overrides=draft_rules))
            n_verify = max(n_verify, simple_setup.lookahead)
        target_config = TargetConfig(
            n_ctx=target.n_ctx, n_ubatch=target.n_ubatch, n_verify=n_verify, n_threads=target.n_threads,
            kv_type=kv_type, kv_type_v=kv_type_v, feature_layers=meta["target_layers"] if meta else (),
            device=target.device, repack=target.repack, n_gpu_layers=target.n_gpu_layers, n_seq=target.n_seq,
            rope=RopeScaling(target.rope_scaling, float(target.rope_scale), target.yarn_orig_ctx),
            tensor_overrides=target_rules)
        # a chain cut by p_min reads its drafts' probabilities: the drafter ranks one candidate
        # (and beside the n-gram kinds or suffix, the drafter's confidence is its expected accepted length)
        top_k = drafter.draft_top_k if budget else (0 if drafter.draft_p_min == 0 and not weightless.kinds else 1)
        draft_config = None
        if meta is not None:
            window = meta["train_window"] if drafter.draft_window == "auto" else drafter.draft_window
            draft_config = DraftConfig(n_threads=target.n_threads, top_k=top_k, window=window,
                                       block_size=block if meta["kind"] in AUTOREGRESSIVE else 0,
                                       tensor_overrides=draft_rules)
        drafting = DraftingSetup(block, budget, auto, drafter.draft_p_min, drafter.chain_rule,
                                 float(drafter.spec_draft_conf_min))
        return cls(target_config, draft_config, target.n_threads, drafting, weightless, draft_path, simple_setup,
                   0 if simple else drafter.spec_draft_vocab, () if simple else vocab_from)


def _block_of(meta: Optional[dict], block_size: Optional[int], spec_draft_n_max: Optional[int]) -> Optional[int]:
    """The drafted block (the bonus token and the drafts) of a drafter file, None without
    one: an autoregressive drafter's drafts per step and the bonus (at most 64), a DFlash
    block at most the file's."""
    if meta is None:
        if block_size is not None:
            _count("block_size", block_size, 1, what="the block size")
        return None
    if meta["kind"] in AUTOREGRESSIVE:
        if block_size is None:
            block_size = (spec_draft_n_max or DEFAULT_MTP_DRAFTS) + 1
        return _count("block_size", block_size, 2, 64, what=f"the block size (the bonus and the {meta['kind']} drafts)")
    if spec_draft_n_max is not None and block_size is None:
        block_size = min(spec_draft_n_max + 1, meta["block_size"])  # a DFlash block: the bonus, then its drafts
    if block_size is not None:
        _count("block_size", block_size, 1, meta["block_size"], what="the block size")
    return block_size or meta["block_size"]


def _simple_setup(draft: str, tree_budget, n_max: Optional[int], n_min, p_min: Optional[float], draft_vocab: int,
                  draft_vocab_from: Tuple[str, ...], config: TargetConfig) -> SimpleSetup:
    """draft-simple's settings, checked: llama.cpp's defaults where left out (n_max 3,
    n_min 0, p_min 0); a --tree-budget number verifies the chain with the second choices
    beside it, and `auto` chooses each step between plain decoding and the chain, cut
    where it pays (SimpleProposer)."""
    auto = tree_budget == "auto"
    if auto:
        tree_budget = None
    n_max = DEFAULT_SIMPLE_N_MAX if n_max is None else n_max
    if tree_budget is not None and 1 + 2 * n_max > 64:
        raise ConfigError("spec_draft_n_max", f"{SIMPLE}'s tree has up to 1 + 2 x n-max nodes, at most 64: "
                                              f"n-max {n_max} is too long for a tree")
    # the drafter verifies its drafts but the last as a chain
    config = replace(config, n_verify=max(n_max, 2))
    return SimpleSetup(draft, config, n_max, n_min, DEFAULT_SIMPLE_P_MIN if p_min is None else float(p_min),
                       tree=tree_budget is not None, draft_vocab=draft_vocab, draft_vocab_from=draft_vocab_from,
                       auto=auto)
