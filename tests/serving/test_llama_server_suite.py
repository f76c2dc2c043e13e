"""llama.cpp's own server tests (tools/server/tests of the pinned sdist) against
dflash-server, through tests/llama_server_suite/ (a launcher that takes llama-server's
command line, and its runner): every test of the files run passes, or is on the list of
those that cannot (tests/llama_server_suite/expected.py: the suite's model's own words,
features out of scope, the safe CORS default), each with its reason.

The files run here (SUITE_FILES, or DFLASH_LLAMA_SUITE_FILES, comma-separated) fit the CI
stage; `python tests/llama_server_suite/run_suite.py` runs all the files in scope
(docs/serving.md gives the counts)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from helpers.fixtures import missing_oracle

HERE = Path(__file__).resolve().parents[1] / "llama_server_suite"
sys.path.insert(0, str(HERE))

import expected  # noqa: E402
import run_suite  # noqa: E402

# 152 tests, each with a server start of its own (about 5 minutes on 2 busy cores); tool_call's 202
# (~45 s each on the demo model) and the files whose tests nearly all fail as expected.py says
# (infill's, speculative's) are left to full runs
SUITE_FILES = ["basic", "tokenize", "security", "metrics", "ctx_shift", "template", "ignore_eos",
               "compat_oai_responses", "stream", "kv_keep_only_active", "chat_completion"]


@pytest.mark.timeout(2400)  # some 55 server starts: minutes, many on a busy machine
def test_llama_server_suite(tmp_path):
    from dflash_gguf.tools.llama_cpp_tree import source_dir

    src = source_dir()
    if src is None or not (src / "tools" / "server" / "tests" / "utils.py").is_file():
        missing_oracle("llama.cpp's server tests (the pinned sdist)")
    files = [f for f in os.environ.get("DFLASH_LLAMA_SUITE_FILES", ",".join(SUITE_FILES)).split(",") if f]
    log = tmp_path / "suite.log"
    with open(log, "w") as out:
        result = run_suite.run(files, log=out, timeout=2300)
    tests = result["tests"]
    assert tests, f"the suite ran no test: {log.read_text()[-3000:]}"
    unexpected = sorted(name for name, outcome in tests.items()
                        if outcome in ("failed", "error") and expected.reason(name) is None)
    counts = run_suite.summary(tests)
    print(f"llama.cpp's server suite ({', '.join(files)}): {counts} in {result['seconds']} s")
    assert not unexpected, (f"{len(unexpected)} of llama.cpp's server tests failed that are not on "
                            f"tests/llama_server_suite/expected.py: {unexpected}\n{log.read_text()[-6000:]}")


# llama.cpp's slow tool-call tests with a real model: the suite's Qwen2.5 models (1.5B,
# Coder 3B, 7B) are all served as the published Qwen2.5-Coder-1.5B, in their own template
# and in chatml: a required call, the weather asked, hello world in python. Each test is
# run under one of the names (the others send the same requests to the same file again:
# 20 more, some six minutes of a slow two-core machine). test_calc_result (6 more) checks an
# answer after a tool's result, which the 1.5B gives under its own template only
# (docs/serving.md has the whole run's counts beside llama-server's). CI leaves out
# hello world (4 tests, a minute of a slow machine): the required calls' python tool asks
# for code too; pytest --full runs it.
CI_TOOL_CALLS = "Qwen2.5-1.5B and (test_completion_with_required_tool_real_model or test_weather)"
REAL_TOOL_CALLS = f"({CI_TOOL_CALLS}) or (Qwen2.5-7B and test_hello_world)"


@pytest.mark.real
@pytest.mark.timeout(2400)
def test_tool_call_suite_on_the_published_coder(tmp_path, request):
    from dflash_gguf.tools import real_models
    from dflash_gguf.tools.llama_cpp_tree import source_dir

    src = source_dir()
    if src is None or not (src / "tools" / "server" / "tests" / "utils.py").is_file():
        missing_oracle("llama.cpp's server tests (the pinned sdist)")
    full = request.config.getoption("--full")
    log = tmp_path / "suite.log"
    with open(log, "w") as out:
        result = run_suite.run(["tool_call"], k=REAL_TOOL_CALLS if full else CI_TOOL_CALLS, log=out, timeout=2300,
                               model=str(real_models.path("qwen2.5-coder-1.5b")))
    tests = result["tests"]
    print(f"llama.cpp's tool-call suite on Qwen2.5-Coder-1.5B: {run_suite.summary(tests)} in {result['seconds']} s")
    assert len(tests) == (14 if full else 10), sorted(tests)
    failed = sorted(name for name, outcome in tests.items() if outcome != "passed")
    assert not failed, f"{failed}\n{log.read_text()[-6000:]}"
