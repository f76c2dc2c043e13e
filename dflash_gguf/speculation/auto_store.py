"""What `--tree-budget auto` learnt, kept across processes: a new engine's first request
starts from what the last engine of the same pair, settings, machine and sampling setting
learnt (the measured costs of a step's parts, the drafter's calibration, the arm it was
on, when to probe next), not cold. Cold, auto spends its first timed steps finding out
what it would otherwise know: on a pair where plain decoding is fastest, a short request
of a new `dflash-run` pays for those steps in full.

One JSON file (DFLASH_AUTO_MEMORY: its path, or "off"; default
~/.cache/dflash-gguf/auto-memory.json), an entry per key, the newest MAX_ENTRIES kept.
Written when a sequence ends, at most every 10 s (a few hundred bytes; replaced whole, so that a reader
never sees half a file); a file that cannot be read or an entry that does not fit is
ignored, and auto starts cold."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

from ..runtime.demo import cache_dir

MAX_ENTRIES = 64
VERSION = 2  # bumped when AutoBudget.state changes what it holds


def path() -> Optional[Path]:
    where = os.environ.get("DFLASH_AUTO_MEMORY")
    if where and where.lower() == "off":
        return None
    return Path(where) if where else cache_dir() / "auto-memory.json"


def key(*parts) -> str:
    """An entry's key: whatever decides what auto learns (files, settings, machine)."""
    return hashlib.sha256(repr((VERSION,) + parts).encode()).hexdigest()[:24]


def file_identity(file: str) -> tuple:
    st = os.stat(file)
    return os.path.abspath(file), st.st_size, int(st.st_mtime)


def _read(where: Path) -> dict:
    try:
        table = json.loads(where.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def load(entry: str) -> Optional[dict]:
    where = path()
    if where is None:
        return None
    found = _read(where).get(entry)
    return found.get("state") if isinstance(found, dict) else None


def save(entry: str, state: dict) -> None:
    """Best effort: a memory that cannot be written leaves auto starting cold next time."""
    where = path()
    if where is None:
        return
    table = _read(where)
    table[entry] = {"saved": time.time(), "state": state}
    newest = sorted(table, key=lambda k: table[k].get("saved", 0) if isinstance(table[k], dict) else 0)
    table = {k: table[k] for k in newest[-MAX_ENTRIES:]}
    tmp = None
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where.parent, prefix=where.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f)
        os.replace(tmp, where)
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
