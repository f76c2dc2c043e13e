"""dflash_gguf.convert.shape_model: random-weight GGUFs of published configs, shrunk here to
seconds. The files must carry exactly the planner's tensor table (names, shapes, types),
load and run in our runtime (plain and speculative greedy agree) and in llama.cpp."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from dflash_gguf.convert import shape_model
from dflash_gguf.convert.shape_model import main as make_main, write_model
from dflash_gguf.convert.shapes import (GEMMA4_26B_A4B, GPT_OSS_20B, QWEN35_27B, QWEN35_27B_DFLASH, QWEN35_35B_A3B,
                                        shrunk, tensor_nbytes, tensor_table)
from dflash_gguf.engine.engine import Engine, EngineOptions, EngineSetup
from dflash_gguf.engine.memory import plan_memory

# the structures of the published configs at hidden 256 (every row a whole number of
# K-quant blocks), the demo tokenizer's vocabulary (4096 tokens)
SMALL = dict(hidden=256, vocab=4096, heads=4, kv_heads=2, head_dim=64, rot=16, sections=[3, 3, 2, 0])
LINEAR = dict(lin_k_heads=2, lin_v_heads=4, lin_dim=64)
TINY_27B = shrunk(QWEN35_27B, 4, ffn=512, **SMALL, **LINEAR)
TINY_A3B = shrunk(QWEN35_35B_A3B, 4, experts=4, experts_used=2, expert_ffn=256, shared_ffn=256, **SMALL, **LINEAR)
TINY_DRAFT = shrunk(QWEN35_27B_DFLASH, 1, hidden=256, vocab=4096, ffn=512, heads=4, kv_heads=2, head_dim=64,
                    target_layers=[1, 3])
# Gemma 4 26B-A4B's structure: sliding and full layers of other head sizes (K = V in the
# full ones), a dense FFN beside 4 experts in every layer
TINY_GEMMA4 = shrunk(GEMMA4_26B_A4B, 4, hidden=256, vocab=4096, heads=4, kv_heads=2, head_dim=64, head_dim_full=128,
                     kv_heads_full=1, ffn=512, experts=4, experts_used=2, expert_ffn=256, window=8, interval=2)
TINY_GPT_OSS = shrunk(GPT_OSS_20B, 2, hidden=256, vocab=4096, heads=4, kv_heads=2, head_dim=64, experts=4,
                      experts_used=2, expert_ffn=256, window=16)


def table_of(path: Path) -> list[tuple[str, tuple[int, ...], object]]:
    r = GGUFReader(str(path))
    return [(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type) for t in r.tensors]


@pytest.mark.parametrize("config,outtype", [(TINY_27B, "q4_k_m"), (TINY_A3B, "q4_k_m"), (TINY_27B, "q8_0"),
                                            (TINY_27B, "f16"), (TINY_DRAFT, "q8_0"), (TINY_GEMMA4, "q4_k_m"),
                                            (TINY_GPT_OSS, "mxfp4_moe")])
def test_file_has_the_planned_tensor_table(tmp_path, config, outtype):
    path = write_model(config, outtype, tmp_path / "m.gguf", progress=False)
    want = [(name, tuple(shape), qtype) for name, shape, qtype in tensor_table(config, outtype)]
    assert table_of(path) == want
    if outtype == "q4_k_m":  # llama-quantize's mix, not one type
        assert {q.name for _, _, q in want} >= {"Q4_K", "Q6_K", "F32"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("shape-pair")
    target, draft = root / "target.gguf", root / "draft.gguf"
    assert make_main(["qwen35-27b", "--outtype", "q4_k_m", "--outfile", str(target), "--layers", "4", "--quiet",
                      *[f"--set={k}={','.join(map(str, v)) if isinstance(v, list) else v}"
                        for k, v in {**SMALL, **LINEAR, "ffn": 512}.items()]]) == 0
    write_model(TINY_DRAFT, "q8_0", draft, progress=False)
    return str(target), str(draft)


def test_runs_in_our_runtime_as_planned(pair):
    target, draft = pair
    options = dict(n_ctx=256, kv_type="f16", draft_window=0, n_threads=2)
    setup = EngineSetup.of(target, draft, EngineOptions.of(**options))
    plan = plan_memory(target, draft, setup.target_config, setup.draft_config).devices[0].parts
    assert plan["target_weights"] == sum(tensor_nbytes(s, q) for _, s, q in tensor_table(TINY_27B, "q4_k_m"))
    assert plan["draft_weights"] == sum(tensor_nbytes(s, q) for _, s, q in tensor_table(TINY_DRAFT, "q8_0"))
    prompt = list(range(10, 60))
    with Engine(target, draft, **options) as engine:
        plain = engine.generate(prompt, max_tokens=12, speculative=False).tokens
        spec = engine.generate(prompt, max_tokens=12, speculative=True).tokens
        engine.target.reset()
        engine.target.prefill(prompt)
        logits = engine.target.logits(0, 1)
    assert np.isfinite(logits).all() and logits.std() > 0
    assert spec == plain


def test_loads_in_llama_cpp(pair):
    from llama_cpp import Llama

    llm = Llama(pair[0], n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    llm.eval(list(range(10, 30)))
    scores = np.asarray(llm.scores[:20])
    assert scores.shape == (20, 4096) and np.isfinite(scores).all()


def test_gemma4_moe_shape_runs_in_both_runtimes(tmp_path):
    from llama_cpp import Llama

    from dflash_gguf.runtime.target import LOGITS_ALL, Target, TargetConfig

    path = str(write_model(TINY_GEMMA4, "q4_k_m", tmp_path / "g.gguf", progress=False))
    with Target(path, TargetConfig(n_ctx=128, kv_type="f32", n_threads=1)) as target:
        target.decode(list(range(10, 40)), LOGITS_ALL)  # past the sliding window
        ours = target.logits(0, 30)
    assert np.isfinite(ours).all() and ours.std() > 0
    llm = Llama(path, n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    llm.eval(list(range(10, 40)))
    assert np.isfinite(np.asarray(llm.scores[:30])).all()


def test_refuses_a_file_system_too_small(tmp_path, monkeypatch, capsys):
    import re
    import shutil

    monkeypatch.setattr(shape_model.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 0, 1 << 30))
    assert make_main(["qwen35-27b", "--outfile", str(tmp_path / "big.gguf")]) == 1
    assert re.search(r"error: .* 1\.0 GiB free; the model needs 1[5-7]\.\d GiB", capsys.readouterr().err)
    assert not list(tmp_path.iterdir())


def test_bad_options_are_clear_errors(tmp_path, capsys):
    for argv, msg in ((["--set", "widht=3"], "unknown config entry 'widht'"),
                      (["--layers", "2"], "needs at least 4 layers"),
                      (["--set", "hidden=x"], "bad value for hidden")):
        with pytest.raises(SystemExit):
            make_main(["qwen35-27b", "--outfile", str(tmp_path / "x.gguf"), *argv])
        assert msg in capsys.readouterr().err


def test_gpt_oss_shape_runs_in_both_runtimes(tmp_path):
    """A tiny gpt-oss of the published structure (MXFP4 experts with random codes): our
    runtime loads it with the planned weights and decodes, and so does llama.cpp."""
    from helpers.fixtures import open_llama

    path = str(write_model(TINY_GPT_OSS, "mxfp4_moe", tmp_path / "oss.gguf", progress=False))
    setup = EngineSetup.of(path, None, EngineOptions.of(n_ctx=256, kv_type="f16", n_threads=2))
    plan = plan_memory(path, None, setup.target_config, None).devices[0].parts
    assert plan["target_weights"] == sum(tensor_nbytes(s, q) for _, s, q in tensor_table(TINY_GPT_OSS, "mxfp4_moe"))
    with Engine(path, n_ctx=256, n_threads=2) as engine:
        assert len(engine.generate(list(range(1, 40)), max_tokens=4, stop_tokens=()).tokens) == 4
    llm = open_llama(path, n_ctx=64, n_threads=2)
    try:
        llm.eval(list(range(1, 20)))
    finally:
        llm.close()
