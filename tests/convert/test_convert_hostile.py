"""The converter on hostile checkpoints: NaN/Inf weights are named and refused (unless
--allow-nan), missing or inconsistent shards and config keys are one clear line, and an
interrupted conversion never leaves a file under the output name."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from dflash_gguf.convert import writer

from helpers.convert_checks import assert_one_clear_line, convert, edit_config, linked_copy


# ---- NaN / Inf ---------------------------------------------------------------------------

def test_nan_and_inf_weights_are_named_and_refused(qwen35_dir, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    model = linked_copy(qwen35_dir("base"), tmp_path / "model")
    weights = load_file(str(model / "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"][3, :5] = np.nan
    weights["model.layers.2.input_layernorm.weight"][7] = np.inf
    (model / "model.safetensors").unlink()
    save_file(weights, str(model / "model.safetensors"))
    out = tmp_path / "x.gguf"

    rc, err = convert(model, out, capsys)
    assert_one_clear_line(rc, err, out, "2 tensors with NaN/Inf values")
    assert "blk.1.ffn_up.weight (5 NaN)" in err and "blk.2.attn_norm.weight (1 Inf)" in err
    assert "--allow-nan" in err

    rc, err = convert(model, out, capsys, "--allow-nan")
    assert rc == 0, err
    assert "blk.1.ffn_up.weight (5 NaN)" in err and "WARNING" in err
    assert out.read_bytes()[:4] == b"GGUF"


# ---- shards --------------------------------------------------------------------------------

def _shard_files(model: Path) -> list[Path]:
    return sorted(model.glob("model-*.safetensors"))


def _unindexed(qwen35_dir, tmp_path) -> Path:
    model = linked_copy(qwen35_dir("sharded"), tmp_path / "model")
    (model / "model.safetensors.index.json").unlink()
    return model


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.unlink()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


SHARD_CASES = {
    "unindexed set with a missing shard": (
        lambda m: _shard_files(m)[1].unlink(), "1 of 4 shard files are missing: model-00002-of-00004"),
    "tensor in two shards": (lambda m: _claim(m), "is in two shards"),
    "byte count that does not fit dtype and shape": (
        lambda m: _rewrite_header(_shard_files(m)[0], lambda h: h[_first_tensor(h)].update(
            data_offsets=[h[_first_tensor(h)]["data_offsets"][0], h[_first_tensor(h)]["data_offsets"][1] - 2])),
        "does not fit its dtype"),
    "header length past the end": (
        lambda m: _corrupt_length(_shard_files(m)[2]), "header length"),
    "header not an object": (
        lambda m: _rewrite_raw_header(_shard_files(m)[0], b"[1, 2, 3]   "), "not a JSON object"),
}


def _claim(model: Path) -> None:
    """Shard 2 claims a tensor of shard 1 as well."""
    raw = _shard_files(model)[0].read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    name = _first_tensor(json.loads(raw[8:8 + n]))
    _rewrite_header(_shard_files(model)[1], lambda h: h.update({name: h[_first_tensor(h)]}))


def _corrupt_length(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    struct.pack_into("<Q", raw, 0, 1 << 62)
    path.unlink()
    path.write_bytes(bytes(raw))


def _rewrite_raw_header(path: Path, header: bytes) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    path.unlink()
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])


@pytest.mark.parametrize("case", list(SHARD_CASES))
def test_shard_problems_are_one_clear_line(case, qwen35_dir, tmp_path, capsys):
    model = _unindexed(qwen35_dir, tmp_path)
    damage, needle = SHARD_CASES[case]
    damage(model)
    out = tmp_path / "x.gguf"
    assert_one_clear_line(*convert(model, out, capsys), out, needle)


def test_index_problems_are_one_clear_line(qwen35_dir, tmp_path, capsys):
    model = linked_copy(qwen35_dir("sharded"), tmp_path / "model")
    out = tmp_path / "x.gguf"
    index = model / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    extra = {**content["weight_map"], "model.extra.weight": "model-00009-of-00009.safetensors"}
    for bad, needle in [({"weight_map": ["a", "b"]}, "weight_map"), ({"metadata": {}}, "weight map"),
                        ({"weight_map": extra}, "missing: model-00009-of-00009")]:
        index.unlink()
        index.write_text(json.dumps(bad))
        assert_one_clear_line(*convert(model, out, capsys), out, needle)


# ---- config keys ---------------------------------------------------------------------------

CONFIG_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "rms_norm_eps", "linear_conv_kernel_dim", "linear_key_head_dim",
               "linear_num_key_heads", "linear_num_value_heads", "head_dim"]
BAD_VALUES = [None, "64", 0, -4, True, 2.5, [8]]


@pytest.mark.parametrize("key", CONFIG_KEYS)
def test_config_keys_missing_or_wrong_are_one_clear_line(key, qwen35_dir, tmp_path, capsys):
    out = tmp_path / "x.gguf"
    for i, value in enumerate(["<missing>"] + BAD_VALUES):
        if key == "rms_norm_eps" and value == 2.5:
            continue  # a valid epsilon, if an odd one
        model = linked_copy(qwen35_dir("base"), tmp_path / f"model{i}")
        edit_config(model, lambda c: c.pop(key) if value == "<missing>" else c.update({key: value}))
        rc, err = convert(model, out, capsys)
        if key == "head_dim" and value == "<missing>":
            assert rc == 2 and "shape" in err  # transformers' default 256 does not fit the tensors
        assert_one_clear_line(rc, err, out, key if key != "head_dim" or value != "<missing>" else "shape")


def _more_layers(cfg: dict, n: int) -> None:
    cfg.update(num_hidden_layers=n, layer_types=(cfg["layer_types"] * n)[:n])


@pytest.mark.parametrize("edit,needle", [
    (lambda c: c.update(hidden_size=96), "shape"),                       # inconsistent with the tensors
    (lambda c: c.update(num_hidden_layers=6), "4 entries for 6 layers"),
    (lambda c: _more_layers(c, 6), "missing"),                           # more layers than the checkpoint
    (lambda c: c.update(layer_types="linear_attention"), "layer_types"),
    (lambda c: c.update(layer_types=["linear_attention"] * 3), "layer_types"),
    (lambda c: c.update(rope_parameters=[1, 2]), "rope_parameters"),
    (lambda c: c["rope_parameters"].update(partial_rotary_factor="quarter"), "partial_rotary_factor"),
    (lambda c: c["rope_parameters"].update(mrope_section=[11, "x"]), "mrope_section"),
    (lambda c: c.update(linear_num_value_heads=3), "multiple"),
])
def test_inconsistent_config_is_one_clear_line(edit, needle, qwen35_dir, tmp_path, capsys):
    model = linked_copy(qwen35_dir("base"), tmp_path / "model")
    edit_config(model, edit)
    out = tmp_path / "x.gguf"
    assert_one_clear_line(*convert(model, out, capsys), out, needle)


# ---- interruptions -------------------------------------------------------------------------

@pytest.mark.parametrize("exc,code", [(KeyboardInterrupt, 130), (OSError, 1)])
@pytest.mark.parametrize("threads", ["1", "2"])
def test_interrupted_conversion_leaves_no_output(exc, code, threads, qwen35_dir, tmp_path, capsys, monkeypatch):
    real = writer.encode_rows
    calls = []
    partial_seen = []  # checked here, not inside the converter, whose `except Exception` would swallow it

    def failing(rows, t):
        calls.append(1)
        if len(calls) == 5:  # a few tensors in: the partial file exists by now
            partial_seen.append(any(p.name.endswith(".partial") for p in tmp_path.iterdir()))
            raise exc("No space left on device") if exc is OSError else exc()
        return real(rows, t)

    monkeypatch.setattr(writer, "encode_rows", failing)
    out = tmp_path / "x.gguf"
    rc, err = convert(qwen35_dir("base"), out, capsys, "--threads", threads)
    assert rc == code, err
    assert partial_seen == [True], "the conversion was not interrupted while writing its .partial file"
    assert "Traceback" not in err
    if exc is OSError:  # the error reported is the one raised, in one line
        assert "No space left on device" in err, err
    assert not out.exists() and not (tmp_path / "x.gguf.partial").exists()

    # over an existing file (--force): the old file stays whole until the new one is complete
    out.write_bytes(b"precious")
    calls.clear()
    partial_seen.clear()
    rc, err = convert(qwen35_dir("base"), out, capsys, "--threads", threads, "--force")
    assert rc == code and out.read_bytes() == b"precious"
    assert partial_seen == [True], "the conversion was not interrupted while writing its .partial file"
    assert not (tmp_path / "x.gguf.partial").exists()


@pytest.mark.parametrize("edit,needle", [
    (lambda c: c.update(num_key_value_heads=0), "num_key_value_heads"),
    (lambda c: c.update(hidden_size="128"), "hidden_size"),
    (lambda c: c["dflash_config"].update(block_size="8"), "block_size"),
    (lambda c: c["dflash_config"].update(mask_token_id=None), "mask_token_id"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[0, "2"]), "target_layer_ids"),
])
def test_drafter_config_problems_are_one_clear_line(edit, needle, tmp_path, capsys, qwen35_dir):
    from helpers.draft_fixtures import make_dflash

    draft = make_dflash(tmp_path / "draft", qwen35_dir("base"), seed=5)
    edit_config(draft, edit)
    out = tmp_path / "x.gguf"
    rc, err = convert(draft, out, capsys, "--target-model-dir", str(qwen35_dir("base")))
    assert_one_clear_line(rc, err, out, needle)
