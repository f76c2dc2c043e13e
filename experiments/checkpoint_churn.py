"""Where a server's memory goes while its prefix-checkpoint store turns over, without
HTTP: the soak's prompts (dflash-bench soak's plan, malformed ones left out) one after
another through an Engine of the demo pair with a PrefixCheckpoints store, and every 100
requests the process's memory by kind:

    net    resident memory less what the store counts (its checkpoints' bytes and overhead)
    heap   resident pages of the C heap (/proc/self/smaps, [heap])
    anon   resident anonymous mappings less what the store counts (checkpoint mappings,
           malloc's large blocks, Python's arenas, ggml's buffers)
    arena, in_use, free   glibc's mallinfo2 for the main heap

    .venv/bin/python experiments/checkpoint_churn.py --requests 1600 --checkpoint-mib 256

First one 4,000-token prompt, so that the caches' and compute buffers' pages are resident
before the count starts. Memory figures only: nothing here is timed. It prints its table
and writes no file; an earlier draft of it took results/soak-2026-11-25-creep2-replay-*.log.
"""
from __future__ import annotations

import argparse
import ctypes
import re

from dflash_gguf.bench.serving.soak import plan
from dflash_gguf.runtime.checkpoints import PrefixCheckpoints
from dflash_gguf.runtime.demo import demo_paths
from dflash_gguf.engine.engine import Engine
from dflash_gguf.serving.server import fix_mmap_threshold


class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def resident() -> dict:
    """Resident KiB of the C heap, of anonymous mappings and in all (/proc/self/smaps)."""
    out = {"heap": 0, "anon": 0, "all": 0}
    kind = None
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                fields = line.split()
                name = fields[5] if len(fields) > 5 else ""
                kind = "heap" if name == "[heap]" else "anon" if not name else None
            elif line.startswith("Rss:"):
                kib = int(line.split()[1])
                out["all"] += kib
                if kind:
                    out[kind] += kib
    return out


def report(done: int, store: PrefixCheckpoints, mallinfo2) -> None:
    r, m, mib = resident(), mallinfo2(), 1 << 20
    held = store.held_nbytes
    print(f"{done:6d} entries {len(store):5d} net {(r['all'] * 1024 - held) / mib:8.2f} MiB  heap "
          f"{r['heap'] / 1024:6.2f} MiB  anon {(r['anon'] * 1024 - held) / mib:7.2f} MiB  arena {m.arena / mib:6.2f} "
          f"in_use {m.uordblks / mib:6.2f} free {m.fordblks / mib:5.2f} MiB", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1600, help="requests of the soak's plan to replay (default 1600)")
    p.add_argument("--checkpoint-mib", type=int, default=256, help="the store's budget (default 256)")
    p.add_argument("-md", "--model-draft", help="drafter GGUF (default: the demo drafter)")
    args = p.parse_args()
    fix_mmap_threshold()  # as dflash-server does
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = Mallinfo2
    target_path, draft_path = demo_paths()
    engine = Engine(target_path, args.model_draft or draft_path, n_ctx=4096, n_ubatch=64, n_threads=1)
    store = engine.checkpoints = PrefixCheckpoints(args.checkpoint_mib << 20)
    specs = [s for s in plan(args.requests, 0, 32, 6000) if s.kind != "malformed"]
    long_prompt = engine.encode(" ".join(s.body["prompt"] for s in specs[:200]) * 2)[:4000]
    engine.generate(long_prompt, max_tokens=8)
    store.clear()
    report(0, store, mallinfo2)
    for i, spec in enumerate(specs, 1):
        engine.generate(spec.body["prompt"], max_tokens=min(spec.body["max_tokens"], 8))
        if i % 100 == 0 or i == len(specs):
            report(i, store, mallinfo2)


if __name__ == "__main__":
    main()
