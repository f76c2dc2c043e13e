"""Results files as they are kept in git: every setting, provenance and per-repetition
figure, but a run's generated text and token ids only as their sha256 and length.

A run's text and ids are what made results/ hundreds of MiB (and the checkout too big to
send to the GPU machine): every comparison reads them only to ask whether two runs made
the same output, which their hashes answer. --keep-raw keeps the whole record beside the
file, gzipped and out of git (<name>.raw.json.gz).

Forms of a run's fields (a raw record and a slim one are read alike, see `ids_key`,
`text_key`, `text_prefix_key`):
  token_ids  raw: [ids]     slim: {"sha256": of the ids joined by "," (ASCII), "count": n}
  text       raw: "..."     slim: {"sha256": of its UTF-8, "chars": n,
                                   "rstrip": {"sha256", "chars"} where trailing white space differs,
                                   "prefix": {"sha256", "chars"} for another engine's text: its first
                                             as many characters as our plain decoder's (rstripped)
                                             text of the same prompt and sampling has, where it is
                                             longer (report.same_text's "went on past -n" case)}
The file itself is indented at the top level, with each element of a list of records
(rows, cells) as one compact line.

The per-record lists (RECORD_LISTS: a bench file's runs, a soak file's requests and
memory samples; NESTED_LISTS: a concurrency row's replies, the old benchmark's runs) are
most of a file's bytes even slim, and no reader of the figures needs them: they go, slim,
into <name>.records.jsonl.xz beside <name>.json (`write`), a record a line, list after
list (`split`'s order), xz-compressed (a format with no name or time in it, so that the
same document always gives the same bytes). Their floats are kept to 6 significant
digits (FLOAT_DIGITS): a run's seconds to a millionth of themselves, far below any
run-to-run noise, while the 17-digit noise of full doubles was most of the compressed
bytes. The rows and comparisons in the JSON were computed from the full values before
that. The JSON keeps all else (settings, provenance,
load, rows and cells with per-repetition figures, comparisons, headline) and, where the
first top-level list was (else at its end), a pointer:
  "records": {"file": "<name>.records.jsonl.xz", "sha256": of its uncompressed lines,
              "counts": {"runs": n, "rows/0/replies": m, ...}}
`read` gives back the whole document from the pair (checking the sha256 and the counts).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import math
from pathlib import Path
from typing import Optional, Sequence

from .runs import OURS_PLAIN

RAW_SUFFIX = ".raw.json.gz"
RECORDS_SUFFIX = ".records.jsonl.xz"
FLOAT_DIGITS = 6  # significant digits of a float in a records file
RECORD_LISTS = ("runs", "requests", "memory_samples")  # the top-level lists that leave the JSON
# and the nested ones, as keys through lists of objects: a concurrency file's replies of
# each row (rows[i].replies), the old benchmark's runs (e2e[i].rows[j].runs, token ids raw);
# named in the pointer by their path ("rows/3/replies") and put back there
NESTED_LISTS = (("rows", "replies"), ("e2e", "rows", "runs"))
POINTER = "records"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def ids_digest(ids: Sequence[int]) -> dict:
    return {"sha256": _sha(",".join(str(int(i)) for i in ids)), "count": len(ids)}


def text_digest(text: str, prefix_chars: Optional[int] = None) -> dict:
    out = {"sha256": _sha(text), "chars": len(text)}
    stripped = text.rstrip()
    if stripped != text:
        out["rstrip"] = {"sha256": _sha(stripped), "chars": len(stripped)}
    if prefix_chars is not None and len(text) > prefix_chars:
        out["prefix"] = {"sha256": _sha(text[:prefix_chars]), "chars": prefix_chars}
    return out


def ids_key(ids) -> Optional[str]:
    """What two runs' token ids are compared by: the sha256 of ids_digest (None: none kept)."""
    if ids is None:
        return None
    return ids["sha256"] if isinstance(ids, dict) else ids_digest(ids)["sha256"]


def text_key(text) -> Optional[tuple]:
    """(sha256, chars) of a text with its trailing white space stripped (None: no text)."""
    if text is None:
        return None
    if isinstance(text, dict):
        stripped = text.get("rstrip", text)
        return stripped["sha256"], stripped["chars"]
    stripped = text.rstrip()
    return _sha(stripped), len(stripped)


def text_prefix_key(text, chars: int) -> Optional[str]:
    """The sha256 of a text's first `chars` characters (None: shorter, or a slim text
    that kept no prefix of that length)."""
    if text is None:
        return None
    if isinstance(text, dict):
        if text["chars"] == chars:
            return text["sha256"]
        prefix = text.get("prefix")
        return prefix["sha256"] if prefix and prefix["chars"] == chars else None
    return _sha(text[:chars]) if len(text) >= chars else None


def _reference_chars(runs: Sequence[dict]) -> dict:
    """{(sampling, prompt): length of our plain decoder's rstripped text}, of the first
    round of the first repetition (the one report.same_output compares with)."""
    out = {}
    for r in runs:
        if isinstance(r, dict) and (r.get("engine"), r.get("mode")) == OURS_PLAIN and r.get("rep") == 0 and r.get("round", 0) == 0:
            key = text_key(r.get("text"))
            if key is not None:
                out[r.get("sampling"), r.get("prompt")] = key[1]
    return out


def slim_runs(runs: Sequence[dict]) -> list:
    """The runs with their texts and token ids as digests (those already slim as they are)."""
    refs = _reference_chars(runs)
    out = []
    for r in runs:
        if not isinstance(r, dict):
            out.append(r)
            continue
        r = dict(r)
        if isinstance(r.get("text"), str):
            prefix = refs.get((r.get("sampling"), r.get("prompt"))) if r.get("engine") != OURS_PLAIN[0] else None
            r["text"] = text_digest(r["text"], prefix)
        if isinstance(r.get("token_ids"), list):
            r["token_ids"] = ids_digest(r["token_ids"])
        out.append(r)
    return out


def rounded(value):
    """`value` with every float in it to FLOAT_DIGITS significant digits."""
    if isinstance(value, float):
        return float(f"{value:.{FLOAT_DIGITS}g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def same_figures(a, b, rel: float = 1e-5) -> bool:
    """Whether two documents are equal but for floats within `rel` of each other: what
    figures recomputed from a records file's rounded floats (FLOAT_DIGITS) are to the
    ones computed from the full values."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_figures(a[k], b[k], rel) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_figures(x, y, rel) for x, y in zip(a, b))
    return a == b


def _slim_split(doc: dict) -> tuple:
    """`split` of the document as kept: its runs (if it has any) slimmed, the floats of
    its record lists rounded."""
    if isinstance(doc.get("runs"), list):
        doc = {**doc, "runs": slim_runs(doc["runs"])}
    head, lists = split(doc)
    return head, {name: rounded(records) for name, records in lists.items()}


def slim_doc(doc: dict) -> dict:
    """A results document as kept in git: its runs (if it has any) slimmed and the floats
    of its record lists (RECORD_LISTS, NESTED_LISTS) rounded; all else as is."""
    head, lists = _slim_split(doc)
    return join_lists(head, lists, Path("<document>")) if lists else doc


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def _dump(value, depth: int) -> str:
    pad = " " * depth
    if isinstance(value, dict) and value:
        items = (f"{pad} {json.dumps(str(k))}: {_dump(v, depth + 1)}" for k, v in value.items())
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(f"{pad} {_compact(v)}" for v in value) + f"\n{pad}]"
    return _compact(value)


def dumps(doc: dict) -> str:
    """JSON indented by one space a level down to the lists of records, whose elements
    are one compact line each (a run is a line, not one line per token id)."""
    return _dump(doc, 0) + "\n"


def raw_path(path: Path) -> Path:
    """<name>.raw.json.gz beside <name>.json (git ignores results/*.raw.json.gz)."""
    return path.with_name(path.name.removesuffix(".json") + RAW_SUFFIX)


def records_path(path: Path) -> Path:
    """<name>.records.jsonl.xz beside <name>.json (kept in git with it)."""
    return path.with_name(path.name.removesuffix(".json") + RECORDS_SUFFIX)


def _take_nested(container: dict, keys: tuple, prefix: str, lists: dict) -> None:
    """Move container[keys[0]][i][keys[1]]... (the last key's non-empty list) into lists
    under its path, copying what it changes (the document given is left as it is)."""
    value = container.get(keys[0])
    if len(keys) == 1:
        if isinstance(value, list) and value:
            lists[prefix + keys[0]] = value
            del container[keys[0]]
        return
    if not isinstance(value, list):
        return
    container[keys[0]] = value = list(value)
    for i, item in enumerate(value):
        if isinstance(item, dict):
            value[i] = dict(item)
            _take_nested(value[i], keys[1:], f"{prefix}{keys[0]}/{i}/", lists)


def split(doc: dict) -> tuple:
    """(the document less its record lists, with the pointer's place where the first
    top-level one was, {list name or path: records}: the top-level lists in the document's
    order, then NESTED_LISTS' in theirs). Empty lists stay inline."""
    head, lists = {}, {}
    for key, value in doc.items():
        if key in RECORD_LISTS and isinstance(value, list) and value:
            head.setdefault(POINTER, None)
            lists[key] = value
        else:
            if key == POINTER:
                raise ValueError(f"a results document's own {POINTER!r} key would be taken for the pointer")
            head[key] = value
    for keys in NESTED_LISTS:
        _take_nested(head, keys, "", lists)
    return head, lists


def _put_nested(doc: dict, name: str, records: list, path: Path) -> None:
    *where, key = name.split("/")
    obj = doc
    try:
        for part in where:
            obj = obj[int(part)] if isinstance(obj, list) else obj[part]
        if not isinstance(obj, dict):
            raise TypeError
    except (KeyError, IndexError, ValueError, TypeError):
        raise ValueError(f"{path}: the pointer names {name}, which the JSON does not have") from None
    obj[key] = records


def records_lines(lists: dict) -> bytes:
    """The records file's uncompressed content: a compact JSON record a line."""
    return "".join(_compact(r) + "\n" for records in lists.values() for r in records).encode("utf-8")


def xz_bytes(data: bytes) -> bytes:
    """data xz-compressed at the strongest preset (the same bytes on every run)."""
    return lzma.compress(data, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)


def pair(path: Path, doc: dict) -> tuple:
    """(the JSON text, the records file's bytes or None) `write` makes of a document."""
    head, lists = _slim_split(doc)
    if not lists:
        return dumps(head), None
    data = records_lines(lists)
    head[POINTER] = {"file": records_path(path).name, "sha256": hashlib.sha256(data).hexdigest(),
                     "counts": {k: len(v) for k, v in lists.items()}}
    return dumps(head), xz_bytes(data)


def join(head: dict, path: Path) -> dict:
    """The whole document from the JSON `head` read from `path` and its records file
    (a document with no pointer: as it is). ValueError: the records file is missing, or
    is not the one the pointer names (another sha256 or other counts)."""
    pointer = head.get(POINTER)
    if not isinstance(pointer, dict) or "counts" not in pointer:
        return head
    records = path.with_name(pointer["file"])
    try:
        data = lzma.decompress(records.read_bytes(), format=lzma.FORMAT_XZ)
    except FileNotFoundError:
        raise ValueError(f"{path}: its records file {records} is missing (results files come in pairs: "
                         f"<name>.json and <name>{RECORDS_SUFFIX})") from None
    except lzma.LZMAError as e:
        raise ValueError(f"{records}: not an xz file ({e})") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != pointer["sha256"]:
        raise ValueError(f"{records}: sha256 {digest} is not the {pointer['sha256']} that {path} names: "
                         f"the records file was changed or belongs to another version of {path.name}")
    lines = data.decode("utf-8").splitlines()
    if len(lines) != sum(pointer["counts"].values()):
        raise ValueError(f"{records}: {len(lines)} records, {path} counts {sum(pointer['counts'].values())}")
    lists, at = {}, 0
    for name, count in pointer["counts"].items():
        lists[name] = [json.loads(line) for line in lines[at:at + count]]
        at += count
    return join_lists(head, lists, path)


def join_lists(head: dict, lists: dict, path: Path) -> dict:
    """`split`'s inverse: the record lists put back into `head` where the pointer is
    (the top-level ones) and by their paths (the nested ones)."""
    out = {}
    for key, value in head.items():
        if key == POINTER:
            out.update((name, records) for name, records in lists.items() if "/" not in name)
        else:
            out[key] = value
    for name, records in lists.items():
        if "/" in name:
            _put_nested(out, name, records, path)
    return out


def read(path: Path) -> dict:
    """A results file as a whole document: the JSON with its records put back where the
    pointer is (any results file: one written before the pair form is read as it is).
    ValueError: not JSON, or a records file missing or not the one named."""
    path = Path(path)
    try:
        head = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    return join(head, path) if isinstance(head, dict) else head


def write(path: Path, doc: dict, keep_raw: bool = False) -> Optional[Path]:
    """Write the slim pair form of `doc`: `path` and, where it has record lists,
    records_path(path) (a records file left from an earlier write without them is removed);
    with keep_raw also the raw document, gzipped, to raw_path(path) (returned)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text, records = pair(path, doc)
    if records is None:
        records_path(path).unlink(missing_ok=True)
    else:
        records_path(path).write_bytes(records)  # before the JSON that points to it
    path.write_text(text)
    if not keep_raw:
        return None
    raw = raw_path(path)
    with gzip.open(raw, "wt", encoding="utf-8") as f:
        json.dump(doc, f)
        f.write("\n")
    return raw
