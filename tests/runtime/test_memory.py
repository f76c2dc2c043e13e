"""The memory planner: every part of a plan against numbers computed here by hand from
the published shapes (metadata-only GGUFs of Qwen3.5-27B with its DFlash drafter, and
Qwen3.5-35B-A3B), the plan against what a real load uses, and refusal before loading."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from helpers.cli_run import run

from dflash_gguf.convert.shape_model import write_header_only
from dflash_gguf.convert.shapes import QWEN35_27B, QWEN35_27B_DFLASH, QWEN35_35B_A3B, tensor_nbytes, tensor_table
from dflash_gguf.runtime.demo import demo_paths
from dflash_gguf.runtime.drafter import DraftConfig
from dflash_gguf.engine.engine import Engine, EngineOptions, EngineSetup
from dflash_gguf.engine.memory import MemoryPlanError, plan_memory, settle
from dflash_gguf.decoding.sampling import SamplingParams

MIB = 1 << 20


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    return {
        "27b": write_header_only(root / "qwen35-27b-q4_k_m.gguf", QWEN35_27B, "q4_k_m"),
        "27b-draft": write_header_only(root / "qwen35-27b-dflash-q8_0.gguf", QWEN35_27B_DFLASH, "q8_0"),
        "35b-a3b": write_header_only(root / "qwen35-35b-a3b-q4_k_m.gguf", QWEN35_35B_A3B, "q4_k_m"),
    }


def weights_bytes(c, outtype):
    return sum(tensor_nbytes(shape, qtype) for _, shape, qtype in tensor_table(c, outtype))


def recurrent_layers(c):
    return sum(1 for il in range(c["layers"]) if (il + 1) % c["interval"])


def test_plan_of_qwen35_27b_with_its_drafter(shapes):
    c, d = QWEN35_27B, QWEN35_27B_DFLASH
    n_ctx, budget = 131072, 16
    setup = EngineSetup.of(str(shapes["27b"]), str(shapes["27b-draft"]), EngineOptions.of(n_ctx=n_ctx, kv_type="q8_0",
                                                                                          tree_budget=budget))
    plan = plan_memory(str(shapes["27b"]), str(shapes["27b-draft"]), setup.target_config, setup.draft_config)
    assert [dev.name for dev in plan.devices] == ["CPU"]
    p = plan.devices[0].parts

    n_attn = c["layers"] - recurrent_layers(c)
    n_rec = recurrent_layers(c)
    kv_row = c["kv_heads"] * c["head_dim"]                 # K and V elements per token and layer
    q8_0 = 34 / 32                                         # bytes per element of q8_0 blocks
    assert p["kv_cache"] == n_attn * 2 * kv_row * n_ctx * q8_0

    hk = hv = c["lin_dim"]
    Hk, Hv = c["lin_k_heads"], c["lin_v_heads"]
    conv_ch = 2 * Hk * hk + Hv * hv
    state = hv * hv * Hv
    assert p["recurrent_state"] == n_rec * 4 * ((c["conv"] - 1) * conv_ch + state)

    n_verify = budget + 1                                  # the tree's root plus its budget
    # what the commit reruns of a row: the activated conv output (raw q, k and v), q and k
    # normalised, g and beta, each a plane of n_verify columns and an always-zero one
    replay = (conv_ch + 2 * Hk * hk + 2 * Hv) * (n_verify + 1)
    per_layer = replay + conv_ch * (c["conv"] - 1 + n_verify)
    features = len(d["target_layers"]) * c["hidden"] * 512  # the default prefill chunk of rows
    assert p["verify_scratch"] == 4 * (n_rec * per_layer + features)

    draft_kv_row = d["kv_heads"] * d["head_dim"]
    # f32 on the CPU; the last slot takes padding rows; the block handed to the target
    assert p["draft_cache"] == d["layers"] * 2 * draft_kv_row * (n_ctx + 1) * 4 + d["block"] * 4

    assert p["target_weights"] == weights_bytes(c, "q4_k_m")
    assert p["draft_weights"] == weights_bytes(d, "q8_0")
    assert 0 < p["target_compute"] < 2048 * MIB and 0 < p["draft_compute"] < 512 * MIB


def test_each_slot_has_feature_rows_for_a_step_and_prefill_chunks_share_one_set(shapes):
    """Every slot's state is its own: with 4 slots the verify scratch's recurrent inputs
    are 4 times one slot's; the captured features are a step's rows a slot (2 x n_verify:
    a verify and as many rows a drafter lacks) and one prefill chunk's rows (-ub) that
    every slot's chunks share, where one slot holds its chunk in rows of its own; a
    target without feature layers has none."""
    c, d = QWEN35_27B, QWEN35_27B_DFLASH
    target, draft = str(shapes["27b"]), str(shapes["27b-draft"])

    def scratch(n_seq, with_draft=True):
        setup = EngineSetup.of(target, draft, EngineOptions.of(n_ctx=8192, tree_budget=16, n_seq=n_seq))
        if with_draft:
            return plan_memory(target, draft, setup.target_config, setup.draft_config).devices[0].parts["verify_scratch"]
        plain = replace(setup.target_config, feature_layers=())
        return plan_memory(target, None, plain, None).devices[0].parts["verify_scratch"]

    row = 4 * len(d["target_layers"]) * c["hidden"]
    n_verify = EngineSetup.of(target, draft, EngineOptions.of(n_ctx=8192,
                                                              tree_budget=16)).target_config.n_verify  # 17: root + 16
    assert scratch(4, with_draft=False) == 4 * scratch(1, with_draft=False)
    assert scratch(1) - scratch(1, with_draft=False) == 512 * row
    assert scratch(4) - scratch(4, with_draft=False) == (4 * 2 * n_verify + 512) * row


def test_drafter_window_and_quantized_cache_shrink_the_plan(shapes):
    setup = EngineSetup.of(str(shapes["27b"]), str(shapes["27b-draft"]), EngineOptions.of(n_ctx=131072, kv_type="q4_0",
                                                                                          tree_budget=16,
                                                                                          draft_window=4096))
    plan = plan_memory(str(shapes["27b"]), str(shapes["27b-draft"]), setup.target_config, setup.draft_config)
    p = plan.devices[0].parts
    d = QWEN35_27B_DFLASH
    ring = 4096 + d["block"]
    assert p["draft_cache"] == d["layers"] * 2 * d["kv_heads"] * d["head_dim"] * (ring + 1) * 4 + d["block"] * 4
    assert p["kv_cache"] == 16 * 2 * 1024 * 131072 * 18 // 32  # q4_0: 18 bytes per 32 elements


def test_plan_of_qwen35_35b_a3b(shapes):
    c = QWEN35_35B_A3B
    setup = EngineSetup.of(str(shapes["35b-a3b"]), None, EngineOptions.of(n_ctx=65536, kv_type="f16"))
    p = plan_memory(str(shapes["35b-a3b"]), None, setup.target_config, None).devices[0].parts
    n_attn = c["layers"] - recurrent_layers(c)
    assert p["kv_cache"] == n_attn * 2 * c["kv_heads"] * c["head_dim"] * 65536 * 2
    assert p["target_weights"] == weights_bytes(c, "q4_k_m")
    assert p["draft_weights"] == p["draft_cache"] == p["draft_compute"] == 0


def test_plan_covers_what_a_real_load_uses():
    """On the demo pair: weights and caches as planned, and the compute memory the
    graph slots hold after prefilling the whole context and verifying there stays
    within the plan."""
    target_path, draft_path = demo_paths()
    n_ctx = 512
    with Engine(str(target_path), str(draft_path), n_ctx=n_ctx, n_ubatch=64, tree_budget=8) as engine:
        plan = engine.memory_plan.devices[0].parts
        engine.generate(list(range(10, 10 + n_ctx - 40)), max_tokens=30)
        used = engine.target.info()["compute_bytes"] + engine.draft.info()["compute_bytes"]
    assert 0 < used <= plan["target_compute"] + plan["draft_compute"]


@pytest.mark.parametrize("tree_budget", [None, 8])
def test_compute_memory_is_taken_at_load_and_never_grows(tree_budget):
    """The target's graph slots and the drafter's (its proposes, prefill entries and, for
    trees, its rank graph) hold their planned worst-case compute memory from the load on,
    so nothing grows as prompts get longer or requests sample (before, the slots grew
    with the longest context seen, and a server's resident memory crept up for thousands
    of requests)."""
    target_path, draft_path = demo_paths()
    with Engine(str(target_path), str(draft_path), n_ctx=1024, n_ubatch=64, n_seq=2,
                tree_budget=tree_budget) as engine:
        parts = engine.memory_plan.devices[0].parts
        planned = (parts["target_compute"], parts["draft_compute"])

        def used():
            return engine.target.info()["compute_bytes"], engine.draft.info()["compute_bytes"]

        loaded, seen = used(), set()
        for n, sampling in ((8, None), (300, SamplingParams(temperature=0.8, seed=1)), (900, None)):
            engine.generate(list(range(10, 10 + n)), max_tokens=24, sampling=sampling)
            seen.add(used())
    assert loaded == planned and seen == {planned}


def test_engine_refuses_a_plan_over_the_limit_before_loading(shapes):
    with pytest.raises(MemoryPlanError, match=r"needs .* MiB of 24576 MiB.*would fit: -ctk q8_0.*-c 65536"):
        Engine(str(shapes["27b"]), str(shapes["27b-draft"]), n_ctx=131072, tree_budget=8, kv_type="f16",
               draft_window=4096, memory_limit_mib=24576)


def test_auto_settings_make_128k_fit_a_24_gib_budget(shapes):
    """kv_type and draft_window "auto": the whole drafter context and f16 when they fit,
    else a drafter window, then q8_0, then q4_0."""
    target, draft = str(shapes["27b"]), str(shapes["27b-draft"])
    options = dict(n_ctx=131072, tree_budget=16)
    setup, plan, over = settle(target, draft, EngineOptions.of(**options), 24000)
    assert not over and plan.devices[0].need <= 24000 * MIB
    assert (setup.target_config.kv_type, setup.draft_config.window) == ("q8_0", 4096)
    setup, _, over = settle(target, draft, EngineOptions.of(**{**options, "n_ctx": 16384}), 24000)
    assert not over and (setup.target_config.kv_type, setup.draft_config.window) == ("f16", 0)
    setup, _, over = settle(target, draft, EngineOptions.of(**{**options, "n_ctx": 65536}), 24000)
    assert not over and setup.target_config.kv_type in ("f16", "q8_0") and setup.draft_config.window == 4096


def test_auto_draft_window_is_the_window_the_drafter_was_trained_on(shapes, monkeypatch):
    """A drafter whose file records the context it was trained on (dflash-train's -c;
    the demo drafter's 256) keeps that window by default: past it its acceptance falls
    (docs/performance.md, "Acceptance at depth"). A window the user names, and a drafter
    that records none, keep their windows; the plan tries the recorded window, then 4096,
    with each cache type in turn."""
    from dflash_gguf.runtime import drafter
    from dflash_gguf.runtime.drafter import read_draft_metadata

    target, draft = demo_paths()
    assert read_draft_metadata(draft)["train_window"] == 256
    for options, window in ((dict(), 256), (dict(draft_window=0), 0), (dict(draft_window=1024), 1024)):
        setup, _, over = settle(target, draft, EngineOptions.of(n_ctx=4096, **options))
        assert not over and setup.draft_config.window == window
        assert EngineSetup.of(target, draft, EngineOptions.of(n_ctx=4096, **options)).draft_config.window == window
    with Engine(target, draft, n_ctx=1024) as engine:
        assert engine.setup.draft_config.window == 256
    big, draft27 = str(shapes["27b"]), str(shapes["27b-draft"])
    assert read_draft_metadata(draft27)["train_window"] == 0  # z-lab's drafters record none
    monkeypatch.setattr(drafter, "training_window", lambda path: 8192)
    options = dict(n_ctx=16384, tree_budget=16)
    setup, _, over = settle(big, draft27, EngineOptions.of(**options), 24000)
    assert not over and (setup.target_config.kv_type, setup.draft_config.window) == ("f16", 8192)
    setup, _, over = settle(big, draft27, EngineOptions.of(**{**options, "n_ctx": 131072}), 24000)
    # neither 8192 nor 4096 fits with f16: q8_0 with the trained window does
    assert not over and (setup.target_config.kv_type, setup.draft_config.window) == ("q8_0", 8192)


def test_a_bad_training_window_is_one_clear_line(tmp_path):
    import gguf
    from dflash_gguf.runtime.drafter import training_window

    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), "dflash")
    w.add_string("dflash.train_context_length", "long")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ValueError, match="dflash.train_context_length is 'long', not a number of positions"):
        training_window(str(path))


def test_settle_checks_the_options_and_reads_the_drafter_once(shapes, monkeypatch):
    """Trying every kv type and drafter window (none fits here) checks the options and
    reads the drafter's metadata once, not once a try; each try is what EngineSetup.of
    gives for its options."""
    from dflash_gguf.engine import setup as config

    reads = []
    for name in ("read_draft_metadata", "_gguf_arch_and_keys"):
        real = getattr(config, name)
        monkeypatch.setattr(config, name, lambda *a, _real=real, _name=name: reads.append(_name) or _real(*a))
    target, draft = str(shapes["27b"]), str(shapes["27b-draft"])
    options = dict(n_ctx=131072, tree_budget=16)
    setup, plan, over = settle(target, draft, EngineOptions.of(**options), 1000)
    assert over and sorted(reads) == ["_gguf_arch_and_keys", "read_draft_metadata"]
    reads.clear()
    for kv, window in (("q8_0", 4096), ("q4_0", 0)):
        once = config.EngineSetup.of(target, draft, EngineOptions.of(**options, kv_type=kv, draft_window=window))
        assert once == setup.with_memory(kv, window)
    with pytest.raises(config.ConfigError, match="unknown KV cache type 'q3'"):
        setup.with_memory("q3", 0)


def run_cli(*args):
    return run(*args, stdin="")


def test_cli_print_memory(shapes):
    res = run_cli("-m", str(shapes["27b"]), "-md", str(shapes["27b-draft"]), "-c", "32768", "--tree-budget", "8",
                  "--print-memory", "--json")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan["fits"] and plan["devices"][0]["kv_cache"] == 16 * 2 * 1024 * 32768 * 2
    res = run_cli("-m", str(shapes["27b"]), "-md", str(shapes["27b-draft"]), "-c", "131072", "--print-memory",
                  "--memory-limit", "20000")
    assert res.returncode == 2
    assert "does not fit: CPU needs" in res.stdout and "target weights" in res.stdout


def test_cli_refuses_before_loading_with_exit_2(shapes):
    res = run_cli("-m", str(shapes["27b"]), "-md", str(shapes["27b-draft"]), "-c", "131072", "-p", "hi",
                  "--memory-limit", "16000")
    assert res.returncode == 2
    assert "not enough memory" in res.stderr and "largest:" in res.stderr


def test_window_plan_uses_the_ring(shapes):
    """The drafter's cache is sized by its window, not the context."""
    setup = EngineSetup.of(str(shapes["27b"]), str(shapes["27b-draft"]), EngineOptions.of(n_ctx=8192))
    small = plan_memory(str(shapes["27b"]), str(shapes["27b-draft"]), setup.target_config,
                        DraftConfig(window=1024)).devices[0].parts["draft_cache"]
    full = plan_memory(str(shapes["27b"]), str(shapes["27b-draft"]), setup.target_config,
                       DraftConfig()).devices[0].parts["draft_cache"]
    assert small < full / 6


def test_plan_of_the_mtp_drafter():
    """--spec-type draft-mtp plans the nextn layer's own tensors (the embedding and LM head
    are the target's), its one layer's cache over the whole context with a padding row,
    the hidden state it carries and its block, per slot."""
    from gguf import GGUFReader

    target, _ = demo_paths()
    n_ctx, n_seq = 1024, 2
    setup = EngineSetup.of(target, None, EngineOptions.of(spec_type="draft-mtp", n_ctx=n_ctx, n_seq=n_seq))
    assert setup.draft_path == target and setup.target_config.feature_layers == [4]
    p = plan_memory(target, setup.draft_path, setup.target_config, setup.draft_config).devices[0].parts
    reader = GGUFReader(target)
    key = {k: int(reader.fields[f"qwen35.{k}"].contents()) for k in
           ("block_count", "nextn_predict_layers", "embedding_length", "attention.head_count_kv",
            "attention.key_length")}
    mtp = f"blk.{key['block_count'] - key['nextn_predict_layers']}."
    assert p["draft_weights"] == sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith(mtp))
    kv_row = key["attention.head_count_kv"] * key["attention.key_length"]
    block = setup.drafting.block_size                              # the bonus and 3 drafts
    assert p["draft_cache"] == n_seq * 4 * (2 * kv_row * (n_ctx + 1) + key["embedding_length"] + block)


def gemma3_kv_bytes(c, n_ctx, n_ubatch, elem_bytes, spare=0):
    """A Gemma 3 model's KV cache: its global layers (every interval-th) over the whole
    context, its sliding-window layers as a ring of the window and one call's rows; every
    layer `spare` rows after it (a verify's, for a tree's rows past a ring's end)."""
    from dflash_gguf.convert.shapes import is_global

    rows = sum(spare + (n_ctx if is_global(c, il) else min(c["window"] + n_ubatch, n_ctx)) for il in range(c["layers"]))
    return rows * 2 * c["kv_heads"] * c["head_dim"] * elem_bytes


@pytest.mark.parametrize("drafter", ["gemma3-270m", "gemma3-1b"])
@pytest.mark.parametrize("tree", [False, True])
def test_plan_of_gemma3_27b_with_a_draft_simple_drafter(tmp_path_factory, drafter, tree):
    """Gemma 3 27B Q4_K_M with its 270M or 1B drafting draft-simple, as
    experiments/memory_table.py plans them: both models' weights (each head tied to its
    embedding: no output.weight), the target's cache a sliding window's ring in five
    layers of six (every sixth is global, over the whole context), the drafter's cache as
    its own model's (f16, its own window), its parts counted as the drafter's."""
    from dflash_gguf.convert.shapes import CONFIGS, GEMMA3_27B
    from dflash_gguf.engine.memory import plan_setup

    root = tmp_path_factory.mktemp("gemma3-shapes")
    c, d = GEMMA3_27B, CONFIGS[drafter]
    target = str(write_header_only(root / "gemma3-27b.gguf", c, "q4_k_m"))
    draft = str(write_header_only(root / f"{drafter}.gguf", d, "q4_k_m"))
    n_ctx = 32768
    setup = EngineSetup.of(target, draft, EngineOptions.of(n_ctx=n_ctx, kv_type="q8_0",
                                                           tree_budget=8 if tree else None))
    assert setup.simple is not None and setup.draft_path is None and setup.simple.tree == tree
    small = replace(setup.simple, config=replace(setup.simple.config, kv_type="f16"))
    (dev,) = plan_setup(target, replace(setup, simple=small)).devices
    p = dev.parts

    assert sum(is_g for is_g in (il % 6 == 5 for il in range(c["layers"]))) == 10  # layers 5, 11, ..., 59
    assert p["kv_cache"] == gemma3_kv_bytes(c, n_ctx, 512, 34 / 32, spare=setup.target_config.n_verify)
    assert p["draft_cache"] == gemma3_kv_bytes(d, n_ctx, 512, 2, spare=small.config.n_verify)
    assert p["target_weights"] == weights_bytes(c, "q4_k_m")
    assert p["draft_weights"] == weights_bytes(d, "q4_k_m")
    assert not any(n == "output.weight" for n, _, _ in tensor_table(c, "q4_k_m"))
    assert 0 < p["target_compute"] < 2048 * MIB and 0 < p["draft_compute"] < 1024 * MIB
    # the sliding windows are what keeps 128K within reach: all-global would take 6x the cache
    assert gemma3_kv_bytes({**c, "interval": 1}, n_ctx, 512, 34 / 32) > 4 * p["kv_cache"]
