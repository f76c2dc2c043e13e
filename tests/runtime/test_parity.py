"""Named tensors and the parity tool (dflash_gguf.tools.parity) against llama.cpp's
llama-eval-callback, on tiny seeded qwen2, qwen3, qwen35 and gemma3 checkpoints converted
by our converter (and, marked real, the published Gemma 3 270M): our dump names every
layer's tensors as llama.cpp does, naming changes no logit, every tensor both print
agrees within the tool's tolerance, and a deliberately perturbed run is reported as
diverging at the first tensor the perturbation reaches."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from helpers.fixtures import make_qwen2, make_qwen3, make_qwen35, missing_oracle
from helpers.gemma3_fixtures import make_gemma3

from dflash_gguf.tools import llama_cpp_tree
from dflash_gguf.tools import parity
from dflash_gguf.runtime.native import DflashError
from dflash_gguf.runtime.target import DECODE, LOGITS_ALL, LOGITS_LAST, Rows, Target, TargetConfig

PROMPT = "def add(a, b):\n    return a + b"
# llama.cpp's names of each layer's tensors (src/models/qwen2.cpp, qwen3.cpp, qwen35.cpp)
DENSE = ("attn_norm", "Qcur", "Kcur", "Vcur", "kqv_out", "ffn_inp", "ffn_norm", "ffn_out", "l_out")
QWEN35_ATTENTION = ("attn_norm", "Qcur_normed", "Kcur_normed", "Qcur", "Kcur", "Vcur", "attn_pregate", "gate_sigmoid",
                    "attn_gated", "attn_output", "attn_residual", "attn_post_norm", "ffn_out", "l_out")
QWEN35_RECURRENT = ("attn_norm", "z", "beta_sigmoid", "alpha", "a_softplus", "gate", "conv_output_silu", "final_output",
                    "linear_attn_out", "attn_residual", "attn_post_norm", "ffn_out", "l_out")
# src/models/gemma3.cpp: every layer's, local or global
GEMMA3 = ("attn_norm", "Qcur_normed", "Kcur_normed", "Qcur", "Kcur", "Vcur", "kqv_out", "attn_post_norm", "sa_out",
          "ffn_norm", "ffn_out", "ffn_post_norm", "l_out")
# arch: (maker, its arguments, the names of each layer, llama.cpp's first named tensor)
ARCHS = {
    "qwen3": (make_qwen3, dict(layers=3), [DENSE + ("Qcur_normed", "Kcur_normed")] * 3, "attn_norm-0"),
    "qwen2": (make_qwen2, dict(layers=3), [DENSE] * 3, "attn_norm-0"),
    # transformers' default pattern: layer 3 is full attention, the others Gated DeltaNet
    "qwen35": (make_qwen35, dict(layers=4), [QWEN35_RECURRENT] * 3 + [QWEN35_ATTENTION], "attn_norm-0"),
    # layer 5 global, the others local with a window of 8 that PROMPT exceeds; the scaled
    # embedding is named
    "gemma3": (make_gemma3, dict(layers=6), [GEMMA3] * 6, "inp_scaled"),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory, convert_model):
    maker, kwargs, names, first = ARCHS[request.param]
    d = maker(tmp_path_factory.mktemp("parity") / request.param, seed=3, **kwargs)
    return {"gguf": convert_model(d, "f32"), "names": names, "first": first, "arch": request.param}


@pytest.fixture
def gguf(arch):
    return arch["gguf"]


def built(name: str):
    """A tool of the llama.cpp build (a missing one is a missing oracle)."""
    exe = llama_cpp_tree.tool(name)
    if exe is None:
        missing_oracle(f"{name} (python scripts/llama_cpp_build.py {name})")
    return exe


@pytest.fixture(scope="module")
def tool():
    return built(parity.TOOL)


def test_dump_names_every_layer(arch):
    tokens = [5, 17, 300, 42, 9, 77, 128]
    dump = parity.run_ours(arch["gguf"], tokens, threads=2)
    for il, names in enumerate(arch["names"]):
        for name in names:
            assert f"{name}-{il}" in dump, f"{name}-{il} missing from the dump"
        assert dump[f"attn_norm-{il}"]["ne"][:2] == [128, len(tokens)]
        if "Qcur" in names:
            assert dump[f"Qcur-{il}"]["ne"][1:3] == [4, len(tokens)]  # [head, heads, tokens]
    assert dump["inp_embd"]["ne"][:2] == [128, len(tokens)]
    # the last layer's FFN runs on the row with logits alone where llama.cpp's does (inp_out_ids)
    last = len(arch["names"]) - 1
    cut = arch["arch"] != "qwen35"
    assert dump["ffn_out-0"]["ne"][1] == len(tokens) and dump[f"ffn_out-{last}"]["ne"][1] == (1 if cut else len(tokens))
    assert dump["result_norm"]["ne"][:2] == [128, 1]
    assert np.all(np.isfinite(dump["result_output"]["values"]))


def test_one_row_equals_row_0_of_eight_at_every_named_tensor(arch):
    """The parity tool's batch-invariance mode (--rows): every named tensor of a one-row
    pass equals row 0 of an eight-row pass bit for bit (f32 weights: stock ggml took
    llamafile's sgemm for 2+ rows and vec_dot for one, and this named the first Qcur)."""
    result = parity.row_parity(arch["gguf"], PROMPT, 8, threads=2)
    assert result["n_compared"] >= 3 * 5, result["n_compared"]
    assert result["first_divergence"] is None, parity.row_summary(result)


def test_dump_changes_no_logit(gguf, monkeypatch, tmp_path):
    tokens = [5, 17, 300, 42]

    def logits():
        with Target(str(gguf), TargetConfig(n_ctx=64, n_threads=2)) as t:
            t.prefill(tokens, LOGITS_LAST)
            return t.logits(0, 1)[0].copy()

    plain = logits()
    monkeypatch.setenv("DFLASH_DUMP_TENSORS", ".")
    monkeypatch.setenv("DFLASH_DUMP_FILE", str(tmp_path / "d.bin"))
    assert np.array_equal(logits(), plain)


def test_the_output_rows_cut_keeps_the_logits(gguf):
    """A pass whose last layer's FFN runs on the rows with logits alone (a prompt: its last
    row; two sequences' prompts in one pass: each one's last, gathered) gives those rows'
    logits as a pass of every row does."""
    a, b = [5, 17, 300, 42, 9, 77, 128], [8, 31, 2, 250]
    with Target(str(gguf), TargetConfig(n_ctx=64, n_threads=2, n_seq=2)) as t:
        t.step([Rows(0, DECODE, a, logits=LOGITS_ALL), Rows(1, DECODE, b, logits=LOGITS_ALL)])
        every = t.logits(0, len(a) + len(b))
        t.reset()
        t.step([Rows(0, DECODE, a, logits=LOGITS_LAST), Rows(1, DECODE, b, logits=LOGITS_LAST)])
        cut = t.logits(0, 2)
    want = every[[len(a) - 1, len(a) + len(b) - 1]]
    np.testing.assert_allclose(cut, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_dump_settings_fail_clearly(gguf, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_DUMP_TENSORS", "l_out-(")
    monkeypatch.setenv("DFLASH_DUMP_FILE", str(tmp_path / "d.bin"))
    with pytest.raises(DflashError, match="invalid regular expression"):
        Target(str(gguf), TargetConfig(n_ctx=64))
    monkeypatch.setenv("DFLASH_DUMP_TENSORS", "l_out")
    monkeypatch.delenv("DFLASH_DUMP_FILE")
    with pytest.raises(DflashError, match="DFLASH_DUMP_FILE"):
        Target(str(gguf), TargetConfig(n_ctx=64))


def test_parity_with_llama_cpp(arch, tool):
    result = parity.parity(arch["gguf"], PROMPT, threads=2, tool=tool)
    compared = {r["name"]: r for r in result["tensors"] if "max_abs_diff" in r}
    for il, names in enumerate(arch["names"]):
        for name in names:
            assert f"{name}-{il}" in compared, f"{name}-{il} not compared: {result['tensors']}"
    assert {"result_norm", "result_output"} <= set(compared)
    assert result["first_divergence"] is None, parity.summary(result)
    assert json.loads(parity.to_json(result)) == json.loads(json.dumps(result))
    # llama.cpp prints four decimals (a rounding of up to 5e-5): the tiny f32 models agree
    # to its printing (measured: under 5.1e-5 on every tensor), and so do the whole sums
    assert result["max_abs_diff"] < 2e-4, parity.summary(result)
    assert result["max_sum_rel_diff"] < 1e-4, parity.summary(result)


def test_perturbed_token_diverges_at_the_first_norm(arch, tool):
    tokens, _, _ = parity.run_llama(arch["gguf"], PROMPT, 2, tool)
    other = list(tokens)
    other[0] = (other[0] + 1) % 1000
    result = parity.parity(arch["gguf"], PROMPT, threads=2, our_tokens=other, tool=tool)
    # the embedding lookup is not a named node in llama.cpp's graph: its first named one is
    # (Gemma's scaled embedding, else the first layer's norm)
    assert result["first_divergence"] == arch["first"], parity.summary(result)


def test_truncated_log_compares_what_both_have(gguf, tool):
    """llama.cpp's logger may lose the tail of its output at exit: a tensor cut off inside
    its values is skipped, the ones before it are still compared, and the lost ones are
    not an error."""
    text = parity.llama_log(gguf, PROMPT, 2, tool)
    start = text.index("attn_norm-1 = ")
    second_row = text.index("],\n", text.index("],\n", start) + 3)  # after two rows of values
    tokens, theirs = parity.parse_eval_callback(text[:second_row + 3])
    result = parity.compare(parity.run_ours(gguf, tokens, threads=2), theirs)
    rows = {r["name"]: r for r in result["tensors"]}
    assert "truncated" in rows["attn_norm-1"]["skipped"]
    assert "l_out-1" not in rows and "result_output" not in rows
    assert rows["l_out-0"]["ok"] and result["first_divergence"] is None


def test_printed_indices_follow_llama_cpps_layout():
    assert parity.printed_indices((2, 3, 1, 1)) == list(range(6))
    idx = parity.printed_indices((8, 1, 1, 1))
    assert idx == [0, 1, 2, 5, 6, 7]
    assert len(parity.printed_indices((128, 4, 7, 1))) == 6 * 4 * 6


def test_dflash_run_dump_flags(gguf, tmp_path, capsys):
    from dflash_gguf.cli import main

    path = tmp_path / "dump.bin"
    assert main(["-m", str(gguf), "-p", PROMPT, "-n", "2", "-t", "2", "--dump-tensors", "^l_out-",
                 "--dump-file", str(path)]) == 0
    dump = parity.read_dump(path)
    assert "l_out-0" in dump and "attn_norm-0" not in dump
    n_prompt = dump["l_out-0"]["ne"][1]
    assert n_prompt > 1  # the prompt pass, not a later decode step
    with pytest.raises(SystemExit):
        main(["-m", str(gguf), "-p", PROMPT, "--dump-tensors", "l_out"])
    assert "--dump-file" in capsys.readouterr().err


# the mixture-of-experts layers, as llama.cpp names them (src/models/openai-moe.cpp,
# qwen35moe.cpp): gpt-oss's every layer, Qwen3.5 MoE's FFN after its mixer (qwen35's names)
GPTOSS = ("attn_norm", "Qcur", "Kcur", "Vcur", "attn_out", "ffn_inp", "attn_post_norm", "ffn_moe_out", "l_out")
QWEN35MOE_FFN = ("attn_residual", "attn_post_norm", "ffn_moe_out", "ffn_shexp", "shared_expert_gate_sigmoid",
                 "ffn_shexp_gated", "ffn_out", "l_out")


def _moe(kind: str, root, convert_model) -> dict:
    from helpers.fixtures import make_qwen35moe
    from helpers.gptoss_fixtures import make_gptoss

    if kind == "gpt-oss":
        return {"gguf": convert_model(make_gptoss(root / "gptoss", seed=3), "f32"), "names": [GPTOSS] * 4}
    return {"gguf": convert_model(make_qwen35moe(root / "qwen35moe", seed=3), "f32"), "names": [QWEN35MOE_FFN] * 4}


@pytest.fixture(scope="module", params=["gpt-oss", "qwen35moe"])
def moe(request, tmp_path_factory, convert_model):
    return _moe(request.param, tmp_path_factory.mktemp("parity-moe"), convert_model)


def test_moe_graphs_name_every_layer_and_each_named_row_is_batch_invariant(moe):
    """The MoE graphs name their tensors as llama.cpp does, and every named tensor of a
    one-row pass equals row 0 of an eight-row pass bit for bit (routing included)."""
    tokens = [5, 17, 300, 42, 9, 77, 128]
    dump = parity.run_ours(moe["gguf"], tokens, threads=2)
    for il, names in enumerate(moe["names"]):
        for name in names:
            assert f"{name}-{il}" in dump, f"{name}-{il} missing from the dump"
    result = parity.row_parity(moe["gguf"], PROMPT, 8, threads=2)
    assert result["n_compared"] >= 3 * len(moe["names"][0]), result["n_compared"]
    assert result["first_divergence"] is None, parity.row_summary(result)


def test_qwen35moe_parity_with_llama_cpp(tmp_path, convert_model, tool):
    """Qwen3.5 MoE's named tensors against llama.cpp's (gpt-oss's YaRN correction range is
    rounded by llama.cpp and not by this fixture: tests/runtime/test_gptoss.py compares a
    rounded checkpoint's tokens)."""
    moe = _moe("qwen35moe", tmp_path, convert_model)
    result = parity.parity(moe["gguf"], PROMPT, threads=2, tool=tool)
    compared = {r["name"] for r in result["tensors"] if "max_abs_diff" in r}
    for il, names in enumerate(moe["names"]):
        assert {f"{name}-{il}" for name in names} <= compared, result["tensors"]
    assert result["first_divergence"] is None, parity.summary(result)


# llama.cpp's names of a DFlash drafter's tensors (src/models/dflash.cpp): the target's
# features as each layer's keys and values, then the block's rows
DFLASH_CONTEXT = ("Kcur_injected", "Vcur_injected")
DFLASH_ROWS = ("noise_norm", "Qcur", "Kcur", "Vcur", "attn_out", "ffn_inp", "ffn_norm", "ffn_out", "l_out")


def test_a_dflash_drafters_dump_names_its_tensors_as_llama_cpp(monkeypatch, tmp_path):
    """A drafter's first graph with a matching name goes to DFLASH_DUMP_DRAFT_FILE (the
    target's, to DFLASH_DUMP_FILE when set): the bundled DFlash drafter names the context's
    keys and values and the block's rows as llama.cpp's dflash graph does, and dumping
    changes no token."""
    from dflash_gguf.runtime.demo import demo_paths
    from dflash_gguf.engine.engine import Engine

    target, draft = demo_paths()

    def tokens():
        with Engine(target, draft, n_ctx=256, n_threads=2, kv_type="f32") as engine:
            return engine.generate(PROMPT, 8, stop_tokens=()).tokens

    want = tokens()
    dumps = {}
    for part, pattern in (("context", "injected|inp_g_embeddings"),
                          ("rows", "^(inp_noise_embd|noise_norm|Qcur|Kcur-|Vcur-|attn_out|ffn_|l_out|result_)")):
        monkeypatch.setenv("DFLASH_DUMP_TENSORS", pattern)
        monkeypatch.setenv("DFLASH_DUMP_DRAFT_FILE", str(tmp_path / f"{part}.bin"))
        assert tokens() == want
        dumps[part] = parity.read_dump(tmp_path / f"{part}.bin")
    n_layer = sum(1 for name in dumps["rows"] if re.fullmatch(r"l_out-\d+", name))
    assert n_layer >= 1 and "inp_g_embeddings" in dumps["context"]
    assert {"inp_noise_embd", "result_norm", "result_output"} <= set(dumps["rows"])
    for il in range(n_layer):
        assert {f"{n}-{il}" for n in DFLASH_CONTEXT} <= set(dumps["context"]), sorted(dumps["context"])
        assert {f"{n}-{il}" for n in DFLASH_ROWS} <= set(dumps["rows"]), sorted(dumps["rows"])


# llama.cpp's names of the MTP layer's tensors (qwen35.cpp) and of the EAGLE3 layer's
# (eagle3.cpp), layer-numbered as there: those every graph of the drafter computes (the
# context entries' keys and values need them), and those only a graph of drafted rows does
DRAFTER_NAMES = {
    "mtp": (("mtp_enorm", "mtp_hnorm", "mtp_concat", "mtp_eh_proj", "mtp_attn_norm", "mtp_Kcur_normed", "mtp_Vcur"),
            ("mtp_Qcur_full", "mtp_gate", "mtp_Qcur_normed", "mtp_attn_pregate", "mtp_attn_out", "mtp_attn_residual",
             "mtp_attn_post_norm", "mtp_ffn_out", "mtp_post_ffn")),
    "eagle3": (("embd_norm", "g_norm", "concat_embd", "Kcur", "Vcur", "Kcur_rope"),
               ("Qcur", "Qcur_rope", "ffn_inp", "post_attn_norm", "ffn_out", "eagle3_prenorm")),
}


@pytest.mark.parametrize("kind", sorted(DRAFTER_NAMES))
def test_mtp_and_eagle3_drafters_name_their_tensors_as_llama_cpp(kind, monkeypatch, tmp_path):
    """The bundled target's MTP layer and the bundled EAGLE3 drafter name their graphs'
    tensors as llama.cpp's graphs do, and dumping changes no token."""
    from dflash_gguf.runtime.demo import DATA, demo_paths
    from dflash_gguf.engine.engine import Engine

    target, _ = demo_paths()
    draft, spec_type = (None, "draft-mtp") if kind == "mtp" else (str(DATA / "demo-eagle3.gguf"), "draft-eagle3")

    def tokens():
        with Engine(target, draft, n_ctx=256, n_threads=2, kv_type="f32", spec_type=spec_type) as engine:
            return engine.generate(PROMPT, 8, stop_tokens=()).tokens

    want = tokens()
    every, rows = DRAFTER_NAMES[kind]
    names = set()
    # the first graph a pattern matches is dumped: the rows' names alone reach a graph of rows
    for part, wanted in (("every", every + rows), ("rows", rows)):
        monkeypatch.setenv("DFLASH_DUMP_TENSORS", "^(" + "|".join(wanted + ("result_", "h_nextn")) + ")")
        monkeypatch.setenv("DFLASH_DUMP_DRAFT_FILE", str(tmp_path / f"{part}.bin"))
        assert tokens() == want
        names |= set(parity.read_dump(tmp_path / f"{part}.bin"))
    layers = {m.group(1) for m in (re.fullmatch(r".+-(\d+)", n) for n in names) if m}
    assert len(layers) == 1, sorted(names)
    il = layers.pop()
    assert {f"{n}-{il}" for n in every + rows} <= names, sorted(names)
    assert {"result_output", "h_nextn" if kind == "mtp" else "result_norm"} <= names, sorted(names)


@pytest.fixture(scope="module")
def draft_tool():
    from dflash_gguf.tools import parity_draft

    return built(parity_draft.TOOL)


def demo_drafter(kind: str, tmp_path) -> tuple:
    """(target, drafter or None, tokens per draft) of the bundled pair for a drafter kind."""
    from dflash_gguf.runtime.demo import DATA, demo_paths
    from dflash_gguf.tools.demo_dspark import make_dspark

    target, draft = demo_paths()
    if kind == "draft-dspark":
        return target, str(make_dspark(tmp_path / "dspark.gguf", seed=7)), 7
    return target, {"draft-dflash": draft, "draft-eagle3": str(DATA / "demo-eagle3.gguf"), "draft-mtp": None}[kind], \
        {"draft-dflash": 7, "draft-eagle3": 3, "draft-mtp": 3}[kind]


@pytest.mark.parametrize("kind", ["draft-dflash", "draft-dspark", "draft-eagle3", "draft-mtp"])
def test_drafters_tensors_equal_llama_cpps(kind, draft_tool, tmp_path):
    """Each drafter kind tensor by tensor against llama.cpp's own graph of it
    (dflash-draft-eval, dflash_gguf.tools.parity_draft): the prompt's pass (a DFlash drafter's
    keys and values of the target's features, an EAGLE3 drafter's encoder, the MTP
    layer's cache) and every drafted token's graph (one block for DFlash and DSpark, one
    graph per token for EAGLE3 and MTP, which ours runs as one), every tensor both name
    within the tool's tolerance (measured: 5.0e-5 at most, llama.cpp's printing)."""
    from dflash_gguf.tools import parity_draft

    target, draft, n_max = demo_drafter(kind, tmp_path)
    result = parity_draft.draft_parity(target, draft, kind, PROMPT, n_max, threads=2, tool=draft_tool)
    report = parity_draft.summary(result)
    assert result["first_divergence"] is None, report
    assert result["first_token_ours"] == result["first_token_llama"], report
    drafts = [p for p in result["phases"] if p.startswith("draft ")]
    assert len(drafts) == (1 if kind in ("draft-dflash", "draft-dspark") else n_max), report
    for phase, r in result["phases"].items():
        assert r["n_compared"] >= 5 and r["max_abs_diff"] < 2e-4, (phase, report)
        assert not [t for t in r["tensors"] if "skipped" in t], (phase, report)


def test_a_perturbed_drafter_run_diverges_where_the_prompt_reaches_it(draft_tool, tmp_path):
    """Our side fed another first token: the DFlash drafter's first tensor, the target's
    features of the prompt, is named as the divergence."""
    from dflash_gguf.tools import parity_draft

    target, draft, n_max = demo_drafter("draft-dflash", tmp_path)
    tokens = parity_draft.llama_phases(parity_draft.llama_draft_log(target, draft, "draft-dflash", PROMPT, n_max, 2,
                                                                    tool=draft_tool))[0]
    other = [(tokens[0] + 1) % 1000, *tokens[1:]]
    result = parity_draft.draft_parity(target, draft, "draft-dflash", PROMPT, n_max, threads=2, tool=draft_tool,
                                       our_tokens=other)
    assert result["first_divergence"] == "prompt: inp_g_embeddings", parity_draft.summary(result)


# in a process of its own: RPC devices stay registered for the life of a process
_DEVICE_WORKER = """
import json, sys
import numpy as np
from dflash_gguf.tools import parity
from dflash_gguf.runtime.devices import add_rpc_server
gguf, endpoint = sys.argv[1:3]
tokens = [5, 17, 300, 42, 9]
cpu = parity.run_ours(gguf, tokens, threads=2)
add_rpc_server(endpoint)
rpc = parity.run_ours(gguf, tokens, threads=2, device="RPC0")
print(json.dumps({n: None if n not in rpc or rpc[n]["ne"] != t["ne"]
                  else float(np.abs(rpc[n]["values"] - t["values"]).max()) for n, t in cpu.items()}))
"""


def test_dump_reads_a_device(gguf):
    """The dump reads tensors with ggml_backend_tensor_get, so a device's (the ggml RPC
    backend, our stand-in for a GPU, serving the CPU's kernels) dumps the CPU's values."""
    import subprocess
    import sys

    from helpers.rpc_local import local_rpc_server

    for endpoint in local_rpc_server():
        out = subprocess.run([sys.executable, "-c", _DEVICE_WORKER, str(gguf), endpoint], capture_output=True,
                             text=True, timeout=300, cwd="/")  # not the source tree: the installed package
    assert out.returncode == 0, out.stderr[-2000:]
    diffs = json.loads(out.stdout.strip().splitlines()[-1])
    assert "l_out-0" in diffs and "result_output" in diffs
    assert all(d is not None and d <= 1e-5 for d in diffs.values()), diffs


@pytest.mark.real
def test_parity_of_the_published_gemma3_270m(real_path, tool):
    """The published Gemma 3 270M Q4_K_M (its Q4_K, Q5_0, Q6_K and Q8_0 matrices, a
    262,144-row tied head) against llama.cpp tensor by tensor: every layer's names
    compared, all within llama.cpp's printing (measured: 5.0e-5 at most over 237 tensors,
    results/parity-2026-11-25-gemma-3-270m.json.gz). Before the two fixes it found (the
    query scale's place, ggml's GELU: docs/parity.md) it diverged at Qcur_normed-1 and
    was 0.65 apart in the logits."""
    result = parity.parity(real_path("gemma-3-270m"), "def quicksort(arr):", threads=2, tool=tool)
    compared = {r["name"] for r in result["tensors"] if "max_abs_diff" in r}
    assert {f"{name}-{il}" for il in range(18) for name in GEMMA3} <= compared
    assert {"inp_scaled", "result_norm", "result_output"} <= compared
    assert result["first_divergence"] is None, parity.summary(result)
    assert result["max_abs_diff"] < 2e-4, parity.summary(result)
