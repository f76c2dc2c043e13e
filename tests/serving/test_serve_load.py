"""The serving benchmarks' pure parts (dflash_gguf/bench/serving/serve_load.py, dflash-bench concurrency):
percentiles, reading a reply's events, /metrics, flag detection, the workers, a cell's
summary and its comparisons, the servers' command lines."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_gguf.bench.serving import concurrency as bench_concurrency
from dflash_gguf.bench import slim
from dflash_gguf.bench.serving import serve_load
from dflash_gguf.bench.serving.serve_load import Reply

BENCH = str(Path(sys.executable).with_name("dflash-bench"))


def test_percentile_interpolates_between_ranks():
    assert serve_load.percentile([3, 1, 2], 0.5) == 2
    assert serve_load.percentile([1, 2, 3, 4], 0.5) == 2.5
    assert serve_load.percentile([10, 20], 0.95) == pytest.approx(19.5)
    assert serve_load.percentile([7], 0.99) == 7
    assert serve_load.percentile([1, 2, 3], 0) == 1 and serve_load.percentile([1, 2, 3], 1) == 3
    assert serve_load.percentile([], 0.5) != serve_load.percentile([], 0.5)  # nan
    with pytest.raises(ValueError):
        serve_load.percentile([1], 95)


HELP = """usage: dflash-server [-h] [-m MODEL] [-np N] [--no-spec]
  -npx N        not it
  --np-foo      not it either
  -np N, --parallel N   sequences served at once
"""


def test_a_flag_is_found_only_as_an_option_of_its_own():
    assert serve_load.accepts_flag(HELP, "-np") and serve_load.accepts_flag(HELP, "--parallel")
    assert serve_load.accepts_flag(HELP, "--no-spec")
    assert not serve_load.accepts_flag("  -npx N\n  --np-foo\n  --np\n", "-np")
    assert not serve_load.accepts_flag(HELP, "--spec")  # only inside --no-spec


def test_the_installed_server_s_help_is_read():
    text = serve_load.dflash_server_help()
    assert serve_load.accepts_flag(text, "--queue") and not serve_load.accepts_flag(text, "--no-such-flag")


def test_prometheus_text_with_labels_and_comments():
    text = ('# HELP dflash_requests_total Requests.\n# TYPE dflash_requests_total counter\n'
            'dflash_requests_total 12\ndflash_checkpoint_bytes{where="host"} 4096\n\n'
            'process_resident_memory_bytes 1.5e+08\n')
    assert serve_load.parse_metrics(text) == {"dflash_requests_total": 12.0,
                                              'dflash_checkpoint_bytes{where="host"}': 4096.0,
                                              "process_resident_memory_bytes": 1.5e8}
    with pytest.raises(ValueError, match="not a Prometheus sample"):
        serve_load.parse_metrics("dflash_requests_total twelve\n")


def test_only_loopback_urls():
    assert serve_load.loopback_url("http://127.0.0.1:8080/") == "http://127.0.0.1:8080"
    assert serve_load.loopback_url("http://localhost:1") == "http://localhost:1"
    with pytest.raises(ValueError, match="loopback"):
        serve_load.loopback_url("http://10.0.0.2:8080")


def sse(*objs, done=1, extra=()):
    lines = [": keep-alive", ""]
    for o in objs:
        lines += [f"data: {json.dumps(o)}", ""]
    lines += ["data: [DONE]", ""] * done
    return lines + list(extra)


def chunk(text, finish=None, **more):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}], **more}


def read(lines, status=200):
    r = Reply(status=status)
    for i, line in enumerate(lines):
        r.feed(line, elapsed=0.1 * (i + 1))
    return r


def test_a_whole_stream_is_one_answer():
    r = read(sse(chunk(""), chunk("def"), chunk(" f():"),
                 chunk("", "length", usage={"completion_tokens": 3}, dflash={"mean_accepted_length": 2.5})))
    assert r.complete and r.text == "def f():" and r.tokens == 3 and r.finish_reason == "length"
    assert r.ttft == pytest.approx(0.5)  # the first chunk with text (the empty one does not count)
    assert (r.finals, r.dones, r.after_done) == (1, 1, 0)
    assert bench_concurrency.accepted_length(r) == 2.5


def test_an_answer_sent_twice_or_cut_short_is_seen():
    twice = read(sse(chunk("a", "stop"), chunk("a", "stop")))
    assert twice.finals == 2 and not twice.complete
    after = read(sse(chunk("a", "stop"), extra=["data: " + json.dumps(chunk("b"))]))
    assert after.after_done == 1 and after.text == "a"
    cut = read(sse(chunk("a"), done=0))
    assert cut.finals == 0 and not cut.complete
    failed = read(sse(chunk("a"), {"error": {"message": "generation failed", "code": 500}}))
    assert failed.error == "generation failed" and not failed.complete


def test_llama_server_s_acceptance_from_its_timings():
    r = read(sse(chunk("x", "length", timings={"predicted_n": 30, "draft_n": 40, "draft_n_accepted": 20})))
    assert bench_concurrency.accepted_length(r) == pytest.approx(3.0)  # 30 tokens in 10 rounds
    assert bench_concurrency.accepted_length(read(sse(chunk("x", "stop")))) is None


def test_drain_keeps_the_order_runs_everything_and_stops_at_the_deadline():
    items = list(range(20))
    assert serve_load.drain(items, 4, lambda i: i * i) == [i * i for i in items]

    def slow(i):
        time.sleep(0.05)
        return i
    out = serve_load.drain(items, 2, slow, deadline=time.monotonic() + 0.12)
    ran = [x for x in out if x is not None]
    assert 2 <= len(ran) < len(items) and ran == sorted(ran) and out[-1] is None


def row(engine, clients, tps, sampling="greedy", pair="demo", setting="default", reps=None, loaded=False):
    return {"engine": engine, "setting": setting, "default": setting == "default", "pair": pair, "sampling": sampling,
            "clients": clients, "aggregate_tps": {"median": tps},
            "aggregate_rounds_per_rep": [[(x, 1.0)] for x in reps or [tps]], "loaded": loaded}


def test_rows_compare_with_one_client_and_llama_server_at_the_same_setting():
    rows = [row("ours", 1, 100), row("ours", 4, 250), row("llama-server", 1, 80), row("llama-server", 4, 200),
            row("ours", 4, 90, sampling="temp 0.6"), row("ours", 2, 150)]
    bench_concurrency.compare(rows)
    assert [r["vs_one_client"] for r in rows] == [1.0, 2.5, 1.0, 2.5, None, 1.5]
    assert [r["vs_llama_server"] for r in rows] == [1.25, 1.25, None, None, None, None]


def test_each_side_at_its_best_and_at_its_default():
    rows = [row("ours", 4, 250, reps=[240, 250, 260]),
            row("ours", 4, 300, setting="p-min 0.5 n-max 7", reps=[300, 280, 330], loaded=True),
            row("llama-server", 4, 200, reps=[200, 190, 210]),
            row("llama-server", 4, 240, setting="p-min 0.5 n-max 7", reps=[240, 250, 220]),
            row("llama-server", 4, 150, setting="p-min 0 n-max 7", reps=[150, 150, 150])]
    best, default = bench_concurrency.compare(rows)
    assert (best["pairing"], best["ours"], best["llama_server"]) == ("best vs best", "p-min 0.5 n-max 7",
                                                                      "p-min 0.5 n-max 7")
    assert best["ratio_of_medians"] == 1.25 and best["per_rep_ratio_range"] == [1.12, 1.5] and best["loaded"]
    assert (default["pairing"], default["ours"], default["llama_server"]) == ("default vs default", "default",
                                                                               "default")
    assert default["ratio_of_medians"] == 1.25 and not default["loaded"]
    assert rows[1]["vs_llama_server"] == 1.25  # matched: the same p-min and n-max
    text = bench_concurrency.comparisons_text([best, default])
    assert "best vs best" in text and "1.12-1.50x" in text


def test_the_sweep_gives_each_side_its_own_settings():
    from dflash_gguf.runtime.demo import demo_paths

    target, draft = demo_paths()
    args = bench_concurrency.parser().parse_args(["--draft-p-min", "0,0.3", "--block-size", "8,4",
                                                  "--spec-draft-p-min", "0.5,0.75", "--spec-draft-n-max", "7"])
    arms = bench_concurrency.arms_of(args, draft, ["ours", "llama-server"])
    assert [(a.engine, a.setting) for a in arms] == [
        ("ours", "default"), ("ours", "p-min 0 n-max 7"), ("ours", "p-min 0 n-max 3"), ("ours", "p-min 0.3 n-max 7"),
        ("ours", "p-min 0.3 n-max 3"), ("llama-server", "default"), ("llama-server", "p-min 0.5 n-max 7"),
        ("llama-server", "p-min 0.75 n-max 7")]
    defaults = bench_concurrency.parser().parse_args([])
    assert defaults.draft_p_min == defaults.spec_draft_p_min == [0.0, 0.3, 0.5, 0.75]
    assert [a.setting for a in bench_concurrency.arms_of(defaults, None, ["ours"])] == ["default"]  # no drafter


def test_a_cell_summary_counts_tokens_over_wall_time_and_failures():
    good = [Reply(status=200, finals=1, dones=1, tokens=50, seconds=s, ttft=s / 10) for s in (1.0, 2.0, 3.0)]
    lost = Reply(status=None, error="ReadTimeout: timed out")
    s = bench_concurrency.summarize([{"wall_seconds": 2.0, "replies": good[:2] + [lost],
                                      "rounds": [(1.5, good[:1]), (0.5, [good[1], lost])]},
                                     {"wall_seconds": 1.0, "replies": good[2:], "rounds": [(1.0, good[2:])]}])
    assert (s["requests"], s["ok"], s["tokens"]) == (4, 3, 150)
    assert s["aggregate_tps"]["median"] == 50.0 and s["aggregate_tps"]["min"] == 50.0
    assert s["latency_p50"] == 2.0 and s["ttft_p50"] == 0.2
    assert s["errors"] == ["ReadTimeout: timed out"]
    assert [len(rep) for rep in s["replies"]] == [3, 1]  # every request on record, by repetition
    assert s["aggregate_rounds_per_rep"] == [[(50, 1.5), (50, 0.5)], [(50, 1.0)]] and s["rounds_per_rep"] == [2, 1]
    assert s["replies"][0][2]["error"] == "ReadTimeout: timed out" and s["replies"][1][0]["tokens"] == 50


def test_sampled_requests_carry_our_sampler_order_and_their_own_seed():
    greedy = bench_concurrency.Sampling(0.0, 20, 0.95)
    sampled = bench_concurrency.Sampling(0.6, 20, 0.95)
    assert greedy.fields(5) == {"temperature": 0} and greedy.label == "greedy"
    f = sampled.fields(7)
    assert (f["temperature"], f["top_k"], f["top_p"], f["seed"]) == (0.6, 20, 0.95, 7)
    assert f["samplers"] == ["top_k", "top_p", "min_p", "temperature"]


def test_llama_server_gets_a_slot_of_the_context_each_and_dflash_drafting(tmp_path):
    from dflash_gguf.runtime.demo import demo_paths

    target, draft = demo_paths()
    args = bench_concurrency.parser().parse_args(["-t", "3", "-c", "1024"])
    arm = bench_concurrency.Arm("llama-server", 0.5, 7)
    cmd = bench_concurrency.llama_server_command(Path("/x/llama-server"), 9999, target, draft, args, 4, arm)
    flag = {a: cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a.startswith("-")}
    assert (flag["-np"], flag["-c"], flag["-t"], flag["-td"]) == ("4", "4096", "3", "3")
    assert (flag["--spec-type"], flag["-md"], flag["--spec-draft-p-min"]) == ("draft-dflash", draft, "0.5")
    assert (flag["--spec-draft-n-max"], flag["--spec-draft-n-min"], flag["--host"]) == ("7", "0", "127.0.0.1")
    default = bench_concurrency.llama_server_command(Path("/x/llama-server"), 9999, target, draft, args, 4)
    assert not any(a.startswith("--spec-draft") for a in default) and "draft-dflash" in default  # its own defaults
    ours = bench_concurrency.ours_command(9999, target, draft, args, None, queue=8)
    assert "-np" not in ours and ours[ours.index("-t") + 1] == "3" and ours[ours.index("--queue") + 1] == "8"
    assert ours[ours.index("-c") + 1] == "1024" and "--draft-p-min" not in ours and "--block-size" not in ours
    ours = bench_concurrency.ours_command(9999, target, draft, args, 4, queue=4,
                                          arm=bench_concurrency.Arm("ours", 0.3, 3))
    assert ours[-2:] == ["-np", "4"] and ours[ours.index("-c") + 1] == "4096"  # each of the 4 slots has -c
    assert ours[ours.index("--draft-p-min") + 1] == "0.3" and ours[ours.index("--block-size") + 1] == "4"


@pytest.mark.parametrize("argv, message", [
    (["--clients", "0"], "--clients must be 1..64"),
    (["--clients", "64", "--requests", "20"], "clients x requests <= 1000"),
    (["--pairs", "demo,strong"], "--pairs"),
    (["--engines", "vllm"], "--engines"),
    (["-md", "d.gguf"], "-md needs -m"),
    (["--spec-draft-n-max", "0"], "at least 1"),
    (["--draft-p-min", "1"], "--draft-p-min values"),
    (["--min-seconds", "-1"], "--min-seconds"),
])
def test_bad_options_exit_2_with_a_message(argv, message, capsys):
    p = bench_concurrency.parser()
    with pytest.raises(SystemExit) as e:
        bench_concurrency.check(p, p.parse_args(argv))
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_small_run_against_our_server_writes_rows_with_provenance(tmp_path):
    out = tmp_path / "c.json"
    res = subprocess.run([BENCH, "concurrency", "--engines", "ours", "--pairs", "demo", "--clients", "1,2",
                          "--requests", "2", "-r", "2", "-n", "8", "--temp", "0,0.6", "-t", "1", "--draft-p-min", "0.5",
                          "--min-seconds", "0", "-o", str(out)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    result = slim.read(out)
    rows = result["rows"]
    # a row per setting, sampling and client count
    settings = ("default", "p-min 0.5 n-max 7")
    assert sorted((r["setting"], r["sampling"], r["clients"]) for r in rows) == sorted(
        (s, m, c) for s in settings for m in ("greedy", "temp 0.6, top-k 20, top-p 0.95") for c in (1, 2))
    for r in rows:
        assert r["ok"] == r["requests"] == 2 * 2 * r["clients"] and r["tokens"] > 0  # 2 requests a client, 2 reps
        assert r["aggregate_tps"]["median"] > 0 and 0 < r["ttft_p50"] <= r["latency_p50"] <= r["latency_p95"]
        assert r["accepted_length_median"] >= 1 and r["vs_llama_server"] is None
        assert (r["slots"] is None) != result["ours"]["np_flag"]  # -np passed exactly when offered
        assert len(r["load_1m_at_start"]) == 2 and r["loaded"] == any(
            x > result["settings"]["load_threshold_1m"] for x in r["load_1m_at_start"])
        assert ("--draft-p-min" in r["command"]) == (r["setting"] != "default")
    assert result["failures"] == [] and result["comparisons"] == []
    assert result["checkout"]["commit"] and result["load_average"]["after"] and result["machine"]["threads"] == 1
    # interleaved: per client count, each repetition's 4 cells (2 settings x 2 samplings) before the next's
    cells = [c["cell"] for c in result["cells"]]
    assert len(cells) == 16 and [c[-5:] for c in cells[:8]] == ["rep 1"] * 4 + ["rep 2"] * 4


def test_fifo_inversions_are_counted_on_the_servers_clock():
    """Requests sent close together reach the scheduler in either order: only the
    server's own times (taken in, started) say whether it ran them first come, first served."""
    from dflash_gguf.bench.serving.serve import fifo_inversions

    fifo = [{"arrival": 0.0, "queued_at": 10.2, "started_at": 10.3},  # sent first, taken in second
            {"arrival": 0.001, "queued_at": 10.1, "started_at": 10.1}]
    assert fifo_inversions(fifo) == 0
    assert fifo_inversions([{"queued_at": 1.0, "started_at": 3.0}, {"queued_at": 2.0, "started_at": 2.5},
                            {"queued_at": 2.2, "started_at": None}]) == 1


def test_dflash_bench_serve_load_tests_a_demo_server(tmp_path):
    res = subprocess.run([BENCH, "serve", "--clients", "2", "--requests", "2", "--max-tokens", "8", "--json", "--",
                          "-t", "1"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads(res.stdout)
    assert (summary["requests"], summary["ok"], summary["refused"]) == (4, 4, 0)
    assert summary["generated_tokens"] > 0 and summary["fifo_inversions"] == 0
    assert 0 < summary["ttft_p50"] <= summary["latency_p50"]


FAKE_LLAMA_SERVER = """#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
if "--version" in sys.argv:
    print("version: 1 (fake)")
    sys.exit(0)
with open(Path(sys.argv[0]).with_name("calls.jsonl"), "a") as f:
    f.write(json.dumps(sys.argv) + "\\n")


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{{"status": "ok"}}')

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunks = [{{"choices": [{{"index": 0, "text": "ab", "finish_reason": None}}]}},
                  {{"choices": [{{"index": 0, "text": "", "finish_reason": "length"}}], "usage": {{"completion_tokens": 4}},
                   "timings": {{"predicted_n": 4, "draft_n": 4, "draft_n_accepted": 2}}}}]
        for c in chunks:
            self.wfile.write(("data: " + json.dumps(c) + "\\n\\n").encode())
        self.wfile.write(b"data: [DONE]\\n\\n")

    def log_message(self, *args):
        pass


try:
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler).serve_forever()
except KeyboardInterrupt:
    sys.exit(0)
"""


def test_both_servers_swept_and_their_cells_interleaved(tmp_path):
    tools = tmp_path / "bin"
    tools.mkdir()
    exe = tools / "llama-server"
    exe.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable))
    exe.chmod(0o755)
    out = tmp_path / "c.json"
    res = subprocess.run([BENCH, "concurrency", "--pairs", "demo", "--clients", "2", "--requests", "1", "-r", "2",
                          "-n", "8", "--temp", "0", "-t", "1", "--draft-p-min", "0.5", "--spec-draft-p-min", "0.25",
                          "--min-seconds", "0", "--llama-cpp", str(tools), "-o", str(out)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    result = slim.read(out)
    calls = [json.loads(line) for line in (tools / "calls.jsonl").read_text().splitlines()]
    draft_flags = [[a for a in c if a.startswith("--spec-draft")] for c in calls]
    assert sorted(draft_flags) == [[], ["--spec-draft-n-max", "--spec-draft-n-min", "--spec-draft-p-min"]]
    (swept,) = [c for c in calls if "--spec-draft-p-min" in c]
    assert swept[swept.index("--spec-draft-p-min") + 1] == "0.25" and swept[swept.index("--spec-draft-n-max") + 1] == "7"
    cells = [c["cell"] for c in result["cells"]]
    # ours and llama-server at their defaults and at one setting each: 4 cells a repetition, rotating
    assert len(cells) == 8 and [c[-5:] for c in cells] == ["rep 1"] * 4 + ["rep 2"] * 4
    assert {c.split(" ")[0] for c in cells[:4]} == {"ours", "llama-server"} and cells[4] == cells[1].replace(
        "rep 1", "rep 2")
    rows = {(r["engine"], r["setting"]): r for r in result["rows"]}
    assert set(rows) == {("ours", "default"), ("ours", "p-min 0.5 n-max 7"), ("llama-server", "default"),
                         ("llama-server", "p-min 0.25 n-max 7")}
    assert rows[("ours", "default")]["vs_llama_server"] > 0  # default against default
    assert rows[("ours", "p-min 0.5 n-max 7")]["vs_llama_server"] is None  # no llama-server row at that setting
    assert rows[("llama-server", "default")]["accepted_length_median"] == 2.0  # 4 tokens, 2 of them drafts
    assert [c["pairing"] for c in result["comparisons"]] == ["best vs best", "default vs default"]
    assert result["comparisons"][1]["ours"] == result["comparisons"][1]["llama_server"] == "default"
