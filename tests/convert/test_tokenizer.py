"""Tokenizer metadata: our GGUF must tokenize like the Hugging Face tokenizer under
llama.cpp, and the pre-tokenizer name must be chosen by hash, regex or --pre."""
from __future__ import annotations

import ast
import json
import shutil
from hashlib import sha256

import pytest
from gguf import TokenType

from dflash_gguf.convert.vocab import load as vocab
from dflash_gguf.convert.cli import main

from helpers.fixtures import (CHAT_TEMPLATE, PLAIN_ADDED_TOKENS, SAMPLE_TEXT, SPECIAL_TOKENS, llama_cpp_source,
                              make_qwen35, missing_oracle, open_llama, read_gguf)

TEXTS = [
    SAMPLE_TEXT,
    "   leading spaces, trailing spaces   ",
    "\n\n\nnewlines\r\nand CRLF\r\n\ttab\t\t",
    "I'm sure you'VE heard 'bout it, they'll know; DON'T",
    "x = {'a': [1,2,3]} # comment\nif x:\n\treturn x['a'][0]**2",
    "नमस्ते दुनिया — é (e + ́ combining) and ñ, Zürich, İstanbul",
    "<think>plain added tokens match inside text</think> ok",
    "🦙🦙🦙 emoji runs 😶‍🌫️ and CJK 中文字符 with numbers 12345678",
]


@pytest.fixture(scope="session")
def hf_tokenizer(qwen35_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen35_dir("base")))


@pytest.fixture(scope="session")
def vocab_llama(qwen35_dir, convert_model):
    llm = open_llama(convert_model(qwen35_dir("base"), "f32"), vocab_only=True)
    yield llm
    llm.close()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizes_like_hf(text, hf_tokenizer, vocab_llama):
    ids = vocab_llama.tokenize(text.encode(), add_bos=False, special=False)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert vocab_llama.detokenize(ids).decode() == text


def test_no_bos_is_added(vocab_llama):
    assert vocab_llama.tokenize(b"hello", add_bos=True) == vocab_llama.tokenize(b"hello", add_bos=False)


def test_special_tokens_parse_like_hf(hf_tokenizer, vocab_llama):
    chat = hf_tokenizer.apply_chat_template([{"role": "user", "content": "Hello <think>x</think>"}],
                                            tokenize=False, add_generation_prompt=True)
    ids = vocab_llama.tokenize(chat.encode(), add_bos=False, special=True)
    assert ids == hf_tokenizer.encode(chat, add_special_tokens=False)
    assert ids[0] == hf_tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_vocab_metadata(qwen35_dir, convert_model, hf_tokenizer):
    kv, _ = read_gguf(convert_model(qwen35_dir("tied"), "f32"))
    val = {k: v[1] for k, v in kv.items()}
    tokens, types = val["tokenizer.ggml.tokens"], val["tokenizer.ggml.token_type"]
    assert val["tokenizer.ggml.model"] == "gpt2"
    assert val["tokenizer.ggml.pre"] == "qwen35"
    assert len(tokens) == len(types) == 1056  # the model's vocab_size, past the tokenizer
    n_tok = len(hf_tokenizer)
    assert tokens[n_tok:] == [f"[PAD{i}]" for i in range(n_tok, 1056)]
    assert set(types[n_tok:]) == {TokenType.UNUSED}
    for t in SPECIAL_TOKENS:
        assert types[hf_tokenizer.convert_tokens_to_ids(t)] == TokenType.CONTROL
    for t in PLAIN_ADDED_TOKENS:
        assert types[hf_tokenizer.convert_tokens_to_ids(t)] == TokenType.USER_DEFINED
    assert types[:n_tok - len(SPECIAL_TOKENS) - len(PLAIN_ADDED_TOKENS)] == \
        [TokenType.NORMAL] * (n_tok - len(SPECIAL_TOKENS) - len(PLAIN_ADDED_TOKENS))
    assert val["tokenizer.ggml.eos_token_id"] == hf_tokenizer.eos_token_id
    assert val["tokenizer.ggml.padding_token_id"] == hf_tokenizer.pad_token_id
    assert "tokenizer.ggml.bos_token_id" not in val
    assert val["tokenizer.ggml.add_bos_token"] is False and val["tokenizer.ggml.add_eos_token"] is False
    assert val["tokenizer.chat_template"] == CHAT_TEMPLATE
    merges = json.loads((qwen35_dir("tied") / "tokenizer.json").read_text())["model"]["merges"]
    assert val["tokenizer.ggml.merges"] == [" ".join(m) if isinstance(m, list) else m for m in merges]


def test_check_hash_is_llama_cpp_fingerprint(qwen35_dir, hf_tokenizer):
    # llama.cpp hashes str(AutoTokenizer.encode(chktxt)); ours must produce the same digest.
    expected = sha256(str(hf_tokenizer.encode(vocab.CHECK_TEXT)).encode()).hexdigest()
    assert vocab.check_hash(qwen35_dir("base") / "tokenizer.json") == expected


def test_hash_table_entries_come_from_llama_cpp():
    src = llama_cpp_source()
    if src is None:
        missing_oracle("llama.cpp's sources (the llama-cpp-python sdist)")
    text = (src / "conversion" / "base.py").read_text(encoding="utf-8")
    for digest, name in vocab.KNOWN_HASHES.items():
        at = text.index(f'chkhsh == "{digest}"')
        assert f'res = "{name}"' in text[at:at + 300]
    line = next(ln.strip() for ln in text.splitlines() if ln.strip().startswith("chktxt = "))
    assert ast.literal_eval(line[len("chktxt = "):]) == vocab.CHECK_TEXT


def _pre_of(path) -> str:
    kv, _ = read_gguf(path)
    return kv["tokenizer.ggml.pre"][1]


def test_pre_from_known_hash(qwen35_dir, tmp_path, monkeypatch, capsys):
    d = qwen35_dir("base")
    digest = vocab.check_hash(d / "tokenizer.json")
    monkeypatch.setitem(vocab.KNOWN_HASHES, digest, "qwen2")
    out = tmp_path / "h.gguf"
    assert main([str(d), "--outfile", str(out), "--outtype", "f32"]) == 0
    assert _pre_of(out) == "qwen2"
    assert "check-string hash" in capsys.readouterr().err


def test_pre_from_regex(qwen35_dir, capsys, tmp_path):
    out = tmp_path / "r.gguf"
    assert main([str(qwen35_dir("base")), "--outfile", str(out), "--outtype", "f32"]) == 0
    assert "tokenizer.json Split regex" in capsys.readouterr().err
    assert _pre_of(out) == "qwen35"


def test_qwen2_regex_tokenizer(tmp_path_factory, convert_model):
    from transformers import AutoTokenizer

    d = make_qwen35(tmp_path_factory.mktemp("q2") / "qwen2tok", layers=2, tokenizer_regex="qwen2")
    path = convert_model(d, "f32")
    assert _pre_of(path) == "qwen2"
    hf = AutoTokenizer.from_pretrained(str(d))
    llm = open_llama(path, vocab_only=True)
    try:
        for text in TEXTS:
            assert llm.tokenize(text.encode(), add_bos=False, special=False) == \
                hf.encode(text, add_special_tokens=False), text
    finally:
        llm.close()


def test_pre_override_wins(qwen35_dir, tmp_path, monkeypatch):
    d = qwen35_dir("base")
    monkeypatch.setitem(vocab.KNOWN_HASHES, vocab.check_hash(d / "tokenizer.json"), "qwen35")
    out = tmp_path / "o.gguf"
    assert main([str(d), "--outfile", str(out), "--outtype", "f32", "--pre", "qwen2"]) == 0
    assert _pre_of(out) == "qwen2"


def test_unknown_pre_tokenizer_is_a_clear_error(qwen35_dir, tmp_path, capsys):
    d = tmp_path / "model"
    shutil.copytree(qwen35_dir("base"), d)
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+|\S+"
    (d / "tokenizer.json").write_text(json.dumps(tok))
    out = tmp_path / "u.gguf"

    assert main([str(d), "--outfile", str(out), "--outtype", "f32"]) == 2
    err = capsys.readouterr().err
    assert "not recognised" in err and "--pre" in err and "qwen35" in err and "Traceback" not in err
    assert not out.exists()

    assert main([str(d), "--outfile", str(out), "--outtype", "f32", "--pre", "qwen35"]) == 0
    assert _pre_of(out) == "qwen35"
