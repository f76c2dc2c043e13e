"""A SentencePiece tokenizer (tokenizer.model) -> GGUF tokenizer metadata of kind `llama`,
as llama.cpp's converter writes it for Gemma 3 (its _set_vocab_sentencepiece).

Every piece in id order with its score and type (normal, unknown, control, unused, byte);
ids the model has beyond the tokenizer's pieces are `[PAD<i>]`, unused, score -10000.
added_tokens.json entries become user-defined tokens (score -1000), and
tokenizer_config.json's added_tokens_decoder entries control tokens when special (or
looking special) else user-defined ones with U+2581 written as a space. Special ids and
the add_bos/add_eos flags are read as for the other tokenizers; pre-tokenizer "default",
no space prefix (Gemma 3 sets add_space_prefix false).
"""
from __future__ import annotations

from pathlib import Path

from gguf import TokenType

from ..errors import ConversionError
from .common import Vocab, looks_special, read_chat_template, read_json, special_tokens


def _processor(path: Path):
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise ConversionError("converting a SentencePiece tokenizer (tokenizer.model) needs the sentencepiece "
                              "package: pip install sentencepiece") from None
    sp = SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(path))
    except (OSError, RuntimeError) as e:
        raise ConversionError(f"cannot read the SentencePiece model {path}: {e}") from None
    return sp


def _piece_type(sp, i: int) -> int:
    if sp.IsUnknown(i):
        return int(TokenType.UNKNOWN)
    if sp.IsControl(i):
        return int(TokenType.CONTROL)
    if sp.IsUnused(i):
        return int(TokenType.UNUSED)
    if sp.IsByte(i):
        return int(TokenType.BYTE)
    return int(TokenType.NORMAL)


def load_spm_vocab(model_dir: Path, config: dict, n_vocab: int) -> Vocab:
    path = model_dir / "tokenizer.model"
    if not path.is_file():
        raise ConversionError(f"{str(model_dir)!r} has no tokenizer.model (Gemma 3's SentencePiece tokenizer, which "
                              "llama.cpp's converter reads)")
    sp = _processor(path)
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    scores = [-10000.0] * n_vocab
    types = [int(TokenType.UNUSED)] * n_vocab
    for i in range(min(sp.vocab_size(), n_vocab)):
        tokens[i], scores[i], types[i] = sp.IdToPiece(i), float(sp.GetScore(i)), _piece_type(sp, i)

    added = read_json(model_dir / "added_tokens.json") or {}
    for text, i in added.items():
        if isinstance(i, int) and 0 <= i < n_vocab:
            tokens[i], scores[i], types[i] = text, -1000.0, int(TokenType.USER_DEFINED)
    tokenizer_config = read_json(model_dir / "tokenizer_config.json") or {}
    for key, entry in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        i, text = int(key), entry.get("content")
        if not isinstance(text, str) or not 0 <= i < n_vocab:
            continue
        if entry.get("special") or looks_special(text):
            types[i] = int(TokenType.CONTROL)
        else:
            text = text.replace("\u2581", " ")
            types[i] = int(TokenType.USER_DEFINED)
        tokens[i], scores[i] = text, -1000.0

    # special ids and flags from tokenizer.json where there is one, as gguf-py's SpecialVocab reads them
    tokenizer = read_json(model_dir / "tokenizer.json") or {}
    ids, add_special = special_tokens(tokenizer, tokenizer_config, config, n_vocab)
    return Vocab(tokens=tokens, types=types, merges=[], pre="default", pre_source="the SentencePiece tokenizer",
                 special_ids=ids, add_special=add_special,
                 chat_template=read_chat_template(model_dir, tokenizer_config),
                 model="llama", scores=scores, add_space_prefix=False)

