"""The EAGLE3 drafter (csrc/models/eagle3.c): llama.cpp's eagle3 GGUF drafting for its
target autoregressively, one pass per draft, every pass in one graph.

Oracles: the head as transformers runs its parts (Llama attention, rotary embedding,
RMSNorm, MLP) with speculators' glue, over transformers' target features; llama.cpp's draft-eagle3 through llama-speculative-simple on the same GGUFs (the
drafts it makes: its drafted and accepted counts, on the bundled trained head, whose
drafts are right often enough for the counts to say something); the target's own plain
greedy and sampled output; the pairing keys the converter writes (tests/convert/test_convert_eagle3.py
checks them against llama.cpp's converter)."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.engine.engine import Engine
from dflash_gguf.runtime.target import Target, TargetConfig

from helpers.decoding_checks import our_draft_mtp
from helpers.paths import ROOT, TESTS

RUN = str(Path(sys.executable).with_name("dflash-run"))
DATA = ROOT / "dflash_gguf" / "data"
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


# ---- the head against transformers -------------------------------------------------------

DEMO_HF = TESTS / "data" / "demo-hf" / "target"


class ReferenceEagle3:
    """A speculators EAGLE3 checkpoint in torch: transformers' own Llama attention (its
    q/k/v projections reading twice the width, as speculators builds its layer), rotary
    embedding, RMSNorm and MLP with the checkpoint's weights; the glue around them as
    speculators' Eagle3DraftModel defines it (fc over three target layers' hidden states,
    RMSNormed first with norm_before_fc,
    [input_layernorm(embed(token)); hidden_norm(h)], the residual h or its norm, the final
    norm, lm_head over the draft vocabulary, d2t offsets to target ids). Target features
    from transformers' Qwen3.5 (hidden_states[L]; L = n_layer: the final-normed state).
    A row at position p pairs the token at p + 1 with g of p, as speculators trains it."""

    def __init__(self, draft_dir: Path):
        import json

        import torch
        from safetensors.torch import load_file
        from transformers import LlamaConfig, Qwen3_5ForCausalLM
        from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaMLP, LlamaRMSNorm,
                                                              LlamaRotaryEmbedding)

        self.torch = torch
        self.target = Qwen3_5ForCausalLM.from_pretrained(str(DEMO_HF), dtype=torch.float32).eval()
        config = json.loads((draft_dir / "config.json").read_text())
        self.layers = config["eagle_aux_hidden_state_layer_ids"]
        self.norm_before_residual = config["norm_before_residual"]
        cfg = LlamaConfig(**config["transformer_layer_config"])
        cfg._attn_implementation = "eager"
        w = load_file(str(draft_dir / "model.safetensors"))
        E = cfg.hidden_size
        self.attn = LlamaAttention(cfg, 0).eval()
        for name in ("q_proj", "k_proj", "v_proj"):  # speculators' layer: q/k/v over [embedding; hidden]
            out = w[f"layers.0.self_attn.{name}.weight"].shape[0]
            setattr(self.attn, name, torch.nn.Linear(2 * E, out, bias=False))
        self.attn.load_state_dict({k[len("layers.0.self_attn."):]: v for k, v in w.items()
                                   if k.startswith("layers.0.self_attn.")})
        self.mlp = LlamaMLP(cfg).eval()
        self.mlp.load_state_dict({k[len("layers.0.mlp."):]: v for k, v in w.items() if k.startswith("layers.0.mlp.")})
        self.norms = {}
        for name, key in (("input", "layers.0.input_layernorm.weight"), ("hidden", "layers.0.hidden_norm.weight"),
                          ("post", "layers.0.post_attention_layernorm.weight"), ("final", "norm.weight")):
            self.norms[name] = LlamaRMSNorm(E, eps=cfg.rms_norm_eps)
            self.norms[name].weight.data = w[key].float()
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.fc, self.head = w["fc.weight"].float(), w["lm_head.weight"].float()
        self.fc_norm = None
        if config["norm_before_fc"]:  # RMSNorm over the concatenated features before fc
            self.fc_norm = LlamaRMSNorm(self.fc.shape[1], eps=cfg.rms_norm_eps)
            self.fc_norm.weight.data = w["input_norm.weight"].float()
        self.embed = w.get("embed_tokens.weight", self.target.model.embed_tokens.weight.detach()).float()
        V = self.target.config.vocab_size
        self.ids = torch.arange(self.head.shape[0]) + w["d2t"] if "d2t" in w else torch.arange(V)
        self.n_vocab = V

    def run(self, tokens, hidden):
        """Each row's output (before the final norm) and logits over the target's vocabulary."""
        torch = self.torch
        with torch.no_grad():
            e = self.norms["input"](self.embed[torch.tensor(tokens)])[None]
            h = self.norms["hidden"](hidden[None])
            n = len(tokens)
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            x = torch.cat([e, h], -1)
            y = (h if self.norm_before_residual else hidden[None]) + \
                self.attn(x, position_embeddings=self.rotary(x, pos), attention_mask=mask)[0]
            y = y + self.mlp(self.norms["post"](y))
            logits = torch.full((n, self.n_vocab), float("-inf"))
            logits[:, self.ids] = (self.norms["final"](y) @ self.head.T)[0]
            return y[0], logits

    def drafts(self, context, bonus, n):
        """n greedy drafts after `context` and `bonus`, and each pass's logits."""
        torch = self.torch
        with torch.no_grad():
            hs = self.target(torch.tensor([context]), output_hidden_states=True).hidden_states
            features = torch.cat([hs[L][0] for L in self.layers], -1)
            g = (self.fc_norm(features) if self.fc_norm is not None else features) @ self.fc.T
        tokens, hidden, logits = list(context[1:]) + [bonus], g, []
        for _ in range(n):
            y, out = self.run(tokens, hidden)
            logits.append(out[-1].numpy())
            tokens.append(int(out[-1].argmax()))
            hidden = torch.cat([hidden, y[-1:]])
        return tokens[len(context):], np.stack(logits)


@pytest.fixture(scope="module")
def random_heads(tmp_path_factory, convert_model):
    """The demo target in f32, and two random EAGLE3 heads for it: one with a draft
    vocabulary (d2t), its own embedding and the final-normed state among its features;
    one over the target's vocabulary with the target's embedding and LM head, RMSNorm
    before fc and the normed residual."""
    from helpers.eagle3_fixtures import make_eagle3

    root = tmp_path_factory.mktemp("eagle3")
    target = str(convert_model(DEMO_HF, "f32"))
    heads = {
        "d2t": make_eagle3(root / "d2t", DEMO_HF, layer_ids=(1, 2, 4), draft_vocab=512, head_dim=64, seed=31),
        "plain": make_eagle3(root / "plain", DEMO_HF, layer_ids=(1, 3, 4), draft_vocab=None, own_embedding=False,
                             norm_before_fc=True, norm_before_residual=True, head_dim=64, seed=32),
    }
    return target, {name: (d, str(convert_model(d, "f32", "--target-model-dir", str(DEMO_HF))))
                    for name, d in heads.items()}


@pytest.mark.parametrize("head", ["d2t", "plain"])
def test_drafts_and_logits_match_transformers(random_heads, head):
    """Each pass's logits (over the target's vocabulary, -inf outside the draft's) and the
    greedy drafts equal the reference's: after a prompt taken in two chunks, and after a
    verify whose kept positions the next propose takes from the target's feature rows."""
    from helpers.decoding_checks import prefill, rel_err

    target_path, heads = random_heads
    draft_dir, draft_path = heads[head]
    ref = ReferenceEagle3(draft_dir)
    meta = read_draft_metadata(draft_path)
    target = Target(target_path, TargetConfig(n_ctx=256, n_ubatch=16, n_verify=16, kv_type="f32", n_threads=2,
                                              feature_layers=meta["target_layers"]))
    draft = Draft(draft_path, target, DraftConfig(kv_type="f32", top_k=4, block_size=4))
    prompt = list(np.random.default_rng(3).integers(1, 4000, 27))
    prefill(target, draft, prompt)
    bonus = int(target.choices(0, 1)[0])
    drafts = draft.propose(bonus)
    want, logits = ref.drafts(prompt, bonus, 3)
    got = draft.logits(0, 3)
    assert drafts == want
    assert np.array_equal(np.isinf(got), np.isinf(logits))
    assert rel_err(got[np.isfinite(got)], logits[np.isfinite(logits)]) < 1e-3
    target.verify([bonus] + drafts)
    kept, nxt = [bonus, drafts[0]], 7
    target.commit(2)
    drafts = draft.propose(nxt, tokens=kept)
    want, logits = ref.drafts(prompt + kept, nxt, 3)
    got = draft.logits(0, 3)
    assert drafts == want
    assert rel_err(got[np.isfinite(got)], logits[np.isfinite(logits)]) < 1e-3


# ---- llama.cpp's draft-eagle3 ---------------------------------------------------------------

def llama_draft_eagle3(text, n_predict, n_max, n_ctx):
    """llama-speculative-simple --spec-type draft-eagle3, greedy, p-min 0: its counts."""
    from helpers.speculative_simple import llama_speculative_simple

    return llama_speculative_simple(DEMO, text, n_predict, "draft-eagle3", n_max, draft=EAGLE3, n_ctx=n_ctx)


def test_drafted_and_accepted_counts_equal_llama_cpp():
    """The same steps as llama.cpp's draft-eagle3 on the same GGUFs draft the same tokens:
    its drafted and accepted counts, per prompt, on the trained head."""
    from dflash_gguf.bench.prompts import PROMPTS
    from dflash_gguf.runtime.tokenizer import Tokenizer

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


def test_auto_plain_stretches_are_the_plain_greedy_text(plain_text):
    """`--tree-budget auto` going plain for a stretch and drafting again: the drafter runs
    no graph over the stretch, catches up in the next propose, and the text is the
    target's own greedy text."""
    from helpers.decoding_checks import check_plain_steps
    from dflash_gguf.runtime.tokenizer import Tokenizer

    tok = Tokenizer(DEMO)
    target, draft = load(top_k=4)
    for text, want in zip(TEXTS, plain_text):
        check_plain_steps(target, draft, tok.encode(text), want, 6)


def test_sequences_in_a_batch_decode_as_alone(plain_text):
    """-np: sequences (a chain and a tree) in one drafter graph and one target graph per
    step, joining at different rounds: each gets its solo greedy text."""
    from helpers.decoding_checks import batch_outputs
    from dflash_gguf.decoding.step import Sequence
    from dflash_gguf.decoding.requests import GenerationStats, Placement, Request
    from dflash_gguf.speculation.drafting import chain_proposer, tree_proposer
    from dflash_gguf.runtime.tokenizer import Tokenizer

    tok = Tokenizer(DEMO)
    target, draft = load(n_seq=2, top_k=6)
    proposers = [chain_proposer(target, draft, None, None), tree_proposer(target, draft, 6, None)]
    seqs = [Sequence(target, draft, p, Request(tok.encode(text), 40, ()), GenerationStats(), Placement(slot=i))
            for i, (p, text) in enumerate(zip(proposers, TEXTS))]
    outs = batch_outputs(target, draft, seqs, join_every=3)
    assert outs == plain_text[:2]


def test_sampled_chain_keeps_the_targets_distribution():
    """Sampled continuations with the EAGLE3 drafter's greedy drafts (kept by the argmax
    rule) are distributed as the target's own sampling (test_sampling's chi-square test)."""
    from dflash_gguf.runtime.tokenizer import Tokenizer
    from helpers.sampling_checks import SETTINGS, chi2_critical, chi2_stat, exact_joint, run_mode

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

    from dflash_gguf.runtime.tokenizer import Tokenizer

    res = subprocess.run([RUN, "-m", DEMO, "-md", EAGLE3, "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3",
                          "-p", TEXTS[0], "-n", "40", "-t", "2", "--json"], capture_output=True, text=True,
                         timeout=300, env={**os.environ})
    assert res.returncode == 0, res.stderr
    text = res.stdout.rstrip("\n")
    assert len(text) > 20 and Tokenizer(DEMO).decode(plain_text[0]).startswith(text)
    report = json.loads(res.stderr.strip().splitlines()[-1])
    assert report["mode"] == "eagle3 chain" and report["mean_accepted_length"] > 1.3


def test_the_server_drafts_with_eagle3_over_slots(tmp_path, plain_text):
    """dflash-server -np 2 -md eagle3.gguf: concurrent clients each get the plain greedy
    text, several tokens a step."""
    from dflash_gguf.runtime.tokenizer import Tokenizer
    from helpers.servers import ServerProcess

    server = ServerProcess(tmp_path, "-m", DEMO, "-md", EAGLE3, "-c", "1024", "-np", "2", "-t", "2", "-ctk", "f32")
    answers = server.greedy_texts(TEXTS, 40)
    tok = Tokenizer(DEMO)
    assert [a["choices"][0]["text"] for a in answers] == [tok.decode(t) for t in plain_text]
    assert all(a["dflash"]["mean_accepted_length"] > 1.3 for a in answers)


def test_the_benchmark_runs_llama_cpps_eagle3_beside_ours(tmp_path):
    """dflash-bench -md eagle3.gguf: our EAGLE3 chain rows beside llama-speculative-simple
    --spec-type draft-eagle3 on the same drafter (the tools stood in for by test_bench's
    fakes); a drafter under another kind's --spec-type exits 2."""
    import json

    from helpers.bench_checks import bench, fake_tools

    tools = fake_tools(tmp_path)
    res = bench("-m", DEMO, "-md", EAGLE3, "--spec-type", "draft-eagle3", "--modes", "chain", "--temp", "0",
                "--llama-cpp", str(tools), "--spec-draft-p-min", "0", "--spec-draft-n-max", "3", "-r", "1", "--json",
                cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    calls = [json.loads(line) for line in (tools / "calls.jsonl").read_text().splitlines()]
    spec = [c for c in calls if c[0].endswith("llama-speculative-simple")]
    assert spec and all(c[c.index("--spec-type") + 1] == "draft-eagle3" and c[c.index("-md") + 1] == EAGLE3
                        for c in spec)
    modes = {r["mode"] for r in out["rows"]}
    assert "chain p-min 0 n-max 3" in modes and "EAGLE3 (llama-speculative-simple, p-min 0, n-max 3)" in modes
    assert all(r["al"]["median"] > 1.3 for r in out["rows"] if r["engine"] == "ours")
    res = bench("-m", DEMO, "-md", EAGLE3, "--spec-type", "draft-dflash", "--no-llama-cpp", cwd=tmp_path)
    assert res.returncode == 2 and "is a eagle3 drafter (--spec-type draft-eagle3)" in res.stderr


# ---- bad input: one line --------------------------------------------------------------------

@pytest.fixture(scope="module")
def other_target(tmp_path_factory, convert_model):
    """A target of the demo's shape that is another model (its own tokenizer)."""
    from helpers.fixtures import make_qwen3

    return str(convert_model(make_qwen3(tmp_path_factory.mktemp("other") / "model", seed=5), "f32"))


@pytest.mark.parametrize("args,message", [
    (["-m", DEMO, "-md", EAGLE3, "--spec-type", "draft-dflash"],
     "is an EAGLE3 drafter, not a DFlash drafter (--spec-type draft-eagle3)"),
    (["-m", DEMO, "-md", str(DATA / "demo-draft.gguf"), "--spec-type", "draft-eagle3"],
     "is a DFlash drafter, not an EAGLE3 drafter (--spec-type draft-dflash)"),
    (["-m", DEMO, "--spec-type", "draft-eagle3"], "draft-eagle3 needs an EAGLE3 drafter (-md)"),
    (["-m", DEMO, "-md", EAGLE3, "--spec-type", "ngram-mod"], "is an EAGLE3 drafter (--spec-type draft-eagle3)"),
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
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "wrong target/drafter pair" in res.stderr and "demo-target" in res.stderr, res.stderr
    assert len([ln for ln in res.stderr.splitlines() if ln.strip()]) <= 2, res.stderr


@pytest.mark.parametrize("value,words", [(4096, "outside the target's vocabulary"), (None, "which another maps to")])
def test_a_bad_vocabulary_map_is_one_line(tmp_path, value, words):
    """d2t is bounded at load: an id outside the target's vocabulary, or two draft tokens
    on one target token, is refused by name (never an out-of-range scatter in the graph)."""
    import shutil

    from gguf import GGUFReader

    from dflash_gguf import DflashError

    bad = tmp_path / "bad-eagle3.gguf"
    shutil.copy(EAGLE3, bad)
    d2t = next(t for t in GGUFReader(EAGLE3).tensors if t.name == "d2t")
    ids = np.array(d2t.data, dtype=np.int64)
    ids[5] = ids[4] if value is None else value
    with open(bad, "r+b") as f:
        f.seek(d2t.data_offset)
        f.write(ids.tobytes())
    meta = read_draft_metadata(str(bad))
    target = Target(DEMO, TargetConfig(n_ctx=128, kv_type="f32", feature_layers=meta["target_layers"], n_threads=1))
    with pytest.raises(DflashError, match=f"d2t maps draft token 5 to .*{words}"):
        Draft(str(bad), target)

