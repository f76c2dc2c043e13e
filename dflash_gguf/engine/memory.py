"""Memory plan: what a target (and drafter) configuration needs on each device,
computed by the C runtime before anything is allocated (dfl_plan_memory): the same
placement, caches and graphs as a real load, the graphs measured by ggml's allocator."""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

from ..runtime import placement
from ..runtime.drafter import DraftConfig, draft_params
from ..runtime.native import check, ffi, lib
from ..runtime.target import TargetConfig, target_params
from .options import EngineOptions
from .setup import EngineSetup

PARTS = {
    "target_weights": "target weights",
    "draft_weights": "drafter weights",
    "kv_cache": "attention KV cache",
    "recurrent_state": "recurrent + conv state",
    "verify_scratch": "verify scratch + features",
    "draft_cache": "drafter context cache",
    "target_compute": "target compute buffers",
    "draft_compute": "drafter compute buffers",
}
# the target's weights by tensor group (parts of target_weights, not added to the need):
# where each lives when some are placed by name (-ot, --n-cpu-moe)
WEIGHT_GROUPS = {
    "target_embd": "token embedding",
    "target_layers": "layers (attention, dense FFN, ...)",
    "target_experts": "routed experts",
    "target_output": "LM head",
}
MIB = 1 << 20


@dataclass
class DevicePlan:
    name: str
    free: int
    total: int
    parts: Dict[str, int] = field(default_factory=dict)
    groups: Dict[str, int] = field(default_factory=dict)  # WEIGHT_GROUPS' bytes, of parts["target_weights"]

    @property
    def need(self) -> int:
        return sum(self.parts.values())


@dataclass
class MemoryPlan:
    devices: List[DevicePlan]

    def to_json(self) -> dict:
        return {"devices": [{"name": d.name, "free": d.free, "total": d.total, "need": d.need, **d.parts,
                             "weight_groups": d.groups} for d in self.devices]}

    def format(self) -> str:
        names = [d.name for d in self.devices]
        rows = [f"{'part':<36}" + "".join(f"{n:>14}" for n in names)]
        for key, label in PARTS.items():
            rows.append(f"{label:<36}" + "".join(f"{d.parts[key] / MIB:>10.1f} MiB" for d in self.devices))
            if key == "target_weights":
                for group, what in WEIGHT_GROUPS.items():
                    rows.append(f"{'  ' + what:<36}" +
                                "".join(f"{d.groups.get(group, 0) / MIB:>10.1f} MiB" for d in self.devices))
        rows.append(f"{'total':<36}" + "".join(f"{d.need / MIB:>10.1f} MiB" for d in self.devices))
        rows.append(f"{'device free / total':<36}" +
                    "".join(f"{d.free / MIB:>6.0f}/{d.total / MIB:.0f}".rjust(14) for d in self.devices))
        return "\n".join(rows)

    def over(self, limit: Optional[int] = None, check_free: bool = True) -> List[str]:
        """Devices whose need exceeds their reported free memory (check_free; not the
        CPU's, whose weights are mapped from the file) or, for the model's device (the
        first: an accelerator, or the CPU when everything runs there), `limit` bytes. Host
        memory beside an accelerator is not limited by `limit`: it holds what was placed
        there to spare the device (-ngl, --n-cpu-moe)."""
        out = []
        for k, d in enumerate(self.devices):
            cap = [c for c in (limit if k == 0 else None,
                               d.free if check_free and d.name != "CPU" and d.free else None) if c]
            if cap and d.need > min(cap):
                out.append(f"{d.name} needs {d.need / MIB:.0f} MiB of {min(cap) / MIB:.0f} MiB "
                           f"(largest: {self.largest(d)})")
        return out

    @staticmethod
    def largest(d: DevicePlan, n: int = 3) -> str:
        top = sorted(d.parts.items(), key=lambda kv: -kv[1])[:n]
        return ", ".join(f"{PARTS[k]} {v / MIB:.0f} MiB" for k, v in top if v)


def plan_memory(model: str, draft: Optional[str], target_config: TargetConfig,
                draft_config: Optional[DraftConfig] = None) -> MemoryPlan:
    tp, _device = target_params(target_config, model)
    dp = draft_params(draft_config or DraftConfig(), draft) if draft else ffi.NULL
    plan = ffi.new("dfl_plan *")
    check(lib.dfl_plan_memory(str(model).encode(), tp, str(draft).encode() if draft else ffi.NULL, dp, plan))
    devices = []
    for k in range(plan.n_devices):
        d = plan.devices[k]
        groups = {key: int(getattr(d, key)) for key in WEIGHT_GROUPS if key != "target_layers"}
        groups["target_layers"] = int(d.target_weights) - sum(groups.values())
        devices.append(DevicePlan(ffi.string(d.name).decode(), int(d.free), int(d.total),
                                  {key: int(getattr(d, key)) for key in PARTS}, groups))
    return MemoryPlan(devices)


# where a draft-simple drafter's needs go in the plan: it is planned as the model it is (a
# target), its parts counted as the drafter's
SIMPLE_PARTS = {"target_weights": "draft_weights", "kv_cache": "draft_cache", "recurrent_state": "draft_cache",
                "verify_scratch": "draft_cache", "target_compute": "draft_compute"}


def plan_setup(model: str, setup: EngineSetup) -> MemoryPlan:
    """The plan of an EngineSetup: its target and drafter, a draft-simple drafter's needs
    added to its device's as the drafter's parts, a DFlash drafter's cut head counted
    (--spec-draft-vocab: its size is what the plan needs, not which tokens it keeps)."""
    draft_config = setup.draft_config
    if setup.draft_vocab and draft_config is not None:
        draft_config = replace(draft_config, head_tokens=tuple(range(setup.draft_vocab)))
    plan = plan_memory(model, setup.draft_path, setup.target_config, draft_config)
    if setup.simple is not None:
        small = plan_memory(setup.simple.path, None, setup.simple.config)
        for d in small.devices:
            into = next((p for p in plan.devices if p.name == d.name), None)
            if into is None:
                plan.devices.append(into := DevicePlan(d.name, d.free, d.total, {k: 0 for k in PARTS}))
            for part, as_part in SIMPLE_PARTS.items():
                into.parts[as_part] += d.parts[part]
    return plan


def what_fits(model: str, draft: Optional[str], target_config: TargetConfig, draft_config: Optional[DraftConfig],
              plan: MemoryPlan, limit: Optional[int], check_free: bool = True) -> List[str]:
    """Single changes to the configuration that would fit: a quantized KV cache, a
    smaller context, a smaller tree budget, a drafter window, fewer sequences at once,
    routed experts in host memory (--n-cpu-moe), fewer layers on the device."""
    def fits(tc, dc):
        return not plan_memory(model, draft, tc, dc).over(limit, check_free)

    ideas = []
    for kv in ("q8_0", "q4_0"):
        if target_config.kv_type in ("f32", "f16", "bf16") or (kv == "q4_0" and target_config.kv_type == "q8_0"):
            if fits(replace(target_config, kv_type=kv, kv_type_v=kv), draft_config):
                ideas.append(f"-ctk {kv} (quantized KV cache)")
                break
    n_ctx = target_config.n_ctx // 2
    while n_ctx >= 1024:
        if fits(replace(target_config, n_ctx=n_ctx, n_ubatch=min(target_config.n_ubatch, n_ctx)), draft_config):
            ideas.append(f"-c {n_ctx} (a smaller context)")
            break
        n_ctx //= 2
    if draft and draft_config is not None and draft_config.window == 0:
        dc = replace(draft_config, window=4096)
        if fits(target_config, dc):
            ideas.append("--draft-window 4096 (the drafter keeps the last 4096 positions)")
    if target_config.n_verify > 17 and fits(replace(target_config, n_verify=17), draft_config):
        ideas.append("--tree-budget 16 (a smaller tree)")
    if target_config.n_seq > 1:
        total = target_config.n_ctx * target_config.n_seq  # -np shares -c
        for n_seq in range(target_config.n_seq - 1, 0, -1):
            if fits(replace(target_config, n_seq=n_seq, n_ctx=total // n_seq), draft_config):
                ideas.append(f"-np {n_seq} (fewer sequences at once)")
                break
    n_cpu_moe = smallest_n_cpu_moe(model, plan, fits, target_config, draft_config)
    if n_cpu_moe is not None:
        ideas.append(f"--n-cpu-moe {n_cpu_moe} (the routed experts of the first {n_cpu_moe} layers in host memory)")
    if len(plan.devices) > 1 and target_config.n_gpu_layers != 0:
        for ngl in range(64, -1, -4):
            if fits(replace(target_config, n_gpu_layers=ngl), draft_config):
                ideas.append(f"-ngl {ngl} (fewer layers on {plan.devices[0].name})")
                break
    return ideas


def expert_layers(model: str) -> int:
    """Layers of the model with routed experts (by their tensor names: placement.EXPERTS)."""
    layers = {int(m.group(1)) for name in placement.tensor_names(model)
              for m in [re.match(r"blk\.(\d+)" + placement.EXPERTS, name)] if m}
    return max(layers) + 1 if layers else 0


def smallest_n_cpu_moe(model: str, plan: MemoryPlan, fits, target_config: TargetConfig,
                       draft_config: Optional[DraftConfig]) -> Optional[int]:
    """The fewest layers whose routed experts, moved to host memory after the rules the
    configuration has (--n-cpu-moe N's rules), make it fit the device; None when the model
    runs on the CPU, has no experts, or fits no other way. The device's need only shrinks
    as N grows, so a bisection finds it."""
    n_layers = expert_layers(model) if len(plan.devices) > 1 else 0

    def fits_with(n: int) -> bool:
        rules = target_config.tensor_overrides + placement.expert_rules(n)
        return fits(replace(target_config, tensor_overrides=rules), draft_config)

    if n_layers == 0 or not fits_with(n_layers):
        return None
    lo, hi = 0, n_layers  # fits_with(hi); lo: not known to fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits_with(mid) else (mid, hi)
    return hi


class MemoryPlanError(ValueError):
    """A configuration that does not fit, refused before anything was allocated."""


AUTO_DRAFT_WINDOW = 4096


def settle(model: str, draft: Optional[str], options: EngineOptions, limit_mib: Optional[int] = None):
    """Choose the "auto" options (kv_type, draft_window) so that the plan fits the
    devices and the limit, preferring what changes the output least: an f16 cache with
    the drafter's context as it was trained (the window its file records, else the whole
    context), then a 4096-position drafter window (still lossless), then q8_0 and q4_0
    caches. Returns (setup, plan, what does not fit: empty when it fits)."""
    limit = limit_mib * MIB if limit_mib else None
    kv, window = options.target.kv_type, options.drafter.draft_window
    kvs = ["f16", "q8_0", "q4_0"] if kv == "auto" else [kv]
    # the options checked and the drafter's file read once; a window left "auto" is then the
    # one the drafter was trained on where its file says (0: the whole context), else 4096
    checked = EngineSetup.of(model, draft, options.with_memory(kvs[0], window))
    drafted = checked.draft_config
    windows = [drafted.window if drafted is not None else 0] if window == "auto" else [window]
    if window == "auto" and drafted is not None and not 0 < windows[0] <= AUTO_DRAFT_WINDOW:
        windows.append(AUTO_DRAFT_WINDOW)
    first = None
    for kv in kvs:
        for window in windows:
            setup = checked.with_memory(kv, window)
            plan = plan_setup(model, setup)
            over = plan.over(limit)
            if not over:
                return setup, plan, []
            first = first or (setup, plan, over)
    return first


def refusal(model: str, draft: Optional[str], setup, plan: MemoryPlan, over: List[str],
            limit_mib: Optional[int]) -> MemoryPlanError:
    """The error for a plan that does not fit: what is over, its biggest parts, and single
    changes that would fit."""
    ideas = what_fits(model, setup.draft_path, setup.target_config, setup.draft_config, plan,
                      limit_mib * MIB if limit_mib else None)
    hint = f"; would fit: {'; or '.join(ideas)}" if ideas else "; no single smaller setting fits"
    return MemoryPlanError("not enough memory: " + "; ".join(over) + hint)
