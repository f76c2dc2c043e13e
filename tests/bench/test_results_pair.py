"""The pair form of results files (dflash_gguf/bench/slim.py): the JSON with settings,
provenance and figures, and its per-record lists in <name>.records.jsonl.xz beside it;
`slim.read` gives the whole document back, and refuses a records file that is not the one
the JSON names."""
from __future__ import annotations

import lzma
import gzip
import json
from pathlib import Path

import pytest

from dflash_gguf.bench import report, slim
from dflash_gguf.bench.runs import Run

from helpers.paths import ROOT

RESULTS = ROOT / "results"


def soak_like() -> dict:
    """A document with all three record lists, one of them between other keys (as a
    soak file's memory samples are), and an empty list that stays inline."""
    return {"tool": "soak", "settings": {"requests": 3}, "passed": True,
            "memory_samples": [{"t": 0.5 * i, "rss": 1e8 + i} for i in range(4)],
            "warmed_after_requests": 1, "cells": [],
            "requests": [{"index": i, "kind": "stream", "seconds": 0.1 * i, "error": None} for i in range(3)],
            "runs": [{"engine": "ours", "mode": "plain", "text": "déf f():\n  ", "token_ids": [1, 2, 3]}]}


def test_the_pair_reads_back_as_the_slim_document(tmp_path):
    doc = soak_like()
    path = tmp_path / "soak.json"
    assert slim.write(path, doc) is None
    head = json.loads(path.read_text())
    assert list(head) == ["tool", "settings", "passed", "records", "warmed_after_requests", "cells"]
    assert head["records"]["file"] == "soak.records.jsonl.xz"
    assert head["records"]["counts"] == {"memory_samples": 4, "requests": 3, "runs": 1}
    back = slim.read(path)
    assert back == slim.slim_doc(doc) and back["runs"][0]["text"]["chars"] == len("déf f():\n  ")
    # the lists come back where the pointer was, in their order; rewriting the whole gives the same pair
    assert list(back)[3:6] == ["memory_samples", "requests", "runs"]
    text, data = path.read_text(), slim.records_path(path).read_bytes()
    slim.write(path, back)
    assert path.read_text() == text and slim.records_path(path).read_bytes() == data


def test_nested_record_lists_go_too_and_come_back_where_they_were(tmp_path):
    """A concurrency row's replies and the old benchmark's runs (slim.NESTED_LISTS) leave
    the JSON by their path; the rows' figures stay."""
    doc = {"tool": "concurrency",
           "rows": [{"clients": 1, "replies": [[{"status": 200}], [{"status": 200}, {"status": 500}]]},
                    {"clients": 2, "replies": []}, "not a row"],
           "e2e": [{"type": "f32", "rows": [{"tps": 10.5, "runs": [[{"tokens": [1, 2]}]]}, {"tps": 3.0}]}]}
    before = json.dumps(doc)
    path = tmp_path / "c.json"
    slim.write(path, doc)
    assert json.dumps(doc) == before  # the document given is left as it is
    head = json.loads(path.read_text())
    assert list(head) == ["tool", "rows", "e2e", "records"]
    assert head["records"]["counts"] == {"rows/0/replies": 2, "e2e/0/rows/0/runs": 1}
    assert head["rows"][0] == {"clients": 1} and head["rows"][1] == {"clients": 2, "replies": []}
    assert head["e2e"][0]["rows"] == [{"tps": 10.5}, {"tps": 3.0}]
    assert slim.read(path) == doc
    head["records"]["counts"] = {"rows/5/replies": 2, "e2e/0/rows/0/runs": 1}
    path.write_text(json.dumps(head))
    with pytest.raises(ValueError, match="names rows/5/replies, which the JSON does not have"):
        slim.read(path)


def test_the_pair_is_written_alike_every_time(tmp_path):
    a, b = tmp_path / "a" / "x.json", tmp_path / "b" / "x.json"
    slim.write(a, soak_like())
    slim.write(b, json.loads(json.dumps(soak_like())))
    assert a.read_bytes() == b.read_bytes()
    data = slim.records_path(a).read_bytes()
    assert data == slim.records_path(b).read_bytes()
    assert data[:6] == b"\xfd7zXZ\0"  # xz, whose format holds no name or time


def test_a_document_without_record_lists_is_one_file(tmp_path):
    path = tmp_path / "x.json"
    slim.write(path, soak_like())
    slim.write(path, {"tool": "t", "runs": [], "rows": [{"a": 1}]})
    assert not slim.records_path(path).exists()  # the earlier write's records went with them
    assert slim.read(path) == json.loads(path.read_text()) == {"tool": "t", "runs": [], "rows": [{"a": 1}]}
    with pytest.raises(ValueError, match="'records' key"):
        slim.write(path, {"records": 1, "runs": [{}]})


def _rewrite_records(path: Path, edit) -> None:
    records = slim.records_path(path)
    lines = lzma.decompress(records.read_bytes()).decode().splitlines()
    records.write_bytes(lzma.compress("".join(line + "\n" for line in edit(lines)).encode()))


@pytest.mark.parametrize("edit, message", [
    (lambda lines: [lines[0].replace('"t":0.0', '"t":0.1'), *lines[1:]], "sha256 .* is not the .* that"),
    (lambda lines: lines[:-1], "sha256"),
])
def test_a_changed_records_file_is_refused(tmp_path, edit, message):
    path = tmp_path / "x.json"
    slim.write(path, soak_like())
    _rewrite_records(path, edit)
    with pytest.raises(ValueError, match=message):
        slim.read(path)


def test_a_missing_or_broken_records_file_is_named(tmp_path):
    path = tmp_path / "x.json"
    slim.write(path, soak_like())
    slim.records_path(path).write_bytes(b"not xz")
    with pytest.raises(ValueError, match="x.records.jsonl.xz: not an xz file"):
        slim.read(path)
    slim.records_path(path).unlink()
    with pytest.raises(ValueError, match="its records file .*x.records.jsonl.xz is missing"):
        slim.read(path)
    # the counts are checked too: a pointer that counts other lists than the file holds
    slim.write(path, soak_like())
    head = json.loads(path.read_text())
    head["records"]["counts"]["runs"] = 2
    path.write_text(json.dumps(head))
    with pytest.raises(ValueError, match="8 records, .* counts 9"):
        slim.read(path)


# a converted real file (scripts/slim_results.py): its runs, read from the pair, give the
# rows and auto comparisons the file stored when dflash-bench wrote it from the raw runs
# (its other comparisons came from an earlier report.py: llama-bench is a row of them since)
REAL = "bench-2026-11-25-turns-draft.json"


def test_a_converted_real_file_gives_its_stored_rows_and_comparisons():
    path = RESULTS / REAL
    head = json.loads(path.read_text())
    assert "runs" not in head and head["records"]["counts"] == {"runs": 8323}
    doc = slim.read(path)
    assert len(doc["runs"]) == 8323 and doc["rows"] == head["rows"]
    table = report.rows([Run.from_json(r) for r in doc["runs"]])
    # the rows were computed from the full floats, the records keep 6 significant digits
    assert slim.same_figures([r.to_json() for r in table], doc["rows"])
    # the file predates the comparisons' ranges, repetition counts and verdicts: its fields agree
    comparisons = report.each_sampling(table, report.auto_comparisons)
    assert {k for c in comparisons for k in c} - {k for c in doc["auto_comparisons"] for k in c} \
        == {"auto_tok_s_range", "fixed_tok_s_range", "per_rep_ratio_n", "verdict"}
    assert slim.same_figures([{k: c[k] for k in stored} for c, stored in zip(comparisons, doc["auto_comparisons"])],
                             doc["auto_comparisons"])
    moved = json.loads(json.dumps(doc["rows"]))
    moved[0]["decode_tok_s"]["median"] *= 1.0001  # a tenth of a per mille is a difference
    assert not slim.same_figures([r.to_json() for r in table], moved)


def test_every_figure_from_an_uncommitted_tree_says_so():
    """A results file whose checkout had uncommitted changes is quoted, in README and docs/,
    only in a paragraph that says so: a reader can tell a figure no commit reproduces."""
    unlabelled = []
    stems = []
    for path in [*RESULTS.glob("*.json"), *RESULTS.glob("*.json.gz")]:  # the large ones are kept gzipped
        try:
            text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
            checkout = json.loads(text).get("checkout")
        except ValueError:
            continue
        if isinstance(checkout, dict) and checkout.get("uncommitted_changes"):
            stems.append(path.name.split(".json")[0])
    assert stems, "no results file records uncommitted changes: the check has nothing to hold"
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for paragraph in doc.read_text().split("\n\n"):
            for stem in stems:
                if stem in paragraph and not any(w in paragraph for w in ("uncommitted", "not committed",
                                                                          "untracked")):
                    unlabelled.append(f"{doc.name}: {stem}")
    assert not unlabelled, "figures from uncommitted trees quoted without saying so: " + ", ".join(unlabelled)
