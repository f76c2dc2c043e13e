"""What the dflash-bench tests share: a short bench run, and stand-ins for llama.cpp's tools."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from dflash_gguf.bench import llama_cpp


def bench(*argv, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([BENCH, "--prompts", "2", "-n", "16", "-r", "2", "-t", "1", "--min-seconds", "0", *argv],
                          capture_output=True,
                          text=True, cwd=cwd, timeout=900)


def fake_tools(tmp_path):
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in llama_cpp.TOOLS:
        exe = tools / name
        exe.write_text(FAKE_TOOL.format(python=sys.executable, completion=COMPLETION_LOG,
                                        spec=SPEC_LOG))
        exe.chmod(0o755)
    return tools


BENCH = str(Path(sys.executable).with_name("dflash-bench"))


COMPLETION_LOG = """\
common_perf_print:    sampling time =      12.50 ms
common_perf_print:    samplers time =       4.00 ms /   160 tokens
common_perf_print:        load time =      45.00 ms
common_perf_print: prompt eval time =      20.00 ms /    33 tokens (    0.61 ms per token,  1650.00 tokens per second)
common_perf_print:        eval time =     100.00 ms /   127 runs   (    0.79 ms per token,  1270.00 tokens per second)
common_perf_print:       total time =     140.00 ms /   160 tokens
"""


FAKE_TOOL = """#!{python}
import json, sys
from pathlib import Path
name = Path(sys.argv[0]).name
with open(Path(sys.argv[0]).with_name("calls.jsonl"), "a") as f:
    f.write(json.dumps(sys.argv) + "\\n")
if name == "llama-bench":
    print(json.dumps([{{"n_gen": 16, "samples_ns": [1e8, 2e8], "build_commit": "abc", "build_number": 1}}]))
elif name == "llama-completion":
    print("generated")
    print({completion!r}, file=sys.stderr)
else:
    print("\\n\\n" + sys.argv[sys.argv.index("-p") + 1] + "generated\\n\\n")
    print({spec!r}, file=sys.stderr)
"""


SPEC_LOG = """\
speculative decoding will use checkpoints (context does not support partial sequence removal)
accepted 3/7 draft tokens, the last target token is: (12)
partial acceptance: 3 < 7, restoring checkpoint
accepted 7/7 draft tokens, the last target token is: (40)
encoded   33 tokens in    0.020 seconds, speed: 1650.000 t/s
decoded   12 tokens in    0.010 seconds, speed: 1200.000 t/s
n_draft   = 7
n_predict = 12
n_drafted = 14
n_accept  = 10
"""
