"""Training text: plain text files, directories of them (recursively), and JSONL files
of chats ({"messages": [...]}, {"conversations": [...]} with from/value turns, or
{"text": ...}), chats rendered with the target's own chat template. Everything is
tokenized with the target's tokenizer (the GGUF's, through llama.cpp's vocabulary) and
cut into windows of the training length; a seeded share of the documents is held out
for the acceptance measurements."""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .target import TrainError

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
          "model": "assistant", "tool": "tool"}


@dataclass
class Dataset:
    train: list[np.ndarray]  # windows of exactly `length` tokens
    heldout: list[np.ndarray]  # held-out documents' tokens (prompts for the AL measurements)
    sha256: str  # of the files' bytes, in the order read
    n_files: int
    n_docs: int
    n_tokens: int


def _files(paths) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            # hidden names count below the directory given only: one under ~/.cache or a
            # .venv is read like any other
            found = sorted(f for f in p.rglob("*")
                           if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts))
            if not found:
                raise TrainError(f"--data {p}: the directory has no files")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise TrainError(f"--data {p}: no such file or directory")
    return out


def _chat(record, where: str):
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return record["text"]
    turns = record.get("messages", record.get("conversations")) if isinstance(record, dict) else None
    if not isinstance(turns, list) or not turns:
        raise TrainError(f"{where}: expected an object with \"messages\", \"conversations\" or \"text\"")
    msgs = []
    for t in turns:
        if not isinstance(t, dict):
            raise TrainError(f"{where}: a turn is not an object")
        role = t.get("role", t.get("from"))
        content = t.get("content", t.get("value"))
        if role not in _ROLES or not isinstance(content, str):
            raise TrainError(f"{where}: a turn needs a known role (user, assistant, system, ...) and text content")
        msgs.append({"role": _ROLES[role], "content": content})
    return msgs


def read_documents(paths, render_chat) -> tuple[list, str, int]:
    """(documents, sha256 of the inputs, files read): a document is (text, is_chat);
    render_chat(messages) -> text, whose special tokens are tokenized as such."""
    h = hashlib.sha256()
    docs = []
    files = _files(paths)
    for f in files:
        raw = f.read_bytes()
        h.update(raw)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TrainError(f"--data {f}: not UTF-8 text (byte {e.start}); give text files or JSONL chats") from None
        if f.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TrainError(f"--data {f}:{n}: not JSON ({e.msg})") from None
                chat = _chat(record, f"--data {f}:{n}")
                docs.append((chat, False) if isinstance(chat, str) else (render_chat(chat), True))
        elif text.strip():
            docs.append((text, False))
    if not docs:
        raise TrainError("--data holds no text")
    return docs, h.hexdigest(), len(files)


def load_dataset(paths, tokenizer, render_chat, length: int, seed: int, heldout: int) -> Dataset:
    """Documents tokenized (chats with their special tokens, plain text as text), a seeded
    `heldout` of them set aside (at least one left to train on), the rest concatenated
    with the end-of-text token between documents and cut into windows of `length`."""
    docs, sha, n_files = read_documents(paths, render_chat)
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_held = min(heldout, len(docs) - 1)
    held_idx, train_idx = order[:n_held], order[n_held:]
    sep = tokenizer.eos_id
    ids = []
    for i in train_idx:
        text, chat = docs[i]
        ids += tokenizer.encode(text, special=chat)
        ids.append(sep)
    stream = np.asarray(ids, dtype=np.int32)
    n_win = len(stream) // length
    if n_win == 0:
        raise TrainError(f"--data has {len(stream)} training tokens, fewer than one window of {length} (-c)")
    windows = [stream[i * length:(i + 1) * length] for i in range(n_win)]
    held = [np.asarray(tokenizer.encode(docs[i][0], special=docs[i][1]), dtype=np.int32) for i in held_idx]
    return Dataset(windows, held, sha, n_files, len(docs), len(stream))


# windows regenerated side by side: each target pass decodes a token of every slot's
# window, one read of the weights for all of them (a continuous batch: a slot whose window
# is done takes the next one)
REGENERATE_SLOTS = 8


def regenerate(dataset: Dataset, target_path: str, prompt_len: int, threads: int, device=None, say=None,
               n_slots: int = REGENERATE_SLOTS) -> None:
    """--regenerate: each training window becomes its first `prompt_len` tokens followed
    by the target's own greedy continuation (our engine, the GGUF as served, n_slots
    windows at a time as a server batches requests), as z-lab and SpecForge train: the
    drafter then learns the text it will be asked to draft."""
    from ..decoding.step import Batch, Sequence
    from ..decoding.requests import GenerationStats, Placement, Request
    from ..speculation.proposers import PlainProposer
    from ..runtime.target import Target, TargetConfig

    length = len(dataset.train[0])
    n_slots = max(1, min(n_slots, len(dataset.train)))
    target = Target(target_path, TargetConfig(n_ctx=length + 16, n_seq=n_slots, n_threads=threads, kv_type="f32",
                                              device=device))
    batch = Batch(target, None)
    windows = iter(range(len(dataset.train)))
    running: dict = {}  # id(sequence) -> (its window, the sequence, the tokens it generated)
    done = 0

    def start(slot: int) -> None:
        i = next(windows, None)
        if i is None:
            return
        prompt = dataset.train[i][:prompt_len].tolist()
        seq = Sequence(target, None, PlainProposer(), Request(prompt, length - prompt_len, ()), GenerationStats(),
                       Placement(slot=slot))
        running[id(seq)] = (i, seq, [])
        batch.add(seq)

    try:
        for slot in range(n_slots):
            start(slot)
        while len(batch):
            for seq, new in batch.advance():
                if seq.error is not None:
                    raise TrainError(f"regenerating a window with the target failed: {seq.error}")
                running[id(seq)][2].extend(new)
            for key, (i, seq, out) in list(running.items()):
                if not seq.done:
                    continue
                del running[key]
                w = dataset.train[i]
                if len(out) < length - prompt_len:  # an end-of-generation token: keep the text after it
                    out += w[prompt_len + len(out):].tolist()
                dataset.train[i] = np.asarray(w[:prompt_len].tolist() + out, dtype=np.int32)[:length]
                done += 1
                if say and done % 100 == 0:
                    say(f"  regenerated {done}/{len(dataset.train)} windows")
                start(seq.slot)
    finally:
        target.close()
