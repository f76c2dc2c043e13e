"""An Engine's options, checked in one place before anything is loaded: what the target
and drafter are loaded with (TargetConfig, DraftConfig), how decoding drafts (block size,
tree budget, auto, the chain's confidence cut) and how many sequences it holds at once.
The Engine, the memory plan, dflash-run and dflash-server all take an EngineSetup; the
command lines only translate its ConfigError into their flags' words."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from .draft import DraftConfig, read_draft_metadata
from .target import KV_TYPES, TargetConfig

# the largest tree `--tree-budget auto` grows to
AUTO_MAX_BUDGET = 32
# sequences a target holds at most (csrc: DFL_MAX_SEQ)
MAX_SEQ = 16


class ConfigError(ValueError):
    """An option out of its range: `option` is its Engine keyword."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


# a sampled chain's accept rules (proposers.ChainProposer)
CHAIN_RULES = ("argmax", "reject")
DEFAULT_CHAIN_RULE = "argmax"


def check_chain_rule(rule: str) -> str:
    """The chain's accept rule when sampling (see speculative.speculative_steps), checked."""
    if rule not in CHAIN_RULES:
        raise ConfigError("chain_rule", f"chain rule must be one of {', '.join(CHAIN_RULES)}, got {rule!r}")
    return rule


def check_p_min(p_min: float) -> None:
    if isinstance(p_min, bool) or not isinstance(p_min, (int, float)) or not 0 <= p_min < 1:
        raise ConfigError("draft_p_min", f"draft p-min must be at least 0 and below 1, got {p_min}")


def _count(option: str, value, lo: int, hi: Optional[int] = None, what: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ConfigError(option, f"{what or option.replace('_', ' ')} must be {span}, got {value!r}")
    return value


# llama.cpp's --rope-scaling values, in its enum's order (the C runtime's type numbers)
ROPE_SCALING_TYPES = ("none", "linear", "yarn")


@dataclass
class EngineSetup:
    """What an Engine loads, derived and checked from its options (also what the memory
    plan is made of)."""

    block_size: Optional[int]
    tree_budget: Optional[int]
    auto_budget: bool
    target_config: TargetConfig
    draft_config: Optional[DraftConfig]
    n_threads: int
    draft_p_min: Optional[float] = None  # None: speculative.default_p_min of the loaded target
    chain_rule: str = DEFAULT_CHAIN_RULE  # a sampled chain's accept rule (speculative.speculative_steps)

    @property
    def n_seq(self) -> int:
        return self.target_config.n_seq

    @classmethod
    def of(cls, model: str, draft: Optional[str] = None, *, n_ctx: int = 4096, n_ubatch: int = 512,
           n_threads: int = 0, kv_type: str = "f16", kv_type_v: Optional[str] = None,
           block_size: Optional[int] = None, tree_budget: Union[int, str, None] = None,
           draft_top_k: int = 8, device: Optional[str] = None, repack: bool = True,
           n_gpu_layers: int = -1, draft_window: int = 0,
           draft_p_min: Optional[float] = None, chain_rule: str = DEFAULT_CHAIN_RULE,
           n_seq: int = 1, rope_scaling: Optional[str] = None, rope_scale: float = 0.0,
           yarn_orig_ctx: int = 0) -> "EngineSetup":
        _count("n_ctx", n_ctx, 1, what="the context size")
        _count("n_ubatch", n_ubatch, 1, what="the ubatch size")
        _count("n_threads", n_threads, 0, what="the thread count")
        _count("n_gpu_layers", n_gpu_layers, -1, what="the layers on the device")
        _count("n_seq", n_seq, 1, MAX_SEQ, what="the sequences held at once")
        for option, kv in (("kv_type", kv_type), ("kv_type_v", kv_type_v or kv_type)):
            if kv not in KV_TYPES:
                raise ConfigError(option, f"unknown KV cache type {kv!r}; choose one of {', '.join(KV_TYPES)}")
        meta = read_draft_metadata(draft) if draft else None
        if block_size is not None:
            _count("block_size", block_size, 1, meta["block_size"] if meta else None, what="the block size")
        block = (block_size or meta["block_size"]) if meta else None
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
        if rope_scaling is not None and rope_scaling not in ROPE_SCALING_TYPES:
            raise ConfigError("rope_scaling", f"RoPE scaling must be one of {', '.join(ROPE_SCALING_TYPES)}, "
                              f"got {rope_scaling!r}")
        if isinstance(rope_scale, bool) or not isinstance(rope_scale, (int, float)) or not math.isfinite(rope_scale) \
                or rope_scale < 0:
            raise ConfigError("rope_scale", f"the RoPE context scale must be a number > 0 (0: the model's), "
                              f"got {rope_scale!r}")
        _count("yarn_orig_ctx", yarn_orig_ctx, 0, what="the original context of YaRN (0: the model's)")
        n_verify = max(block or 1, (budget or 0) + 1)
        target_config = TargetConfig(
            n_ctx=n_ctx, n_ubatch=n_ubatch, n_verify=n_verify, n_threads=n_threads, kv_type=kv_type,
            kv_type_v=kv_type_v, feature_layers=meta["target_layers"] if meta else (), device=device,
            repack=repack, n_gpu_layers=n_gpu_layers, n_seq=n_seq, rope_scaling=rope_scaling,
            rope_scale=float(rope_scale), yarn_orig_ctx=yarn_orig_ctx)
        # a chain cut by p_min reads its drafts' probabilities: the drafter ranks one candidate
        top_k = draft_top_k if budget else (0 if draft_p_min == 0 else 1)
        draft_config = DraftConfig(n_threads=n_threads, top_k=top_k, window=draft_window) if draft else None
        return cls(block, budget, auto, target_config, draft_config, n_threads, draft_p_min, chain_rule)
