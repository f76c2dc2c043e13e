"""What the readers of every tokenizer kind share (vocab.py's byte-level BPE,
vocab_spm.py's SentencePiece, vocab_gemma4.py's Gemma 4): the GGUF form of a vocabulary
(Vocab) and the readers of the Hugging Face tokenizer files around the model
(tokenizer_config.json's special tokens and flags, the chat template, BPE merges).

A module of its own so that vocab.py, which picks the reader by model type, imports the
other readers and they import none of it back (issue 68: no import cycle).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path

from gguf import GGUFValueType

from ..base import KV, array, boolean, string, u32
from ..errors import ConversionError

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


def read_json(path: Path) -> dict | None:
    """A tokenizer file's JSON, or None when the model has no such file."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from e


def looks_special(token: str) -> bool:
    """Whether an added token is a control token by its spelling alone."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def bpe_merges(model: dict) -> list[str]:
    """tokenizer.json's merges in GGUF's "a b" form."""
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


def read_chat_template(model_dir: Path, tokenizer_config: dict) -> str | list[dict] | None:
    """The chat template, or the named templates (the default first), wherever the model keeps them."""
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
    data = read_json(model_dir / "chat_template.json")
    return data.get("chat_template") if data else None


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
