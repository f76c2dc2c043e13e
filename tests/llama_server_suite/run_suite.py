"""Run llama.cpp's server test suite (tools/server/tests in the pinned sdist) against
dflash-server: the suite is copied into a scratch tree beside a link to the sdist's
models/ (its tests read templates at ../../../models/templates), started with
LLAMA_SERVER_BIN_PATH at the launcher (llama-server's flags to dflash-server's) and
suite_plugin (no model downloads), and each test's outcome is written as JSON.

    python tests/llama_server_suite/run_suite.py [--out results.json] [-k EXPR] [--llama-server [PATH]] [FILE ...]

FILE: the suite's test files by short name (basic, completion, ...; default IN_SCOPE).
--llama-server runs the same tests against llama.cpp's own llama-server (PATH, default
the one scripts/llama_cpp_build.py builds) on the same demo target, for its counts beside
ours. The JSON written holds each test's outcome, the counts, the command, the commit,
the date and the machine's load average at the start."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEST_TIMEOUT = 300  # seconds a test of the suite may take (its servers' starts included)
IN_SCOPE = ["basic", "chat_completion", "completion", "infill", "tokenize", "template", "security", "metrics",
            "speculative", "ignore_eos", "ctx_shift", "stream", "compat_oai_responses", "compat_anthropic",
            "tool_call", "kv_keep_only_active"]


def suite_source() -> Path:
    """tools/server/tests of the pinned llama.cpp sources, or SystemExit when set-up has not unpacked them."""
    from dflash_gguf.tools.llama_cpp_tree import source_dir

    src = source_dir()
    if src is None or not (src / "tools" / "server" / "tests" / "utils.py").is_file():
        raise SystemExit("llama.cpp's sources are missing: run scripts/setup.sh")
    return src


def scratch_tree(src: Path, root: Path) -> Path:
    """A copy of the suite at root/tools/server/tests, with root/models linked to the sdist's."""
    tests = root / "tools" / "server" / "tests"
    shutil.copytree(src / "tools" / "server" / "tests", tests)
    os.symlink(src / "models", root / "models")
    return tests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def outcomes(junit: Path) -> tuple:
    """({test id: "passed" | "failed" | "skipped" | "error"}, {test id: the first line of
    its failure's message, for those that failed}) from pytest's JUnit XML."""
    out, why = {}, {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        if not case.get("name"):  # an interrupted run's entry for the interruption itself
            continue
        name = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
        kinds = {child.tag: child for child in case}
        out[name] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                     else "skipped" if "skipped" in kinds else "passed")
        failure = kinds.get("failure", kinds.get("error"))
        if failure is not None:
            why[name] = (failure.get("message") or "").strip().split("\n")[0][:300]
    return out, why


def run(files, k: str = None, timeout: float = 1800, log=None, llama_server: str = None, model: str = None) -> dict:
    src = suite_source()
    with tempfile.TemporaryDirectory(prefix="llama-server-suite-") as tmp:
        tests = scratch_tree(src, Path(tmp))
        junit = Path(tmp) / "junit.xml"
        env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(HERE / "llama-server"), "DFLASH_SUITE_PYTHON": sys.executable,
               # the plugin from here; dflash_gguf as this process imports it (the installed package, whose
               # native library a source tree lacks, unless PYTHONPATH says otherwise)
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               "LLAMA_CACHE": str(Path(tmp) / "cache")}
        env.pop("DEBUG", None)
        env.pop("DFLASH_SUITE_LLAMA_SERVER", None)
        env.pop("DFLASH_SUITE_MODEL", None)
        if model:
            env["DFLASH_SUITE_MODEL"] = str(model)
        if llama_server:
            env["DFLASH_SUITE_LLAMA_SERVER"] = llama_server
        env.setdefault("PORT", str(free_port()))  # the suite's servers listen there (its default, 8080, may be taken)
        cmd = [sys.executable, "-m", "pytest", "-p", "suite_plugin", "-p", "no:cacheprovider", "-q", "-rN",
               f"--junitxml={junit}", "-o", "junit_family=xunit1"]
        try:
            import pytest_timeout  # noqa: F401 - a test that hangs fails alone, not the whole run
            cmd += ["--timeout", str(TEST_TIMEOUT)]
        except ImportError:
            pass
        if k:
            cmd += ["-k", k]
        cmd += [f"unit/test_{f}.py" for f in files]
        started = time.time()
        # a group of its own: on a timeout the suite and the servers it started go together
        proc = subprocess.Popen(cmd, cwd=tests, env=env, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            status = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
            raise RuntimeError(f"the suite ran past {timeout} s") from None
        if not junit.exists():
            raise RuntimeError(f"the suite did not run (exit status {status})")
        tests, why = outcomes(junit)
        return {"seconds": round(time.time() - started, 1), "exit_status": status, "tests": tests,
                "failure_messages": why}


def summary(tests: dict) -> dict:
    counts = {}
    for outcome in tests.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def llama_server_binary() -> str:
    from dflash_gguf.tools.llama_cpp_tree import tool

    path = tool("llama-server")
    if path is None:
        raise SystemExit("llama-server is not built: run scripts/llama_cpp_build.py llama-server")
    return str(path)


def provenance(argv) -> dict:
    """What a results file says of its run: the command, the commit (and whether the tree
    had changes), the date, the load average when it started."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True).stdout.strip()

    return {"command": " ".join(["python", "tests/llama_server_suite/run_suite.py", *argv]),
            "commit": git("rev-parse", "HEAD"), "uncommitted_changes": bool(git("status", "--porcelain")),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load_average_at_start": list(os.getloadavg())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", default=IN_SCOPE)
    p.add_argument("-k")
    p.add_argument("--out", help="write the outcomes as JSON here")
    p.add_argument("--log", help="the suite's output (default: none)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds the whole run may take (default 1800)")
    p.add_argument("--llama-server", nargs="?", const="", metavar="PATH",
                   help="run against llama.cpp's llama-server (default: the one scripts/llama_cpp_build.py built)")
    p.add_argument("--model", metavar="GGUF", help="serve this GGUF as every model of the suite's (default: the demo "
                                                   "target); a name of dflash_gguf.tools.real_models fetches it")
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    binary = None if a.llama_server is None else a.llama_server or llama_server_binary()
    log = open(a.log, "w") if a.log else None
    about = {**provenance(argv), "server": binary or "dflash-server (tests/llama_server_suite/launcher.py)"}
    model = None
    if a.model:
        from dflash_gguf.tools import real_models

        model = str(real_models.path(a.model)) if a.model in real_models.MODELS else a.model
        about["model"] = model
    result = {**about, **run(a.files, a.k, a.timeout, log=log, llama_server=binary, model=model)}
    result["counts"] = summary(result["tests"])
    import expected

    for name, outcome in sorted(result["tests"].items()):
        why = expected.reason(name)
        mark = "" if outcome in ("passed", "skipped") or why else "  <- not on expected.py"
        print(f"{outcome:8s} {name}{mark}")
    print(json.dumps({"seconds": result["seconds"], **result["counts"]}))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
