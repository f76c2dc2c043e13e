"""GPT-2 style byte-level BPE tokenizers (tokenizer.json) -> GGUF tokenizer metadata.

llama.cpp does not run the Hugging Face pre-tokenizer; it picks a built-in one by the
name in `tokenizer.ggml.pre`. The name is chosen, in this order:
1. `--pre NAME` when given;
2. the hash of the token ids of llama.cpp's check string, against llama.cpp's table;
3. the Split regex of tokenizer.json's pre-tokenizer, against the regexes llama.cpp
   implements under a name.
"""
from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path

from gguf import GGUFValueType, TokenType

from .base import KV, array, boolean, string, u32
from .errors import ConversionError

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

_SPECIAL_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "sep": "tokenizer.ggml.seperator_token_id",  # sic: llama.cpp's spelling
    "pad": "tokenizer.ggml.padding_token_id",
    "mask": "tokenizer.ggml.mask_token_id",
}


@dataclass
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    pre_source: str
    special_ids: dict[str, int] = field(default_factory=dict)
    add_special: dict[str, bool] = field(default_factory=dict)
    chat_template: str | list[dict] | None = None
    model: str = "gpt2"                   # tokenizer.ggml.model
    scores: list[float] | None = None
    add_space_prefix: bool | None = None

    def fingerprint(self) -> str:
        return tokenizer_sha256(self.tokens, self.merges, self.special_ids)

    def metadata(self) -> list[KV]:
        kv = [string("tokenizer.ggml.model", self.model)]
        if self.pre:
            kv.append(string("tokenizer.ggml.pre", self.pre))
        kv.append(array("tokenizer.ggml.tokens", self.tokens, GGUFValueType.STRING))
        if self.scores is not None:
            kv.append(array("tokenizer.ggml.scores", self.scores, GGUFValueType.FLOAT32))
        kv.append(array("tokenizer.ggml.token_type", self.types, GGUFValueType.INT32))
        if self.merges:
            kv.append(array("tokenizer.ggml.merges", self.merges, GGUFValueType.STRING))
        kv += [u32(_SPECIAL_KEYS[t], i) for t, i in self.special_ids.items()]
        kv += [boolean(f"tokenizer.ggml.add_{t}_token", v) for t, v in self.add_special.items()]
        if self.add_space_prefix is not None:
            kv.append(boolean("tokenizer.ggml.add_space_prefix", self.add_space_prefix))
        kv += _chat_template_kv(self.chat_template)
        return kv


FINGERPRINT_SPECIALS = ("bos", "eos", "unk", "sep", "pad")


def tokenizer_sha256(tokens: list[str], merges: list[str], special_ids: dict[str, int]) -> str:
    """The tokenizer fingerprint a drafter records of its target: sha256 over the token
    list, the merges and the bos/eos/unk/sep/pad ids, exactly as the runtime computes it
    from a GGUF's metadata (csrc/dfl_pair.c, dfl_tokenizer_sha256)."""
    h = sha256(b"dflash-tokenizer-v1\n")
    for entries in (tokens, merges):
        h.update(struct.pack("<Q", len(entries)))
        for entry in entries:
            b = entry.encode("utf-8").split(b"\0")[0]  # the runtime reads C strings
            h.update(struct.pack("<I", len(b)) + b)
    for kind in FINGERPRINT_SPECIALS:
        h.update(struct.pack("<i", int(special_ids.get(kind, -1))))
    return h.hexdigest()


def _chat_template_kv(template: str | list[dict] | None) -> list[KV]:
    if template is None:
        return []
    if isinstance(template, str):
        return [string("tokenizer.chat_template", template)]
    kv, names = [], []
    for choice in template:
        name = "".join(c if c.isascii() and c.isalnum() else "_" for c in choice.get("name", ""))
        body = choice.get("template")
        if not name or body is None:
            continue
        if name == "default":
            kv.insert(0, string("tokenizer.chat_template", body))
        else:
            names.append(name)
            kv.append(string(f"tokenizer.chat_template.{name}", body))
    if names:
        kv.append(array("tokenizer.chat_templates", names, GGUFValueType.STRING))
    return kv


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from e


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


def _looks_special(token: str) -> bool:
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _merges(model: dict) -> list[str]:
    merges = model.get("merges") or []
    if merges and isinstance(merges[0], list):
        # Pair format: a space inside a piece is written as U+0120 in the "a b" form.
        return [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair)
                for pair in merges]
    return list(merges)


def _post_processor_flags(post: dict | None, bos: str | None, eos: str | None,
                          sep: str | None = None) -> dict[str, bool]:
    flags: dict[str, bool] = {}
    if not post:
        return flags
    for proc in post.get("processors", [post]):
        kind = proc.get("type")
        if kind == "ByteLevel":
            flags.setdefault("bos", False)
            flags.setdefault("eos", False)
        elif kind == "RobertaProcessing":
            flags.update(bos=True, eos=True, sep=True)
        elif kind == "TemplateProcessing":
            single = proc.get("single", [])
            first = last = None
            if len(single) > 1:
                first = single[0].get("SpecialToken", {}).get("id")
                last = single[-1].get("SpecialToken", {}).get("id")
                if first:
                    flags["bos"] = first == bos
                if last:
                    flags["eos"] = last == eos
            _pair_sep_flag(proc.get("pair", []), first, last, sep, eos, flags)
    return flags


def _pair_sep_flag(pair: list, first: str | None, last: str | None, sep: str | None, eos: str | None,
                   flags: dict[str, bool]) -> None:
    """A pair template "[first] A <middle> B [last]": a separator is added when the
    middle is sep or eos (after A, or second), as llama.cpp's SpecialVocab reads it."""
    def special(entry):
        return entry.get("SpecialToken", {}).get("id")

    start = 1 if first and pair and special(pair[0]) == first else 0
    stop = -1 if last and pair and special(pair[-1]) == last else None
    pair = pair[slice(start, stop)]
    if not pair or pair[0].get("Sequence", {}).get("id") != "A" or pair[-1].get("Sequence", {}).get("id") != "B":
        return
    middle = pair[1:-1]
    if not middle:
        return
    add = bool(special(middle[0]) in (sep, eos) and not last)
    if len(middle) == 2 and special(middle[1]) in (sep, eos):
        add = True
    flags["sep"] = add


def _chat_template(model_dir: Path, tokenizer_config: dict) -> str | list[dict] | None:
    if isinstance(tokenizer_config.get("chat_template"), (str, list)):
        return tokenizer_config["chat_template"]
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
        extra = sorted((model_dir / "additional_chat_templates").glob("*.jinja"))
        if extra:
            return [{"name": "default", "template": template}] + \
                [{"name": p.stem, "template": p.read_text(encoding="utf-8")} for p in extra]
        return template
    data = _read_json(model_dir / "chat_template.json")
    return data.get("chat_template") if data else None


def text_model_type(config: dict) -> str | None:
    text = config.get("text_config")
    return (text.get("model_type") if isinstance(text, dict) else None) or config.get("model_type")


def load_vocab(model_dir: Path, config: dict, n_vocab: int, pre_override: str | None = None) -> Vocab:
    """Read tokenizer.json / tokenizer_config.json / config.json into GGUF vocab form."""
    if text_model_type(config) in ("gemma4", "gemma4_text"):
        from .vocab_gemma4 import load_gemma4_vocab  # its own tokenizer kind, 'gemma4'

        return load_gemma4_vocab(model_dir, config, n_vocab)
    if text_model_type(config) in ("gemma3", "gemma3_text"):
        from .vocab_spm import load_spm_vocab  # SentencePiece, 'llama'

        return load_spm_vocab(model_dir, config, n_vocab)
    tokenizer_file = model_dir / "tokenizer.json"
    tokenizer = _read_json(tokenizer_file)
    if tokenizer is None:
        raise ConversionError(f"{str(model_dir)!r} has no tokenizer.json (a GPT-2 style BPE tokenizer is required)")
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE":
        raise ConversionError(f"tokenizer.json has a {model.get('type')!r} model; only byte-level BPE is supported")
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json") or {}

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
            if added[i].get("special") or _looks_special(tok):
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

    return Vocab(tokens=tokens, types=types, merges=_merges(model), pre=pre, pre_source=how,
                 special_ids=special_ids, add_special=add_special,
                 chat_template=_chat_template(model_dir, tokenizer_config))


def special_tokens(tokenizer: dict, tokenizer_config: dict, config: dict,
                   n_vocab: int) -> tuple[dict[str, int], dict[str, bool]]:
    """Special token ids (named in tokenizer_config.json and found among the added
    tokens, else config.json's *_token_id) and the add_bos/add_eos flags, as llama.cpp's
    SpecialVocab reads them."""
    added = {int(t["id"]): t for t in tokenizer.get("added_tokens", [])}

    def content(entry):
        return entry.get("content") if isinstance(entry, dict) else entry

    names = {typ: content(tokenizer_config.get(f"{typ}_token")) for typ in _SPECIAL_KEYS}
    if not names["bos"] and tokenizer_config.get("cls_token"):
        names["bos"] = content(tokenizer_config["cls_token"])
    if not names["eos"] and tokenizer_config.get("sep_token"):
        names["eos"] = content(tokenizer_config["sep_token"])
    added_by_content: dict[str, int] = {}
    for i, t in sorted(added.items()):
        added_by_content.setdefault(t["content"], i)
    special_ids: dict[str, int] = {}
    for typ, name in names.items():
        if isinstance(name, str) and name in added_by_content:
            special_ids[typ] = added_by_content[name]
    text_config = config.get("text_config") or {}
    for typ in _SPECIAL_KEYS:
        tid = config.get(f"{typ}_token_id", text_config.get(f"{typ}_token_id"))
        if typ not in special_ids and isinstance(tid, int) and 0 <= tid < n_vocab:
            special_ids[typ] = tid

    add_special = _post_processor_flags(tokenizer.get("post_processor"), names["bos"], names["eos"], names["sep"])
    for typ in _SPECIAL_KEYS:
        flag = tokenizer_config.get(f"add_{typ}_token")
        if isinstance(flag, bool):
            add_special.setdefault(typ, flag)

    return special_ids, add_special
