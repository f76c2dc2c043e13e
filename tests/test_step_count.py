"""scripts/step_count.py's reading of callgrind dumps: a phase whose steps each have their
own pair of dumps (setup outside the counted windows) sums its windows, each less what a
dump costs (an empty window)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import step_count  # noqa: E402


def test_windows_of_one_phase_are_summed(tmp_path, capsys):
    prefix = tmp_path / "sc.123"
    # dumps in order: pre, decode (one window of 2 steps), then per-step windows of batch8
    labels_counts = [("pre", 999), ("overhead", 50_000), ("pre", 999), ("decode", 2_050_000),
                     ("pre", 5_000_000), ("batch8", 750_000), ("pre", 5_000_000), ("batch8", 950_000)]
    for i, (_, c) in enumerate(labels_counts, start=1):
        (tmp_path / f"sc.123.{i}").write_text(f"events: Ir\nsummary: {c}\ntotals: {c}\n")
    rows = {"decode": {"nodes": 10, "n_host_writes": 4.0, "n_host_reads": 1.0, "n_graphs": 1.0},
            "batch8": {"nodes": 12, "n_host_writes": 4.0, "n_host_reads": 0.0, "n_graphs": 1.0}}
    log = tmp_path / "sc.log"
    log.write_text("".join(f"@dump {lab}\n" for lab, _ in labels_counts)
                   + "@rows " + json.dumps({"steps": 2, "rows": rows}) + "\n")
    step_count.read_ours(str(prefix), str(log))
    out = capsys.readouterr().out
    assert "| decode | 1.000 M | 10 |" in out
    assert "| batch8 | 0.800 M | 12 |" in out  # (0.7 + 0.9) M / 2 steps, each window less a dump
    assert "| overhead |" not in out
    assert out.count("| batch8 |") == 1 and "| pre |" not in out
