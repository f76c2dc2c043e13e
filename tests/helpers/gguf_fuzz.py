"""A seeded, structure-aware fuzzer for the GGUF loading path.

Each case is one mutant of the bundled demo target or drafter (dflash_gguf/data): random
bytes in the first 8 KiB, truncations, header counts, key lengths, value types, array
lengths and values, token texts and types, tensor names, dims, types and offsets, and
consistent re-serializations (another alignment, keys dropped, duplicated, retyped or
reordered, tensors retyped, dropped, added or reordered). The mutant is loaded the way
a user loads it -- `Engine(target, drafter)` (drafter metadata, target runtime, llama.cpp
tokenizer, drafter runtime) -- and asked for a few tokens.

A case passes when it ends in a clear error (DflashError, ValueError or OSError with a
message) or a correct load. It fails on a crash or abort (a signal), a hang (timeout),
any other Python exception (a traceback), an attempt at an absurd allocation ("out of
... memory", or a peak RSS above RSS_LIMIT_MIB), or when an unmodified file fails.

Every load runs in a child forked from a worker process that has imported the package
but loaded nothing (no threads yet), so an abort is seen as a signal and costs one fork.
Mutant i is a function of (seed, i) alone: a failure is reproduced with
`pytest tests/convert/test_fuzz_gguf.py --fuzz-seed S --fuzz-only i`.

Used by tests/convert/test_fuzz_gguf.py: a bounded run by default, longer ones with its options
(`--fuzz-count N --fuzz-seed S`).
"""
from __future__ import annotations

import json
import os
import random
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, List, Optional

TIMEOUT_S = 30.0
RSS_LIMIT_MIB = 1024
AS_HEADROOM = 3 << 30  # address space a child may add to the worker's (absurd allocations fail)

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B", U64: "<Q",
        I64: "<q", F64: "<d"}

# ggml types: (block size, bytes per block), as gguf-py lists them
_QUANT = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
          10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
          16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110),
          22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
          29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17)}


def _pad(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def tensor_nbytes(dims, typ: int) -> int:
    blck, size = _QUANT[typ]
    n = 1
    for d in dims:
        n *= d
    return n // blck * size


# ---- parsing a valid file into the positions of its fields ------------------------------

@dataclass
class KV:
    key: str
    start: int
    end: int
    type_off: int
    vtype: int
    arr_type_off: Optional[int] = None
    arr_n_off: Optional[int] = None
    arr_type: Optional[int] = None
    elems: List[int] = field(default_factory=list)  # offsets of the values (strings: their length field)

    @property
    def elem_type(self) -> int:
        return self.arr_type if self.vtype == ARR else self.vtype


@dataclass
class TensorInfo:
    name: str
    start: int
    end: int
    n_dims_off: int
    dim_offs: List[int]
    dims: List[int]
    type_off: int
    type: int
    offset_off: int
    offset: int

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dims, self.type)


@dataclass
class Layout:
    data: bytes
    version: int
    kvs: List[KV]
    tensors: List[TensorInfo]
    alignment: int
    data_offset: int

    def kv(self, key: str) -> Optional[KV]:
        return next((k for k in self.kvs if k.key == key), None)

    def payload(self, t: TensorInfo) -> bytes:
        return self.data[self.data_offset + t.offset:self.data_offset + t.offset + t.nbytes]


def parse(data: bytes) -> Layout:
    """Field positions of a valid GGUF v3 file (mutants are made from valid files only)."""
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    pos = 24

    def string(p):
        (n,) = struct.unpack_from("<Q", data, p)
        return data[p + 8:p + 8 + n].decode("utf-8", "replace"), p + 8 + n

    def skip(t, p):
        return string(p)[1] if t == STR else p + struct.calcsize(_FMT[t])

    kvs = []
    for _ in range(n_kv):
        start = pos
        key, pos = string(pos)
        type_off = pos
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        kv = KV(key, start, 0, type_off, vtype)
        if vtype == ARR:
            kv.arr_type_off, kv.arr_n_off = pos, pos + 4
            kv.arr_type, n = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for _ in range(n):
                kv.elems.append(pos)
                pos = skip(kv.arr_type, pos)
        else:
            kv.elems.append(pos)
            pos = skip(vtype, pos)
        kv.end = pos
        kvs.append(kv)
    tensors = []
    for _ in range(n_tensors):
        start = pos
        name, pos = string(pos)
        n_dims_off = pos
        (nd,) = struct.unpack_from("<I", data, pos)
        pos += 4
        dim_offs = [pos + 8 * i for i in range(nd)]
        dims = list(struct.unpack_from(f"<{nd}Q", data, pos))
        pos += 8 * nd
        type_off = pos
        typ, off = struct.unpack_from("<IQ", data, pos)
        pos += 12
        tensors.append(TensorInfo(name, start, pos, n_dims_off, dim_offs, dims, type_off, typ, type_off + 4, off))
    align_kv = next((k for k in kvs if k.key == "general.alignment"), None)
    alignment = struct.unpack_from("<I", data, align_kv.elems[0])[0] if align_kv else 32
    return Layout(data, version, kvs, tensors, alignment, _pad(pos, alignment))


# ---- writing ------------------------------------------------------------------------------

def enc_str(s) -> bytes:
    b = s if isinstance(s, bytes) else s.encode()
    return struct.pack("<Q", len(b)) + b


def enc_value(t: int, v) -> bytes:
    return enc_str(v) if t == STR else struct.pack(_FMT[t], v)


def enc_kv(key: str, t: int, value, arr_type: Optional[int] = None) -> bytes:
    if t == ARR:
        return enc_str(key) + struct.pack("<IIQ", ARR, arr_type, len(value)) + b"".join(
            enc_value(arr_type, v) for v in value)
    return enc_str(key) + struct.pack("<I", t) + enc_value(t, value)


def build(kv_raws: List[bytes], tensors: List[tuple], alignment: int = 32, version: int = 3) -> bytes:
    """A GGUF file from raw KV records and (name, dims, type, payload) tensors, laid out
    consistently for `alignment` (the alignment key, if any, is among kv_raws)."""
    infos, off = [], 0
    for name, dims, typ, payload in tensors:
        infos.append(enc_str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
                     + struct.pack("<IQ", typ, off))
        off += _pad(len(payload), alignment)
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv_raws)) + b"".join(kv_raws) + b"".join(infos)
    out = bytearray(head)
    out += bytes(_pad(len(out), alignment) - len(out))
    for *_, payload in tensors:
        out += payload
        out += bytes(_pad(len(payload), alignment) - len(payload))
    return bytes(out)


def rebuild(L: Layout, kv_raws=None, tensors=None, alignment=None) -> bytes:
    kv_raws = [L.data[k.start:k.end] for k in L.kvs] if kv_raws is None else kv_raws
    tensors = [(t.name, t.dims, t.type, L.payload(t)) for t in L.tensors] if tensors is None else tensors
    return build(kv_raws, tensors, alignment or L.alignment, L.version)


# ---- mutations ------------------------------------------------------------------------------

U32_EDGES = [0, 1, 2, 3, 7, 8, 16, 31, 32, 33, 64, 255, 256, 4095, 4096, 65535, 65536, 1 << 20, (1 << 30) + 1,
             (1 << 31) - 1, 1 << 31, (1 << 32) - 1]
U64_EDGES = U32_EDGES + [1 << 32, (1 << 32) + 1, 1 << 40, 1 << 50, (1 << 62) + 1, (1 << 63) - 1, 1 << 63,
                         (1 << 64) - 1]
F32_EDGES = [0.0, -0.0, 1.0, -1.0, 1e-30, 1e30, 3.4e38, -3.4e38, float("inf"), float("-inf"), float("nan"), 1e-45]


def _put(buf: bytearray, off: int, fmt: str, v) -> None:
    struct.pack_into(fmt, buf, off, v)


def _near(rng: random.Random, v: int, bits: int) -> int:
    cands = U64_EDGES if bits == 64 else U32_EDGES
    mask = (1 << bits) - 1
    return rng.choice(cands + [(v + 1) & mask, (v - 1) & mask, (2 * v) & mask, v // 2, (v + 32) & mask,
                               (v - 32) & mask, rng.getrandbits(bits)])


def _edge_for(rng: random.Random, t: int, old):
    if t in (F32, F64):
        return rng.choice(F32_EDGES + [old * 2, -old, old + 1])
    if t == BOOL:
        return rng.choice([0, 1, 2, 255])
    bits = struct.calcsize(_FMT[t]) * 8
    v = _near(rng, int(old), bits)
    if t in (I8, I16, I32, I64):
        v &= (1 << bits) - 1
        if v >= 1 << (bits - 1):
            v -= 1 << bits
    return v & ((1 << bits) - 1) if t not in (I8, I16, I32, I64) else v


def m_random_bytes(rng, L):
    buf = bytearray(L.data)
    span = min(8192, len(buf))
    k = rng.randint(1, 8)
    for _ in range(k):
        buf[rng.randrange(span)] = rng.randrange(256)
    return f"{k} random bytes in the first 8 KiB", bytes(buf)


def m_truncate(rng, L):
    header_end = L.data_offset
    choices = [rng.randrange(header_end + 64), rng.randrange(header_end, len(L.data)), len(L.data) - 1,
               header_end, rng.choice(L.kvs).start + rng.randrange(4), rng.choice(L.tensors).start + rng.randrange(12),
               rng.randrange(min(8192, len(L.data)))]
    n = rng.choice(choices)
    return f"truncated to {n} bytes", L.data[:n]


def m_header(rng, L):
    buf = bytearray(L.data)
    which = rng.choice(["version", "n_tensors", "n_kv"])
    if which == "version":
        v = rng.choice([0, 1, 2, 4, 0x03000000, 0xFFFFFFFF])
        _put(buf, 4, "<I", v)
    else:
        off = 8 if which == "n_tensors" else 16
        old = struct.unpack_from("<Q", buf, off)[0]
        v = _near(rng, old, 64)
        _put(buf, off, "<Q", v)
    return f"header {which} = {v}", bytes(buf)


def m_kv_structure(rng, L):
    buf = bytearray(L.data)
    kv = rng.choice(L.kvs)
    what = rng.choice(["key length", "key byte", "type", "array type", "array length", "string length"])
    if what == "key length":
        v = _near(rng, struct.unpack_from("<Q", buf, kv.start)[0], 64)
        _put(buf, kv.start, "<Q", v)
    elif what == "key byte":
        n = struct.unpack_from("<Q", buf, kv.start)[0]
        p = kv.start + 8 + rng.randrange(n)
        v = rng.choice([0, 0x2E, 0xFF, 0x80, rng.randrange(256)])
        buf[p] = v
    elif what == "type" or (what == "array type" and kv.vtype != ARR):
        v = rng.choice(list(range(14)) + [0xFFFF, 1 << 31, (1 << 32) - 1])
        _put(buf, kv.type_off, "<I", v)
        what = "type"
    elif what == "array type":
        v = rng.choice(list(range(14)) + [(1 << 32) - 1])
        _put(buf, kv.arr_type_off, "<I", v)
    elif what == "array length" and kv.vtype == ARR:
        v = _near(rng, len(kv.elems), 64)
        _put(buf, kv.arr_n_off, "<Q", v)
    else:
        if kv.elem_type != STR:
            return m_kv_structure(rng, L)
        e = rng.choice(kv.elems)
        v = _near(rng, struct.unpack_from("<Q", buf, e)[0], 64)
        _put(buf, e, "<Q", v)
        what = "string length"
    return f"KV {kv.key}: {what} -> {v}", bytes(buf)


def m_kv_value(rng, L):
    buf = bytearray(L.data)
    numeric = [k for k in L.kvs if k.elem_type not in (STR, ARR)]
    kv = rng.choice(numeric)
    i = rng.randrange(len(kv.elems))
    t = kv.elem_type
    old = struct.unpack_from(_FMT[t], buf, kv.elems[i])[0]
    v = _edge_for(rng, t, old)
    try:
        _put(buf, kv.elems[i], _FMT[t], v)
    except struct.error:
        return m_kv_value(rng, L)
    return f"KV {kv.key}[{i}] = {v!r} (was {old!r})", bytes(buf)


def m_tokens(rng, L):
    buf = bytearray(L.data)
    toks, types = L.kv("tokenizer.ggml.tokens"), L.kv("tokenizer.ggml.token_type")
    merges = L.kv("tokenizer.ggml.merges")
    what = rng.choice(["duplicate token", "token byte", "empty token", "token type", "merge byte", "special id"])
    if what == "duplicate token":
        by_len = {}
        for e in toks.elems:
            by_len.setdefault(struct.unpack_from("<Q", buf, e)[0], []).append(e)
        group = rng.choice([g for g in by_len.values() if len(g) > 1])
        a, b = rng.sample(group, 2)
        n = struct.unpack_from("<Q", buf, a)[0]
        buf[b + 8:b + 8 + n] = buf[a + 8:a + 8 + n]
        return f"token at byte {b} duplicates the one at {a}", bytes(buf)
    if what in ("token byte", "merge byte") and (what == "token byte" or merges):
        e = rng.choice((toks if what == "token byte" else merges).elems)
        n = struct.unpack_from("<Q", buf, e)[0]
        if n == 0:
            return m_tokens(rng, L)
        p = e + 8 + rng.randrange(n)
        buf[p] = rng.choice([0xFF, 0x80, 0xC3, 0x20, 0x00, rng.randrange(256)])
        return f"{what} at {p} = {buf[p]:#x}", bytes(buf)
    if what == "empty token":
        i = rng.randrange(len(toks.elems))
        kv_raws = [L.data[k.start:k.end] for k in L.kvs]
        values = [L.data[e + 8:e + 8 + struct.unpack_from("<Q", L.data, e)[0]] for e in toks.elems]
        values[i] = b""
        kv_raws[L.kvs.index(toks)] = enc_kv(toks.key, ARR, values, STR)
        return f"token {i} is empty", rebuild(L, kv_raws=kv_raws)
    if what == "token type" and types:
        i = rng.randrange(len(types.elems))
        v = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, -1, 1 << 30])
        _put(buf, types.elems[i], "<i", v)
        return f"token_type[{i}] = {v}", bytes(buf)
    ids = [k for k in L.kvs if k.key.startswith("tokenizer.ggml.") and k.key.endswith("_token_id")]
    if not ids:
        return m_tokens(rng, L)
    kv = rng.choice(ids)
    v = rng.choice([len(toks.elems), len(toks.elems) - 1, (1 << 31), (1 << 32) - 1, 0])
    _put(buf, kv.elems[0], "<I", v)
    return f"{kv.key} = {v}", bytes(buf)


def m_tensor_field(rng, L):
    buf = bytearray(L.data)
    t = rng.choice(L.tensors)
    what = rng.choice(["name length", "name byte", "n_dims", "dim", "dim", "type", "type", "offset"])
    if what == "name length":
        v = _near(rng, len(t.name), 64)
        _put(buf, t.start, "<Q", v)
    elif what == "name byte":
        p = t.start + 8 + rng.randrange(len(t.name))
        v = rng.choice([0, 0x2E, 0x31, 0xFF, rng.randrange(256)])
        buf[p] = v
    elif what == "n_dims":
        v = rng.choice([0, 1, 2, 3, 4, 5, 1 << 31, (1 << 32) - 1])
        _put(buf, t.n_dims_off, "<I", v)
    elif what == "dim":
        i = rng.randrange(len(t.dims))
        v = _near(rng, t.dims[i], 64)
        _put(buf, t.dim_offs[i], "<Q", v)
        what = f"dim {i}"
    elif what == "type":
        v = rng.choice(list(range(42)) + [0, 1, 24, 25, 26, 28, 30, 1 << 31, (1 << 32) - 1])
        _put(buf, t.type_off, "<I", v)
    else:
        v = _near(rng, t.offset, 64)
        _put(buf, t.offset_off, "<Q", v)
    return f"tensor {t.name}: {what} -> {v}", bytes(buf)


def m_same_size_type(rng, L):
    """A tensor type swapped for another of the same byte size: the file stays consistent."""
    buf = bytearray(L.data)
    swaps = {0: [26], 1: [30, 25], 30: [1, 25], 26: [0]}
    cands = [t for t in L.tensors if t.type in swaps]
    t = rng.choice(cands)
    v = rng.choice(swaps[t.type])
    _put(buf, t.type_off, "<I", v)
    return f"tensor {t.name}: type {t.type} -> {v} (same size)", bytes(buf)


def m_rebuild(rng, L):
    kv_raws = [L.data[k.start:k.end] for k in L.kvs]
    tensors = [(t.name, list(t.dims), t.type, L.payload(t)) for t in L.tensors]
    what = rng.choice(["alignment", "alignment type", "drop kv", "duplicate kv", "shuffle kvs", "retype kv",
                       "resize array", "string value", "drop tensor", "shuffle tensors", "extra tensor",
                       "retype tensor", "retype tensor", "reshape tensor"])
    alignment = L.alignment
    if what == "alignment":
        alignment = rng.choice([1, 2, 4, 8, 16, 64, 128, 256, 4096])
        kv_raws.append(enc_kv("general.alignment", U32, alignment))
        kv_raws.append(enc_kv("fuzz.padding", STR, "x" * rng.randrange(64)))
        desc = f"consistent layout with general.alignment = {alignment}"
    elif what == "alignment type":
        t, v = rng.choice([(U64, 32), (I32, 32), (STR, "32"), (U32, 0), (U32, 3), (U32, 48), (U32, 1 << 31)])
        kv_raws.append(enc_kv("general.alignment", t, v))
        desc = f"general.alignment = {v!r} of type {t}"
    elif what == "drop kv":
        i = rng.randrange(len(kv_raws))
        desc = f"KV {L.kvs[i].key} removed"
        del kv_raws[i]
    elif what == "duplicate kv":
        i = rng.randrange(len(kv_raws))
        kv_raws.insert(rng.randrange(len(kv_raws) + 1), kv_raws[i])
        desc = f"KV {L.kvs[i].key} duplicated"
    elif what == "shuffle kvs":
        rng.shuffle(kv_raws)
        desc = "KVs reordered"
    elif what == "retype kv":
        numeric = [k for k in L.kvs if k.vtype not in (STR, ARR)]
        kv = rng.choice(numeric)
        old = struct.unpack_from(_FMT[kv.vtype], L.data, kv.elems[0])[0]
        t = rng.choice([U8, I8, U16, I16, U32, I32, F32, BOOL, U64, I64, F64, STR, ARR])
        if t == STR:
            raw = enc_kv(kv.key, STR, str(old))
        elif t == ARR:
            raw = enc_kv(kv.key, ARR, [int(old)] * rng.randrange(3), U32)
        elif t in (F32, F64):
            raw = enc_kv(kv.key, t, float(old))
        else:
            bits = struct.calcsize(_FMT[t]) * 8
            v = int(old) if t != BOOL else 1
            if t in (I8, I16, I32, I64) and rng.random() < 0.5:
                v = -v
            try:
                raw = enc_kv(kv.key, t, v)
            except struct.error:
                raw = enc_kv(kv.key, t, v & ((1 << (bits - 1)) - 1))
        kv_raws[L.kvs.index(kv)] = raw
        desc = f"KV {kv.key} re-encoded as type {t}"
    elif what == "resize array":
        arrays = [k for k in L.kvs if k.vtype == ARR]
        kv = rng.choice(arrays)
        n = len(kv.elems)
        new_n = rng.choice([0, 1, max(n - 1, 0), n + 1, 2 * n, 17, 65])
        if kv.arr_type == STR:
            values = [L.data[e + 8:e + 8 + struct.unpack_from("<Q", L.data, e)[0]] for e in kv.elems]
            values = (values * (new_n // max(n, 1) + 1))[:new_n] if n else [b"x"] * new_n
        else:
            values = [struct.unpack_from(_FMT[kv.arr_type], L.data, e)[0] for e in kv.elems]
            values = (values * (new_n // max(n, 1) + 1))[:new_n] if n else [1] * new_n
            if values and kv.arr_type not in (F32, F64, BOOL) and rng.random() < 0.5:
                values[rng.randrange(len(values))] = _edge_for(rng, kv.arr_type, values[0])
        kv_raws[L.kvs.index(kv)] = enc_kv(kv.key, ARR, values, kv.arr_type)
        desc = f"array {kv.key}: {n} -> {new_n} entries"
    elif what == "string value":
        strings = [k for k in L.kvs if k.vtype == STR]
        kv = rng.choice(strings)
        v = rng.choice(["", "qwen35", "dflash", "llama", "gpt2", "bert", "none", "x" * 300, "\xff", "qwen2"])
        kv_raws[L.kvs.index(kv)] = enc_kv(kv.key, STR, v)
        desc = f"KV {kv.key} = {v[:20]!r}"
    elif what == "drop tensor":
        i = rng.randrange(len(tensors))
        desc = f"tensor {tensors[i][0]} removed"
        del tensors[i]
    elif what == "shuffle tensors":
        rng.shuffle(tensors)
        desc = "tensors reordered"
    elif what == "extra tensor":
        typ = rng.choice([0, 1, 8, 24, 26, 28, 30])
        dims = rng.choice([[32], [32, 4], [64, 2, 2], [32, 1, 1, 3], [0, 5], [256, 0]])
        name = rng.choice(["blk.0.extra.weight", "blk.99.attn_q.weight", "extra", "blk.-1.x", "output.bias"])
        tensors.insert(rng.randrange(len(tensors) + 1), (name, dims, typ, rng.randbytes(tensor_nbytes(dims, typ))))
        desc = f"extra tensor {name} {dims} type {typ}"
    elif what == "retype tensor":
        i = rng.randrange(len(tensors))
        name, dims, old, _ = tensors[i]
        typ = rng.choice([0, 1, 2, 3, 6, 7, 8, 9, 10, 12, 14, 15, 16, 19, 20, 23, 24, 25, 26, 27, 28, 29, 30, 34, 39])
        fits = dims[0] % _QUANT[typ][0] == 0
        payload = rng.randbytes(tensor_nbytes(dims, typ)) if fits else L.payload(L.tensors[i])
        tensors[i] = (name, dims, typ, payload)
        desc = f"tensor {name} retyped {old} -> {typ} (data {'resized' if fits else 'kept'})"
    else:
        i = rng.randrange(len(tensors))
        name, dims, typ, payload = tensors[i]
        new = list(dims)
        how = rng.choice(["swap", "add dim", "drop dim", "zero"])
        if how == "swap" and len(dims) >= 2:
            new[0], new[1] = dims[1], dims[0]
        elif how == "add dim" and len(dims) < 4:
            new.append(1)
        elif how == "drop dim" and len(dims) >= 2 and dims[-1] == 1:
            new.pop()
        else:
            new[rng.randrange(len(new))] = 0
            payload = b""
        tensors[i] = (name, new, typ, payload)
        desc = f"tensor {name} reshaped {dims} -> {new}"
    return desc, build(kv_raws, tensors, alignment, L.version)


MUTATORS = [(m_random_bytes, 4), (m_truncate, 2), (m_header, 1), (m_kv_structure, 3), (m_kv_value, 4),
            (m_tokens, 2), (m_tensor_field, 4), (m_same_size_type, 1), (m_rebuild, 5)]


def mutant(originals: dict, seed: int, index: int):
    """(which file, description, bytes) of mutant `index` of run `seed`."""
    rng = random.Random(f"{seed}:{index}")
    which = "draft" if index % 2 else "target"
    L = originals[which]
    fns, weights = zip(*MUTATORS)
    fn = rng.choices(fns, weights)[0]
    desc, data = fn(rng, L)
    return which, f"{fn.__name__[2:]}: {desc}", data


def load_originals(target: str, draft: str) -> dict:
    return {"target": parse(Path(target).read_bytes()), "draft": parse(Path(draft).read_bytes()),
            "paths": {"target": str(target), "draft": str(draft)}}


# ---- running one case in a forked child ----------------------------------------------------

def _load(target: str, draft: str) -> dict:
    """The user's path: Engine(target, drafter), then a few tokens."""
    from dflash_gguf.runtime.native import DflashError
    from dflash_gguf.engine.engine import Engine

    try:
        with Engine(target, draft, n_ctx=128, n_threads=1) as engine:
            res = engine.generate("def f(x):", 4)
        return {"outcome": "ok", "message": f"{len(res.tokens)} tokens"}
    except (DflashError, ValueError, OSError) as e:
        msg = str(e)
        if not msg.strip():
            return {"outcome": "traceback", "message": f"{type(e).__name__} without a message"}
        if "out of" in msg and "memory" in msg:
            return {"outcome": "alloc", "message": msg}
        return {"outcome": "error", "message": msg}
    except BaseException as e:  # noqa: BLE001 - anything else is a finding
        import traceback

        return {"outcome": "traceback", "message": "".join(traceback.format_exception(e))[-2000:]}


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def run_in_child(target: str, draft: str, timeout: float = TIMEOUT_S) -> dict:
    """Fork, load, report. Must be called from a process without threads."""
    import resource

    rfd, wfd = os.pipe()
    err = tempfile.TemporaryFile()
    limit = _vm_size() + AS_HEADROOM
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(rfd)
            os.dup2(err.fileno(), 2)
            os.dup2(err.fileno(), 1)  # the worker's stdout carries the results
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            out = json.dumps(_load(target, draft)).encode()
            os.write(wfd, out)
        finally:
            os._exit(0)
    os.close(wfd)
    chunks, timed_out = [], False
    while True:
        left = timeout - (time.monotonic() - t0)
        if left <= 0:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            break
        ready, _, _ = select.select([rfd], [], [], left)
        if ready:
            b = os.read(rfd, 65536)
            if not b:
                break
            chunks.append(b)
    os.close(rfd)
    _, status, usage = os.wait4(pid, 0)
    err.seek(0)
    tail = err.read()[-1500:].decode("utf-8", "replace")
    err.close()
    rss_mib = usage.ru_maxrss / 1024
    if timed_out:
        res = {"outcome": "timeout", "message": f"no result after {timeout:.0f} s"}
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        res = {"outcome": "crash", "message": f"killed by {signal.Signals(sig).name}; stderr: {tail.strip()[-600:]}"}
    elif not chunks:
        res = {"outcome": "crash", "message": f"exit status {os.WEXITSTATUS(status)} without a result; "
                                              f"stderr: {tail.strip()[-600:]}"}
    else:
        res = json.loads(b"".join(chunks))
    if res["outcome"] in ("ok", "error") and rss_mib > RSS_LIMIT_MIB:
        res = {"outcome": "alloc", "message": f"peak RSS {rss_mib:.0f} MiB; {res['message']}"}
    res["seconds"] = round(time.monotonic() - t0, 3)
    res["rss_mib"] = round(rss_mib)
    return res


FAILURES = ("crash", "timeout", "traceback", "alloc")


def serve(spec_path: str) -> None:
    """Worker: run the cases of a spec file (JSON: target, draft, seed, cases, tmpdir,
    timeout), one JSON line per case on stdout. A case is a mutant index (-1: the
    unmodified pair) or an explicit [target, draft, description]."""
    spec = json.loads(Path(spec_path).read_text())
    import dflash_gguf.engine.engine  # noqa: F401 - import once, before forking

    originals = load_originals(spec["target"], spec["draft"]) if spec["seed"] is not None else None
    out = sys.stdout
    tmp = Path(spec["tmpdir"])
    for case in spec["cases"]:
        if isinstance(case, list):
            index, which, desc = -2, "given", case[2]
            res = run_in_child(case[0], case[1], spec["timeout"])
        elif case < 0:  # the unmodified pair
            index, which, desc = case, "both", "unmodified files"
            res = run_in_child(spec["target"], spec["draft"], spec["timeout"])
        else:
            index = case
            which, desc, data = mutant(originals, spec["seed"], index)
            path = tmp / f"mutant-{index}-{which}.gguf"
            path.write_bytes(data)
            args = (str(path), spec["draft"]) if which == "target" else (spec["target"], str(path))
            res = run_in_child(*args, spec["timeout"])
            path.unlink()
        res.update(index=index, which=which, desc=desc)
        out.write(json.dumps(res) + "\n")
        out.flush()


def _run_workers(specs: List[dict], tmpdir: str, on_result) -> List[dict]:
    results: List[dict] = []
    lock = threading.Lock()
    procs = []
    for j, spec in enumerate(specs):
        path = Path(tmpdir) / f"spec-{j}.json"
        path.write_text(json.dumps({**spec, "tmpdir": tmpdir}))
        # this file run as the worker; cwd: the temporary directory, so a source checkout
        # does not shadow the installed package
        # no gdb backtraces from ggml's abort handler: an abort is reported by its signal
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "GGML_NO_BACKTRACE": "1"}
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(path)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmpdir))

    def drain(p):
        for line in p.stdout:
            res = json.loads(line)
            with lock:
                results.append(res)
                if on_result:
                    on_result(res)

    threads = [threading.Thread(target=drain, args=(p,)) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        p.wait()
        if p.returncode != 0:
            raise RuntimeError(f"fuzz worker failed ({p.returncode}): {p.stderr.read()[-3000:]}")
    return results


def run(target: str, draft: str, seed: int, indices: Iterable[int], jobs: int = 2, timeout: float = TIMEOUT_S,
        on_result: Optional[Callable[[dict], None]] = None) -> List[dict]:
    """Run the mutants `indices` of run `seed` (-1: the unmodified pair) on `jobs`
    worker processes; results in index order."""
    indices = list(indices)
    with tempfile.TemporaryDirectory(prefix="gguf-fuzz-") as tmpdir:
        specs = [{"target": str(target), "draft": str(draft), "seed": seed, "cases": indices[j::jobs],
                  "timeout": timeout} for j in range(jobs)]
        results = _run_workers(specs, tmpdir, on_result)
    results.sort(key=lambda r: r["index"])
    return results


def run_files(pairs: List[tuple], timeout: float = TIMEOUT_S) -> List[dict]:
    """Load each (target, drafter, description) as the fuzzer does, in one worker; results
    in the given order."""
    with tempfile.TemporaryDirectory(prefix="gguf-fuzz-") as tmpdir:
        spec = {"target": None, "draft": None, "seed": None, "cases": [[str(t), str(d), desc] for t, d, desc in pairs],
                "timeout": timeout}
        return _run_workers([spec], tmpdir, None)


def summary(results: List[dict]) -> str:
    counts = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def describe_failures(results: List[dict]) -> str:
    bad = [r for r in results if r["outcome"] in FAILURES or (r["index"] < 0 and r["outcome"] != "ok")]
    return "\n".join(f"#{r['index']} {r['which']} [{r['outcome']}] {r['desc']}: {r['message'][:800]}" for r in bad)


if __name__ == "__main__":  # a worker of _run_workers
    serve(sys.argv[1])
