"""Prefix checkpoints (csrc/dfl_checkpoint.c, dflash_gguf/runtime/checkpoints.py): target and
drafter restored at a prefix continue exactly as a cold run does, token for token and in
acceptance, on the hybrid demo pair (Gated DeltaNet + attention target), chain and tree,
with the whole drafter context and with a drafter window shorter than the prompt."""
from __future__ import annotations

import pytest

from dflash_gguf.runtime.checkpoints import Checkpoint, PrefixCheckpoints, checkpoint_bytes
from dflash_gguf.runtime.demo import demo_paths
from dflash_gguf.engine.engine import Engine
from dflash_gguf.decoding.requests import GenerationStats, Placement, Request, collect
from dflash_gguf.runtime.tokenizer import Tokenizer

from helpers.checkpoint_workers import BUDGET, TEXT, UBATCH, load, prefill_with_checkpoints
from helpers.loops import autoregressive_steps, prefill_prompt, speculative_steps, tree_steps
from helpers.target_workers import run_isolated

OTHER = '''class Queue:
    """A first-in first-out queue."""

    def __init__(self, items=()):
        self.items = list(items)

    def get(self):
        return self.items.pop(0)

    def put(self, item):
        self.items.append(item)


def main(argv):
    for name in sorted(os.listdir(argv[1])):
        print(name)
'''
N = 48


@pytest.fixture(scope="module")
def geometry():
    """Bytes of the demo pair's state, from its GGUF metadata: per context position (the
    target's attention K/V rows in the f16 cache, the drafter's projected context in its
    f32 CPU cache) and per checkpoint whatever the position (the recurrent layers' conv
    and Gated DeltaNet states, f32)."""
    from gguf import GGUFReader

    def fields(path, arch):
        r = GGUFReader(path)
        return {k[len(arch) + 1:]: int(f.parts[f.data[0]][0]) for k, f in r.fields.items()
                if k.startswith(arch + ".") and len(f.data) == 1}

    target_path, draft_path = demo_paths()
    t, d = fields(target_path, "qwen35"), fields(draft_path, "dflash")
    n_layer = t["block_count"] - t.get("nextn_predict_layers", 0)  # an MTP head's layers keep no state here
    n_attention = sum((il + 1) % t["full_attention_interval"] == 0 for il in range(n_layer))
    conv = (t["ssm.conv_kernel"] - 1) * (t["ssm.inner_size"] + 2 * t["ssm.group_count"] * t["ssm.state_size"]) * 4
    head_v = t["ssm.inner_size"] // t["ssm.time_step_rank"]
    delta = head_v * head_v * t["ssm.time_step_rank"] * 4
    kv = t["attention.head_count_kv"] * (t["attention.key_length"] + t["attention.value_length"]) * 2
    draft_kv = d["attention.head_count_kv"] * (d["attention.key_length"] + d["attention.value_length"]) * 4
    return {"row": n_attention * kv + d["block_count"] * draft_kv,
            "fixed": (n_layer - n_attention) * (conv + delta)}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(demo_paths()[0])


def run(target, draft, prompt, mode, reused=0):
    stats = GenerationStats()
    if mode == "chain":
        steps = speculative_steps(target, draft, Request(prompt, N), stats, where=Placement(reused=reused))
    elif mode == "tree":
        steps = tree_steps(target, draft, Request(prompt, N), stats, BUDGET, where=Placement(reused=reused))
    else:
        steps = autoregressive_steps(target, Request(prompt, N), stats, Placement(reused=reused))
    return collect(steps), stats


@pytest.mark.parametrize("mode", ["chain", "tree", "plain"])
@pytest.mark.parametrize("window", [0, 12])
def test_restored_prefix_decodes_like_a_cold_run(tokenizer, mode, window):
    """Checkpoint at a prefix, dirty every state with another prompt (KV rows past the
    prefix, recurrent and conv states, the drafter's ring wrapped several times), then
    restore: the continuation equals a cold run's, and so do the acceptance lengths."""
    target, draft = load(window)
    prompt, other = tokenizer.encode(TEXT), tokenizer.encode(OTHER)
    cut = 3 * UBATCH  # a chunk boundary of the cold prefill: both runs compute the same chunks
    assert len(prompt) > cut + UBATCH and window < cut
    cold, cold_stats = run(target, draft, prompt, mode)
    assert mode == "plain" or cold_stats.mean_accepted > 1.5  # the drafter helps: its context matters

    target.reset()
    draft.reset()
    spec = mode != "plain"
    prefill_prompt(target, prompt[:cut], 0, draft if spec else None)
    checkpoint = Checkpoint(target, draft if spec else None)
    assert checkpoint.n_past == cut and checkpoint.nbytes > 0
    run(target, draft, other, mode)
    assert target.n_past > cut + UBATCH

    checkpoint.restore(target, draft if spec else None)
    assert target.n_past == cut and (not spec or draft.n_ctx_tokens == cut)
    warm, warm_stats = run(target, draft, prompt, mode, reused=cut)
    assert warm_stats.reused_tokens == cut
    assert warm == cold
    assert warm_stats.accepted_lengths == cold_stats.accepted_lengths
    assert warm_stats.trees.sizes == cold_stats.trees.sizes


def test_a_window_keeps_the_checkpoint_small(tokenizer):
    """With a window the drafter's part holds the window's positions, not the prefix's."""
    prompt = tokenizer.encode(TEXT)[:96]
    sizes = {}
    for window in (0, 12):
        target, draft = load(window)
        prefill_prompt(target, prompt, 0, draft)
        sizes[window] = Checkpoint(target, draft).nbytes
        target_only = Checkpoint(target).nbytes
        assert sizes[window] > target_only
        assert checkpoint_bytes(target, draft) == sizes[window] and checkpoint_bytes(target) == target_only
    assert sizes[12] < sizes[0]


def test_checkpoint_misuse_is_refused(tokenizer):
    target, draft = load(0)
    other_target, other_draft = load(0)
    prompt = tokenizer.encode(TEXT)[:40]
    with pytest.raises(Exception, match="empty"):
        Checkpoint(target, draft)
    prefill_prompt(target, prompt, 0, draft)
    target_only = Checkpoint(target)
    with pytest.raises(Exception, match="no drafter context"):
        target_only.restore(target, draft)
    full = Checkpoint(target, draft)
    with pytest.raises(Exception, match="another target"):
        full.restore(other_target, None)
    with pytest.raises(Exception, match="another drafter"):
        full.restore(target, other_draft)
    target.verify([1, 2, 3])
    with pytest.raises(Exception, match="between a verify and its commit"):
        Checkpoint(target)
    target.commit(2)
    with pytest.raises(Exception, match="between a verify and its commit"):
        Checkpoint(target)  # the recurrent state is committed by the next graph only
    target.decode([4])
    with pytest.raises(Exception, match="drafter holds"):
        Checkpoint(target, draft)
    full.restore(target, draft)
    assert target.n_past == len(prompt) and draft.n_ctx_tokens == len(prompt)


@pytest.mark.parametrize("tree", [False, True])
def test_engine_resumes_a_shared_prefix_from_a_checkpoint(tokenizer, tree):
    """An Engine with PrefixCheckpoints: a prompt sharing a long prefix with an earlier
    one prefills only what follows the checkpoint, with a fresh engine's output and
    acceptance; a prompt extending an earlier one resumes at that one's end (before
    its last token, whose logits began that reply)."""
    target_path, draft_path = demo_paths()
    options = dict(n_ctx=512, n_ubatch=UBATCH, n_threads=1, tree_budget=BUDGET if tree else None)
    base = tokenizer.encode(TEXT)
    first, second = base, base[:100] + tokenizer.encode(OTHER)[:30]
    third = second + tokenizer.encode("\n\ndef push(self, item):\n")
    with Engine(target_path, draft_path, **options) as fresh:
        want = {}
        for i, p in enumerate((first, second, third)):
            want[i] = fresh.generate(p, N, stop_tokens=[])
            fresh.generate(OTHER, 4)  # no continuation of the previous context
    with Engine(target_path, draft_path, **options) as engine:
        engine.checkpoints = PrefixCheckpoints(64 << 20, every=UBATCH)
        got = {}
        for i, p in enumerate((first, second, third)):
            got[i] = engine.generate(p, N, stop_tokens=[])
            engine.generate(OTHER, 4)
        assert got[0].stats.reused_tokens == 0
        assert got[1].stats.reused_tokens == 96  # the last checkpoint at or before the 100 shared tokens
        assert got[2].stats.reused_tokens == len(second) - 1  # the end of the second prompt
        again = engine.generate(third, N, stop_tokens=[])  # the same prompt again: all but its last token
        assert again.stats.reused_tokens == len(third) - 1 and again.tokens == want[2].tokens
        for i in got:
            assert got[i].tokens == want[i].tokens, f"prompt {i}"
            assert got[i].stats.accepted_lengths == want[i].stats.accepted_lengths, f"prompt {i}"
        assert engine.checkpoints.hits >= 2 and engine.checkpoints.saved > 6
        assert engine.checkpoints.nbytes <= 64 << 20


def test_store_evicts_least_recently_used_by_bytes(tokenizer):
    target, draft = load(0)
    prompt = tokenizer.encode(TEXT)
    probe = PrefixCheckpoints(1 << 30)
    for n in (32, 64):
        target.reset()
        draft.reset()
        prefill_prompt(target, prompt[:n], 0, draft)
        probe.save(prompt[:n], target, draft)
    sizes = [e.checkpoint.nbytes + e.overhead_bytes for e in probe._entries.values()]  # what the budget counts
    probe.clear()
    store = PrefixCheckpoints(sizes[0] + sizes[1], every=32)  # room for the 32- and the 64-token ones
    for n in (32, 64):
        target.reset()
        draft.reset()
        prefill_prompt(target, prompt[:n], 0, draft)
        assert store.save(prompt[:n], target, draft)
    assert store.lookup(prompt, 40, True).n_past == 32  # now the most recently used
    target.reset()
    draft.reset()
    prefill_prompt(target, prompt[:33], 0, draft)
    assert store.save(prompt[:33], target, draft)  # evicts the 64-token one
    assert store.evicted == 1 and len(store) == 2 and store.held_nbytes <= store.budget_bytes
    assert store.lookup(prompt, 100, True).n_past == 33
    assert store.lookup(prompt[:10] + [0] * 50, 100, True) is None
    assert not store.save(prompt[:33], target, draft)  # already kept
    assert store.positions(100, 0) == [32, 64, 96, 99] and store.positions(70, 40) == [64, 69]
    assert store.positions(70, 69) == []
    store.clear()
    assert len(store) == 0 and store.nbytes == 0 and store.overhead_nbytes == 0


def test_the_store_counts_all_it_keeps(tokenizer):
    """What the soak found creeping in a server: a store of many long prompts' checkpoints
    kept about 36 bytes a token of Python ints as keys, and each checkpoint a few
    kilobytes of records, metadata and page padding that its budget did not count. A key
    is a prefix's digest and length now, and the overhead is counted: the Python memory
    the store keeps per checkpoint is a small record whatever the prompt's length, and
    its held bytes cover it."""
    import tracemalloc

    target, draft = load(0)
    prompt = (tokenizer.encode(TEXT) * 4)[:480]
    store = PrefixCheckpoints(1 << 30, every=1 << 20)
    target.reset()
    draft.reset()
    prefill_prompt(target, prompt, 0, draft)
    warm = PrefixCheckpoints(1 << 30, every=1 << 20)
    warm.save(prompt, target, draft)  # cffi parses a type the first time it meets it
    warm.clear()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        cut = len(prompt)
        assert store.save(prompt[:cut], target, draft)
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename")
                    if "tracemalloc" not in str(s.traceback))
    finally:
        tracemalloc.stop()
    assert grown < 4096, f"{grown} bytes of Python memory for the checkpoint of a {cut}-token prompt"
    entry = next(iter(store._entries.values()))
    assert entry.checkpoint.overhead_bytes >= 1024  # its records and tensor metadata at least
    assert store.overhead_nbytes == entry.overhead_bytes >= 1024 + entry.checkpoint.overhead_bytes
    assert store.held_nbytes == store.nbytes + store.overhead_nbytes


def test_the_server_maps_large_blocks_apart():
    """glibc's dynamic mmap threshold fragments a server's heap as its checkpoint store
    churns buffers (see fix_mmap_threshold): the server fixes it where it can."""
    import platform

    from dflash_gguf.serving.server import fix_mmap_threshold

    assert fix_mmap_threshold() or platform.libc_ver()[0] != "glibc"


def test_a_checkpoint_holds_its_host_memory_apart():
    """What the soak's creep came from (results/soak-2026-11-25-creep*): a server's store
    turns over thousands of checkpoints, whose records, tensor metadata and host copies,
    carved from the C heap, pinned it between requests' short-lived allocations, and the
    heap grew with the turnover. A checkpoint's host memory is mappings of its own now:
    holding checkpoints takes (almost) nothing from the C heap, what they add to resident
    memory is what they report (what the soak subtracts), freed it all goes back, and a
    store churned through many times its budget stays at its level. Counted in bytes and
    pages, not time."""
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("reads glibc's malloc counters")
    m = run_isolated("checkpoint_workers:checkpoint_memory_trace")
    assert all(b == m["nbytes"] > 0 for b in m["host_bytes"])  # the demo pair runs on the CPU
    assert m["heap_held"] / len(m["host_bytes"]) < 4096, "a checkpoint's memory came from the C heap"  # the old code took its copies' megabytes
    assert abs(m["anon_held"] - m["reported"]) < 64 << 10, (m["anon_held"], m["reported"])
    assert abs(m["anon_freed"]) < 64 << 10 and m["heap_freed"] < 16 << 10
    assert m["evicted"] > 6 * m["kept"]
    level = m["levels"][8]  # every prompt length has been seen once
    assert abs(m["levels"][-1] - level) < 128 << 10, m["levels"]
    assert m["heap_cleared"] < 64 << 10


@pytest.mark.parametrize("where", ["device", "host"])
@pytest.mark.parametrize("placement", [{"device": "RPC0", "n_gpu_layers": 2},
                                       {"device": "RPC0", "n_gpu_layers": -1, "window": 12}])
def test_checkpoints_on_another_device(rpc_endpoint, tokenizer, placement, where):
    """Target split between the CPU and a device (a ggml RPC server: memory that is not
    host memory), or all on the device with a drafter window. A chain of two
    checkpoints kept in the device's memory (copied device to device), or in host
    memory when the store's device budget is 0: the end of the chain restores to a cold
    run's continuation, and every byte is counted where it lives."""
    prompt, other = tokenizer.encode(TEXT), tokenizer.encode(OTHER)
    target_path, draft_path = demo_paths()
    budget = 1 << 30 if where == "device" else 0
    res = run_isolated("checkpoint_trace", rpc_endpoint, target_path, draft_path, placement, prompt, other, 64, 40,
                       budget)
    assert res["info"]["device"] == "RPC0"
    split = placement["n_gpu_layers"] == 2
    assert res["info"]["n_gpu_layers"] == (2 if split else res["info"]["n_layer"])
    assert res["warm"]["reused"] == 64
    assert res["warm"]["tokens"] == res["cold"]["tokens"]
    assert res["warm"]["accepted"] == res["cold"]["accepted"]

    first, second = res["kept"]
    assert (first["n_past"], first["parent"], second["n_past"], second["parent"]) == (32, 0, 64, 32)
    for kept, (device, host) in zip(res["kept"], res["measured"]):
        # measured: device and host state; kept: where the copies went
        assert device > 0 and (host > 0) == split
        if where == "device":
            assert (kept["device"], kept["host"]) == (device, host)
        else:
            assert (kept["device"], kept["host"]) == (0, device + host)
    assert res["store"] == {"device": sum(k["device"] for k in res["kept"]), "host": sum(k["host"] for k in res["kept"])}


def assert_restores_exactly(target, draft, checkpoint, prompt, cold):
    """`checkpoint` (of a prefix of prompt), restored after another prompt dirtied every
    state, continues as the cold run `cold` (tokens, accepted lengths)."""
    n = checkpoint.n_past
    run(target, draft, OTHER_TOKENS, "chain")
    checkpoint.restore(target, draft)
    warm, warm_stats = run(target, draft, prompt, "chain", reused=n)
    assert warm == cold[0], f"restored at {n}"
    assert warm_stats.accepted_lengths == cold[1].accepted_lengths, f"restored at {n}"


OTHER_TOKENS: list = []


@pytest.fixture(autouse=True)
def other_tokens(tokenizer):
    OTHER_TOKENS[:] = tokenizer.encode(OTHER)


def test_checkpoints_of_a_long_prompt_keep_its_prefix_once(tokenizer, geometry):
    """Checkpoints every UBATCH tokens of one prompt: each keeps the rows from the
    previous one's position on, so together they hold the prefix's rows once plus one
    set of recurrent states each, not every prefix again. Restored from the middle or
    the end of the chain, the continuation is a cold run's."""
    target, draft = load(0)
    prompt = tokenizer.encode(TEXT)
    cold = run(target, draft, prompt, "chain")
    store = PrefixCheckpoints(1 << 30, every=UBATCH)
    marks = prefill_with_checkpoints(target, draft, store, prompt)
    assert len(marks) >= 5 and len(store) == len(marks)
    assert [c.parent_n_past for c in store.checkpoints()] == [0] + marks[:-1]
    assert store.nbytes == marks[-1] * geometry["row"] + len(marks) * geometry["fixed"]
    assert store.held_nbytes == store.nbytes + store.overhead_nbytes and store.overhead_nbytes > 0
    assert store.host_nbytes == store.nbytes and store.device_nbytes == 0  # the CPU's state is host memory
    every_prefix = sum(n * geometry["row"] + geometry["fixed"] for n in marks)  # what copying prefixes took
    assert every_prefix - store.nbytes > 2 * marks[-1] * geometry["row"]
    for n in (marks[len(marks) // 2], marks[-1]):
        found = store.lookup(prompt, n, True)
        assert found.n_past == n
        assert_restores_exactly(target, draft, found, prompt, cold)


def test_eviction_keeps_every_kept_checkpoint_restorable(tokenizer, geometry):
    """A budget far below the chains of two prompts that share a prefix: evictions
    shorten chains from their ends (a checkpoint another kept one reads from stays),
    the bytes stay counted right, and every checkpoint left restores exactly."""
    target, draft = load(0)
    first = tokenizer.encode(TEXT)
    second = first[:40] + OTHER_TOKENS[:60]
    colds = {id(p): run(target, draft, p, "chain") for p in (first, second)}
    row, fixed = geometry["row"], geometry["fixed"]
    store = PrefixCheckpoints(2 * len(first) * row + 5 * fixed, every=UBATCH)
    for prompt in (first, second):
        prefill_with_checkpoints(target, draft, store, prompt)
    assert store.evicted > 0 and store.nbytes <= store.budget_bytes
    kept = store.checkpoints()
    owners = [second if store.lookup(second, c.n_past, True) is c else first for c in kept]
    assert {len(first) - 1, len(second) - 1} & {c.n_past for c in kept}  # a prompt end survives
    assert any(o is first and c.n_past > 40 for c, o in zip(kept, owners))  # both branches have some
    assert any(o is second and c.n_past > 40 for c, o in zip(kept, owners))
    assert store.nbytes == sum((c.n_past - c.parent_n_past) * row + fixed for c in kept)
    for c, prompt in zip(kept, owners):
        assert c.parent_n_past == 0 or c.parent_n_past in {k.n_past for k in kept}  # what it reads from is kept
        assert_restores_exactly(target, draft, c, prompt, colds[id(prompt)])


def test_a_chain_is_refused_across_pairs_and_after_free(tokenizer):
    target, draft = load(0)
    other_target, other_draft = load(0)
    prompt = tokenizer.encode(TEXT)[:64]
    prefill_prompt(target, prompt[:32], 0, draft)
    parent = Checkpoint(target, draft)
    prefill_prompt(other_target, prompt[:40], 0, other_draft)
    with pytest.raises(Exception, match="parent checkpoint was taken from another target"):
        Checkpoint(other_target, other_draft, parent)
    with pytest.raises(Exception, match="another drafter"):
        Checkpoint(target, None, parent)
    with pytest.raises(Exception, match="not before the context"):
        Checkpoint(target, draft, parent)  # the same position
    prefill_prompt(target, prompt, 32, draft)
    child = Checkpoint(target, draft, parent)
    assert child.parent_n_past == 32 and child.nbytes < Checkpoint(target, draft).nbytes
    parent.close()  # the child keeps what it reads alive
    with pytest.raises(Exception, match="closed"):
        Checkpoint(target, draft, parent)
    run(target, draft, OTHER_TOKENS, "chain")
    child.restore(target, draft)
    assert target.n_past == 64 and draft.n_ctx_tokens == 64
