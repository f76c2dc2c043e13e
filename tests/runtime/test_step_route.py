"""A step's calls go one way (issue 68): followed through every call handed a sequence,
each proposer kind's step visits at most 6 files and never comes back to a file it left.
The measure is experiments/step_route.py's, the one docs/design.md quotes, run here on
the bundled demo pair for every kind it lists."""
from __future__ import annotations

import json
import subprocess
import sys

from helpers.paths import ROOT


def test_every_kind_of_step_goes_one_way(tmp_path):
    out = tmp_path / "route.json"
    # run outside the source tree, so that the installed package is the one traced
    subprocess.run([sys.executable, str(ROOT / "experiments" / "step_route.py"), "--out", str(out), "-n", "12"],
                   check=True, cwd=tmp_path, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert {r["kind"] for r in rows} >= {"plain", "dflash chain (fused)", "dflash tree", "auto", "suffix",
                                          "draft-dflash,suffix", "draft-simple,suffix"}
    for row in rows:
        assert row["came_back"] == 0 and row["files"] <= 6, row
        assert row["route"][0].startswith("step.py(step"), row
