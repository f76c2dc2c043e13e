"""A target model on the C runtime (qwen35, qwen35moe, qwen3, qwen2, gemma3, gemma4 or gpt-oss): decode, verify,
commit, and the results of the last call."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

from . import placement
from .native import NativeObject, check, ffi, lib, own_ggml_log

LOGITS_NONE, LOGITS_LAST, LOGITS_ALL = 0, 1, 2
DECODE, CHAIN, TREE = lib.DFL_STEP_DECODE, lib.DFL_STEP_CHAIN, lib.DFL_STEP_TREE
# the most rows a step may have for each of its rows to round as one-row decoding does: the
# patched CPU kernels' flash attention takes its tiled kernel past it (docs/exactness.md)
INVARIANT_STEP_ROWS = 256


@dataclass
class Rows:
    """One sequence's rows in a Target.step: a decode (append `tokens`, with logits for
    none, the last or every row), a chain verify (`tokens`, or None for the first n
    tokens of the drafter's last block for this sequence) or a tree verify (`tokens`
    with their `parents`)."""

    seq: int
    kind: int
    tokens: Optional[Sequence[int]] = None
    parents: Optional[Sequence[int]] = None
    logits: int = LOGITS_ALL
    n: Optional[int] = None  # a chain of the drafter's block: its length

    @property
    def n_rows(self) -> int:
        return len(self.tokens) if self.tokens is not None else int(self.n)

    @property
    def n_out(self) -> int:
        """Its rows with logits (and choices) in the step's results."""
        if self.kind != DECODE:
            return self.n_rows
        return {LOGITS_NONE: 0, LOGITS_LAST: 1}.get(self.logits, self.n_rows)

KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2}
# llama.cpp's --rope-scaling values, in its enum's order (the C runtime's type numbers)
ROPE_SCALING_TYPES = ("none", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE's scaling over what the model file says (--rope-scaling, --rope-scale,
    --yarn-orig-ctx): the type (none / linear / yarn; None: the file's), the context scale
    factor (freq_scale = 1 / it; 0: the file's) and YaRN's original context (0: the file's)."""

    type: Optional[str] = None
    scale: float = 0.0
    yarn_orig_ctx: int = 0


@dataclass
class TargetConfig:
    """How a target is loaded. feature_layers use llama.cpp's convention (L is the
    input of layer L, i.e. the output of HF layer L-1)."""

    n_ctx: int = 4096
    n_ubatch: int = 512
    n_verify: int = 16
    n_threads: int = 0
    kv_type: str = "f16"
    kv_type_v: Optional[str] = None  # None: the same as kv_type
    feature_layers: Sequence[int] = field(default_factory=tuple)
    device: Optional[str] = None
    repack: bool = True  # let the CPU backend repack quantized matrices for speed
    # with an accelerator: the last n layers (and the LM head when n > n_layer) on it,
    # the rest on the CPU; -1: everything on the accelerator
    n_gpu_layers: int = -1
    n_seq: int = 1  # sequence slots, each of n_ctx positions
    rope: RopeScaling = RopeScaling()
    # weights placed by name: (pattern, device) rules, the first matching one decides
    # (runtime/placement.py: -ot, --cpu-moe, --n-cpu-moe); the rest are placed by n_gpu_layers
    tensor_overrides: tuple = ()
    # the output head cut to these token ids (FR-Spec's drafter head): logits are one per
    # kept token, in this order; choices and candidates still come back as token ids.
    # None: the whole vocabulary
    head_tokens: Optional[Sequence[int]] = None


def set_head_tokens(params, tokens: Sequence[int], what: str) -> None:
    """params.head_tokens (a dfl_target_params or dfl_draft_params): the kept token ids of
    a cut head, alive as long as the struct."""
    if len(tokens) == 0:
        raise ValueError(f"{what} cut to no tokens: keep at least one (None: the whole head)")
    kept = ffi.new("int32_t[]", [int(t) for t in tokens])
    params.n_head_tokens, params.head_tokens = len(tokens), kept
    placement._keep[params] = placement._keep.get(params, ()) + (kept,)


def target_params(cfg: TargetConfig, path: Optional[str] = None):
    """The C runtime's dfl_target_params for a config (checked) and the model at `path`
    (which its tensor overrides are resolved against); keep the result alive while the
    C side may read its device string."""
    for kv in (cfg.kv_type, cfg.kv_type_v or cfg.kv_type):
        if kv not in KV_TYPES:
            raise ValueError(f"unknown KV cache type {kv!r}; choose one of {', '.join(KV_TYPES)}")
    p = ffi.new("dfl_target_params *")
    lib.dfl_target_default_params(p)
    p.n_ctx, p.n_ubatch, p.n_verify, p.n_threads = cfg.n_ctx, cfg.n_ubatch, cfg.n_verify, cfg.n_threads
    p.kv_type = KV_TYPES[cfg.kv_type]
    p.kv_type_v = KV_TYPES[cfg.kv_type_v or cfg.kv_type]
    p.no_repack = 0 if cfg.repack else 1
    if cfg.n_gpu_layers < -1:
        raise ValueError(f"n_gpu_layers must be >= -1, got {cfg.n_gpu_layers}")
    p.n_gpu_layers = cfg.n_gpu_layers
    p.n_seq = int(cfg.n_seq)
    rope = cfg.rope
    p.rope_scaling_type = -1 if rope.type is None else ROPE_SCALING_TYPES.index(rope.type)
    p.rope_freq_scale = 1.0 / rope.scale if rope.scale > 0 else 0.0
    p.yarn_orig_ctx = int(rope.yarn_orig_ctx)
    layers = list(cfg.feature_layers)
    if len(layers) > 16:
        raise ValueError("at most 16 feature layers are supported")
    p.n_feature_layers = len(layers)
    for i, layer in enumerate(layers):
        p.feature_layers[i] = int(layer)
    device = ffi.new("char[]", cfg.device.encode()) if cfg.device else ffi.NULL
    p.device = device
    if cfg.head_tokens is not None:
        set_head_tokens(p, cfg.head_tokens, "an output head")
    if cfg.tensor_overrides:
        if path is None:
            raise ValueError("tensor overrides are resolved against a model file: give its path")
        placement.attach(p, cfg.tensor_overrides, str(path))
    return p, device


# dfl_target_info's numeric fields, as Target.info() gives them
_INFO_NUMBERS = (
    "n_vocab", "n_head", "n_embd", "n_layer", "n_ctx_train", "n_ctx", "n_ubatch", "n_verify", "n_seq", "n_past",
    "n_gpu_layers", "n_graphs", "n_graph_builds", "n_threads", "n_threads_in_use", "n_weight_buffers",
    "compute_bytes", "n_last_nodes", "n_last_replay", "n_host_writes", "n_host_reads", "n_host_write_bytes",
    "n_host_read_bytes", "host_layer_weights", "n_last_splits", "last_copy_bytes", "copy_bytes")


class _OneCallSteps:
    """The arguments and results of a target's steps made in one call of the library
    (Target.decode_next, Target.chain_step), allocated once for its sequence slots:
    plain decoding crosses into the library once a token and allocates nothing for it,
    and a chain step likewise."""

    def __init__(self, n_seq: int, n_verify: int):
        self.seqs, self.tokens = ffi.new("int32_t[]", n_seq), ffi.new("int32_t[]", n_seq)
        self.u, self.out = ffi.new("float[]", n_seq), ffi.new("int32_t[]", n_seq)
        self.copies = ffi.new("int64_t[2]")  # the step's graph_copies(), read with its results
        # chain_step's entries, each slot's drafts, and its (drafting, verifying) time
        self.chain_entries = ffi.new("dfl_chain_seq[]", n_seq)
        self.chain_outs = [ffi.new("int32_t[]", n_verify) for _ in range(n_seq)]
        self.chain_us = ffi.new("int64_t[2]")
        self.chain_seconds = (0.0, 0.0)
        self.chain_drafted: List[int] = []  # per sequence of the last chain_step, the drafts verified

    def decode_next(self, handle, source, seqs: Sequence[int], tokens: Sequence[int],
                    uniforms: Sequence[float]) -> list:
        n = len(seqs)
        s, t, u = self.seqs, self.tokens, self.u
        for i in range(n):
            s[i], t[i], u[i] = seqs[i], tokens[i], uniforms[i]
        check(lib.dfl_target_decode_next(handle, source, s, t, u, n, self.out, self.copies))
        return ffi.unpack(self.out, n)

    def chain_step(self, handle, draft, blocks: Sequence[tuple], p_min: float) -> List[List[int]]:
        n = len(blocks)
        entries, outs = self.chain_entries, self.chain_outs
        keep = []
        for e, (seq, bonus, n_block, tokens) in zip(entries, blocks):
            arr = np.ascontiguousarray(tokens, dtype=np.int32)
            keep.append(arr)
            if len(outs[seq]) < n_block:  # the slot's drafts buffer, grown once to the block size
                outs[seq] = ffi.new("int32_t[]", int(n_block))
            e.seq, e.bonus, e.n_block, e.out = int(seq), int(bonus), int(n_block), outs[seq]
            e.tokens = ffi.from_buffer("int32_t[]", arr) if len(arr) else ffi.NULL
            e.n_tokens = len(arr)
        us = self.chain_us
        check(lib.dfl_chain_step(handle, draft._handle(), entries, n, float(p_min), self.copies, us))
        self.chain_seconds = (us[0] * 1e-6, us[1] * 1e-6)
        self.chain_drafted = [int(entries[i].n_verified) - 1 for i in range(n)]
        return [ffi.unpack(entries[i].out, entries[i].n_out) for i in range(n)]


class Target(NativeObject):
    _what = "target"
    _free = staticmethod(lib.dfl_target_free)
    _last_placement = staticmethod(lib.dfl_target_last_placement)

    def __init__(self, path: str, config: Optional[TargetConfig] = None):
        cfg = config or TargetConfig()
        p, _device = target_params(cfg, path)
        layers = list(cfg.feature_layers)
        out = ffi.new("dfl_target **")
        own_ggml_log()
        check(lib.dfl_target_load(str(path).encode(), p, out))
        self._ptr = out[0]
        self.path = str(path)
        self.config = cfg
        info = self.info()
        self.n_vocab = info["n_vocab"]
        self.n_head = info["n_head"]  # the logits' width: n_vocab unless the head is cut
        # a cut head's row -> token id (None: rows are token ids)
        self.head_tokens = None if cfg.head_tokens is None else np.asarray(cfg.head_tokens, dtype=np.int32)
        self.n_embd = info["n_embd"]
        self.n_ctx = info["n_ctx"]
        self.n_ubatch = info["n_ubatch"]
        self.n_verify = info["n_verify"]
        self.n_seq = info["n_seq"]
        self.n_features = len(layers)
        self._choices = np.zeros(max(self.n_ubatch, self.n_seq * self.n_verify), dtype=np.int32)
        self._one_call = _OneCallSteps(self.n_seq, self.n_verify)

    # -- state --------------------------------------------------------------------
    def info(self) -> dict:
        """dfl_target_info's fields: sizes, placement, graph and copy counters."""
        info = ffi.new("dfl_target_info *")
        check(lib.dfl_target_get_info(self._handle(), info))
        out = {name: getattr(info, name) for name in _INFO_NUMBERS}
        out.update((name, ffi.string(getattr(info, name)).decode()) for name in ("device", "arch"))
        return out

    def graph_copies(self) -> tuple:
        """(splits, bytes copied between devices) of the last graph computed: its runs on
        one backend, and the inputs the scheduler copies from one to another per compute."""
        info = ffi.new("dfl_target_info *")
        check(lib.dfl_target_get_info(self._handle(), info))
        return int(info.n_last_splits), int(info.last_copy_bytes)

    def last_copies(self) -> tuple:
        """graph_copies() of decode_next's or chain_step's step, which read them with its results."""
        copies = self._one_call.copies
        return int(copies[0]), int(copies[1])

    @property
    def chain_seconds(self) -> tuple:
        """The last chain_step's (drafting, verifying) seconds."""
        return self._one_call.chain_seconds

    @property
    def chain_drafted(self) -> List[int]:
        """Per sequence of the last chain_step, the drafts it verified (those the p_min cut kept)."""
        return self._one_call.chain_drafted

    @property
    def n_past(self) -> int:
        """Positions sequence 0 holds (seq_n_past: any sequence's)."""
        return self.seq_n_past(0)

    def seq_n_past(self, seq: int) -> int:
        n = lib.dfl_target_n_past(self._handle(), int(seq))
        if n < 0:
            raise ValueError(f"sequence {seq} is outside 0..{self.n_seq - 1}")
        return int(n)

    def settled(self, seq: int) -> bool:
        """The sequence's state is its position's (no verify or commit pending): a
        checkpoint of it may be taken."""
        return bool(lib.dfl_target_settled(self._handle(), int(seq)))

    def reset(self) -> None:
        """Forget every sequence's context."""
        check(lib.dfl_target_reset(self._handle()))

    def seq_reset(self, seq: int) -> None:
        """Forget one sequence's context (its slot is free)."""
        check(lib.dfl_target_seq_reset(self._handle(), int(seq)))

    def seq_truncate(self, seq: int, n_past: int) -> None:
        """Forget the sequence's positions from n_past on (after a decode; attention
        memories only: see can_truncate)."""
        check(lib.dfl_target_seq_truncate(self._handle(), int(seq), int(n_past)))

    def can_truncate(self) -> bool:
        """Whether seq_truncate can take positions back (no recurrent layers): asked of
        an empty slot, which it leaves empty."""
        slot = next((s for s in range(self.n_seq) if self.seq_n_past(s) == 0), None)
        return slot is not None and lib.dfl_target_seq_truncate(self._handle(), slot, 0) == 0

    def seq_copy(self, src: int, dst: int) -> None:
        """Slot dst holds what slot src holds (after a decode: no verify pending)."""
        check(lib.dfl_target_seq_copy(self._handle(), int(src), int(dst)))

    # -- evaluation -----------------------------------------------------------------
    @staticmethod
    def _tokens(tokens) -> np.ndarray:
        return np.ascontiguousarray(tokens, dtype=np.int32)

    def step(self, rows: Sequence[Rows], draft=None) -> None:
        """One graph over the rows of several sequences (each at most once); the results
        (logits, choices, candidates, features) are their rows in this order. Chain rows
        without tokens read the drafter's last block on the device (draft.device_tokens())."""
        entries = ffi.new("dfl_rows[]", len(rows))
        keep = []
        for e, r in zip(entries, rows):
            e.seq, e.kind, e.logits = int(r.seq), int(r.kind), int(r.logits)
            if r.tokens is not None:
                arr = self._tokens(r.tokens)
                keep.append(arr)
                e.tokens = ffi.from_buffer("int32_t[]", arr)
                e.n = len(arr)
            else:
                e.tokens = ffi.NULL
                e.n = int(r.n)
            if r.parents is not None:
                par = np.ascontiguousarray(r.parents, dtype=np.int32)
                if len(par) != e.n:
                    raise ValueError("tokens and parents differ in length")
                keep.append(par)
                e.parents = ffi.from_buffer("int32_t[]", par)
        source = draft.device_tokens() if draft is not None else ffi.NULL
        check(lib.dfl_target_step(self._handle(), source, entries, len(rows)))

    def decode_next(self, seqs: Sequence[int], tokens: Sequence[int], uniforms: Sequence[float], draft=None) -> list:
        """Plain decoding's step: sequence seqs[i] appends tokens[i] and its row chooses the
        next token, with uniforms[i] when it samples (-1 when greedy); returns the choices
        (-1: see choices()). Penalties and masks are staged beforehand, as for step();
        graph_copies() is the step's. draft: the sequences' drafter, whose feature rows
        the target keeps while it lacks them (as for step())."""
        source = draft.device_tokens() if draft is not None else ffi.NULL
        return self._one_call.decode_next(self._handle(), source, seqs, tokens, uniforms)

    def chain_step(self, draft, blocks: Sequence[tuple], p_min: float) -> List[List[int]]:
        """A greedy chain step in one call (dfl_chain_step): for each (seq, bonus, n_block,
        tokens) the drafter takes `tokens` (the positions it lacks) and drafts the block,
        cut by p_min; this target verifies every chain in one graph, and each keeps the
        drafts its argmax agrees with, committed. Returns each sequence's accepted drafts
        then its next token; last_copies() is the step's, chain_seconds its (drafting,
        verifying) seconds."""
        return self._one_call.chain_step(self._handle(), draft, blocks, p_min)

    def decode(self, tokens, logits: int = LOGITS_LAST, seq: int = 0) -> None:
        """Append tokens (at most n_ubatch) to the context."""
        self.step([Rows(seq, DECODE, tokens, logits=logits)])

    def prefill(self, tokens, logits: int = LOGITS_LAST, on_chunk=None, seq: int = 0) -> None:
        """Append any number of tokens in ubatch-sized chunks. on_chunk(start, n) runs
        after each chunk, e.g. to consume its features."""
        arr = self._tokens(tokens)
        for start in range(0, len(arr), self.n_ubatch):
            chunk = arr[start:start + self.n_ubatch]
            last = start + len(chunk) == len(arr)
            self.decode(chunk, logits if last else (LOGITS_ALL if logits == LOGITS_ALL else LOGITS_NONE), seq)
            if on_chunk is not None:
                on_chunk(start, len(chunk))

    def verify(self, tokens, seq: int = 0) -> None:
        """Evaluate a chain of candidate tokens without committing them."""
        self.step([Rows(seq, CHAIN, tokens)])

    def commit(self, n_keep: int, seq: int = 0) -> None:
        check(lib.dfl_target_commit(self._handle(), int(seq), int(n_keep)))

    def verify_tree(self, tokens, parents, seq: int = 0) -> None:
        """Evaluate a tree of candidate tokens without committing them: node 0 is the
        root (parent -1), parents precede children, nodes are ordered by depth."""
        self.step([Rows(seq, TREE, tokens, parents)])

    def commit_path(self, path, seq: int = 0) -> None:
        """Keep the root-to-node path (node indices, starting at 0) of the last tree verify."""
        arr = np.ascontiguousarray(path, dtype=np.int32)
        check(lib.dfl_target_commit_path(self._handle(), int(seq), ffi.from_buffer("int32_t[]", arr), len(arr)))

    # -- results of the last call -------------------------------------------------------
    def _head_ids(self, rows: np.ndarray) -> np.ndarray:
        """Head rows as token ids (a cut head's kept tokens; -1 stays -1)."""
        if self.head_tokens is None:
            return rows
        return np.where(rows >= 0, self.head_tokens[np.maximum(rows, 0)], rows).astype(np.int32)

    def logits(self, row0: int = 0, n_rows: int = 1) -> np.ndarray:
        """[n_rows, n_head]: one logit per head row (token head_tokens[i] of a cut head)."""
        out = np.empty((n_rows, self.n_head), dtype=np.float32)
        check(lib.dfl_target_logits(self._handle(), ffi.from_buffer("float[]", out), row0, n_rows))
        return out

    def raw_logits(self, row0: int = 0, n_rows: int = 1) -> np.ndarray:
        """[n_rows, n_head]: the model's own logits, before the bias, the penalties and the
        masks (the sequence's sampling kept them: dfl_sampling.raw_logits; see
        dfl_target_raw_logits)."""
        out = np.empty((n_rows, self.n_head), dtype=np.float32)
        check(lib.dfl_target_raw_logits(self._handle(), ffi.from_buffer("float[]", out), row0, n_rows))
        return out

    def choices(self, row0: int = 0, n_rows: int = 1) -> np.ndarray:
        """The token chosen on the device at each row: the argmax (greedy), or the draw
        of the sampling settings; -1 where it could not decide (see
        sampling.Sampler.choices)."""
        out = self._choices[:n_rows]
        check(lib.dfl_target_choices(self._handle(), ffi.from_buffer("int32_t[]", out), row0, n_rows))
        return self._head_ids(out.copy())

    def redraw(self, rows, u, seq: int = 0) -> np.ndarray:
        """Draws again on the device the rows of the last call that chose -1 (their kept
        set reached past the ranked candidates), with their uniforms u, over their logits
        ranked in full: only token ids come back."""
        rows = np.ascontiguousarray(rows, dtype=np.int32)
        u = np.ascontiguousarray(u, dtype=np.float32)
        out = np.empty(len(rows), dtype=np.int32)
        check(lib.dfl_target_redraw(self._handle(), int(seq), ffi.from_buffer("int32_t[]", rows),
                                    ffi.from_buffer("float[]", u), len(rows), ffi.from_buffer("int32_t[]", out)))
        return self._head_ids(out)

    def candidates(self, row0: int, n_rows: int, k: int):
        """(tokens, probabilities), [n_rows, k] each: the kept candidates of the last
        call's rows as they were drawn (sampling with top_k = k)."""
        toks = np.empty((n_rows, k), dtype=np.int32)
        probs = np.empty((n_rows, k), dtype=np.float32)
        check(lib.dfl_target_candidates(self._handle(), row0, n_rows, k, ffi.from_buffer("int32_t[]", toks),
                                        ffi.from_buffer("float[]", probs)))
        return self._head_ids(toks), probs

    # -- sampling (sampling.Sampler drives these) ---------------------------------------
    def set_sampling(self, native, seq: int = 0) -> None:
        """The sequence's dfl_sampling from its next step on (SamplingParams.native())."""
        check(lib.dfl_target_set_sampling(self._handle(), int(seq), native))

    def set_logit_bias(self, bias: Sequence[Tuple[int, float]], seq: int = 0) -> None:
        """The sequence's logit bias, (token id, bias) pairs of distinct tokens (-inf: never),
        until its sampling is set again (see dfl_target_set_logit_bias); a cut head's rows for
        the kept tokens (a token it left out is never chosen anyway)."""
        pairs = list(bias)
        if self.head_tokens is not None:
            row = {int(t): i for i, t in enumerate(self.head_tokens)}
            pairs = [(row[t], b) for t, b in pairs if t in row]
        toks = np.array([t for t, _ in pairs], dtype=np.int32)
        vals = np.array([b for _, b in pairs], dtype=np.float32)
        check(lib.dfl_target_set_logit_bias(self._handle(), int(seq), ffi.from_buffer("int32_t[]", toks),
                                            ffi.from_buffer("float[]", vals), len(toks)))

    def set_uniforms(self, u: np.ndarray, seq: int = 0) -> None:
        arr = np.ascontiguousarray(u, dtype=np.float32)
        check(lib.dfl_target_set_uniforms(self._handle(), int(seq), ffi.from_buffer("float[]", arr), len(arr)))

    def set_penalties(self, tokens: np.ndarray, counts: np.ndarray, seq: int = 0) -> None:
        toks = np.ascontiguousarray(tokens, dtype=np.int32)
        cnt = np.ascontiguousarray(counts, dtype=np.float32)
        check(lib.dfl_target_set_penalties(self._handle(), int(seq), ffi.from_buffer("int32_t[]", toks),
                                           ffi.from_buffer("float[]", cnt), toks.shape[0], toks.shape[1]))

    def set_masks(self, words: np.ndarray, seq: int = 0) -> None:
        """Allowed-token bitmasks [rows, ceil(n_vocab / 32)] uint32 of the sequence's rows
        with logits in its next step (see dfl_target_set_masks)."""
        w = np.ascontiguousarray(words, dtype=np.uint32)
        if w.ndim != 2:
            raise ValueError(f"masks must be [rows, words], got shape {w.shape}")
        check(lib.dfl_target_set_masks(self._handle(), int(seq), ffi.from_buffer("uint32_t[]", w), w.shape[0],
                                       w.shape[1]))

    def features(self, row0: int = 0, n_rows: int = 1, seq: int = 0) -> np.ndarray:
        """[n_rows, feature layers, n_embd] captured at rows row0.. of the sequence's last
        call (each sequence keeps its own until its next call)."""
        out = np.empty((n_rows, self.n_features, self.n_embd), dtype=np.float32)
        check(lib.dfl_target_features(self._handle(), int(seq), ffi.from_buffer("float[]", out), row0, n_rows))
        return out
