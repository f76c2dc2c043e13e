"""GPT-2 style byte-level BPE tokenizers (tokenizer.json) -> GGUF tokenizer metadata.

llama.cpp does not run the Hugging Face pre-tokenizer; it picks a built-in one by the
name in `tokenizer.ggml.pre`. The name is chosen, in this order:
1. `--pre NAME` when given;
2. the hash of the token ids of llama.cpp's check string, against llama.cpp's table;
3. the Split regex of tokenizer.json's pre-tokenizer, against the regexes llama.cpp
   implements under a name.
"""
from __future__ import annotations

import logging
from hashlib import sha256
from pathlib import Path

from gguf import TokenType

from ..errors import ConversionError
from .common import Vocab, bpe_merges, looks_special, read_chat_template, read_json, special_tokens

log = logging.getLogger("dflash_gguf.convert")

# llama.cpp's check string (convert_hf_to_gguf.py, get_vocab_base_pre): its token ids
# identify a pre-tokenizer.
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
    "✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

# sha256(str(token ids of CHECK_TEXT)) -> pre-tokenizer name, from llama.cpp's table.
KNOWN_HASHES = {
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",  # Qwen3.5
    "1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f": "qwen35",  # MiniCPM-V 4.6
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",   # Qwen1.5 / 2 / 2.5 / 3
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",   # Qwen3-Embedding
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",  # o200k (gpt-oss's o200k_harmony)
}

# tokenizer.json Split regexes llama.cpp implements (src/llama-vocab.cpp), by name.
KNOWN_REGEXES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen35",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "gpt-4o",  # o200k
}

KNOWN_PRE_NAMES = sorted(set(KNOWN_HASHES.values()) | set(KNOWN_REGEXES.values()))


def check_hash(tokenizer_file: Path) -> str | None:
    """sha256 of the check string's token ids (llama.cpp's fingerprint), or None when the
    `tokenizers` package is not installed or cannot load the file."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        log.info("the tokenizers package is not installed: skipping the check-string hash")
        return None
    try:
        ids = Tokenizer.from_file(str(tokenizer_file)).encode(CHECK_TEXT).ids
    except Exception as e:  # a tokenizer.json this tokenizers version cannot load
        log.warning("cannot run the tokenizer for the check-string hash: %s", e)
        return None
    return sha256(str(ids).encode()).hexdigest()


def split_regexes(pre_tokenizer: dict | None) -> list[str]:
    """The Regex patterns of every Split step in a tokenizer.json pre_tokenizer."""
    if not pre_tokenizer:
        return []
    steps = pre_tokenizer.get("pretokenizers", [pre_tokenizer]) if pre_tokenizer.get("type") == "Sequence" \
        else [pre_tokenizer]
    out = []
    for step in steps:
        pattern = step.get("pattern") or {}
        if step.get("type") == "Split" and "Regex" in pattern:
            out.append(pattern["Regex"])
    return out


def choose_pre(tokenizer_file: Path, tokenizer: dict, override: str | None) -> tuple[str, str]:
    """(pre-tokenizer name, how it was chosen)."""
    if override:
        return override, "--pre"
    digest = check_hash(tokenizer_file)
    if digest in KNOWN_HASHES:
        return KNOWN_HASHES[digest], f"check-string hash {digest[:12]}"
    regexes = split_regexes(tokenizer.get("pre_tokenizer"))
    if len(regexes) == 1 and regexes[0] in KNOWN_REGEXES:
        return KNOWN_REGEXES[regexes[0]], "tokenizer.json Split regex"
    hash_note = f"check-string hash {digest}" if digest else "no check-string hash"
    raise ConversionError(
        "the tokenizer's pre-tokenizer is not recognised "
        f"({hash_note}; Split regexes {regexes or 'none'}). Pass --pre NAME with the llama.cpp pre-tokenizer "
        f"that matches it, e.g. one of: {', '.join(KNOWN_PRE_NAMES)}")


def text_model_type(config: dict) -> str | None:
    text = config.get("text_config")
    return (text.get("model_type") if isinstance(text, dict) else None) or config.get("model_type")


def load_vocab(model_dir: Path, config: dict, n_vocab: int, pre_override: str | None = None) -> Vocab:
    """Read tokenizer.json / tokenizer_config.json / config.json into GGUF vocab form."""
    if text_model_type(config) in ("gemma4", "gemma4_text"):
        from .gemma4 import load_gemma4_vocab  # its own tokenizer kind, 'gemma4'

        return load_gemma4_vocab(model_dir, config, n_vocab)
    if text_model_type(config) in ("gemma3", "gemma3_text"):
        from .spm import load_spm_vocab  # SentencePiece, 'llama'

        return load_spm_vocab(model_dir, config, n_vocab)
    tokenizer_file = model_dir / "tokenizer.json"
    tokenizer = read_json(tokenizer_file)
    if tokenizer is None:
        raise ConversionError(f"{str(model_dir)!r} has no tokenizer.json (a GPT-2 style BPE tokenizer is required)")
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE":
        raise ConversionError(f"tokenizer.json has a {model.get('type')!r} model; only byte-level BPE is supported")
    tokenizer_config = read_json(model_dir / "tokenizer_config.json") or {}

    by_id: dict[int, str] = {int(i): tok for tok, i in model.get("vocab", {}).items()}
    added = {int(t["id"]): t for t in tokenizer.get("added_tokens", [])}
    for i, t in added.items():
        by_id[i] = t["content"]
    too_big = [i for i in by_id if i >= n_vocab]
    if too_big:
        raise ConversionError(f"tokenizer has token id {max(too_big)} but the model's vocab_size is {n_vocab}")

    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
        elif i in added:
            tok = by_id[i]
            if added[i].get("special") or looks_special(tok):
                types.append(int(TokenType.CONTROL))
            else:
                tok = tok.replace("\u2581", " ")
                types.append(int(TokenType.USER_DEFINED))
            tokens.append(tok)
        else:
            tokens.append(by_id[i])
            types.append(int(TokenType.NORMAL))

    pre, how = choose_pre(tokenizer_file, tokenizer, pre_override)

    special_ids, add_special = special_tokens(tokenizer, tokenizer_config, config, n_vocab)

    return Vocab(tokens=tokens, types=types, merges=bpe_merges(model), pre=pre, pre_source=how,
                 special_ids=special_ids, add_special=add_special,
                 chat_template=read_chat_template(model_dir, tokenizer_config))


