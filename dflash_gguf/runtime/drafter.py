"""A drafter on the C runtime (a DFlash or DFlash2 GGUF, an EAGLE3 GGUF, or a
Qwen3.5/3.6 GGUF's MTP layer). It reads the target's captured features and shares its token embedding and LM
head, so it is loaded against a loaded Target. Each sequence's drafter context follows
its target by itself: a propose (or append) first takes the positions the target
committed since, from that sequence's own feature rows, which other sequences' target
calls leave alone."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from . import placement
from .native import NativeObject, check, ffi, lib, own_ggml_log
from .target import KV_TYPES, Target, set_head_tokens


@dataclass
class DraftConfig:
    kv_type: str = "auto"  # context cache type; auto: f32 on the CPU, f16 on other devices
    window: int = 0  # attend to the last `window` context positions only; 0: all
    n_threads: int = 0
    top_k: int = 0  # candidates per drafted position for tree building; 0: greedy chain only
    block_size: int = 0  # the largest block proposed (bonus + drafts); 0: the drafter's own (DFlash's trained)
    tensor_overrides: tuple = ()  # weights placed by name: (pattern, device) rules (runtime/placement.py)
    # a DFlash drafter's LM head cut to these token ids (FR-Spec: it drafts none other);
    # None: the kept set its file carries (dflash.head_tokens), else the whole head
    head_tokens: Optional[Sequence[int]] = None


def read_draft_metadata(path: str) -> dict:
    """What a drafter GGUF says about itself, read before anything is loaded (the target
    must capture its layers): its kind ("dflash"; "dspark" for a dflash GGUF with a
    Markov head; "eagle3"; "mtp" for a model GGUF whose nextn layers draft for it), block
    size (0 for mtp and eagle3: the caller's drafts per step), mask token, target layers,
    names, the fingerprint of the target it was converted for (None for drafters
    converted by llama.cpp, and for mtp), and the context window it was trained on
    (train_window: TRAIN_WINDOW_KEY, which dflash-train writes; 0 when the file does not
    say). The C runtime parses and bounds the
    file: a corrupt one is a ValueError with the runtime's message, never a traceback
    from a GGUF reader."""
    meta = ffi.new("dfl_draft_meta *")
    status = lib.dfl_draft_read_meta(str(path).encode(), meta)
    if status != 0:
        raise ValueError(ffi.string(lib.dfl_last_error()).decode("utf-8", "replace"))
    fingerprint = None
    if meta.has_fingerprint:
        fingerprint = {"target_name": _text(meta.target_name),
                       "tokenizer_sha256": _text(meta.target_tokenizer_sha256),
                       "embedding": (meta.target_n_vocab, meta.target_n_embd)}
    return {
        "kind": _text(meta.kind),
        "name": _text(meta.name),
        "block_size": int(meta.block_size),
        "mask_token_id": None if meta.mask_token_id < 0 else int(meta.mask_token_id),
        "n_embd": int(meta.n_embd),
        "target_layers": [int(meta.target_layers[i]) for i in range(meta.n_target_layers)],
        "target": fingerprint,
        "train_window": training_window(path),
    }


# "<arch>.train_context_length": the longest context a drafter saw in training
# (dflash-train's -c). Past it a drafter's acceptance can fall to nothing (the demo's
# DFlash: 1.5 tokens a pass to 1.0 past 2K), while a window of that many positions holds
# it (docs/performance.md, "Acceptance at depth"); --draft-window auto takes it.
TRAIN_WINDOW_KEY = "{arch}.train_context_length"


def training_window(path: str) -> int:
    """The context window a drafter GGUF says it was trained on; 0 when it does not say."""
    from .gguf_meta import GGUFMeta

    meta = GGUFMeta(str(path))
    key = TRAIN_WINDOW_KEY.format(arch=meta.get("general.architecture"))
    value = meta.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{path}: {key} is {value!r}, not a number of positions")
    return value


def draft_params(cfg: DraftConfig, path: Optional[str] = None):
    """The C runtime's dfl_draft_params for a config (checked) and the drafter at `path`
    (which its tensor overrides are resolved against)."""
    if cfg.kv_type != "auto" and cfg.kv_type not in KV_TYPES:
        raise ValueError(f"unknown drafter cache type {cfg.kv_type!r}")
    p = ffi.new("dfl_draft_params *")
    lib.dfl_draft_default_params(p)
    if cfg.kv_type != "auto":
        p.kv_type = KV_TYPES[cfg.kv_type]
    p.window = int(cfg.window)
    p.n_threads = int(cfg.n_threads)
    p.top_k = int(cfg.top_k)
    p.block_size = int(cfg.block_size)
    if cfg.head_tokens is not None:
        set_head_tokens(p, cfg.head_tokens, "a drafter head")
    if cfg.tensor_overrides:
        if path is None:
            raise ValueError("tensor overrides are resolved against a drafter file: give its path")
        placement.attach(p, cfg.tensor_overrides, str(path))
    return p


def tokenizer_fingerprint(path: str) -> str:
    """sha256 of a GGUF's tokenizer (tokens, merges, special ids): what a converted
    drafter records of its target."""
    out = ffi.new("char[]", 65)
    check(lib.dfl_tokenizer_fingerprint(str(path).encode(), out, 65))
    return _text(out)


def _text(chars) -> str:
    return ffi.string(chars).decode("utf-8", "replace")


def _tokens(tokens) -> np.ndarray:
    return np.ascontiguousarray(tokens, dtype=np.int32)


def _buffer(arr: np.ndarray):
    """A token array as the C runtime takes it (NULL when empty: no tokens given)."""
    return ffi.from_buffer("int32_t[]", arr) if len(arr) else ffi.NULL


class Draft(NativeObject):
    _what = "drafter"
    _free = staticmethod(lib.dfl_draft_free)
    _last_placement = staticmethod(lib.dfl_draft_last_placement)

    def __init__(self, path: str, target: Target, config: Optional[DraftConfig] = None):
        cfg = config or DraftConfig()
        p = draft_params(cfg, path)
        out = ffi.new("dfl_draft **")
        own_ggml_log()
        check(lib.dfl_draft_load(str(path).encode(), target._handle(), p, out))
        self._ptr = out[0]
        self._target = target  # the drafter borrows the target's weights: keep it alive
        self.path = str(path)
        info = ffi.new("dfl_draft_info *")
        check(lib.dfl_draft_get_info(self._ptr, info))
        self.kind = _text(info.kind)
        self.block_size = info.block_size
        self.mask_token_id = info.mask_token_id
        self.target_layers = [info.target_layers[i] for i in range(info.n_target_layers)]
        self.reads_tokens = bool(info.reads_tokens)  # its context needs the committed tokens
        self.greedy_only = bool(info.greedy_only)  # it drafts its own choices: no drawn drafts
        self.has_confidence = bool(info.has_confidence)  # it estimates each draft's acceptance (DSpark)
        self.n_head_tokens = int(info.n_head_tokens)  # tokens its head drafts from (a cut head's kept set)
        self.n_vocab = target.n_vocab
        self.top_k = int(cfg.top_k)
        self._row0: Dict[int, int] = {}  # per sequence: its first drafted row in the last propose's results
        self._source = lib.dfl_draft_tokens(self._ptr)  # what its target reads: fixed for the drafter's life

    def _handle(self):
        self._target._handle()  # the drafter reads the target's weights and features
        return super()._handle()

    @property
    def n_ctx_tokens(self) -> int:
        """Context positions sequence 0 holds (n_past: any sequence's)."""
        return self.n_past(0)

    def n_past(self, seq: int = 0) -> int:
        n = lib.dfl_draft_n_past(self._handle(), int(seq))
        if n < 0:
            raise ValueError(f"sequence {seq} is outside the target's slots")
        return int(n)

    def catch_up_due(self, seq: int, n_rows: int) -> bool:
        """Whether the drafter must take the positions of the sequence it lacks before
        the target's next call of up to n_rows rows in the slot, which would let their
        features go. The drafter's memory is the one record of how far it is."""
        return lib.dfl_draft_catch_up_due(self._handle(), seq, n_rows) != 0

    def info(self) -> dict:
        info = ffi.new("dfl_draft_info *")
        check(lib.dfl_draft_get_info(self._handle(), info))
        return {"block_size": info.block_size, "n_ctx_tokens": info.n_ctx_tokens, "n_graphs": info.n_graphs,
                "n_graph_builds": info.n_graph_builds, "compute_bytes": info.compute_bytes,
                "n_last_nodes": info.n_last_nodes, "n_host_writes": info.n_host_writes,
                "n_host_reads": info.n_host_reads, "n_host_write_bytes": info.n_host_write_bytes,
                "n_host_read_bytes": info.n_host_read_bytes}

    def reset(self) -> None:
        """Forget every sequence's context."""
        check(lib.dfl_draft_reset(self._handle()))

    def seq_reset(self, seq: int) -> None:
        """Forget one sequence's context."""
        check(lib.dfl_draft_seq_reset(self._handle(), int(seq)))

    def append(self, tokens: Sequence[int] = (), seq: int = 0) -> None:
        """Take the positions the sequence's target committed since the drafter's last
        graph for it (after a prefill chunk; or before the sequence's next target call,
        which replaces their features), in a graph of its own. `tokens`: those positions'
        tokens, which drafters that read them (reads_tokens) need; the others check their
        count when given."""
        arr = _tokens(tokens)
        check(lib.dfl_draft_append(self._handle(), int(seq), _buffer(arr), len(arr)))

    def propose(self, bonus: int, n_block: Optional[int] = None, read: bool = True, seq: int = 0,
                tokens: Sequence[int] = ()) -> List[int]:
        """Greedy drafts for block positions 1..n_block-1 after `bonus`, the positions the
        target committed since taken first in the same graph (`tokens` as in append).
        With read=False they stay on the device for a target's chain rows and [] is
        returned; block() reads them."""
        b = self.block_size if n_block is None else int(n_block)
        self.propose_many([(seq, bonus, b, tokens)])
        return self.block(b, seq)[1:] if read else []

    def propose_many(self, blocks: Sequence[tuple]) -> None:
        """One graph drafting a block for each (seq, bonus, n_block[, tokens]), each
        sequence first taking the positions its target committed since (`tokens` as in
        append; n_block 0: those alone); the drafts stay on the device (block() reads
        them; Target.step's chain rows of the drafter's block verify them), and the
        drafted rows of the results (topk, top1_logprobs, candidates, logits) are the
        blocks' n_block - 1 rows in this order (row0() tells where a sequence's start)."""
        entries = ffi.new("dfl_block[]", len(blocks))
        keep = []
        row0 = 0
        self._row0 = {}
        for e, block in zip(entries, blocks):
            seq, bonus, n_block = block[:3]
            arr = _tokens(block[3] if len(block) > 3 else ())
            keep.append(arr)
            e.seq, e.bonus, e.n_block = int(seq), int(bonus), int(n_block)
            e.tokens, e.n_tokens = _buffer(arr), len(arr)
            if n_block:
                self._row0[seq] = row0
                row0 += max(int(n_block) - 1, 0)
        check(lib.dfl_draft_propose(self._handle(), entries, len(blocks)))

    def row0(self, seq: int = 0) -> int:
        """The first drafted row of the sequence's block in the last propose's results
        (0 when it had none: the runtime then refuses the rows)."""
        return self._row0.get(seq, 0)

    def device_tokens(self):
        """What the drafter shows its target (dfl_token_source): the last blocks as device
        tokens, which a target's chain verify reads, and how far it has taken the target's
        features."""
        self._handle()
        return self._source

    def block(self, n: int, seq: int = 0) -> List[int]:
        """The first n tokens of the sequence's last proposed block: the bonus, then the drafts."""
        out = np.empty(n, dtype=np.int32)
        check(lib.dfl_draft_block(self._handle(), int(seq), ffi.from_buffer("int32_t[]", out), n))
        return out.tolist()

    def topk(self, n_rows: int, seq: int = 0):
        """(tokens, logprobs), each [n_rows, top_k], best first, of the sequence's block in
        the last propose."""
        toks = np.empty((n_rows, self.top_k), dtype=np.int32)
        lps = np.empty((n_rows, self.top_k), dtype=np.float32)
        check(lib.dfl_draft_topk(self._handle(), self.row0(seq), n_rows, ffi.from_buffer("int32_t[]", toks),
                                 ffi.from_buffer("float[]", lps)))
        return toks, lps

    def top1_logprobs(self, n_rows: int, seq: int = 0) -> np.ndarray:
        """[n_rows] log-probabilities of the top choices of the sequence's block in the last
        propose (topk's first column, computed by the propose itself: no ranking graph runs)."""
        lps = np.empty(n_rows, dtype=np.float32)
        check(lib.dfl_draft_top1(self._handle(), self.row0(seq), n_rows, ffi.NULL, ffi.from_buffer("float[]", lps)))
        return lps

    def confidence(self, n_rows: int, seq: int = 0) -> np.ndarray:
        """[n_rows] acceptance estimates (0..1) of the sequence's drafts in the last propose,
        from the drafter's confidence head (has_confidence)."""
        out = np.empty(n_rows, dtype=np.float32)
        check(lib.dfl_draft_confidence(self._handle(), self.row0(seq), n_rows, ffi.from_buffer("float[]", out)))
        return out

    def set_sampling(self, native, seq: int = 0) -> None:
        """How the sequence's next proposes draft: the argmax, or drawn (SamplingParams.native())."""
        check(lib.dfl_draft_set_sampling(self._handle(), int(seq), native))

    def set_uniforms(self, u: np.ndarray, seq: int = 0) -> None:
        arr = np.ascontiguousarray(u, dtype=np.float32)
        check(lib.dfl_draft_set_uniforms(self._handle(), int(seq), ffi.from_buffer("float[]", arr), len(arr)))

    def candidates(self, n_rows: int, k: int, seq: int = 0):
        """(tokens, probabilities), [n_rows, k] each: what the sequence's drafts in the last
        propose were drawn from (sampling with top_k = k)."""
        toks = np.empty((n_rows, k), dtype=np.int32)
        probs = np.empty((n_rows, k), dtype=np.float32)
        check(lib.dfl_draft_candidates(self._handle(), self.row0(seq), n_rows, k, ffi.from_buffer("int32_t[]", toks),
                                       ffi.from_buffer("float[]", probs)))
        return toks, probs

    def logits(self, row0: int = 0, n_rows: int = 1) -> np.ndarray:
        out = np.empty((n_rows, self.n_vocab), dtype=np.float32)
        check(lib.dfl_draft_logits(self._handle(), ffi.from_buffer("float[]", out), row0, n_rows))
        return out
