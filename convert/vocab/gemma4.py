"""Gemma 4's tokenizer (tokenizer.json: BPE with byte fallback over U+2581-spaced text)
-> GGUF tokenizer metadata of kind `gemma4`, as llama.cpp's converter writes it.

Tokens in id order with a score of -1000 each; byte tokens <0xNN> are BYTE, the special
tokens CONTROL, the chat-channel and tool markers Gemma 4 renders as text USER_DEFINED,
every other token NORMAL. Merges, special ids and flags as for the other tokenizers; no
space prefix; a BOS token is always added.
"""
from __future__ import annotations

import re
from pathlib import Path

from gguf import TokenType

from ..errors import ConversionError
from .common import Vocab, bpe_merges, read_chat_template, read_json, special_tokens

# tokens llama.cpp's gemma4 converter marks USER_DEFINED so that they are always rendered
VISIBLE_TOKENS = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                  "<tool_response|>", '<|"|>'}
_SPECIAL_NAMES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
_BYTE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _special_contents(tokenizer_config: dict) -> set[str]:
    """What transformers counts as special tokens: the named ones and the extra lists."""
    out: set[str] = set()
    for name in _SPECIAL_NAMES:
        entry = tokenizer_config.get(f"{name}_token")
        entry = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(entry, str):
            out.add(entry)
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = tokenizer_config.get(key) or []
        for entry in extra.values() if isinstance(extra, dict) else extra:
            entry = entry.get("content") if isinstance(entry, dict) else entry
            if isinstance(entry, str):
                out.add(entry)
    return out


def load_gemma4_vocab(model_dir: Path, config: dict, n_vocab: int) -> Vocab:
    tokenizer = read_json(model_dir / "tokenizer.json")
    if tokenizer is None:
        raise ConversionError(f"{str(model_dir)!r} has no tokenizer.json (Gemma 4's BPE tokenizer is required)")
    model = tokenizer.get("model") or {}
    decoder = tokenizer.get("decoder") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback") or decoder.get("type") != "Sequence":
        raise ConversionError("tokenizer.json is not a Gemma 4 style tokenizer (BPE with byte fallback and a "
                              "Sequence decoder)")
    tokenizer_config = read_json(model_dir / "tokenizer_config.json") or {}

    by_id: dict[int, str] = {int(i): tok for tok, i in model.get("vocab", {}).items()}
    for t in tokenizer.get("added_tokens", []):
        by_id[int(t["id"])] = t["content"]
    missing = [i for i in range(n_vocab) if i not in by_id]
    if missing:
        raise ConversionError(f"the tokenizer has no token with id {missing[0]} (the model has {n_vocab} rows)")
    specials = _special_contents(tokenizer_config)
    special_ids = {i for i, tok in by_id.items() if tok in specials}

    tokens, types = [], []
    for i in range(n_vocab):
        tok = by_id[i]
        tokens.append(tok)
        if _BYTE.fullmatch(tok):
            types.append(int(TokenType.BYTE))
        elif tok in VISIBLE_TOKENS:
            types.append(int(TokenType.USER_DEFINED))
        elif i in special_ids:
            types.append(int(TokenType.CONTROL))
        else:
            types.append(int(TokenType.NORMAL))

    ids, add_special = special_tokens(tokenizer, tokenizer_config, config, n_vocab)
    add_special["bos"] = True
    return Vocab(tokens=tokens, types=types, merges=bpe_merges(model), pre="", pre_source="the gemma4 tokenizer",
                 special_ids=ids, add_special=add_special,
                 chat_template=read_chat_template(model_dir, tokenizer_config),
                 model="gemma4", scores=[-1000.0] * n_vocab, add_space_prefix=False)
