"""Rewrite results files in place in the form results/ keeps (dflash_gguf/bench/slim.py):
each run's text and token ids as their sha256 and length, and the per-record lists (runs,
requests, memory samples) moved into <name>.records.jsonl.xz beside the JSON, which keeps
everything else and a pointer to them. A file already in that form is left as it is.
A file is rewritten only if the pair reads back (slim.read) as the slim form of the
document it held, and a dflash-bench file only if its runs give the same rows and
comparisons slim as raw (dflash_gguf.bench.report: outputs compared by hash instead of
by text; floats within 1e-5, the records keeping 6 significant digits).

    .venv/bin/python scripts/slim_results.py results/bench-2026-11-25-turns-draft.json ...
    .venv/bin/python scripts/slim_results.py --keep-raw FILE   # FILE's raw record also as FILE.raw.json.gz
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash_gguf.bench import report, slim
from dflash_gguf.bench.runs import Run


def derived(runs: list) -> dict:
    """What report.py makes of a file's runs: its rows and comparisons."""
    table = report.rows([Run.from_json(r) for r in runs])
    return {"rows": [r.to_json() for r in table], "comparisons": report.each_sampling(table, report.comparisons),
            "auto_comparisons": report.each_sampling(table, report.auto_comparisons),
            "headline": report.headline(table)}


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def slim_file(path: Path, keep_raw: bool) -> str:
    """Slim one file; what was done, in words. ValueError: it cannot be slimmed faithfully."""
    records = slim.records_path(path)
    old_bytes = _size(path) + _size(records)
    doc = slim.read(path)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a results document (a JSON object)")
    text, data = slim.pair(path, doc)
    if text == path.read_text() and (data is None or (records.exists() and records.read_bytes() == data)):
        return "already slim"
    slimmed = slim.slim_doc(doc)
    if doc.get("tool") == "dflash-bench" and isinstance(doc.get("runs"), list):
        if not slim.same_figures(derived(doc["runs"]), derived(slimmed["runs"])):
            raise ValueError(f"{path}: its slim runs give other rows or comparisons than its raw ones; left as is")
    slim.write(path, doc, keep_raw=keep_raw)
    back = slim.read(path)
    if back != slimmed:  # cannot happen unless slim.py is wrong: say so rather than keep a lossy file
        raise ValueError(f"{path}: the pair written does not read back as the document it held")
    if doc.get("tool") == "dflash-bench" and isinstance(doc.get("runs"), list) and not slim.same_figures(derived(back["runs"]), derived(doc["runs"])):
        raise ValueError(f"{path}: the pair's runs give other rows or comparisons than the file's")
    return f"{old_bytes:,} -> {_size(path) + _size(records):,} bytes"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="results JSON files, rewritten in place")
    p.add_argument("--keep-raw", action="store_true", help="keep each raw record as <name>.raw.json.gz beside it")
    args = p.parse_args(argv)
    status = 0
    for f in args.files:
        try:
            print(f"{f}: {slim_file(f, args.keep_raw)}")
        except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
            print(f"slim_results: error: {e}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
