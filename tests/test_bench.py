"""scripts/bench.py's plumbing: reading llama.cpp's logs, the figures' pass/fail and the
README block. No timing is asserted; the logs below follow the format strings of the
pinned llama.cpp (src/llama-context.cpp, common/sampling.cpp,
examples/speculative-simple/speculative-simple.cpp)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench  # noqa: E402

COMPLETION_LOG = """\
llama_context: graph_reserve: reserving a graph for ubatch with n_tokens =  512, n_seqs =  1, n_outputs =  512
llama_context: graph (pp bs=512, tg bs=1): nodes = 301 / 287, splits = 1, input objects = 9 / 8, input tensors = 12 / 11
common_perf_print:    sampling time =      12.50 ms
common_perf_print:    samplers time =       4.00 ms /   160 tokens
common_perf_print:        load time =      45.00 ms
common_perf_print: prompt eval time =      20.00 ms /    33 tokens (    0.61 ms per token,  1650.00 tokens per second)
common_perf_print:        eval time =     100.00 ms /   127 runs   (    0.79 ms per token,  1270.00 tokens per second)
common_perf_print:       total time =     140.00 ms /   160 tokens
"""

SPEC_LOG = """\
sched_reserve: graph: nodes = 304, splits = 1, input objects = 4, input tensors = 7
sched_reserve: graph: nodes = 74, splits = 1, input objects = 3, input tensors = 5
sched_reserve: graph: nodes = 304, splits = 1, input objects = 4, input tensors = 7
sched_reserve: graph (pp bs=512, tg bs=1): nodes = 115 / 80, splits = 1 / 1, input objects = 4 / 4, input tensors = 5 / 5
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


def test_graph_nodes_of_every_reservation():
    assert bench.parse_graph_nodes(COMPLETION_LOG) == [(301, 287)]
    assert bench.parse_graph_nodes(SPEC_LOG) == [(304, 304), (74, 74), (304, 304), (115, 80)]


def test_completion_log():
    r = bench.parse_completion(COMPLETION_LOG)
    assert r["runs"] == 127 and r["decode_s"] == pytest.approx(0.1)
    assert r["tps"] == pytest.approx(1270.0)
    assert r["prompt_tokens"] == 33 and r["prefill_s"] == pytest.approx(0.02)
    assert r["sampling_s"] == pytest.approx(0.0125)
    assert r["target_nodes"] == 287


def test_spec_log_counts_restores_as_passes():
    r = bench.parse_spec(SPEC_LOG)
    assert (r["tokens"], r["n_drafted"], r["n_accept"]) == (12, 14, 10)
    assert (r["rounds"], r["restores"], r["passes"]) == (2, 1, 3)
    assert r["al"] == pytest.approx(4.0)
    assert (r["target_nodes"], r["drafter_nodes"]) == (304, 115)


def make_row(key, kind, pair, tps):
    r = bench.Row(key, key, kind, pair)
    r.runs = [[{"tps": tps, "al": 1.0}]]
    return r


def test_e2e_figures_pick_the_best_peer_and_the_best_fixed_choice():
    rows = [make_row("ours-ar", "ours", None, 100.0),
            make_row("demo/ours-chain", "ours", "demo", 90.0),
            make_row("demo/ours-tree-8", "ours", "demo", 95.0),
            make_row("demo/ours-tree-auto", "ours", "demo", 93.0),
            make_row("demo/llama-dflash-0", "spec", "demo", 80.0),
            make_row("demo/llama-dflash-0.5", "spec", "demo", 100.0)]
    figs = bench.e2e_figures([{"type": "f32", "rows": rows}])
    chain = next(f for f in figs if f["figure"] == 3)
    auto = next(f for f in figs if f["figure"] == 5)
    assert chain["value"] == pytest.approx(0.9) and chain["pass"] is False
    assert auto["value"] == pytest.approx(93 / 95) and auto["pass"] is True


def test_auto_figure_comes_from_the_side_by_side_run_when_there_is_one():
    rows = [make_row("demo/ours-chain", "ours", "demo", 90.0),
            make_row("demo/ours-tree-auto", "ours", "demo", 50.0)]
    side = {"tps": {"auto": 96.0, "chain": 100.0, "4": 80.0}, "ratio": 0.96, "choices": [0, 0, 4]}
    figs = bench.e2e_figures([{"type": "f32", "rows": rows, "auto": {"demo": side}}])
    auto = next(f for f in figs if f["figure"] == 5)
    assert auto["value"] == pytest.approx(0.96) and auto["pass"] is False
    assert "side by side" in auto["detail"] and "chain: 2, 4: 1" in auto["detail"]
    figs = bench.e2e_figures([{"type": "f32", "rows": rows, "auto": {"demo": {"error": "worker failed"}}}])
    auto = next(f for f in figs if f["figure"] == 5)
    assert auto["value"] is None and "worker failed" in auto["detail"]


def test_tree_figure_is_the_worst_ratio():
    rows = [{"shape": "chain", "n": 4, "wall_ms": 1.0}, {"shape": "ddtree", "n": 4, "wall_ms": 1.02},
            {"shape": "chain", "n": 32, "wall_ms": 2.0}, {"shape": "bushy", "n": 32, "wall_ms": 2.2}]
    (f,) = bench.tree_figures({"t": rows})
    assert f["value"] == pytest.approx(1.1) and f["pass"] is False and "N=32" in f["detail"]
    (f,) = bench.tree_figures({"t": "verify_count.py failed"})
    assert f["pass"] is None


def test_write_readme_replaces_only_the_block(tmp_path, monkeypatch):
    import datetime as dt
    import types

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{bench.README_BEGIN}\nold table\n{bench.README_END}\nrest\n")
    monkeypatch.setattr(bench, "README", readme)
    bench.write_readme("| new |\n", dt.datetime(2026, 1, 1), types.SimpleNamespace(quick=True))
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{bench.README_END}\nrest\n")
    assert "| new |" in text and "old table" not in text
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit):
        bench.write_readme("| new |\n", dt.datetime(2026, 1, 1), types.SimpleNamespace(quick=True))


def test_own_pair_replaces_the_demo_pairs(tmp_path):
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"")
    draft.write_bytes(b"")
    args = bench.parse_args(["-m", str(target), "-md", str(draft)])
    assert args.pairs == [bench.GIVEN] and args.pair_files == {bench.GIVEN: draft.resolve()}
    assert args.model == target.resolve() and args.types == [] and args.no_08b
    args = bench.parse_args(["-m", str(target)])  # plain decoding only
    assert args.pairs == [] and args.pair_files == {}
    args = bench.parse_args([])
    assert args.pairs == list(bench.PAIRS) and args.types == list(bench.TYPES) and args.model is None


@pytest.mark.parametrize("argv", [["-md", "d.gguf"], ["-m", "missing.gguf"], ["-m", "t.gguf", "-md", "missing.gguf"],
                                  ["-m", "t.gguf", "--pairs", "demo"], ["-m", "t.gguf", "--types", "f32"]])
def test_own_pair_bad_options(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.gguf").write_bytes(b"")
    (tmp_path / "d.gguf").write_bytes(b"")
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and "error" in capsys.readouterr().err


def test_own_target_is_named_by_file_and_type(tmp_path):
    import gguf

    path = tmp_path / "my-target.gguf"
    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    args = bench.parse_args(["-m", str(path)])
    assert bench.bench_targets(args) == [("q4_k_m", "my-target.gguf", path.resolve())]


def test_rows_of_the_given_pair(tmp_path):
    import types

    args = types.SimpleNamespace(pair_files={bench.GIVEN: tmp_path / "d.gguf"}, budgets=["4", "auto"],
                                 spec_p_min=["0"], zlab=False)
    tools = {"llama-completion": Path("x"), "llama-speculative-simple": Path("y")}
    rows = bench.e2e_rows(args, 8, [bench.GIVEN], tools)
    keys = [r.key for r in rows]
    assert keys == ["ours-ar", "llama-ar", "given/ours-chain", "given/ours-tree-4", "given/ours-tree-auto",
                    "given/llama-dflash-0"]
    assert rows[2].extra["draft"] == str(tmp_path / "d.gguf")
    assert rows[-1].extra == {"draft": str(tmp_path / "d.gguf"), "block": 8, "p_min": "0"}
    rows = bench.e2e_rows(args, 1, [], {})
    assert [r.key for r in rows] == ["ours-ar", "llama-ar"]
