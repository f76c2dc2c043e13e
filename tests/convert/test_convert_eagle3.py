"""convert-hf-to-gguf for EAGLE3 drafters (speculators checkpoints): keys, tensor names,
types and bytes against llama.cpp's own converter, libllama loading what we write, the
pairing fingerprint, and one clear line for a drafter made for another target or a
layout llama.cpp's eagle3 graph cannot run. Also: the bundled heads (the MTP layer in
demo-target.gguf, demo-eagle3.gguf) load in libllama."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dflash_gguf.convert.cli import main
from dflash_gguf.convert.models.eagle3 import neox_to_interleaved

from helpers.convert_checks import libllama_model, variant
from helpers.eagle3_fixtures import make_eagle3
from helpers.fixtures import read_gguf
from helpers.paths import ROOT

DATA = ROOT / "dflash_gguf" / "data"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, qwen35_dir):
    """ckpt(name) -> checkpoint directory (drafters and targets), built on first use."""
    root = tmp_path_factory.mktemp("eagle3")
    base = qwen35_dir("base")  # hidden 128, 4 layers, vocabulary 1029

    def edit(name, change):
        return lambda: variant(get(name), root / f"{name}-{len(built)}", change)

    recipes = {
        "target": lambda: base,
        "draft": lambda: make_eagle3(root / "draft", base, layer_ids=(1, 2, 4), seed=21),
        # default feature layers, the target's vocabulary, no own embedding, RMSNorm before fc,
        # the residual normed
        "plain": lambda: make_eagle3(root / "plain", base, layer_ids=None, draft_vocab=None, own_embedding=False,
                                     norm_before_fc=True, norm_before_residual=True, seed=22),
        # the original EAGLE-3 layout: flat config, midlayer.*, default feature layers
        "original": lambda: make_eagle3(root / "original", base, original=True, seed=23),
        "qwen3_layer": edit("draft", lambda c: c["transformer_layer_config"].update(model_type="qwen3")),
        "two_layers": edit("draft", lambda c: c["transformer_layer_config"].update(num_hidden_layers=2)),
        "fc_norm": edit("draft", lambda c: c.update(fc_norm=True)),
        "bad_ids": edit("draft", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 5])),
        "four_ids": edit("draft", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2, 3])),
        "other_hidden": edit("draft", lambda c: c.update(target_hidden_size=256)),
        "k256": lambda: qwen35_dir("k256"),  # hidden 256
        "tied": lambda: qwen35_dir("tied"),  # hidden 128, vocabulary 1056
    }
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = Path(recipes[name]())
        return built[name]

    return get


@pytest.fixture(scope="module")
def ours(ckpt, convert_model):
    def convert(draft: str, outtype: str = "f32", target: str = "target") -> Path:
        return convert_model(ckpt(draft), outtype, "--target-model-dir", str(ckpt(target)))

    return convert


@pytest.fixture(scope="module")
def reference(ckpt, llama_cpp_convert_dflash):
    """llama.cpp's converter (the DFlash fixture's call: tokenizer from the target, pre qwen35)."""
    return lambda draft, outtype="f32": llama_cpp_convert_dflash(ckpt(draft), ckpt("target"), outtype)


# ---- layout: llama.cpp's converter as the oracle -----------------------------------------

@pytest.mark.parametrize("draft,outtype", [("draft", "f32"), ("draft", "q8_0"), ("plain", "f16"), ("original", "bf16")])
def test_matches_llama_cpp_converter(draft, outtype, ours, reference):
    ours_kv, ours_t = read_gguf(ours(draft, outtype))
    ref_kv, ref_t = read_gguf(reference(draft, outtype))
    # ours records the target it was converted for (eagle3.target.*); llama.cpp does not
    assert {k for k in ours_kv if not k.startswith("eagle3.target.")} == set(ref_kv)
    for key in set(ref_kv) - {"general.name"}:  # llama.cpp title-cases the directory name
        assert ours_kv[key] == ref_kv[key], key
    assert set(ours_t) == set(ref_t)
    for name, (rtype, rshape, rdata) in ref_t.items():
        otype, oshape, odata = ours_t[name]
        assert (otype, oshape) == (rtype, rshape), name
        assert np.array_equal(odata.view(np.uint8), rdata.view(np.uint8)), name


def test_keys_and_tensors(ckpt, ours):
    kv, tensors = read_gguf(ours("draft", "q8_0"))
    assert kv["general.architecture"][1] == "eagle3"
    assert kv["eagle3.target_layers"][1] == [1, 2, 4]  # the speculators ids as they are: input of layer L
    assert kv["eagle3.target_hidden_size"][1] == 128 and kv["eagle3.vocab_size"][1] == 1029
    assert kv["eagle3.norm_before_fc"][1] is False and kv["eagle3.norm_before_residual"][1] is False
    assert tensors["fc.weight"][1] == (384, 128) and tensors["fc.weight"][0] == "Q8_0"
    assert tensors["blk.0.attn_q.weight"][1] == (256, 128)  # q/k/v read [embedding; hidden]
    assert tensors["output.weight"][1] == (128, 512) and tensors["token_embd.weight"][1] == (128, 1029)
    from safetensors.numpy import load_file

    raw = load_file(str(ckpt("draft") / "model.safetensors"))
    d2t_type, d2t_shape, d2t = tensors["d2t"]
    assert d2t_type == "I64" and d2t_shape == (512,)
    assert np.array_equal(d2t, raw["d2t"] + np.arange(512))  # absolute target ids
    assert np.array_equal(np.flatnonzero(raw["t2d"]), np.sort(d2t))
    # q rows go from each head's rotary halves to interleaved pairs
    q = read_gguf(ours("draft", "f32"))[1]["blk.0.attn_q.weight"][2]
    np.testing.assert_array_equal(q, raw["layers.0.self_attn.q_proj.weight"][neox_to_interleaved(128, 32)])

    kv, tensors = read_gguf(ours("plain", "f16"))
    assert kv["eagle3.norm_before_fc"][1] is True and kv["eagle3.norm_before_residual"][1] is True
    assert kv["eagle3.target_layers"][1] == [2, 2, 1]  # llama.cpp's default for 4 target layers
    assert "d2t" not in tensors and "token_embd.weight" not in tensors
    assert tensors["enc.output_norm.weight"][1] == (384,)


def test_interleave_permutation():
    assert neox_to_interleaved(8, 4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_pairing_fingerprint_is_the_targets(ckpt, ours, convert_model):
    """eagle3.target.* holds what dfl_pair.c compares for DFlash drafters: the target's
    tokenizer fingerprint (as the runtime computes it from the target's GGUF) and shape."""
    from dflash_gguf.runtime.native import check, ffi, lib

    kv, _ = read_gguf(ours("draft"))
    hex_ = ffi.new("char[65]")
    check(lib.dfl_tokenizer_fingerprint(str(convert_model(ckpt("target"), "f32")).encode(), hex_, 65))
    assert kv["eagle3.target.tokenizer_sha256"][1] == ffi.string(hex_).decode()
    assert kv["eagle3.target.embedding_length"][1] == 128 and kv["eagle3.target.vocab_size"][1] == 1029
    assert kv["eagle3.target.name"][1] == ckpt("target").name


@pytest.mark.parametrize("draft,outtype", [("draft", "q8_0"), ("plain", "f32")])
def test_libllama_loads_ours(draft, outtype, ours, ckpt, convert_model):
    model = libllama_model(ours(draft, outtype))  # every tensor with the shape llama.cpp's eagle3 loader wants
    target = libllama_model(convert_model(ckpt("target"), "f32"))
    try:
        assert model.desc().startswith("eagle3")
        assert model.n_embd() == target.n_embd() and model.n_vocab() == target.n_vocab()
        text = "def quicksort(xs):\n    return sorted(xs)"
        assert model.tokenize(text.encode(), False, True) == target.tokenize(text.encode(), False, True)
    finally:
        model.close()
        target.close()


# ---- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("draft,target,message", [
    ("draft", None, "--target-model-dir"),
    ("draft", "missing", "is not a directory"),
    ("draft", "k256", "hidden size 128 does not match the target's 256"),
    ("other_hidden", "target", "target hidden states of size 256"),
    ("draft", "tied", "vocab_size 1029 does not match the target's 1056"),
    ("bad_ids", "target", "reads layer 5, but the target ("),
    ("four_ids", "target", "must list 3 target layers"),
    ("qwen3_layer", "target", "model_type is 'qwen3'"),
    ("two_layers", "target", "an EAGLE3 drafter has one decoder layer"),
    ("fc_norm", "target", "(fc_norm) is not in llama.cpp's eagle3 layout"),
])
def test_bad_input_is_one_line(draft, target, message, ckpt, tmp_path, capsys):
    out = tmp_path / "draft.gguf"
    args = [str(ckpt(draft)), "--outfile", str(out)]
    if target == "missing":
        args += ["--target-model-dir", str(tmp_path / "nowhere")]
    elif target is not None:
        args += ["--target-model-dir", str(ckpt(target))]
    capsys.readouterr()  # what building the checkpoints printed
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_bad_vocabulary_map_is_one_line(ckpt, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    bad = variant(ckpt("draft"), tmp_path / "dup")
    (bad / "model.safetensors").unlink()
    tensors = load_file(str(ckpt("draft") / "model.safetensors"))
    tensors["d2t"][1] = tensors["d2t"][0] - 1  # draft ids 0 and 1 -> one target id
    save_file(tensors, str(bad / "model.safetensors"))
    assert main([str(bad), "--target-model-dir", str(ckpt("target")), "--outfile", str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err
    assert "d2t maps two draft ids to one target id" in err and err.count("\n") == 1


# ---- the bundled heads -------------------------------------------------------------------------

def test_bundled_heads_load_in_libllama():
    """demo-target.gguf carries one nextn (MTP) layer; demo-eagle3.gguf is an eagle3
    drafter for it, converted with its pairing fingerprint."""
    import llama_cpp

    target = libllama_model(DATA / "demo-target.gguf")
    drafter = libllama_model(DATA / "demo-eagle3.gguf")
    try:
        assert llama_cpp.llama_model_n_layer_nextn(target.model) == 1
        assert drafter.desc().startswith("eagle3") and drafter.n_embd() == target.n_embd()
        assert llama_cpp.llama_model_has_encoder(drafter.model)  # the fc over the target's features
    finally:
        target.close()
        drafter.close()
    kv, tensors = read_gguf(DATA / "demo-eagle3.gguf")
    assert kv["eagle3.target.name"][1] == "demo-target" and kv["eagle3.target.vocab_size"][1] == 4096
    assert kv["eagle3.target_layers"][1] == [1, 2, 3] and tensors["d2t"][0] == "I64"
