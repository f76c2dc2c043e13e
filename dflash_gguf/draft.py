"""The DFlash drafter on the C runtime. It reads the target's captured features and
shares its token embedding and LM head, so it is loaded against a loaded Target."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from ._native import NativeObject, check, ffi, lib
from .target import KV_TYPES, Target


@dataclass
class DraftConfig:
    kv_type: str = "auto"  # context cache type; auto: f32 on the CPU, f16 on other devices
    window: int = 0  # attend to the last `window` context positions only; 0: all
    n_threads: int = 0
    top_k: int = 0  # candidates per drafted position for tree building; 0: greedy chain only


def read_draft_metadata(path: str) -> dict:
    """What a drafter GGUF says about itself, read before anything is loaded (the target
    must capture its layers): block size, mask token, target layers, names, and the
    fingerprint of the target it was converted for (None for drafters converted by
    llama.cpp). The C runtime parses and bounds the file: a corrupt one is a ValueError
    with the runtime's message, never a traceback from a GGUF reader."""
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
        "arch": "dflash",
        "name": _text(meta.name),
        "block_size": int(meta.block_size),
        "mask_token_id": None if meta.mask_token_id < 0 else int(meta.mask_token_id),
        "n_embd": int(meta.n_embd),
        "target_layers": [int(meta.target_layers[i]) for i in range(meta.n_target_layers)],
        "target": fingerprint,
    }


def draft_params(cfg: DraftConfig):
    """The C runtime's dfl_draft_params for a config (checked)."""
    if cfg.kv_type != "auto" and cfg.kv_type not in KV_TYPES:
        raise ValueError(f"unknown drafter cache type {cfg.kv_type!r}")
    p = ffi.new("dfl_draft_params *")
    lib.dfl_draft_default_params(p)
    if cfg.kv_type != "auto":
        p.kv_type = KV_TYPES[cfg.kv_type]
    p.window = int(cfg.window)
    p.n_threads = int(cfg.n_threads)
    p.top_k = int(cfg.top_k)
    return p


def tokenizer_fingerprint(path: str) -> str:
    """sha256 of a GGUF's tokenizer (tokens, merges, special ids): what a converted
    drafter records of its target."""
    out = ffi.new("char[]", 65)
    check(lib.dfl_tokenizer_fingerprint(str(path).encode(), out, 65))
    return _text(out)


def _text(chars) -> str:
    return ffi.string(chars).decode("utf-8", "replace")


class Draft(NativeObject):
    _what = "drafter"
    _free = staticmethod(lib.dfl_draft_free)
    _last_placement = staticmethod(lib.dfl_draft_last_placement)

    def __init__(self, path: str, target: Target, config: Optional[DraftConfig] = None):
        cfg = config or DraftConfig()
        p = draft_params(cfg)
        out = ffi.new("dfl_draft **")
        check(lib.dfl_draft_load(str(path).encode(), target._handle(), p, out))
        self._ptr = out[0]
        self._target = target  # the drafter borrows the target's weights: keep it alive
        self.path = str(path)
        info = ffi.new("dfl_draft_info *")
        check(lib.dfl_draft_get_info(self._ptr, info))
        self.block_size = info.block_size
        self.mask_token_id = info.mask_token_id
        self.target_layers = [info.target_layers[i] for i in range(info.n_target_layers)]
        self.n_vocab = target.n_vocab
        self.top_k = int(cfg.top_k)
        self._out = np.zeros(self.block_size, dtype=np.int32)
        self._rows = np.arange(max(target.n_ubatch, target.n_verify), dtype=np.int32)
        self._pending = None

    def _handle(self):
        self._target._handle()  # the drafter reads the target's weights and features
        return super()._handle()

    @property
    def n_ctx_tokens(self) -> int:
        return self.info()["n_ctx_tokens"]

    def info(self) -> dict:
        info = ffi.new("dfl_draft_info *")
        check(lib.dfl_draft_get_info(self._handle(), info))
        return {"block_size": info.block_size, "n_ctx_tokens": info.n_ctx_tokens, "n_graphs": info.n_graphs,
                "n_graph_builds": info.n_graph_builds, "compute_bytes": info.compute_bytes,
                "n_last_nodes": info.n_last_nodes, "n_host_writes": info.n_host_writes,
                "n_host_reads": info.n_host_reads, "n_host_write_bytes": info.n_host_write_bytes,
                "n_host_read_bytes": info.n_host_read_bytes}

    def reset(self) -> None:
        self._pending = None
        check(lib.dfl_draft_reset(self._handle()))

    def append_rows(self, n: int, rows=None, defer: bool = False) -> None:
        """Add the target's features of its last call as context: rows 0..n-1, or the
        given row indices. Deferred rows ride along with the next propose (one graph
        per step); flush() appends them on their own. They must be consumed before the
        target runs its next graph, which overwrites its features."""
        arr = self._rows[:n] if rows is None else np.ascontiguousarray(rows, dtype=np.int32)
        self.flush()
        if defer:
            self._pending = arr.copy()
            return
        check(lib.dfl_draft_append(self._handle(), ffi.from_buffer("int32_t[]", arr), len(arr)))

    def drop_pending(self) -> None:
        """Forget deferred rows without appending them (their features may be gone): the
        drafter context must then be reset before it is used again."""
        self._pending = None

    def flush(self) -> None:
        """Append deferred rows now."""
        if self._pending is not None:
            arr, self._pending = self._pending, None
            check(lib.dfl_draft_append(self._handle(), ffi.from_buffer("int32_t[]", arr), len(arr)))

    def propose(self, bonus: int, n_block: Optional[int] = None, read: bool = True) -> List[int]:
        """Greedy drafts for block positions 1..n_block-1 after `bonus` (deferred
        context rows are appended first, in the same graph). With read=False they stay
        on the device for Target.verify_draft and [] is returned; block() reads them."""
        b = self.block_size if n_block is None else int(n_block)
        rows, self._pending = self._pending, None
        n_rows = 0 if rows is None else len(rows)
        out = ffi.from_buffer("int32_t[]", self._out) if read else ffi.NULL
        check(lib.dfl_draft_propose(self._handle(), ffi.from_buffer("int32_t[]", rows) if n_rows else ffi.NULL,
                                    n_rows, int(bonus), b, out))
        return self._out[: max(b - 1, 0)].tolist() if read else []

    def verify_block(self, target, n: int) -> None:
        """target.verify() of the first n tokens of the last proposed block, which the
        target reads on the device (see Target.verify_draft)."""
        target.verify_draft(self, n)

    def block(self, n: int) -> List[int]:
        """The first n tokens of the last proposed block: the bonus, then the drafts."""
        out = np.empty(n, dtype=np.int32)
        check(lib.dfl_draft_block(self._handle(), ffi.from_buffer("int32_t[]", out), n))
        return out.tolist()

    def topk(self, n_rows: int):
        """(tokens, logprobs), each [n_rows, top_k], best first, of the last propose."""
        toks = np.empty((n_rows, self.top_k), dtype=np.int32)
        lps = np.empty((n_rows, self.top_k), dtype=np.float32)
        check(lib.dfl_draft_topk(self._handle(), 0, n_rows, ffi.from_buffer("int32_t[]", toks),
                                 ffi.from_buffer("float[]", lps)))
        return toks, lps

    def top1_logprobs(self, n_rows: int) -> np.ndarray:
        """[n_rows] log-probabilities of the last propose's top choices (topk's first
        column, computed by the propose itself: no ranking graph runs)."""
        lps = np.empty(n_rows, dtype=np.float32)
        check(lib.dfl_draft_top1(self._handle(), 0, n_rows, ffi.NULL, ffi.from_buffer("float[]", lps)))
        return lps

    def set_sampling(self, native) -> None:
        """How the next proposes draft: the argmax, or drawn (SamplingParams.native())."""
        check(lib.dfl_draft_set_sampling(self._handle(), native))

    def set_uniforms(self, u: np.ndarray) -> None:
        arr = np.ascontiguousarray(u, dtype=np.float32)
        check(lib.dfl_draft_set_uniforms(self._handle(), ffi.from_buffer("float[]", arr), len(arr)))

    def candidates(self, n_rows: int, k: int):
        """(tokens, probabilities), [n_rows, k] each: what the last propose's drafts
        were drawn from (sampling with top_k = k)."""
        toks = np.empty((n_rows, k), dtype=np.int32)
        probs = np.empty((n_rows, k), dtype=np.float32)
        check(lib.dfl_draft_candidates(self._handle(), 0, n_rows, k, ffi.from_buffer("int32_t[]", toks),
                                       ffi.from_buffer("float[]", probs)))
        return toks, probs

    def logits(self, row0: int = 0, n_rows: int = 1) -> np.ndarray:
        out = np.empty((n_rows, self.n_vocab), dtype=np.float32)
        check(lib.dfl_draft_logits(self._handle(), ffi.from_buffer("float[]", out), row0, n_rows))
        return out
