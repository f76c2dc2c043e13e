"""Qwen3.5's multi-token-prediction head (mtp.*) in our converter: kept as llama.cpp's
nextn layers after the model's own unless --no-mtp, the same names, shapes, keys and
data as llama.cpp's converter writes; either file loads in the other's runtime and
decodes as the file without them (the runtime leaves the nextn layers alone)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_gguf.engine.engine import Engine

from helpers.fixtures import llama_greedy, make_qwen35, make_qwen35moe, read_gguf

RUN = str(Path(sys.executable).with_name("dflash-run"))


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return make_qwen35(tmp_path_factory.mktemp("qwen35_mtp") / "mtp", mtp_layers=1, seed=7)


@pytest.fixture(scope="module")
def files(mtp_dir, convert_model, llama_cpp_oracle, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_gguf")
    oracle = llama_cpp_oracle()
    return {"ours": convert_model(mtp_dir, "f32"), "ours_no_mtp": convert_model(mtp_dir, "f32", "--no-mtp"),
            "ref": oracle.convert(mtp_dir, root / "ref.gguf", "f32", pre="qwen35", extra_args=()),
            "ref_no_mtp": oracle.convert(mtp_dir, root / "ref-no-mtp.gguf", "f32", pre="qwen35",
                                         extra_args=("--no-mtp",))}


def test_nextn_layers_match_llama_cpp_converter(files):
    ours_kv, ours_t = read_gguf(files["ours"])
    ref_kv, ref_t = read_gguf(files["ref"])
    assert ref_kv["qwen35.nextn_predict_layers"][1] == 1 and ref_kv["qwen35.block_count"][1] == 5
    assert set(ours_kv) == set(ref_kv)
    for key in set(ref_kv) - {"general.name"}:
        assert ours_kv[key] == ref_kv[key], key
    assert set(ours_t) == set(ref_t)
    assert "blk.4.nextn.eh_proj.weight" in ref_t and "blk.4.attn_q.weight" in ref_t
    for name, (rtype, rshape, rdata) in ref_t.items():
        otype, oshape, odata = ours_t[name]
        assert (otype, oshape) == (rtype, rshape), name
        np.testing.assert_allclose(odata, rdata, rtol=1e-6, atol=0, err_msg=name)


def test_no_mtp_leaves_them_out(files):
    for which in ("ours_no_mtp", "ref_no_mtp"):
        kv, tensors = read_gguf(files[which])
        assert "qwen35.nextn_predict_layers" not in kv and kv["qwen35.block_count"][1] == 4
        assert not [n for n in tensors if n.startswith("blk.4.") or ".nextn." in n]
    assert set(read_gguf(files["ours_no_mtp"])[1]) == set(read_gguf(files["ref_no_mtp"])[1])


def test_either_file_decodes_as_without_the_head(files, mtp_dir):
    with Engine(str(files["ours_no_mtp"]), n_ctx=256, kv_type="f32", n_threads=1) as plain:
        prompt = plain.encode("The quick brown fox")
        want = plain.generate(prompt, 24, stop_tokens=()).tokens
    for which in ("ours", "ref"):
        with Engine(str(files[which]), n_ctx=256, kv_type="f32", n_threads=1) as engine:
            assert engine.target.info()["n_layer"] == 4
            assert engine.generate(prompt, 24, stop_tokens=()).tokens == want, which
    # ours, with its nextn layers, in llama.cpp: the same greedy text
    assert llama_greedy(files["ours"], prompt, 24) == llama_greedy(files["ref_no_mtp"], prompt, 24) == want


def test_draft_mtp_runs_on_either_file_and_is_refused_without_nextn_layers(files, mtp_dir):
    """--spec-type draft-mtp drafts with the file's own nextn layer, from either converter
    (the plain greedy text); a file without them is one error line, exit 2."""
    with Engine(str(files["ours_no_mtp"]), n_ctx=256, kv_type="f32", n_threads=1) as plain:
        prompt = plain.encode("The quick brown fox")
        want = plain.generate(prompt, 16, stop_tokens=()).tokens
    for which in ("ours", "ref"):
        with Engine(str(files[which]), n_ctx=256, kv_type="f32", n_threads=1, spec_type="draft-mtp") as engine:
            assert engine.draft.kind == "mtp"
            assert engine.generate(prompt, 16, stop_tokens=()).tokens == want, which
    res = subprocess.run([RUN, "-m", str(files["ours_no_mtp"]), "-p", "x", "-n", "4", "--spec-type", "draft-mtp"],
                         capture_output=True, text=True, timeout=300, env={**os.environ})
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "no nextn (MTP) layers" in res.stderr


def test_moe_nextn_layers_match_llama_cpp_converter(convert_model, llama_cpp_oracle, tmp_path):
    """qwen35moe: the MTP layer's routed experts and shared expert as well."""
    d = make_qwen35moe(tmp_path / "moe", mtp_layers=1, seed=9)
    ours_kv, ours_t = read_gguf(convert_model(d, "f32"))
    ref_kv, ref_t = read_gguf(llama_cpp_oracle().convert(d, tmp_path / "ref.gguf", "f32", pre="qwen35", extra_args=()))
    assert ref_kv["qwen35moe.nextn_predict_layers"][1] == 1 and "blk.4.ffn_gate_exps.weight" in ref_t
    assert set(ours_kv) == set(ref_kv)
    for key in set(ref_kv) - {"general.name", "general.size_label"}:  # as test_architectures' MoE comparison
        assert ours_kv[key] == ref_kv[key], key
    assert set(ours_t) == set(ref_t)
    for name, (rtype, rshape, rdata) in ref_t.items():
        assert ours_t[name][:2] == (rtype, rshape), name
        np.testing.assert_allclose(ours_t[name][2], rdata, rtol=1e-6, atol=0, err_msg=name)
    with Engine(str(convert_model(d, "f32")), n_ctx=128, kv_type="f32", n_threads=1) as engine, \
            Engine(str(convert_model(d, "f32", "--no-mtp")), n_ctx=128, kv_type="f32", n_threads=1) as plain:
        prompt = plain.encode("The quick brown fox")
        assert engine.generate(prompt, 16, stop_tokens=()).tokens == plain.generate(prompt, 16, stop_tokens=()).tokens
