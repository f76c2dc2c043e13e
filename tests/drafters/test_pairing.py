"""Target/drafter pairing: our converter records in the drafter the target it was made
for (tokenizer fingerprint, embedding shape, name); the runtime refuses any other
target with both names in the message. Drafters from llama.cpp's converter carry no
fingerprint and are checked by shape and by the vocabulary they carry."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.convert_checks import libllama_model
from helpers.fixtures import make_qwen35, read_gguf
from helpers.gguf_fuzz import ARR, STR, build, enc_kv, parse

from dflash_gguf.runtime.native import DflashError
from dflash_gguf.convert.vocab.load import load_vocab
from dflash_gguf.runtime.drafter import Draft, read_draft_metadata, tokenizer_fingerprint
from dflash_gguf.engine.engine import Engine
from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig


@pytest.fixture(scope="module")
def ours(pair, convert_model):
    """The pair's drafter converted by our converter (pair["draft"] is llama.cpp's)."""
    return convert_model(pair["draft_dir"], "f32", "--target-model-dir", str(pair["target_dir"]))


def _rewrite(src: Path, dst: Path, name: str, edit_tokens=None, drop_tokenizer=False) -> Path:
    """A copy of a GGUF with another general.name and, optionally, tokens changed or the
    tokenizer removed (the weights are the same)."""
    L = parse(src.read_bytes())
    raws = []
    for k in L.kvs:
        raw = L.data[k.start:k.end]
        if k.key == "general.name":
            raw = enc_kv("general.name", STR, name)
        elif k.key.startswith("tokenizer.") and drop_tokenizer:
            continue
        elif k.key == "tokenizer.ggml.tokens" and edit_tokens:
            toks = [L.data[e + 8:e + 8 + struct.unpack_from("<Q", L.data, e)[0]] for e in k.elems]
            raw = enc_kv(k.key, ARR, edit_tokens(toks), STR)
        raws.append(raw)
    dst.write_bytes(build(raws, [(t.name, t.dims, t.type, L.payload(t)) for t in L.tensors], L.alignment))
    return dst


def _swap_two(toks):
    toks = list(toks)
    toks[300], toks[301] = toks[301], toks[300]
    return toks


def _target(path, meta, **kw):
    return Target(path, TargetConfig(n_ctx=128, n_verify=8, feature_layers=meta["target_layers"], **kw))


def test_converter_records_the_target(pair, ours):
    kv, _ = read_gguf(ours)
    target_sha = tokenizer_fingerprint(pair["target"])
    assert kv["dflash.target.tokenizer_sha256"][1] == target_sha
    assert kv["dflash.target.name"][1] == Path(pair["target_dir"]).resolve().name
    t_kv, t_tensors = read_gguf(pair["target"])
    assert (kv["dflash.target.vocab_size"][1], kv["dflash.target.embedding_length"][1]) == \
        (len(t_kv["tokenizer.ggml.tokens"][1]), t_kv["qwen35.embedding_length"][1])
    # the converter's hash (Python, from the tokenizer files) is the runtime's (C, from GGUF metadata) ...
    cfg = json.loads((Path(pair["target_dir"]) / "config.json").read_text())
    vocab = load_vocab(Path(pair["target_dir"]), cfg, cfg["vocab_size"])
    assert vocab.fingerprint() == target_sha
    # ... and does not depend on the converter: llama.cpp's drafter carries the same tokenizer
    assert tokenizer_fingerprint(pair["draft"]) == target_sha
    meta = read_draft_metadata(ours)
    assert meta["target"] == {"target_name": Path(pair["target_dir"]).resolve().name,
                              "tokenizer_sha256": target_sha,
                              "embedding": (kv["dflash.target.vocab_size"][1], kv["dflash.target.embedding_length"][1])}
    assert read_draft_metadata(pair["draft"])["target"] is None  # llama.cpp's converter records none


def test_llama_cpp_loads_the_fingerprinted_drafter(pair, ours):
    model = libllama_model(ours)  # unknown keys are ignored by llama.cpp's loader
    try:
        assert model.desc().startswith("dflash")
    finally:
        model.close()


def test_drafter_for_another_target_is_refused_with_both_names(pair, ours, tmp_path):
    other = _rewrite(Path(pair["target"]), tmp_path / "other.gguf", "other-target", edit_tokens=_swap_two)
    meta = read_draft_metadata(ours)
    with _target(other, meta) as target:  # a valid target: same shapes, another tokenizer
        with pytest.raises(DflashError) as e:
            Draft(ours, target)
        msg = str(e.value)
        assert "other-target" in msg and meta["target"]["target_name"] in msg and meta["name"] in msg
        assert "tokenizer" in msg and "wrong target/drafter pair" in msg
        # llama.cpp's drafter carries the right target's vocabulary: refused by that
        with pytest.raises(DflashError, match="another vocabulary than the loaded target 'other-target'"):
            Draft(pair["draft"], target)
    with pytest.raises(DflashError, match="other-target"):
        Engine(str(other), str(ours), n_ctx=128)
    run = str(Path(sys.executable).with_name("dflash-run"))
    res = subprocess.run([run, "-m", str(other), "-md", str(ours), "-p", "x", "-n", "2"], capture_output=True,
                         text=True, timeout=120, env={**os.environ})
    assert res.returncode == 1 and "other-target" in res.stderr and "Traceback" not in res.stderr


def test_embedding_shape_mismatch_names_both_models(ours, convert_model, tmp_path):
    wide = make_qwen35(tmp_path / "wide-target", hidden=192, layers=4, seed=9)
    wide_gguf = convert_model(wide, "f32")
    meta = read_draft_metadata(ours)
    with _target(wide_gguf, meta) as target:
        with pytest.raises(DflashError) as e:
            Draft(ours, target)
    msg = str(e.value)
    assert "wide-target" in msg and meta["target"]["target_name"] in msg and "embedding" in msg


def _first_block(target_path, draft_path, meta) -> list[int]:
    """The block a drafter proposes after a fixed prompt next to a target."""
    prompt = list(range(40, 70))
    with _target(target_path, meta) as target, Draft(draft_path, target) as draft:
        target.prefill(prompt, LOGITS_LAST, on_chunk=lambda _start, n: draft.append())
        return draft.propose(int(target.choices()[0]))


def test_right_pair_loads_either_way(pair, ours):
    """Our conversion of the drafter and llama.cpp's both load next to their target, and
    being the same weights they draft the same full block."""
    meta = read_draft_metadata(pair["draft"])
    ours_block = _first_block(pair["target"], ours, meta)
    theirs_block = _first_block(pair["target"], pair["draft"], meta)
    assert len(ours_block) == meta["block_size"] - 1
    assert ours_block == theirs_block


def test_target_without_a_tokenizer_is_checked_by_shape(pair, ours, tmp_path):
    """A target with token ids only leaves nothing to compare the fingerprint with: our
    drafter loads by shape and drafts what it drafts next to the full target."""
    bare = _rewrite(Path(pair["target"]), tmp_path / "bare.gguf", "bare", drop_tokenizer=True)
    assert not any(k.startswith("tokenizer.") for k in read_gguf(bare)[0])
    meta = read_draft_metadata(ours)
    assert _first_block(bare, ours, meta) == _first_block(pair["target"], ours, meta)
