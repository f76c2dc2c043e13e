"""An Engine's options, checked in one place before anything is loaded: what the target
and drafter are loaded with (TargetConfig, DraftConfig), how decoding drafts (block size,
tree budget, auto, the chain's confidence cut) and how many sequences it holds at once.
The Engine, the memory plan, dflash-run and dflash-server all take an EngineSetup; the
command lines only translate its ConfigError into their flags' words."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

from ..runtime import placement
from ..runtime.drafter import DraftConfig, read_draft_metadata
from ..runtime.drafter_kinds import reading
from ..runtime.errors import ConfigError
from ..runtime.target import KV_TYPES, ROPE_SCALING_TYPES, RopeScaling, TargetConfig
from ..speculation.kinds import (AUTOREGRESSIVE, DEFAULT_CHAIN_RULE, DEFAULT_MTP_DRAFTS, DEFAULT_SIMPLE_N_MAX,
                                 DEFAULT_SIMPLE_N_MIN, DEFAULT_SIMPLE_P_MIN, DEFAULT_SPEC_DRAFT_N_MAX, DRAFTER_KINDS,
                                 FILE_KIND_NAMES, FILE_KINDS, SIMPLE, TARGET_KINDS, WEIGHTLESS, check_chain_rule,
                                 check_p_min, parse_spec_types)
from ..speculation.kinds.kind import check_count as _count

# the largest tree `--tree-budget auto` grows to
AUTO_MAX_BUDGET = 32
# sequences a target holds at most (csrc: DFL_MAX_SEQ)
MAX_SEQ = 16


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


def drafter_path(model: str, draft: Optional[str], spec_type) -> Optional[str]:
    """The GGUF the drafter loads from: -md's, or the model's own for draft-mtp (its
    nextn layers); None without a drafter. spec_type as given (not yet checked)."""
    if draft:
        return draft
    if spec_type is None:
        return None
    names = spec_type.split(",") if isinstance(spec_type, str) else list(spec_type)
    return model if any(n.strip() in TARGET_KINDS for n in names) else None


def _placement_rules(option: str, overrides, cpu_option: str, cpu_moe, n_option: str, n_cpu_moe,
                     device: Optional[str]) -> tuple:
    """Weight placement rules by name (runtime/placement.py), checked: the explicit overrides in
    their order, then --cpu-moe's or --n-cpu-moe's."""
    if not isinstance(cpu_moe, bool):
        raise ConfigError(cpu_option, f"{cpu_option.replace('_', ' ')} is on or off (a bool), got {cpu_moe!r}")
    _count(n_option, n_cpu_moe, 0, what="the layers whose experts stay on the CPU")
    try:
        rules = placement.parse_rules(overrides) + placement.expert_rules(n_cpu_moe, cpu_moe)
        placement.check_devices(rules, device)
    except ValueError as e:
        raise ConfigError(option, str(e)) from None
    return rules


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

    @classmethod
    def of(cls, kinds: Sequence[str], values: Mapping[str, Any], spec_draft_n_max: int) -> "WeightlessSetup":
        """The enabled kinds' options from the kinds' keywords (`values`: every weightless
        kind's options are checked, enabled or not, as a command line's flags are)."""
        declared = {kw for kind in WEIGHTLESS.values() for _, kw, _ in kind.options.declared()}
        unknown = sorted(set(values) - declared)
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
        options = {name: kind.options.of(values) for name, kind in WEIGHTLESS.items()}
        return cls(tuple((k, options[k]) for k in kinds if k in WEIGHTLESS), spec_draft_n_max)

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
        if kv_type not in KV_TYPES:
            raise ConfigError("kv_type", f"unknown KV cache type {kv_type!r}; choose one of {', '.join(KV_TYPES)}")
        _count("draft_window", draft_window, 0, what="the draft window (0: the whole context)")
        simple = self.simple
        if simple is not None:
            simple = replace(simple, config=replace(simple.config, kv_type=kv_type))
        draft_config = self.draft_config
        if draft_config is not None:
            draft_config = replace(draft_config, window=draft_window)
        return replace(self, target_config=replace(self.target_config, kv_type=kv_type), draft_config=draft_config,
                       simple=simple)

    @classmethod
    def of(cls, model: str, draft: Optional[str] = None, *, n_ctx: int = 4096, n_ubatch: int = 512,
           n_threads: int = 0, kv_type: str = "f16", kv_type_v: Optional[str] = None,
           block_size: Optional[int] = None, tree_budget: Union[int, str, None] = None,
           draft_top_k: int = 8, device: Optional[str] = None, repack: bool = True,
           n_gpu_layers: int = -1, draft_window: int = 0,
           draft_p_min: Optional[float] = None, chain_rule: str = DEFAULT_CHAIN_RULE,
           n_seq: int = 1, spec_type=None, spec_draft_n_max: Optional[int] = None,
           spec_draft_conf_min: float = 0.0, rope_scaling: Optional[str] = None,
           rope_scale: float = 0.0, yarn_orig_ctx: int = 0, override_tensor=(), cpu_moe: bool = False,
           n_cpu_moe: int = 0, override_tensor_draft=(), cpu_moe_draft: bool = False,
           n_cpu_moe_draft: int = 0, spec_draft_n_min: int = 0, n_ctx_draft: int = 0,
           n_gpu_layers_draft: int = -1, spec_draft_vocab: int = 0,
           spec_draft_vocab_from: Union[str, Sequence[str]] = (), **kind_options) -> "EngineSetup":
        """`kind_options`: the weightless kinds' own (speculation/kinds/, e.g.
        spec_ngram_simple_size_n)."""
        _count("n_ctx", n_ctx, 1, what="the context size")
        _count("n_ubatch", n_ubatch, 1, what="the ubatch size")
        _count("n_threads", n_threads, 0, what="the thread count")
        _count("n_gpu_layers", n_gpu_layers, -1, what="the layers on the device")
        _count("n_seq", n_seq, 1, MAX_SEQ, what="the sequences held at once")
        for option, kv in (("kv_type", kv_type), ("kv_type_v", kv_type_v or kv_type)):
            if kv not in KV_TYPES:
                raise ConfigError(option, f"unknown KV cache type {kv!r}; choose one of {', '.join(KV_TYPES)}")
        kinds = resolve_spec_types(spec_type, model, draft)
        if spec_draft_n_max is not None:
            _count("spec_draft_n_max", spec_draft_n_max, 1, 63, what="the longest draft")
        if isinstance(spec_draft_conf_min, bool) or not isinstance(spec_draft_conf_min, (int, float)) \
                or not 0 <= spec_draft_conf_min <= 1:
            raise ConfigError("spec_draft_conf_min", f"draft conf-min must be 0..1, got {spec_draft_conf_min!r}")
        n_max = spec_draft_n_max or DEFAULT_SPEC_DRAFT_N_MAX
        weightless = WeightlessSetup.of(kinds, kind_options, n_max)
        simple = SIMPLE in kinds
        vocab_from = _vocab_from(spec_draft_vocab, spec_draft_vocab_from)
        draft_path = model if any(k in TARGET_KINDS for k in kinds) else (None if simple else draft)
        meta = read_draft_metadata(draft_path) if draft_path else None
        if spec_draft_vocab and not simple and (meta is None or meta["kind"] != "dflash"):
            raise ConfigError("spec_draft_vocab", f"the drafter's head is cut for {SIMPLE} and DFlash drafters; "
                                                  f"this run has {'a ' + meta['kind'] + ' drafter' if meta else 'none'}")
        if spec_draft_conf_min > 0 and (meta is None or meta["kind"] != "dspark"):
            raise ConfigError("spec_draft_conf_min", "draft conf-min cuts a DSpark drafter's chain by its confidence "
                                                     "head; this run has no DSpark drafter")
        block = _block_of(meta, block_size, spec_draft_n_max)
        auto = tree_budget == "auto"
        if tree_budget is not None and not auto:
            if isinstance(tree_budget, str):
                raise ConfigError("tree_budget", f"tree budget must be 1..63 or 'auto', got {tree_budget!r}")
            _count("tree_budget", tree_budget, 1, 63, what="the tree budget")
        budget = (AUTO_MAX_BUDGET if auto else tree_budget) if meta else None
        _count("draft_window", draft_window, 0, what="the draft window (0: the whole context)")
        _count("draft_top_k", draft_top_k, 1, 64, what="the draft top-k")
        if draft_p_min is not None:
            if isinstance(draft_p_min, float) and math.isnan(draft_p_min):
                raise ConfigError("draft_p_min", "draft p-min must be a number")
            check_p_min(draft_p_min)
        check_chain_rule(chain_rule)
        if weightless.chains and budget:
            raise ConfigError("spec_type", f"{','.join(weightless.chains)} beside draft-dflash verifies a chain; "
                                           "leave out --tree-budget")
        corpora_kinds = [k for k, _ in weightless.kinds if k not in weightless.chains]
        if corpora_kinds and budget:
            raise ConfigError("spec_type", f"{corpora_kinds[0]} beside a drafter verifies its tree or the drafter's "
                                           "chain; leave out --tree-budget")
        _check_rope(rope_scaling, rope_scale, yarn_orig_ctx)
        target_rules = _placement_rules("override_tensor", override_tensor, "cpu_moe", cpu_moe, "n_cpu_moe",
                                        n_cpu_moe, device)
        draft_rules = _placement_rules("override_tensor_draft", override_tensor_draft, "cpu_moe_draft",
                                       cpu_moe_draft, "n_cpu_moe_draft", n_cpu_moe_draft, device)
        n_verify = max(block or 1, (budget or 0) + 1, n_max + 1 if weightless.kinds else 1)
        simple_setup = None
        if simple:
            simple_setup = _simple_setup(draft, tree_budget, spec_draft_n_max, spec_draft_n_min, draft_p_min,
                                         spec_draft_vocab, tuple(map(str, vocab_from)), TargetConfig(n_ctx=n_ctx_draft or n_ctx, n_ubatch=n_ubatch,
                                                      n_threads=n_threads, kv_type=kv_type, kv_type_v=kv_type_v,
                                                      device=device, repack=repack, n_gpu_layers=n_gpu_layers_draft,
                                                      n_seq=n_seq, tensor_overrides=draft_rules))
            n_verify = max(n_verify, simple_setup.lookahead)
        target_config = TargetConfig(
            n_ctx=n_ctx, n_ubatch=n_ubatch, n_verify=n_verify, n_threads=n_threads, kv_type=kv_type,
            kv_type_v=kv_type_v, feature_layers=meta["target_layers"] if meta else (), device=device,
            repack=repack, n_gpu_layers=n_gpu_layers, n_seq=n_seq,
            rope=RopeScaling(rope_scaling, float(rope_scale), yarn_orig_ctx), tensor_overrides=target_rules)
        # a chain cut by p_min reads its drafts' probabilities: the drafter ranks one candidate
        # (and beside the n-gram kinds or suffix, the drafter's confidence is its expected accepted length)
        top_k = draft_top_k if budget else (0 if draft_p_min == 0 and not weightless.kinds else 1)
        draft_config = None
        if meta is not None:
            draft_config = DraftConfig(n_threads=n_threads, top_k=top_k, window=draft_window,
                                       block_size=block if meta["kind"] in AUTOREGRESSIVE else 0,
                                       tensor_overrides=draft_rules)
        drafting = DraftingSetup(block, budget, auto, draft_p_min, chain_rule, float(spec_draft_conf_min))
        return cls(target_config, draft_config, n_threads, drafting, weightless,
                   draft_path, simple_setup, 0 if simple else spec_draft_vocab,
                   () if simple else tuple(map(str, vocab_from)))


def _vocab_from(spec_draft_vocab: int, spec_draft_vocab_from) -> Tuple[str, ...]:
    """--spec-draft-vocab-from's files, checked (they need --spec-draft-vocab N)."""
    _count("spec_draft_vocab", spec_draft_vocab, 0, what="the drafter's kept tokens (0: all)")
    vocab_from = (spec_draft_vocab_from,) if isinstance(spec_draft_vocab_from, (str, os.PathLike)) \
        else tuple(spec_draft_vocab_from or ())
    if vocab_from and not spec_draft_vocab:
        raise ConfigError("spec_draft_vocab_from", "it chooses the tokens a cut head keeps: give how many "
                                                   "with --spec-draft-vocab N")
    missing = next((str(f) for f in vocab_from if not os.path.exists(f)), None)
    if missing is not None:
        raise ConfigError("spec_draft_vocab_from", f"{missing}: no such file or directory")
    return vocab_from


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


def _check_rope(rope_scaling: Optional[str], rope_scale, yarn_orig_ctx: int) -> None:
    if rope_scaling is not None and rope_scaling not in ROPE_SCALING_TYPES:
        raise ConfigError("rope_scaling", f"RoPE scaling must be one of {', '.join(ROPE_SCALING_TYPES)}, "
                          f"got {rope_scaling!r}")
    if isinstance(rope_scale, bool) or not isinstance(rope_scale, (int, float)) or not math.isfinite(rope_scale) \
            or rope_scale < 0:
        raise ConfigError("rope_scale", f"the RoPE context scale must be a number > 0 (0: the model's), "
                          f"got {rope_scale!r}")
    _count("yarn_orig_ctx", yarn_orig_ctx, 0, what="the original context of YaRN (0: the model's)")


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
    _count("spec_draft_n_min", n_min, 0, what="the shortest draft")
    _count("n_ctx_draft", config.n_ctx, 1, what="the drafter's context size")
    _count("n_gpu_layers_draft", config.n_gpu_layers, -1, what="the drafter's layers on the device")
    if tree_budget is not None and 1 + 2 * n_max > 64:
        raise ConfigError("spec_draft_n_max", f"{SIMPLE}'s tree has up to 1 + 2 x n-max nodes, at most 64: "
                                              f"n-max {n_max} is too long for a tree")
    # the drafter verifies its drafts but the last as a chain
    config = replace(config, n_verify=max(n_max, 2))
    return SimpleSetup(draft, config, n_max, n_min, DEFAULT_SIMPLE_P_MIN if p_min is None else float(p_min),
                       tree=tree_budget is not None, draft_vocab=draft_vocab, draft_vocab_from=draft_vocab_from,
                       auto=auto)
