"""What tests/runtime/test_checkpoints.py measures in a child interpreter (run_isolated),
with the pair and prompt both use."""
from __future__ import annotations

from dflash_gguf.runtime.checkpoints import Checkpoint, PrefillSaver, PrefixCheckpoints
from dflash_gguf.runtime.demo import demo_paths
from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.runtime.target import Target, TargetConfig
from dflash_gguf.runtime.tokenizer import Tokenizer

from helpers.fixtures import CODE_PROMPT
from helpers.loops import prefill_prompt


TEXT = CODE_PROMPT + """    def pop(self):
        return self.items.pop()
"""


UBATCH = 32
BUDGET = 6


def anonymous_resident() -> int:
    """The process's resident anonymous memory (heap, mappings), from the kernel's count."""
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("Anonymous:"))


def c_heap_in_use() -> int:
    """Bytes glibc's malloc has handed out and not had back (its own mappings included)."""
    import ctypes

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = Mallinfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def load(window: int):
    target_path, draft_path = demo_paths()
    meta = read_draft_metadata(draft_path)
    target = Target(target_path, TargetConfig(n_ctx=512, n_ubatch=UBATCH, n_verify=max(meta["block_size"], BUDGET + 1),
                                              n_threads=1, feature_layers=meta["target_layers"]))
    return target, Draft(draft_path, target, DraftConfig(window=window, top_k=8))


def prefill_with_checkpoints(target, draft, store, prompt):
    target.reset()
    draft.reset()
    marks = store.positions(len(prompt), 0)
    prefill_prompt(target, prompt, 0, draft, PrefillSaver(marks, lambda n: store.save(prompt[:n], target, draft)))
    return marks


def checkpoint_memory_trace() -> dict:
    """The measurements of test_a_checkpoint_holds_its_host_memory_apart, taken in a child
    interpreter (run_isolated): the process's resident memory is the quantity measured, and
    in the suite's own process other tests' leftovers (threads, heap fragments, caches)
    moved it by megabytes at random between two readings."""
    tokenizer = Tokenizer(demo_paths()[0])
    target, draft = load(0)
    prompt = (tokenizer.encode(TEXT) * 4)[:400]
    # the store's prompts below: long prompts of many lengths, whose checkpoints make chains of every size
    rounds = [(tokenizer.encode(f"# round {i}\n") + prompt)[:200 + 23 * (i % 9)] for i in range(36)]
    target.reset()
    draft.reset()
    prefill_prompt(target, prompt, 0, draft)
    Checkpoint(target, draft).close()  # what a first checkpoint sets up once
    out = {}
    heap, anon = c_heap_in_use(), anonymous_resident()
    held = [Checkpoint(target, draft) for _ in range(12)]
    out["host_bytes"] = [c.host_bytes for c in held]
    out["nbytes"] = held[0].nbytes
    out["reported"] = sum(c.host_bytes + c.overhead_bytes for c in held)
    out["heap_held"] = c_heap_in_use() - heap
    out["anon_held"] = anonymous_resident() - anon
    for c in held:
        c.close()
    out["anon_freed"] = anonymous_resident() - anon
    out["heap_freed"] = c_heap_in_use() - heap

    # a store with room for a few prompts' checkpoints, churned 6 times over
    store = PrefixCheckpoints(4 * held[0].nbytes, every=UBATCH)
    out["levels"] = []  # resident memory less what the store holds, after each prompt
    for tokens in rounds:
        prefill_with_checkpoints(target, draft, store, tokens)
        out["levels"].append(anonymous_resident() - store.held_nbytes)
    out["evicted"], out["kept"] = store.evicted, len(store)
    store.clear()
    out["heap_cleared"] = c_heap_in_use() - heap
    return out
