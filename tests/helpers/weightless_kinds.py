"""The checks every weightless kind (speculation/kinds/) passes on the demo target, each
from where a user meets it: the Engine's keywords, dflash-run, dflash-server and
dflash-bench's arms. The oracle is plain greedy decoding: a kind's output is the
target's own, and on repetitive text its drafts are proposed and kept."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dflash_gguf.bench import kinds as bench_kinds
from dflash_gguf.engine.engine import Engine
from dflash_gguf.speculation.kinds import WEIGHTLESS

from helpers.bench_checks import bench, fake_tools
from helpers.decoding_checks import REPEATS, use_cost
from helpers.paths import ROOT
from helpers.servers import ServerProcess

TARGET = str(ROOT / "dflash_gguf" / "data" / "demo-target.gguf")
OPTIONS = dict(n_ctx=512, kv_type="f32", n_threads=1)
BIN = Path(sys.executable).parent


def greedy_equals_plain(monkeypatch, kind: str, **options) -> None:
    """Alone (its drafts priced as if rows were free, so that every likely draft is
    verified) and with the n-gram kinds beside it, the kind's greedy output is plain
    decoding's, and on repetitive text it drafts and the target keeps some of it."""
    use_cost(monkeypatch, 0.0)
    with Engine(TARGET, **OPTIONS) as plain:
        want = plain.generate(REPEATS, 60, stop_tokens=()).tokens
    for spec_type in (kind, f"ngram-simple,{kind}"):
        with Engine(TARGET, spec_type=spec_type, spec_draft_n_max=8, spec_ngram_simple_size_n=3, **options,
                    **OPTIONS) as engine:
            got = engine.generate(REPEATS, 60, stop_tokens=())
        assert got.tokens == want, spec_type
        if spec_type == kind:
            assert got.stats.drafts.drafted.get(kind, 0) > 0 and got.stats.drafts.accepted.get(kind, 0) > 0, \
                got.stats.drafts
            assert got.stats.mean_accepted > 1 and max(got.stats.accepted_lengths) <= 9


def _run(*args: str) -> subprocess.CompletedProcess:
    # wide columns: argparse wraps --help at hyphens too, which would split a kind's name
    return subprocess.run([str(BIN / "dflash-run"), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "1000"})


def the_cli_runs_it(kind: str, *flags: str) -> None:
    """dflash-run --help lists the kind and its flags; a run with it prints plain
    decoding's text; a flag out of range exits 2 with one line that names it."""
    help_text = _run("--help").stdout
    assert kind in help_text and all(f in help_text for f in flags[::2]), help_text
    base = ["-m", TARGET, "-p", REPEATS, "-n", "24", "-c", "512", "-t", "1"]
    plain, drafted = _run(*base), _run(*base, "--spec-type", kind, *flags)
    assert plain.returncode == drafted.returncode == 0, drafted.stderr
    assert plain.stdout == drafted.stdout and kind in drafted.stderr
    for flag, value in zip(flags[::2], flags[1::2]):
        bad = _run(*base, "--spec-type", kind, flag, "0")
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and flag in bad.stderr, bad.stderr


def the_server_runs_it(tmp_path, kind: str, *flags: str) -> None:
    """dflash-server --spec-type kind answers with plain decoding's text."""
    with Engine(TARGET, n_ctx=512, n_threads=1) as plain:
        want = plain.generate(REPEATS, 16, stop_tokens=()).text
    server = ServerProcess(tmp_path, "-m", TARGET, "-c", "512", "-t", "1", "--spec-type", kind, *flags)
    try:
        r = server.http.post("/v1/completions", json={"prompt": REPEATS, "max_tokens": 16, "temperature": 0,
                                                      "ignore_eos": True})
    finally:
        server.stop()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    assert server.proc.returncode == 0 and kind in server.text, server.text


def the_bench_runs_it(tmp_path, kind: str) -> None:
    """dflash-bench --spec-type kind against llama.cpp's stand-in tools: our plain and
    chain rows, the n-max sweep (with the kind's lookup size where it has one), and
    llama-speculative-simple's arms with the kind's own flags and no drafter."""
    tools = fake_tools(tmp_path)
    res = bench("-m", TARGET, "--spec-type", kind, "--temp", "0", "--llama-cpp", str(tools), "-r", "1",
                "--block-size", "9", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = {(r["engine"], r["mode"]) for r in json.loads(res.stdout)["rows"]}
    sizes = bench_kinds.SWEEP_SIZE.get(kind, ())
    ours = {"plain", "chain (default)"} | ({f"chain size {s} n-max 8" for s in sizes} if sizes else {"chain n-max 8"})
    assert {("ours", m) for m in ours} <= rows
    assert ("llama.cpp", f"{kind} (llama-speculative-simple, default)") in rows
    calls = [json.loads(line) for line in (tools / "calls.jsonl").read_text().splitlines()]
    spec = [c for c in calls if c[0].endswith("llama-speculative-simple") and "-lv" not in c]
    assert spec and all("-md" not in c and c[c.index("--spec-type") + 1] == kind for c in spec)
    flags = {f for c in spec for f in c if f.startswith("--spec-") and f != "--spec-type"}
    allowed = {f for size in (None, *sizes) for f in WEIGHTLESS[kind].their_flags(size, 8) if f.startswith("--")}
    assert flags <= allowed, flags
