"""The EAGLE3 drafter (csrc/models/eagle3.c): llama.cpp's eagle3 GGUF drafting for its
target autoregressively, one pass per draft, every pass in one graph.

Oracles: llama.cpp's draft-eagle3 through llama-speculative-simple on the same GGUFs (the
drafts it makes: its drafted and accepted counts, on the bundled trained head, whose
drafts are right often enough for the counts to say something); the target's own plain
greedy and sampled output; the pairing keys the converter writes (tests/test_convert_eagle3.py
checks them against llama.cpp's converter)."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dflash_gguf.draft import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.engine import Engine
from dflash_gguf.target import Target, TargetConfig
from test_mtp import our_draft_mtp

RUN = str(Path(sys.executable).with_name("dflash-run"))
DATA = Path(__file__).resolve().parents[1] / "dflash_gguf" / "data"
DEMO = str(DATA / "demo-target.gguf")
EAGLE3 = str(DATA / "demo-eagle3.gguf")

TEXTS = ["    def __init__(self, name):\n        self.name = name\n", "import os\n\n\ndef main():\n",
         "class Stack:\n    def push(self, item):\n"]


def load(n_drafts=3, top_k=4, n_seq=1, n_ctx=512):
    meta = read_draft_metadata(EAGLE3)
    cfg = TargetConfig(n_ctx=n_ctx, n_ubatch=32, n_verify=16, kv_type="f32", feature_layers=meta["target_layers"],
                       n_threads=2, n_seq=n_seq)
    t = Target(DEMO, cfg)
    return t, Draft(EAGLE3, t, DraftConfig(kv_type="f32", top_k=top_k, block_size=n_drafts + 1))


def test_metadata_and_kind():
    """The file describes itself as llama.cpp's converter and ours write it: three feature
    layers, no block of its own (the caller's drafts per step), the target it was made for."""
    meta = read_draft_metadata(EAGLE3)
    assert meta["kind"] == "eagle3" and meta["block_size"] == 0 and meta["target_layers"] == [1, 2, 3]
    assert meta["target"]["target_name"] == "demo-target"
    target, draft = load()
    assert draft.kind == "eagle3" and draft.reads_tokens and draft.greedy_only and draft.block_size == 4


# ---- llama.cpp's draft-eagle3 ---------------------------------------------------------------

def llama_draft_eagle3(text, n_predict, n_max, n_ctx):
    """llama-speculative-simple --spec-type draft-eagle3, greedy, p-min 0: its counts."""
    from dflash_gguf import llama_cpp_tree
    from dflash_gguf.bench.llama_cpp import parse_speculative, run_parsed
    from fixtures import missing_oracle

    exe = llama_cpp_tree.tool("llama-speculative-simple")
    if exe is None:
        missing_oracle("llama-speculative-simple is not built (.venv/bin/python scripts/llama_cpp_build.py "
                       "llama-speculative-simple)")
    cmd = [str(exe), "-m", DEMO, "-md", EAGLE3, "-c", str(n_ctx), "-n", str(n_predict), "-t", "1", "-tb", "1",
           "--temp", "0", "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(n_max), "--spec-draft-n-min", "0",
           "--spec-draft-p-min", "0", "-p", text]
    _, r = run_parsed(cmd, parse_speculative, "rounds")
    return r


def test_drafted_and_accepted_counts_equal_llama_cpp():
    """The same steps as llama.cpp's draft-eagle3 on the same GGUFs draft the same tokens:
    its drafted and accepted counts, per prompt, on the trained head."""
    from dflash_gguf.bench.prompts import PROMPTS
    from dflash_gguf.tokenizer import Tokenizer

    tok = Tokenizer(DEMO)
    target, draft = load(n_drafts=3, top_k=0)
    drafted = accepted = 0
    for _, text in PROMPTS[:3]:
        want = llama_draft_eagle3(text, 40, 3, 512)
        got = our_draft_mtp(target, draft, tok.encode(text), 40, 3, 512, tok.eog_ids)
        assert {k: got[k] for k in ("n_drafted", "n_accept", "n_predict")} == \
            {k: want[k] for k in ("n_drafted", "n_accept", "n_predict")}, text
        drafted, accepted = drafted + got["n_drafted"], accepted + got["n_accept"]
    assert accepted > drafted / 3  # a trained head: many drafts are right


# ---- decoding with it: chain, tree, -np, sampling, CLI --------------------------------------

@pytest.fixture(scope="module")
def plain_text():
    """Plain greedy tokens after each of TEXTS."""
    with Engine(DEMO, n_ctx=512, n_threads=2, kv_type="f32") as plain:
        return [plain.generate(text, 40, stop_tokens=()).tokens for text in TEXTS]


@pytest.mark.parametrize("options", [{}, {"tree_budget": 6}, {"spec_draft_n_max": 5, "draft_p_min": 0.0}])
def test_greedy_chain_and_tree_are_the_plain_greedy_text(plain_text, options):
    """The trained head's chain (cut by confidence, or whole), and trees of its per-pass
    top-K; the kind is picked from -md's architecture."""
    with Engine(DEMO, EAGLE3, n_ctx=512, n_threads=2, kv_type="f32", **options) as engine:
        assert engine.draft.kind == "eagle3"
        n = 1 if options.get("spec_draft_n_max") else len(TEXTS)
        for text, want in zip(TEXTS[:n], plain_text):
            got = engine.generate(text, 40, stop_tokens=())
            assert got.tokens == want
            assert got.stats.mean_accepted > 1.3


def test_sequences_in_a_batch_decode_as_alone(plain_text):
    """-np: sequences (a chain and a tree) in one drafter graph and one target graph per
    step, joining at different rounds: each gets its solo greedy text."""
    from dflash_gguf.decoding import Batch, Sequence
    from dflash_gguf.generate import GenerationStats
    from dflash_gguf.speculative import chain_proposer, tree_proposer
    from dflash_gguf.tokenizer import Tokenizer

    tok = Tokenizer(DEMO)
    target, draft = load(n_seq=2, top_k=6)
    proposers = [chain_proposer(target, draft, None, None), tree_proposer(target, draft, 6, None)]
    seqs = [Sequence(target, draft, p, tok.encode(text), 40, (), GenerationStats(), slot=i)
            for i, (p, text) in enumerate(zip(proposers, TEXTS))]
    batch, outs = Batch(target, draft), [[] for _ in seqs]
    for rnd in range(400):
        if rnd % 3 == 0 and rnd // 3 < len(seqs):
            batch.add(seqs[rnd // 3])
        for seq, new in batch.advance():
            assert seq.error is None, seq.error
            outs[seq.slot] += new
        if not len(batch):
            break
    assert outs == plain_text[:2]


def test_sampled_chain_keeps_the_targets_distribution():
    """Sampled continuations with the EAGLE3 drafter's greedy drafts (kept by the argmax
    rule) are distributed as the target's own sampling (test_sampling's chi-square test)."""
    from dflash_gguf.tokenizer import Tokenizer
    from test_sampling import SETTINGS, chi2_critical, chi2_stat, exact_joint, run_mode

    meta = read_draft_metadata(EAGLE3)
    target = Target(DEMO, TargetConfig(n_ctx=256, n_ubatch=64, n_verify=17, kv_type="f32", n_threads=1,
                                       feature_layers=meta["target_layers"]))
    draft = Draft(EAGLE3, target, DraftConfig(kv_type="f32", top_k=4))
    prompt = Tokenizer(DEMO).encode(TEXTS[0] + "        self.", add_bos=False)
    params, depth, n = SETTINGS["qwen"], 3, 1000
    exact = exact_joint(target, prompt, params, depth)
    counts = {}
    for seed in range(n):
        out = tuple(run_mode(target, draft, prompt, "chain", replace(params, seed=seed), depth))
        counts[out] = counts.get(out, 0) + 1
    stat, df = chi2_stat(counts, exact, n)
    assert df >= 4, "too few cells for the test to say anything"
    assert stat < chi2_critical(df), (stat, df)


def test_cli_drafts_with_the_eagle3_head(plain_text):
    """dflash-run -m target -md eagle3.gguf --spec-type draft-eagle3: the plain greedy text,
    several tokens a step; the mode names the drafter's kind."""
    import json

    from dflash_gguf.tokenizer import Tokenizer

    res = subprocess.run([RUN, "-m", DEMO, "-md", EAGLE3, "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3",
                          "-p", TEXTS[0], "-n", "40", "-t", "2", "--json"], capture_output=True, text=True,
                         timeout=300, env={**os.environ})
    assert res.returncode == 0, res.stderr
    text = res.stdout.rstrip("\n")
    assert len(text) > 20 and Tokenizer(DEMO).decode(plain_text[0]).startswith(text)
    report = json.loads(res.stderr.strip().splitlines()[-1])
    assert report["mode"] == "eagle3 chain" and report["mean_accepted_length"] > 1.3


# ---- bad input: one line --------------------------------------------------------------------

@pytest.fixture(scope="module")
def other_target(tmp_path_factory, convert_model):
    """A target of the demo's shape that is another model (its own tokenizer)."""
    from fixtures import make_qwen3

    return str(convert_model(make_qwen3(tmp_path_factory.mktemp("other") / "model", seed=5), "f32"))


@pytest.mark.parametrize("args,message", [
    (["-m", DEMO, "-md", EAGLE3, "--spec-type", "draft-dflash"], "is a eagle3 GGUF, not a DFlash drafter"),
    (["-m", DEMO, "-md", str(DATA / "demo-draft.gguf"), "--spec-type", "draft-eagle3"],
     "is a dflash GGUF, not an EAGLE3 drafter"),
    (["-m", DEMO, "--spec-type", "draft-eagle3"], "draft-eagle3 needs a drafter GGUF (-md)"),
    (["-m", DEMO, "-md", EAGLE3, "--spec-type", "draft-mtp"], "drop -md"),
    (["-m", DEMO, "-md", EAGLE3, "--spec-type", "draft-eagle3,draft-dflash"], "one drafter at a time"),
])
def test_wrong_kind_is_one_line(args, message):
    res = subprocess.run([RUN, *args, "-p", "hi", "-n", "4", "-t", "1"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr
    assert len([ln for ln in res.stderr.splitlines() if ln.strip()]) <= 2, res.stderr


def test_drafter_for_another_target_is_one_line(other_target):
    """An EAGLE3 drafter converted for another target: refused by its eagle3.target.* keys."""
    res = subprocess.run([RUN, "-m", other_target, "-md", EAGLE3, "-p", "hi", "-n", "4", "-t", "1"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "wrong target/drafter pair" in res.stderr and "demo-target" in res.stderr, res.stderr
    assert len([ln for ln in res.stderr.splitlines() if ln.strip()]) <= 2, res.stderr
