"""dflash-bench: reading llama.cpp's logs (in the format strings of the pinned sources:
tools/completion/completion.cpp, common/sampling.cpp, examples/speculative-simple), the
rows and ratios made of the runs, bad options, a short run on the demo pair with its
JSON, and the llama.cpp command lines it makes (through stand-in tools that record them).
No timing is asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_gguf.bench import cli, llama_cpp, ours, report
from dflash_gguf.bench.runs import Run, Sampling

BENCH = str(Path(sys.executable).with_name("dflash-bench"))

COMPLETION_LOG = """\
common_perf_print:    sampling time =      12.50 ms
common_perf_print:    samplers time =       4.00 ms /   160 tokens
common_perf_print:        load time =      45.00 ms
common_perf_print: prompt eval time =      20.00 ms /    33 tokens (    0.61 ms per token,  1650.00 tokens per second)
common_perf_print:        eval time =     100.00 ms /   127 runs   (    0.79 ms per token,  1270.00 tokens per second)
common_perf_print:       total time =     140.00 ms /   160 tokens
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


def test_completion_log():
    r = llama_cpp.parse_completion(COMPLETION_LOG)
    assert r["runs"] == 127 and r["decode_s"] == pytest.approx(0.1)
    assert r["prompt_tokens"] == 33 and r["prefill_s"] == pytest.approx(0.02)
    assert r["sampling_s"] == pytest.approx(0.0125)


def test_speculative_log_counts_rounds_and_restores():
    r = llama_cpp.parse_speculative(SPEC_LOG)
    assert (r["tokens"], r["n_drafted"], r["n_accept"], r["n_predict"]) == (12, 14, 10, 12)
    assert r["rounds"] == 2  # each round yields its accepted drafts and one token
    assert r["checkpoints"] and r["restores"] == 1
    r = llama_cpp.parse_speculative(SPEC_LOG.split("\n", 1)[1].replace("partial acceptance: 3 < 7", ""))
    assert not r["checkpoints"] and r["restores"] == 0


def test_completion_text_leaves_out_the_end_of_text_mark():
    assert llama_cpp.completion_text("    return x\n [end of text]\n\n") == "    return x\n"
    assert llama_cpp.completion_text("    return x\n\n") == "    return x"


def test_sampling_flags_match_our_sampler():
    assert llama_cpp.sampling_flags(Sampling(), 2) == ["--temp", "0"]
    flags = llama_cpp.sampling_flags(Sampling(0.6, 20, 0.95, 0.05, 5), 2)
    assert flags == ["--temp", "0.6", "--top-k", "20", "--top-p", "0.95", "--min-p", "0.05", "--seed", "7",
                     "--samplers", "top_k;top_p;min_p;temperature"]


def test_a_log_that_lost_its_summary_is_run_again(tmp_path):
    """llama.cpp logs from a worker thread that sometimes loses the last lines at exit."""
    calls, exe = tmp_path / "calls", tmp_path / "tool"
    exe.write_text(f"#!{sys.executable}\nimport sys\nfrom pathlib import Path\ncalls = Path({str(calls)!r})\n"
                   f"calls.write_text(calls.read_text() + 'x' if calls.exists() else 'x')\n"
                   f"if len(calls.read_text()) >= int(sys.argv[1]):\n    print({COMPLETION_LOG!r}, file=sys.stderr)\n")
    exe.chmod(0o755)
    _, parsed = llama_cpp.run_parsed([str(exe), "2"], llama_cpp.parse_completion, "decode_s")
    assert parsed["runs"] == 127 and calls.read_text() == "xx"
    calls.unlink()
    with pytest.raises(llama_cpp.ToolError, match="no summary in 3 runs"):
        llama_cpp.run_parsed([str(exe), "9"], llama_cpp.parse_completion, "decode_s")


def run(engine, mode, rep, prompt, tokens, seconds, passes, sampling="greedy", ids=None, text=None):
    return Run(engine=engine, mode=mode, sampling=sampling, rep=rep, prompt=prompt, prompt_tokens=10, tokens=tokens,
               decode_s=seconds, passes=passes, token_ids=ids, text=text)


def test_rows_aggregate_each_repetition_then_take_the_median():
    runs = [run("ours", "plain", 0, "a", 100, 1.0, 100, ids=[1, 2], text="x"),
            run("ours", "plain", 0, "b", 100, 1.0, 100, ids=[3], text="y"),
            run("ours", "plain", 1, "a", 100, 0.5, 100, ids=[1, 2], text="x"),
            run("ours", "plain", 1, "b", 100, 0.5, 100, ids=[3], text="y"),
            run("ours", "chain", 0, "a", 100, 0.25, 25, ids=[1, 2]),
            run("ours", "chain", 0, "b", 100, 0.25, 50, ids=[4]),
            run("llama.cpp", report.LLAMA_PLAIN[1], 0, "a", 100, 2.0, 100, text="x\n"),
            run("llama.cpp", report.LLAMA_PLAIN[1], 0, "b", 100, 2.0, 100, text="z")]
    rows = {(r.engine, r.mode): r for r in report.rows(runs)}
    plain, chain, llama = rows[("ours", "plain")], rows[("ours", "chain")], rows[report.LLAMA_PLAIN]
    assert (plain.tok_s.median, plain.tok_s.low, plain.tok_s.high, plain.tok_s.n) == (150.0, 100.0, 200.0, 2)
    assert plain.al.median == 1.0 and plain.same is None
    assert chain.tok_s.median == 400.0 and chain.al.median == pytest.approx(200 / 75)
    assert chain.vs_ours_plain == pytest.approx(400 / 150) and chain.vs_llama_plain == pytest.approx(8.0)
    assert chain.same == (1, 2) and llama.same == (1, 2)  # ours by token ids, llama.cpp by text


def test_llama_cpp_text_may_run_past_our_last_token_only_when_we_stopped_at_n():
    at_n = Run("ours", "plain", "greedy", 0, "a", 10, 15, 0.1, 15, text="def f(x):", extra={"stop_reason": "length"})
    at_eog = Run("ours", "plain", "greedy", 0, "a", 10, 9, 0.1, 9, text="def f(x):", extra={"stop_reason": "stop"})
    assert report.same_text("def f(x):\n", at_n) and report.same_text("def f(x):\n    return", at_n)
    assert report.same_text("def f(x):", at_eog) and not report.same_text("def f(x):\n    return", at_eog)
    assert not report.same_text("def g(x):", at_n) and not report.same_text(None, at_n)


def test_headline_pits_our_fastest_mode_against_llama_cpp_s_fastest_dflash():
    runs = [run("ours", "chain", 0, "a", 100, 0.5, 50), run("ours", "tree 4", 0, "a", 100, 1.0, 40),
            run("llama.cpp", "DFlash (llama-speculative-simple, p-min 0)", 0, "a", 100, 1.0, 50),
            run("llama.cpp", "DFlash (llama-speculative-simple, p-min 0.5)", 0, "a", 100, 0.8, 60)]
    (line,) = report.headline(report.rows(runs))
    assert "ours chain 200.0 tok/s" in line and "p-min 0.5) 125.0 tok/s" in line and line.endswith("= 1.60x")


@pytest.mark.parametrize("argv,message", [
    (["-md", "d.gguf"], "-md needs -m"),
    (["-m", "missing.gguf"], "no such file"),
    (["--modes", "chain,fast"], "unknown mode"),
    (["--tree-budgets", "4,64"], "1..63"),
    (["--temp", "0,x"], "comma-separated"),
    (["--top-p", "0"], "--top-p"),
    (["-n", "1"], "at least 2"),
    (["--prompts", "9"], "--prompts"),
    (["--llama-cpp", "/nonexistent"], "no such directory"),
    (["-p", "  "], "a prompt is empty"),
])
def test_bad_options_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


def bench(*argv, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([BENCH, "--prompts", "2", "-n", "16", "-r", "2", "-t", "1", *argv], capture_output=True,
                          text=True, cwd=cwd, timeout=900)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A short run on the demo pair, every mode, greedy and sampled, with --json and -o."""
    cwd = tmp_path_factory.mktemp("bench")
    res = bench("--tree-budgets", "4", "--no-llama-cpp", "--json", "-o", "short.json", cwd=cwd)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout), cwd


def test_json_carries_provenance_and_every_run(demo_run):
    out, cwd = demo_run
    assert json.loads((cwd / "results" / "short.json").read_text()) == out
    assert out["machine"]["threads"] == 1 and out["machine"]["device"] == "CPU" and out["machine"]["cpu"]
    assert len(out["load_average"]["before"]) == 3 and len(out["load_average"]["after"]) == 3
    assert {"dflash_gguf", "llama_cpp_python", "ggml"} <= set(out["versions"])
    assert out["versions"]["ggml"]["version"] and out["models"]["demo"]
    # 4 modes (plain, chain, tree 4, auto) x 2 samplings x 2 repetitions x 2 prompts
    assert len(out["runs"]) == 32 and {r["rep"] for r in out["runs"]} == {0, 1}
    assert {(r["mode"], r["sampling"].split(",")[0]) for r in out["rows"]} == {
        (m, s) for m in ("plain", "chain", "tree 4", "auto") for s in ("greedy", "temp 0.6")}


def test_greedy_modes_give_plain_decoding_s_output(demo_run):
    rows = demo_run[0]["rows"]
    for row in rows:
        if row["sampling"] == "greedy" and row["mode"] != "plain":
            assert row["same_output"] == [2, 2], row
        if row["mode"] == "plain":
            assert row["al"]["median"] == 1.0
        else:  # the demo drafter accepts: more than one token per target pass
            assert row["al"]["median"] > 1.0, row
        assert row["decode_tok_s"]["n"] == 2 and row["decode_tok_s"]["min"] <= row["decode_tok_s"]["median"]


def test_the_table_without_json(tmp_path):
    res = bench("--modes", "plain,chain", "--temp", "0", "--no-llama-cpp", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "| ours | chain | greedy |" in res.stdout and "median [min-max] of 2 reps" in res.stdout
    assert not (tmp_path / "results").exists()


def test_a_chain_row_per_confidence_cut(tmp_path):
    res = bench("--modes", "plain,chain,tree", "--tree-budgets", "4", "--draft-p-min", "0,0.5", "--temp", "0",
                "--no-llama-cpp", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = {r["mode"]: r for r in json.loads(res.stdout)["rows"]}
    assert set(rows) == {"plain", "chain p-min 0", "chain p-min 0.5", "tree 4"}
    # the cut changes what is verified, never the output
    assert rows["chain p-min 0"]["same_output"] == rows["chain p-min 0.5"]["same_output"] == [2, 2]


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


def test_llama_cpp_runs_with_our_settings(tmp_path):
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in llama_cpp.TOOLS:
        exe = tools / name
        exe.write_text(FAKE_TOOL.format(python=sys.executable, completion=COMPLETION_LOG,
                                        spec=SPEC_LOG))
        exe.chmod(0o755)
    res = bench("--modes", "plain,chain", "--temp", "0,0.7", "--top-k", "40", "--llama-cpp", str(tools),
                "--spec-draft-p-min", "0.25", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    calls = [json.loads(line) for line in (tools / "calls.jsonl").read_text().splitlines()]
    by_tool = {name: [c for c in calls if c[0].endswith(name)] for name in llama_cpp.TOOLS}
    assert len(by_tool["llama-bench"]) == 1 and "-r" in by_tool["llama-bench"][0]
    # 2 samplings x 2 repetitions x 2 prompts each; the drafting tool twice (its log says the
    # target needs checkpoints: a second run at -lv 5 counts the restores)
    assert len(by_tool["llama-completion"]) == 8 and len(by_tool["llama-speculative-simple"]) == 16
    assert sum("-lv" in c for c in by_tool["llama-speculative-simple"]) == 8
    n_ctx = {c[c.index("-c") + 1] for c in by_tool["llama-completion"] + by_tool["llama-speculative-simple"]}
    assert len(n_ctx) == 1
    for c in calls:
        assert c[c.index("-t") + 1] == "1" and c[c.index("-ctk") + 1] == "f16" and "--ignore-eos" not in c
    sampled = [c for c in by_tool["llama-completion"] if "0.7" in c]
    assert len(sampled) == 4 and all(c[c.index("--top-k") + 1] == "40" for c in sampled)
    spec = by_tool["llama-speculative-simple"][0]
    assert spec[spec.index("--spec-type") + 1] == "draft-dflash" and spec[spec.index("--spec-draft-p-min") + 1] == "0.25"
    assert spec[spec.index("--spec-draft-n-max") + 1] == "7"  # the demo drafter's block of 8, less the bonus token
    rows = {(r["mode"], r["sampling"]): r for r in out["rows"]}
    spec_row = rows[("DFlash (llama-speculative-simple, p-min 0.25)", "greedy")]
    # the restore is a pass: 12 tokens in 2 rounds and 1 restore
    assert spec_row["al"]["median"] == pytest.approx(12 / 3) and spec_row["decode_tok_s"]["median"] == 1200.0
    assert rows[(report.LLAMA_PLAIN[1], "greedy")]["decode_tok_s"]["median"] == pytest.approx(1270.0)
    assert out["llama_cpp"]["llama_bench"]["build_commit"] == "abc"
    assert os.path.isabs(out["models"]["target"])


def test_a_chain_row_per_confidence_cut_and_accept_rule():
    names = [m.name for m in ours.modes(["plain", "chain"], [8], [0.0, 0.3], True, ["argmax", "reject"])]
    assert names == ["plain", "chain p-min 0 argmax rule", "chain p-min 0 reject rule", "chain p-min 0.3 argmax rule",
                     "chain p-min 0.3 reject rule"]
    (one,) = ours.modes(["chain"], [8], [], True, ["reject"])
    assert one == ours.Mode("chain", p_min=None, chain_rule="reject")
    assert ours.modes(["chain", "tree"], [4], [], False) == []
