"""The MTP drafter (csrc/models/mtp.c): a Qwen3.5/3.6 GGUF's nextn layer drafting for the
model of its own file, autoregressively, one pass per draft, every pass in one graph.

Oracles: the MTP layer as transformers runs a Qwen3.5 decoder layer (its own
Qwen3_5DecoderLayer and RMSNorm over the checkpoint's mtp.* weights, the glue around it
as vLLM's Qwen3.5 MTP model defines it: fc over [enorm(embed(token)); hnorm(hidden)], the
final norm, the target's LM head); llama.cpp's draft-mtp through llama-speculative-simple
on the same GGUF (its drafted and accepted counts); and the target's own plain greedy
and sampled output."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.engine.engine import Engine
from dflash_gguf.runtime.target import Target, TargetConfig

from helpers.decoding_checks import our_draft_mtp, prefill, rel_err
from helpers.paths import ROOT

RUN = str(Path(sys.executable).with_name("dflash-run"))
DATA = ROOT / "dflash_gguf" / "data"
DEMO = str(DATA / "demo-target.gguf")


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    from helpers.fixtures import make_qwen35

    return make_qwen35(tmp_path_factory.mktemp("mtp") / "model", mtp_layers=1, seed=11)


@pytest.fixture(scope="module")
def mtp_gguf(mtp_dir, convert_model):
    return str(convert_model(mtp_dir, "f32"))


def load(path, n_drafts=3, top_k=4, n_seq=1, n_ctx=512, **target):
    meta = read_draft_metadata(path)
    cfg = TargetConfig(n_ctx=n_ctx, n_ubatch=32, n_verify=n_drafts + 1 if n_drafts >= 8 else 16, kv_type="f32",
                       feature_layers=meta["target_layers"], n_threads=2, n_seq=n_seq, **target)
    t = Target(path, cfg)
    return t, Draft(path, t, DraftConfig(kv_type="f32", top_k=top_k, block_size=n_drafts + 1))


# ---- the layer against transformers -------------------------------------------------------

class ReferenceMTP:
    """The checkpoint's MTP head in torch: transformers' own Qwen3.5 decoder layer and norms
    with the mtp.* weights, the target's embedding and LM head. A row at position q takes
    the token there and the target's final-normed hidden state at q - 1 (zero before the
    first), as llama.cpp pairs them; the whole sequence runs causally at once."""

    def __init__(self, model_dir: Path):
        import torch
        from safetensors.torch import load_file
        from transformers import AutoConfig, Qwen3_5ForCausalLM
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        self.torch = torch
        self.model = Qwen3_5ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        cfg = AutoConfig.from_pretrained(str(model_dir))
        cfg._attn_implementation = "eager"
        full = cfg.layer_types.index("full_attention")
        self.layer = Qwen3_5DecoderLayer(cfg, full).eval()
        mtp = load_file(str(model_dir / "model-mtp.safetensors"))
        self.layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in mtp.items()
                                    if k.startswith("mtp.layers.0.")})
        norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            norms[name] = Qwen3_5RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            norms[name].weight.data = mtp[f"mtp.{name}.weight"].float()
        self.norms = norms
        self.fc = mtp["mtp.fc.weight"].float()

    def hidden(self, tokens):
        """The target's final-normed hidden state at every position."""
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([tokens]), output_hidden_states=True)
        return out.hidden_states[-1][0]

    def run(self, tokens, hidden):
        """The head's normed output and logits at every row of (tokens[q], hidden[q])."""
        torch = self.torch
        with torch.no_grad():
            e = self.norms["pre_fc_norm_embedding"](self.model.model.embed_tokens(torch.tensor([tokens])))
            h = self.norms["pre_fc_norm_hidden"](hidden[None])
            x = torch.cat([e, h], -1) @ self.fc.T
            n = len(tokens)
            pos = torch.arange(n)[None]
            rope = self.model.model.rotary_emb(x, pos)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            y = self.norms["norm"](self.layer(x, position_embeddings=rope, attention_mask=mask, position_ids=pos))
            return y[0], self.model.lm_head(y)[0]

    def drafts(self, context, bonus, n):
        """n greedy drafts after `context` and `bonus`, and each pass's logits."""
        torch = self.torch
        h = self.hidden(context)
        tokens = list(context) + [bonus]
        hidden = torch.cat([torch.zeros(1, h.shape[1]), h])  # the hidden state before each position
        logits = []
        for _ in range(n):
            y, out = self.run(tokens, hidden)
            logits.append(out[-1].numpy())
            tokens.append(int(out[-1].argmax()))
            hidden = torch.cat([hidden, y[-1:]])
        return tokens[len(context) + 1:], np.stack(logits)


def test_drafts_and_logits_match_the_layer_in_transformers(mtp_dir, mtp_gguf):
    """Each pass's logits and the greedy drafts equal the reference's: after a prompt taken
    in two chunks (the drafter carrying the hidden state across them), and after a verify
    whose kept positions the next propose takes from the target's feature rows."""
    ref = ReferenceMTP(mtp_dir)
    target, draft = load(mtp_gguf)
    assert draft.kind == "mtp" and draft.reads_tokens and draft.greedy_only and draft.block_size == 4
    prompt = list(np.random.default_rng(3).integers(1, 400, 45))
    prefill(target, draft, prompt)
    bonus = int(target.choices(0, 1)[0])
    drafts = draft.propose(bonus)
    want, logits = ref.drafts(prompt, bonus, 3)
    assert drafts == want
    assert rel_err(draft.logits(0, 3), logits) < 1e-3
    # a verify of the block, two of its rows kept: the next block after them
    target.verify([bonus] + drafts)
    kept = [bonus, drafts[0]]
    nxt = 7
    target.commit(2)
    drafts = draft.propose(nxt, tokens=kept)
    want, logits = ref.drafts(prompt + kept, nxt, 3)
    assert drafts == want
    assert rel_err(draft.logits(0, 3), logits) < 1e-3


# ---- llama.cpp's draft-mtp ------------------------------------------------------------------

def llama_draft_mtp(path, text, n_predict, n_max, n_ctx):
    """llama-speculative-simple --spec-type draft-mtp, greedy, p-min 0: its counts."""
    from helpers.speculative_simple import llama_speculative_simple

    r = llama_speculative_simple(path, text, n_predict, "draft-mtp", n_max, n_ctx=n_ctx)
    assert not r["checkpoints"], "llama.cpp verified with checkpoints: its steps are not one draft each"
    return r


@pytest.mark.parametrize("which", ["trained", "random"])
def test_drafted_and_accepted_counts_equal_llama_cpp(which, mtp_gguf):
    """The same steps as llama.cpp's draft-mtp on the same GGUF draft the same tokens: its
    drafted and accepted counts, on the demo target's trained head and on a random one."""
    from dflash_gguf.bench.prompts import PROMPTS
    from dflash_gguf.runtime.tokenizer import Tokenizer

    path = DEMO if which == "trained" else mtp_gguf
    tok = Tokenizer(path)
    texts = [text for _, text in PROMPTS][1:3] if which == "trained" else ["The quick brown fox"]
    target, draft = load(path, n_drafts=3, n_ctx=512, top_k=0)
    drafted = accepted = 0
    for text in texts:
        want = llama_draft_mtp(path, text, 40, 3, 512)
        got = our_draft_mtp(target, draft, tok.encode(text), 40, 3, 512, tok.eog_ids)
        assert {k: got[k] for k in ("n_drafted", "n_accept", "n_predict")} == \
            {k: want[k] for k in ("n_drafted", "n_accept", "n_predict")}, text
        drafted, accepted = drafted + got["n_drafted"], accepted + got["n_accept"]
    if which == "trained":
        assert accepted > drafted / 2  # a trained head: most drafts are right


# ---- decoding with it: chain, tree, -np, checkpoints, CLI, server ---------------------------

TEXTS = ["    def __init__(self, name):\n        self.name = name\n", "import os\n\n\ndef main():\n",
         "class Stack:\n    def push(self, item):\n"]


@pytest.fixture(scope="module")
def plain_text():
    """Plain greedy tokens after each of TEXTS."""
    with Engine(DEMO, n_ctx=512, n_threads=2, kv_type="f32") as plain:
        return [plain.generate(text, 40, stop_tokens=()).tokens for text in TEXTS]


@pytest.mark.parametrize("options", [{}, {"tree_budget": 6}, {"spec_draft_n_max": 5, "draft_p_min": 0.0}])
def test_greedy_chain_and_tree_are_the_plain_greedy_text(plain_text, options):
    """The trained head's chain (cut by confidence, or whole), and trees of its per-pass
    top-K: the target's own greedy text, several tokens a step."""
    with Engine(DEMO, spec_type="draft-mtp", n_ctx=512, n_threads=2, kv_type="f32", **options) as engine:
        assert engine.draft.kind == "mtp"
        n = 1 if options.get("spec_draft_n_max") else len(TEXTS)
        for text, want in zip(TEXTS[:n], plain_text):
            got = engine.generate(text, 40, stop_tokens=())
            assert got.tokens == want
            assert got.stats.mean_accepted > 1.5


def test_auto_plain_stretches_are_the_plain_greedy_text(plain_text):
    """`--tree-budget auto` going plain for a stretch and drafting again: the drafter runs
    no graph over the stretch, catches up in the next propose, and the text is the
    target's own greedy text."""
    from helpers.decoding_checks import check_plain_steps
    from dflash_gguf.runtime.tokenizer import Tokenizer

    tok = Tokenizer(DEMO)
    target, draft = load(DEMO, n_seq=1, top_k=4)
    for text, want in zip(TEXTS, plain_text):
        check_plain_steps(target, draft, tok.encode(text), want, 6)


def test_sequences_in_a_batch_decode_as_alone(plain_text):
    """-np: three sequences (chains and a tree) in one MTP drafter graph and one target
    graph per step, joining at different rounds: each gets its solo greedy text."""
    from helpers.decoding_checks import batch_outputs
    from dflash_gguf.decoding.step import Sequence
    from dflash_gguf.decoding.requests import GenerationStats, Placement, Request
    from dflash_gguf.speculation.drafting import chain_proposer, tree_proposer
    from dflash_gguf.runtime.tokenizer import Tokenizer

    tok = Tokenizer(DEMO)
    target, draft = load(DEMO, n_seq=3, top_k=6)
    proposers = [chain_proposer(target, draft, None, None, p_min=0.3), tree_proposer(target, draft, 6, None),
                 chain_proposer(target, draft, None, None)]
    seqs = [Sequence(target, draft, p, Request(tok.encode(text), 40), GenerationStats(), Placement(slot=i))
            for i, (p, text) in enumerate(zip(proposers, TEXTS))]
    outs = batch_outputs(target, draft, seqs, join_every=3)
    assert outs == plain_text


def test_a_checkpoint_restores_the_drafters_carried_state():
    """A checkpoint holds the MTP layer's cache and the hidden state it carries: restored
    into a slot that held another text, it drafts what the original slot drafts."""
    from dflash_gguf.runtime.checkpoints import Checkpoint
    from dflash_gguf.runtime.tokenizer import Tokenizer

    tok = Tokenizer(DEMO)
    target, draft = load(DEMO, n_seq=2)
    prefill(target, draft, tok.encode(TEXTS[0]), seq=0)
    prefill(target, draft, tok.encode(TEXTS[1]), seq=1)
    saved = Checkpoint(target, draft, seq=0)
    bonus = int(target.choices(0, 1)[0])  # slot 1's, any token serves
    first = draft.propose(bonus, seq=0)
    logits = draft.logits(0, 3)
    saved.restore(target, draft, seq=1)
    assert draft.propose(bonus, seq=1) == first
    np.testing.assert_array_equal(draft.logits(0, 3), logits)
    saved.close()


def test_cli_drafts_with_the_models_own_mtp_layer(plain_text):
    """dflash-run -m <a GGUF with nextn layers> --spec-type draft-mtp: the plain greedy text
    (to the end of generation), several tokens a step; the mode names the drafter's kind."""
    import json

    from dflash_gguf.runtime.tokenizer import Tokenizer

    res = subprocess.run([RUN, "-m", DEMO, "--spec-type", "draft-mtp", "--spec-draft-n-max", "2", "-p", TEXTS[0],
                          "-n", "40", "-t", "2", "--json"], capture_output=True, text=True, timeout=300,
                         env={**os.environ})
    assert res.returncode == 0, res.stderr
    text = res.stdout.rstrip("\n")
    assert len(text) > 20 and Tokenizer(DEMO).decode(plain_text[0]).startswith(text)
    report = json.loads(res.stderr.strip().splitlines()[-1])
    assert report["mode"] == "mtp chain" and report["mean_accepted_length"] > 1.5


def test_the_server_drafts_with_mtp_over_slots(tmp_path, plain_text):
    """dflash-server -np 2 --spec-type draft-mtp: concurrent clients each get the plain
    greedy text, several tokens a step."""
    from helpers.servers import ServerProcess

    server = ServerProcess(tmp_path, "-m", DEMO, "-c", "1024", "-np", "2", "--spec-type", "draft-mtp", "-t", "2",
                           "-ctk", "f32")
    answers = server.greedy_texts(TEXTS, 40)
    from dflash_gguf.runtime.tokenizer import Tokenizer

    tok = Tokenizer(DEMO)
    assert [a["choices"][0]["text"] for a in answers] == [tok.decode(t) for t in plain_text]
    assert all(a["dflash"]["mean_accepted_length"] > 1.5 for a in answers)


def test_the_benchmark_runs_llama_cpps_mtp_beside_ours(tmp_path):
    """dflash-bench --spec-type draft-mtp: our MTP chain rows beside llama-speculative-simple
    --spec-type draft-mtp on the same GGUF, no -md on either side (the tools stood in for by
    test_bench's fakes); plain rows load no drafter; -md beside draft-mtp exits 2."""
    import json

    from helpers.bench_checks import bench, fake_tools

    tools = fake_tools(tmp_path)
    res = bench("-m", DEMO, "--spec-type", "draft-mtp", "--modes", "plain,chain", "--temp", "0", "--llama-cpp",
                str(tools), "--draft-p-min", "0", "--spec-draft-p-min", "0", "--spec-draft-n-max", "3", "-r", "1",
                "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    calls = [json.loads(line) for line in (tools / "calls.jsonl").read_text().splitlines()]
    spec = [c for c in calls if c[0].endswith("llama-speculative-simple")]
    assert spec and all(c[c.index("--spec-type") + 1] == "draft-mtp" and "-md" not in c for c in spec)
    modes = {r["mode"] for r in out["rows"]}
    assert "chain p-min 0 n-max 3" in modes and "MTP (llama-speculative-simple, p-min 0, n-max 3)" in modes
    ours = {r["mode"]: r for r in out["rows"] if r["engine"] == "ours"}
    assert ours["plain"]["al"]["median"] == 1.0 and ours["chain p-min 0 n-max 3"]["al"]["median"] > 1.5
    res = bench("-m", DEMO, "-md", DEMO, "--spec-type", "draft-mtp", "--no-llama-cpp", cwd=tmp_path)
    assert res.returncode == 2 and "drop -md" in res.stderr
