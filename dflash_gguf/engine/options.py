"""An Engine's options, typed at the door: dflash-run's and dflash-server's flags
(EngineOptions.from_args) and Engine(...)'s keywords (EngineOptions.of) become the same
three groups once, each checked when made, one place per rule: what the target is loaded
with (TargetOptions), how a drafter model drafts (DrafterOptions) and which kinds draft
with which settings (SpeculationOptions: --spec-type, the longest draft, and each
weightless kind's own options as speculation/kinds/ declares them). Sampling has its own
type (decoding.sampling.SamplingParams). The rules that need the files or two groups at
once are EngineSetup.of's (setup.py).

Each field says its flag (for the errors that name it, FLAGS) and how it is read from
argparse's namespace (its dest, or a function of the namespace where the flag is spelled
otherwise: --no-repack, -np's share of -c)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

from ..runtime import placement
from ..runtime.errors import ConfigError
from ..runtime.target import KV_TYPES, ROPE_SCALING_TYPES
from ..speculation.kinds import DEFAULT_CHAIN_RULE, WEIGHTLESS, check_chain_rule, check_p_min, parse_spec_types
from ..speculation.kinds.kind import check_count

# sequences a target holds at most (csrc: DFL_MAX_SEQ)
MAX_SEQ = 16


def setting(default, flag: str, read: Union[str, Callable[[Any], Any], None] = None):
    """A field of an options group: its default, its flag(s) as errors name them, and how
    argparse's namespace gives it (a dest, or a function of the namespace; None: the
    dest of the flag's long name)."""
    if read is None:
        read = flag.split("/")[-1].lstrip("-").replace("-", "_")
    return field(default=default, metadata={"flag": flag, "read": read})


def _n_seq(args) -> int:
    return getattr(args, "parallel", 1)


def _share(value: int, args) -> int:
    """dflash-server's -np N, as llama-server's: N slots share -c, each of -c / N positions;
    with --kv-unified each slot may hold all -c (llama-server's unified cache: a request is
    not held to -c / N)."""
    n_seq = _n_seq(args)
    if getattr(args, "kv_unified", False):
        return value
    return value // n_seq if n_seq >= 1 else value


def _layers_draft(value: Optional[str]) -> int:
    """-ngld as draft-simple's layers on the device: auto, all or left out -1 (all)."""
    return -1 if value in (None, "auto", "all") else int(value)


def _placement_rules(option: str, overrides, cpu_option: str, cpu_moe, n_option: str, n_cpu_moe,
                     device: Optional[str]) -> tuple:
    """Weight placement rules by name (runtime/placement.py), checked: the explicit overrides in
    their order, then --cpu-moe's or --n-cpu-moe's."""
    if not isinstance(cpu_moe, bool):
        raise ConfigError(cpu_option, f"{cpu_option.replace('_', ' ')} is on or off (a bool), got {cpu_moe!r}")
    check_count(n_option, n_cpu_moe, 0, what="the layers whose experts stay on the CPU")
    try:
        rules = placement.parse_rules(overrides) + placement.expert_rules(n_cpu_moe, cpu_moe)
        placement.check_devices(rules, device)
    except ValueError as e:
        raise ConfigError(option, str(e)) from None
    return rules


def check_kv(option: str, kv: str, auto: bool = True) -> None:
    """A KV cache type: one of KV_TYPES, or (auto) "auto", the memory plan's choice."""
    if not (auto and kv == "auto") and kv not in KV_TYPES:
        raise ConfigError(option, f"unknown KV cache type {kv!r}; choose one of {', '.join(KV_TYPES)}")


def check_window(window: int) -> None:
    """A drafter window: the last W positions, 0 the whole context."""
    check_count("draft_window", window, 0, what="the draft window (0: the whole context)")


@dataclass(frozen=True)
class TargetOptions:
    """What the target is loaded with: its context (n_ctx positions per sequence slot,
    n_seq slots), batch, threads, caches ("auto": the memory plan's choice), device and
    layers there, RoPE scaling and weight placement rules."""

    n_ctx: int = setting(4096, "-c/--ctx-size", lambda a: _share(a.ctx_size, a))
    n_ubatch: int = setting(512, "-ub/--ubatch-size", "ubatch_size")
    n_threads: int = setting(0, "-t/--threads", "threads")
    kv_type: str = setting("auto", "-ctk/--cache-type-k", "cache_type_k")
    kv_type_v: Optional[str] = setting(None, "-ctv/--cache-type-v", "cache_type_v")
    device: Optional[str] = setting(None, "--device")
    repack: bool = setting(True, "--no-repack", lambda a: not a.no_repack)
    n_gpu_layers: int = setting(-1, "-ngl/--n-gpu-layers", lambda a: -1 if a.n_gpu_layers is None else a.n_gpu_layers)
    n_seq: int = setting(1, "-np/--parallel", _n_seq)
    rope_scaling: Optional[str] = setting(None, "--rope-scaling")
    rope_scale: float = setting(0.0, "--rope-scale")
    yarn_orig_ctx: int = setting(0, "--yarn-orig-ctx")
    override_tensor: tuple = setting((), "-ot/--override-tensor", lambda a: tuple(a.override_tensor or ()))
    cpu_moe: bool = setting(False, "-cmoe/--cpu-moe", lambda a: False)  # argparse folds it into override_tensor
    n_cpu_moe: int = setting(0, "-ncmoe/--n-cpu-moe", lambda a: 0)

    def __post_init__(self):
        check_count("n_ctx", self.n_ctx, 1, what="the context size")
        check_count("n_ubatch", self.n_ubatch, 1, what="the ubatch size")
        check_count("n_threads", self.n_threads, 0, what="the thread count")
        check_count("n_gpu_layers", self.n_gpu_layers, -1, what="the layers on the device")
        check_count("n_seq", self.n_seq, 1, MAX_SEQ, what="the sequences held at once")
        check_kv("kv_type", self.kv_type)
        check_kv("kv_type_v", self.kv_type_v or self.kv_type)
        if self.rope_scaling is not None and self.rope_scaling not in ROPE_SCALING_TYPES:
            raise ConfigError("rope_scaling", f"RoPE scaling must be one of {', '.join(ROPE_SCALING_TYPES)}, "
                              f"got {self.rope_scaling!r}")
        scale = self.rope_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
            raise ConfigError("rope_scale", f"the RoPE context scale must be a number > 0 (0: the model's), "
                              f"got {scale!r}")
        check_count("yarn_orig_ctx", self.yarn_orig_ctx, 0, what="the original context of YaRN (0: the model's)")
        self.placement()

    def placement(self) -> tuple:
        """The target's weight placement rules, checked."""
        return _placement_rules("override_tensor", self.override_tensor, "cpu_moe", self.cpu_moe, "n_cpu_moe",
                                self.n_cpu_moe, self.device)


@dataclass(frozen=True)
class DrafterOptions:
    """How a drafter model drafts: its block, the tree it verifies ("auto": chosen each
    step), its candidates, window ("auto": the memory plan's choice), its chain's cuts and
    a sampled chain's accept rule; draft-simple's shortest draft, context and layers on
    the device; the drafter's head cut (FR-Spec) and its weight placement rules."""

    block_size: Optional[int] = setting(None, "--block-size")
    tree_budget: Union[int, str, None] = setting(None, "--tree-budget")
    draft_top_k: int = setting(8, "--draft-top-k")
    draft_window: Union[int, str] = setting("auto", "--draft-window")
    draft_p_min: Optional[float] = setting(None, "--draft-p-min")
    chain_rule: str = setting(DEFAULT_CHAIN_RULE, "--chain-rule")
    spec_draft_conf_min: float = setting(0.0, "--spec-draft-conf-min")
    spec_draft_n_min: int = setting(0, "--spec-draft-n-min")
    spec_draft_vocab: int = setting(0, "--spec-draft-vocab")
    spec_draft_vocab_from: Tuple[str, ...] = setting((), "--spec-draft-vocab-from",
                                                     lambda a: tuple(a.spec_draft_vocab_from))
    n_ctx_draft: int = setting(0, "-cd/--ctx-size-draft", lambda a: _share(a.ctx_size_draft, a))
    n_gpu_layers_draft: int = setting(-1, "-ngld/--gpu-layers-draft", lambda a: _layers_draft(a.gpu_layers_draft))
    override_tensor_draft: tuple = setting((), "-otd/--override-tensor-draft",
                                           lambda a: tuple(a.override_tensor_draft or ()))
    cpu_moe_draft: bool = setting(False, "-cmoed/--cpu-moe-draft", lambda a: False)
    n_cpu_moe_draft: int = setting(0, "-ncmoed/--n-cpu-moe-draft", lambda a: 0)

    def __post_init__(self):
        budget = self.tree_budget
        if budget is not None and budget != "auto":
            if isinstance(budget, str):
                raise ConfigError("tree_budget", f"tree budget must be 1..63 or 'auto', got {budget!r}")
            check_count("tree_budget", budget, 1, 63, what="the tree budget")
        if self.draft_window != "auto":
            check_window(self.draft_window)
        check_count("draft_top_k", self.draft_top_k, 1, 64, what="the draft top-k")
        if self.draft_p_min is not None:
            if isinstance(self.draft_p_min, float) and math.isnan(self.draft_p_min):
                raise ConfigError("draft_p_min", "draft p-min must be a number")
            check_p_min(self.draft_p_min)
        check_chain_rule(self.chain_rule)
        conf = self.spec_draft_conf_min
        if isinstance(conf, bool) or not isinstance(conf, (int, float)) or not 0 <= conf <= 1:
            raise ConfigError("spec_draft_conf_min", f"draft conf-min must be 0..1, got {conf!r}")
        check_count("spec_draft_n_min", self.spec_draft_n_min, 0, what="the shortest draft")
        check_count("n_ctx_draft", self.n_ctx_draft, 0, what="the drafter's context size")
        check_count("n_gpu_layers_draft", self.n_gpu_layers_draft, -1, what="the drafter's layers on the device")
        self.vocab_from()

    def vocab_from(self) -> Tuple[str, ...]:
        """--spec-draft-vocab-from's files, checked (they need --spec-draft-vocab N)."""
        check_count("spec_draft_vocab", self.spec_draft_vocab, 0, what="the drafter's kept tokens (0: all)")
        given = self.spec_draft_vocab_from
        files = (given,) if isinstance(given, (str, os.PathLike)) else tuple(given or ())
        if files and not self.spec_draft_vocab:
            raise ConfigError("spec_draft_vocab_from", "it chooses the tokens a cut head keeps: give how many "
                                                       "with --spec-draft-vocab N")
        missing = next((str(f) for f in files if not os.path.exists(f)), None)
        if missing is not None:
            raise ConfigError("spec_draft_vocab_from", f"{missing}: no such file or directory")
        return tuple(map(str, files))

    def placement(self, device: Optional[str]) -> tuple:
        """The drafter's weight placement rules on the target's device, checked."""
        return _placement_rules("override_tensor_draft", self.override_tensor_draft, "cpu_moe_draft",
                                self.cpu_moe_draft, "n_cpu_moe_draft", self.n_cpu_moe_draft, device)


def _kinds_from_args(args) -> Dict[str, Any]:
    return {name: kind.options.of(vars(args)) for name, kind in WEIGHTLESS.items()}


@dataclass(frozen=True)
class SpeculationOptions:
    """Which kinds draft (--spec-type: a comma list or a sequence of llama.cpp's names,
    checked; None: the drafter file's own kind, or plain decoding without one), the
    longest draft (None: each kind's default), and every weightless kind's options by
    name (speculation/kinds/: their own flags, checked by their types)."""

    spec_type: Optional[Tuple[str, ...]] = setting(None, "--spec-type",
                                                   lambda a: None if a.no_spec else a.spec_type)
    spec_draft_n_max: Optional[int] = setting(None, "--spec-draft-n-max")
    kinds: Mapping[str, Any] = setting(None, "--spec-type", _kinds_from_args)

    def __post_init__(self):
        if self.spec_type is not None:
            object.__setattr__(self, "spec_type", parse_spec_types(self.spec_type))
        if self.spec_draft_n_max is not None:
            check_count("spec_draft_n_max", self.spec_draft_n_max, 1, 63, what="the longest draft")
        given = dict(self.kinds or {})
        object.__setattr__(self, "kinds", {name: given.get(name) or kind.options()
                                           for name, kind in WEIGHTLESS.items()})


# every weightless kind's options by Engine keyword: (kind, its options' field)
_KIND_KEYWORDS = {kw: name for name, kind in WEIGHTLESS.items() for _, kw, _ in kind.options.declared()}


@dataclass(frozen=True)
class EngineOptions:
    """An Engine's options in their groups (sampling is each request's)."""

    target: TargetOptions = TargetOptions()
    drafter: DrafterOptions = DrafterOptions()
    speculation: SpeculationOptions = SpeculationOptions()

    @classmethod
    def of(cls, **keywords) -> "EngineOptions":
        """From Engine(...)'s keywords: each group's fields by name, and the weightless
        kinds' options by their flags' names (spec_ngram_simple_size_n, ...); an unknown
        keyword is a TypeError, as a function's."""
        groups = {}
        for group in (TargetOptions, DrafterOptions):
            names = {f.name for f in fields(group)}
            groups[group] = group(**{k: v for k, v in keywords.items() if k in names})
        spec = {k: v for k, v in keywords.items() if k in ("spec_type", "spec_draft_n_max")}
        kinds = {name: kind.options.of(keywords) for name, kind in WEIGHTLESS.items()}
        known = {f.name for g in (TargetOptions, DrafterOptions) for f in fields(g)} | set(spec) | set(_KIND_KEYWORDS)
        unknown = sorted(set(keywords) - known)
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
        return cls(groups[TargetOptions], groups[DrafterOptions], SpeculationOptions(**spec, kinds=kinds))

    @classmethod
    def from_args(cls, args) -> "EngineOptions":
        """From add_engine_args' flags (with dflash-server's -np N)."""
        def read(group):
            return group(**{f.name: f.metadata["read"](args) if callable(f.metadata["read"])
                            else getattr(args, f.metadata["read"]) for f in fields(group)})
        return cls(read(TargetOptions), read(DrafterOptions), read(SpeculationOptions))

    def with_memory(self, kv_type: str, draft_window: int) -> "EngineOptions":
        """These options with the KV cache type and drafter window chosen (memory.settle)."""
        return replace(self, target=replace(self.target, kv_type=kv_type),
                       drafter=replace(self.drafter, draft_window=draft_window))


# the flag of each option, for its errors
FLAGS = {**{f.name: f.metadata["flag"] for g in (TargetOptions, DrafterOptions, SpeculationOptions)
            for f in fields(g)},
         **{kw: f.metadata["flag"] for kind in WEIGHTLESS.values() for _, kw, f in kind.options.declared()}}
