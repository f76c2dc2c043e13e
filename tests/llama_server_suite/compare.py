"""Two results files of run_suite.py compared, dflash-server's and llama-server's (run
with --llama-server) on the same tests: the passes of each on the tests both ran, and the
tests llama-server passes that dflash-server does not, grouped by their reason on
expected.py (or "not on expected.py").

    python tests/llama_server_suite/compare.py OURS.json LLAMA_SERVER.json [--json OUT]"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import expected  # noqa: E402


def compare(ours: dict, theirs: dict) -> dict:
    both = sorted(set(ours["tests"]) & set(theirs["tests"]))
    passed = {name: (ours["tests"][name] == "passed", theirs["tests"][name] == "passed") for name in both}
    only_theirs = [name for name, (a, b) in passed.items() if b and not a]
    groups: dict = {}
    for name in only_theirs:
        groups.setdefault(expected.reason(name) or "not on expected.py", []).append(name)
    return {"tests_in_both": len(both),
            "passed_ours": sum(a for a, _ in passed.values()), "passed_llama_server": sum(b for _, b in passed.values()),
            "passed_both": sum(a and b for a, b in passed.values()),
            "passed_ours_only": sorted(name for name, (a, b) in passed.items() if a and not b),
            "llama_server_only_by_reason": dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ours")
    p.add_argument("llama_server")
    p.add_argument("--json", help="write the comparison here")
    a = p.parse_args(argv)
    out = compare(json.loads(Path(a.ours).read_text()), json.loads(Path(a.llama_server).read_text()))
    print(f"on the {out['tests_in_both']} tests both ran: dflash-server passed {out['passed_ours']}, llama-server "
          f"{out['passed_llama_server']}, both {out['passed_both']}")
    print(f"passed by dflash-server only ({len(out['passed_ours_only'])}):")
    for name in out["passed_ours_only"]:
        print(f"  {name}")
    print("passed by llama-server only, by reason:")
    for why, names in out["llama_server_only_by_reason"].items():
        print(f"  {len(names):3d}  {why}")
        for name in names:
            print(f"         {name}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
