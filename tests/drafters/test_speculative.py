"""Chain speculative decoding with a DFlash drafter: drafter logits against z-lab's
reference model, losslessness against our own autoregressive decoding, and acceptance
lengths against the reference generate loop."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.decoding_checks import (BLOCK, HostBlocks, ScriptedDraft, prompts, reference_draft_logits,
                                     reference_models, rel_err)
from helpers.loops import greedy_generate, speculative_generate
from helpers.parity import Parity
from helpers.paths import TESTS
from helpers.reference_loop import RecomputingTarget, exact_reference

from dflash_gguf import DflashError
from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.speculation.drafting import accepted_prefix, chain_length
from dflash_gguf.runtime.target import CHAIN, LOGITS_LAST, Rows, Target, TargetConfig


def load(pair, target_gguf=None, kv="f32", n_ubatch=16, n_ctx=512, repack=True, top_k=0, n_seq=1):
    meta = read_draft_metadata(pair["draft"])
    target = Target(target_gguf or pair["target"], TargetConfig(
        n_ctx=n_ctx, n_ubatch=n_ubatch, n_verify=BLOCK, kv_type=kv, feature_layers=meta["target_layers"],
        repack=repack, n_seq=n_seq))
    return target, Draft(pair["draft"], target, DraftConfig(kv_type="f32", top_k=top_k))


def test_metadata_uses_llama_cpp_layer_convention(pair):
    meta = read_draft_metadata(pair["draft"])
    assert meta["target_layers"] == [1, 3]  # HF ids 0 and 2, stored +1
    assert meta["block_size"] == BLOCK


def test_drafter_logits_match_reference(pair):
    ref_target, ref_draft = reference_models(pair)
    target, draft = load(pair, n_ubatch=8)
    prompt = prompts(1, seed=1)[0] + list(range(40, 60))  # longer than one ubatch

    target.prefill(prompt, LOGITS_LAST, on_chunk=lambda s, n: draft.append())
    bonus = int(target.choices()[0])
    block = [bonus] + draft.propose(bonus)
    ours = draft.logits(0, BLOCK - 1)
    ref = reference_draft_logits(ref_target, ref_draft, prompt, bonus)
    assert rel_err(ours, ref) < 1e-3
    assert block[1:] == ref.argmax(1).tolist()

    # a later step: the context grew by a verified block of which 3 tokens were kept
    target.verify(block)
    keep = 3
    next_bonus = int(target.choices(0, BLOCK)[keep - 1])
    target.commit(keep)
    draft.propose(next_bonus)  # the kept positions taken first, in the same graph
    ours = draft.logits(0, BLOCK - 1)
    ref = reference_draft_logits(ref_target, ref_draft, prompt + block[:keep], next_bonus)
    assert rel_err(ours, ref) < 1e-3


def test_lossless_random_drafter(pair):
    target, draft = load(pair)
    with Parity(target) as parity:
        for prompt in prompts(10, seed=2):
            ar, _ = greedy_generate(target, prompt, 128)
            spec, stats = speculative_generate(target, draft, prompt, 128)
            parity.check(prompt, ar, spec)
            assert sum(stats.accepted_lengths) == len(spec) - 1  # the first token comes from the prefill


def test_lossless_with_scripted_drafter_and_stops(pair):
    loaded, _ = load(pair)
    target = HostBlocks(loaded)
    for n, prompt in enumerate(prompts(4, seed=5)):
        ar, _ = greedy_generate(loaded, prompt, 96)
        out, stats = speculative_generate(target, ScriptedDraft(len(prompt), ar, BLOCK, 4 + n), prompt, 96)
        assert out == ar
        assert max(stats.accepted_lengths) >= 4, stats.accepted_lengths
        assert len(set(stats.accepted_lengths)) >= 3

        # a stop token in the middle of an accepted block ends generation right there
        stop = ar[21]
        expect = ar[: ar.index(stop) + 1]
        out, stats = speculative_generate(target, ScriptedDraft(len(prompt), ar, BLOCK, 10**6), prompt, 96,
                                          stop_tokens=[stop])
        assert out == expect
        assert stats.stop_reason == "stop"


def reference_parity(pair, prompt_list, monkeypatch, n_tokens=48):
    """Run z-lab's dflash_generate and our chain on each prompt; assert the same tokens
    (no tie allowed: a difference fails, naming the target's top-2 gap there) and the
    same accepted lengths. Returns our accepted lengths."""
    import dflash.model as ref

    for name in ("_cuda_time", "_make_cache"):  # exact_reference patches these: undo after the test
        monkeypatch.setattr(ref, name, getattr(ref, name))
    exact_reference(ref)
    hf_target, ref_draft = reference_models(pair)
    ref_target = RecomputingTarget(hf_target)
    target, draft = load(pair)
    lengths = []
    with Parity(target) as parity:
        for prompt in prompt_list:
            res = ref.dflash_generate(ref_draft, ref_target, torch.tensor([prompt]), n_tokens, None,
                                      temperature=0.0, return_stats=True)
            ref_tokens = res.output_ids[0, len(prompt):].tolist()
            ours, stats = speculative_generate(target, draft, prompt, n_tokens)
            parity.check(prompt, ref_tokens, ours)
            assert stats.accepted_lengths == list(res.acceptance_lengths)
            lengths += stats.accepted_lengths
    return lengths


def test_acceptance_lengths_match_reference_loop(pair, monkeypatch):
    reference_parity(pair, prompts(4, seed=7), monkeypatch)


DEMO_HF = TESTS / "data" / "demo-hf"


@pytest.fixture(scope="module")
def trained_pair(convert_model):
    """The demo pair's HF checkpoints (bf16 copies written by training/train_demo.py),
    converted to f32: a drafter that really accepts, for a meaningful parity check."""
    target_dir, draft_dir = DEMO_HF / "target", DEMO_HF / "draft"
    return {
        "target_dir": target_dir,
        "draft_dir": draft_dir,
        "target": convert_model(target_dir, "f32"),
        "draft": convert_model(draft_dir, "f32", "--target-model-dir", str(target_dir)),
    }


def test_acceptance_lengths_match_reference_loop_on_trained_pair(trained_pair, monkeypatch):
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(DEMO_HF / "target" / "tokenizer.json"))
    texts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):",
             "import os\nimport sys\n\n\ndef main():", "    for line in lines:\n"]
    lengths = reference_parity(trained_pair, [tok.encode(t).ids for t in texts], monkeypatch, n_tokens=64)
    assert len(lengths) >= 20, f"too few steps to compare: {lengths}"
    assert np.mean(lengths) > 1.5, f"the trained pair accepts too little to mean anything: {lengths}"


def test_chain_length_stops_before_the_first_unlikely_draft():
    lp = np.log([0.9, 0.5, 0.2, 0.9])
    assert chain_length(lp, 0.0) == 4  # no cut
    assert chain_length(lp, 0.1) == 4
    assert chain_length(lp, 0.3) == 2
    assert chain_length(lp, 0.6) == 1
    assert chain_length(np.log([0.1, 0.9]), 0.3) == 0  # none: the bonus alone, as llama.cpp cuts


def test_the_kept_drafts_are_those_the_target_chose_up_to_the_first_it_did_not():
    """accepted_prefix is the library's rule (dfl_agreed_drafts, which the fused chain step
    keeps by): choice[i] is the target's token after block[i]."""
    assert accepted_prefix([7, 1, 2, 3], np.int32([1, 2, 9, 4])) == 2
    assert accepted_prefix([7, 1, 2, 3], [1, 2, 3, 5]) == 3  # all kept; the last choice is the next token
    assert accepted_prefix([7, 1, 2], [5, 2, 3]) == 0
    assert accepted_prefix([7], [4]) == 0  # the bonus alone: a plain decode
    assert accepted_prefix([7, 1, 2, 3], [1, 2]) == 2  # no further than the choices given


def test_the_cut_by_default_is_on_where_the_target_computes_on_the_cpu(pair):
    """Where a verify's cost grows with its rows (the CPU computes the target, wholly or
    in part) the chain is cut at DEFAULT_DRAFT_P_MIN; an accelerator holding every layer
    verifies the whole block for about the cost of two rows: no cut. An explicit value
    wins; 0 loads the drafter without a ranking."""
    from dflash_gguf.engine.engine import Engine
    from dflash_gguf.speculation.drafting import DEFAULT_DRAFT_P_MIN, default_p_min

    class Placed:
        def __init__(self, device, n_gpu_layers):
            self.placed = {"device": device, "n_gpu_layers": n_gpu_layers, "n_layer": 4, "host_layer_weights": 0}

        def info(self):
            return self.placed

    assert default_p_min(Placed("CPU", 0)) == DEFAULT_DRAFT_P_MIN
    assert default_p_min(Placed("RPC0", 2)) == DEFAULT_DRAFT_P_MIN
    assert default_p_min(Placed("RPC0", 4)) == 0.0
    with Engine(str(pair["target"]), str(pair["draft"]), n_ctx=256) as engine:
        assert engine.draft_p_min == DEFAULT_DRAFT_P_MIN and engine.draft.top_k == 1
    with Engine(str(pair["target"]), str(pair["draft"]), n_ctx=256, draft_p_min=0.0) as engine:
        assert engine.draft_p_min == 0.0 and engine.draft.top_k == 0
        with pytest.raises(DflashError, match="top_k = 0"):  # nothing ranked: a clear error
            engine.draft.top1_logprobs(1)
    with pytest.raises(ValueError, match="p-min"):
        Engine(str(pair["target"]), str(pair["draft"]), n_ctx=256, draft_p_min=1.0)


def test_confidence_cut_chain_is_lossless_and_verifies_what_chain_length_says(trained_pair, monkeypatch):
    """With p_min, each step verifies the drafts before the first one the drafter gives
    less than p_min (read from its ranked candidates before the verify): blocks of many
    lengths, the target's graphs for each, output still the target's own. (The phased
    step, whose calls the test can watch; test_fused_chain_step_is_the_phased_step holds
    the fused one to it.)"""
    from tokenizers import Tokenizer as HFTokenizer

    from dflash_gguf.speculation.proposers import ChainProposer

    monkeypatch.setattr(ChainProposer, "fuses", lambda self, seq: False)

    tok = HFTokenizer.from_file(str(DEMO_HF / "target" / "tokenizer.json"))
    target, draft = load(trained_pair, top_k=1)
    seen, ranked = [], {}
    real_top1, real_step = draft.top1_logprobs, target.step

    def top1_logprobs(n, seq=0):
        ranked["lp"] = real_top1(n, seq=seq)
        return ranked["lp"]

    def step(rows, source=None):
        for r in rows:
            if r.tokens is None:  # a chain verify of the drafter's block
                seen.append((r.n - 1, chain_length(ranked.pop("lp"), p_min) if "lp" in ranked else None))
        real_step(rows, source)

    draft.top1_logprobs, target.step = top1_logprobs, step
    with Parity(target) as parity:
        for p_min in (0.3, 0.7):
            lengths = []
            for text in ("def fibonacci(n):", "class Stack:\n    def __init__(self):"):
                prompt = tok.encode(text).ids
                ar, _ = greedy_generate(target, prompt, 64)
                seen.clear()
                out, _ = speculative_generate(target, draft, prompt, 64, p_min=p_min)
                parity.check(prompt, ar, out)
                cut = [(n, expect) for n, expect in seen if expect is not None]
                assert len(cut) >= len(seen) - 2 and all(n == expect for n, expect in cut), seen
                lengths += [n for n, _ in cut]
            assert min(lengths) < BLOCK - 1 and len(set(lengths)) >= 3, lengths  # the cut moved


class CallCount:
    """The library's entry points a block of code calls, counted by name."""

    def __init__(self, monkeypatch, *modules):
        self.calls = {}
        for module in modules:
            monkeypatch.setattr(module, "lib", self._proxy(module.lib))

    def _proxy(self, lib):
        count = self.calls

        class Counting:
            def __getattr__(self, name):
                fn = getattr(lib, name)
                if not name.startswith("dfl_") or not callable(fn):
                    return fn

                def call(*args):
                    count[name] = count.get(name, 0) + 1
                    return fn(*args)

                return call

        return Counting()


def test_fused_chain_step_is_the_phased_step(trained_pair, monkeypatch):
    """A greedy chain step runs as one call of the library (dfl_chain_step): the same
    tokens and accepted lengths as the phased step (propose, cut, verify, choices, block,
    commit), alone and two sequences in one step, with and without the p_min cut; the
    phased step crosses into the library several times a step, the fused one once."""
    from tokenizers import Tokenizer as HFTokenizer

    from dflash_gguf.runtime import drafter as draft_module
    from dflash_gguf.runtime import target as target_module
    from helpers.decoding_checks import batch_outputs
    from dflash_gguf.decoding.step import Sequence
    from dflash_gguf.decoding.requests import GenerationStats, Placement, Request
    from dflash_gguf.speculation.proposers import ChainProposer
    from dflash_gguf.speculation.drafting import chain_proposer

    tok = HFTokenizer.from_file(str(DEMO_HF / "target" / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in ("def fibonacci(n):", "class Stack:\n    def __init__(self):")]
    fused_step = ChainProposer.fuses

    def run(fused: bool, p_min: float, batched: bool):
        monkeypatch.setattr(ChainProposer, "fuses", fused_step if fused else (lambda self, seq: False))
        target, draft = load(trained_pair, top_k=1, n_seq=2)
        target_module_calls = CallCount(monkeypatch, target_module, draft_module)
        with target, draft:
            seqs = [Sequence(target, draft, chain_proposer(target, draft, None, None, p_min), Request(p, 48, ()),
                             GenerationStats(), Placement(slot=0 if not batched else i))
                    for i, p in enumerate(prompts)]
            out = []
            if batched:
                out = list(zip(batch_outputs(target, draft, seqs), [s.stats.accepted_lengths for s in seqs]))
            else:
                for s in seqs:
                    target.reset()
                    draft.reset()
                    out.append((collect_steps(s), s.stats.accepted_lengths))
        monkeypatch.undo()
        steps = sum(len(lengths) for _, lengths in out)
        return out, target_module_calls.calls, steps

    for p_min in (0.0, 0.3):
        for batched in (False, True):
            phased, phased_calls, steps = run(False, p_min, batched)
            fused, fused_calls, _ = run(True, p_min, batched)
            assert fused == phased, (p_min, batched)
            rounds = phased_calls["dfl_draft_propose"]  # one drafter graph a step
            assert rounds >= steps // (2 if batched else 1) - 1
            # every step is one call, but for a step that carries a joining prompt's chunk
            # (it runs phased); the prompts' graphs and set-up are the same calls as before
            shared = fused_calls.get("dfl_draft_propose", 0)
            assert shared == 0 if not batched else 0 < shared <= 2
            fused_steps = fused_calls["dfl_chain_step"]
            assert fused_steps + shared == rounds
            for name in ("dfl_target_step", "dfl_target_choices"):
                assert fused_calls[name] == phased_calls[name] - fused_steps
            phased_per_step = (sum(phased_calls.values()) - sum(fused_calls.values())) / fused_steps + 1
            assert phased_per_step >= 6, phased_calls
            for name in ("dfl_draft_propose", "dfl_draft_block", "dfl_target_commit"):
                assert fused_calls.get(name, 0) <= 2 * shared, name


def collect_steps(seq) -> list:
    from dflash_gguf.decoding.step import sequence_steps

    return [t for new in sequence_steps(seq) for t in new]


@pytest.mark.parametrize("outtype", ["q8_0", "q4_k_m"])
def test_quantized_target_speculative_equals_autoregressive(pair, convert_model, outtype):
    # The CPU backend's repacked K-quant kernels round differently for one row (decode)
    # than for several (verify), so bit-exact agreement holds with matrices in file
    # layout; see docs/exactness.md.
    gguf_path = convert_model(pair["target_dir"], outtype)
    target, draft = load(pair, target_gguf=gguf_path, kv="f16", repack=False)
    with Parity(target) as parity:
        for prompt in prompts(4, seed=11):
            ar, _ = greedy_generate(target, prompt, 64)
            spec, _ = speculative_generate(target, draft, prompt, 64)
            parity.check(prompt, ar, spec)


def test_mismatched_pair_is_a_clear_error(pair, tmp_path):
    meta = read_draft_metadata(pair["draft"])
    target = Target(pair["target"], TargetConfig(n_ctx=128, feature_layers=[1]))
    with pytest.raises(Exception, match="feature layers"):
        Draft(pair["draft"], target)
    # a target is no drafter, unless its own MTP (nextn) layers draft for it: this one has none
    with pytest.raises(ValueError, match="architecture 'qwen35' and no nextn"):
        read_draft_metadata(pair["target"])
    target = Target(pair["target"], TargetConfig(n_ctx=128, feature_layers=meta["target_layers"]))
    with pytest.raises(Exception, match="no nextn"):
        Draft(pair["target"], target)


def test_drafter_context_window_matches_reference_on_the_last_positions(pair):
    from dflash.model import extract_context_feature

    ref_target, ref_draft = reference_models(pair)
    meta = read_draft_metadata(pair["draft"])
    window = 9
    target = Target(pair["target"], TargetConfig(n_ctx=256, n_ubatch=16, n_verify=BLOCK, kv_type="f32",
                                                 feature_layers=meta["target_layers"]))
    draft = Draft(pair["draft"], target, DraftConfig(kv_type="f32", window=window))
    prompt = prompts(1, seed=31)[0] + list(range(100, 130))
    target.prefill(prompt, LOGITS_LAST, on_chunk=lambda s, n: draft.append())
    bonus = int(target.choices()[0])
    draft.propose(bonus)
    ours = draft.logits(0, BLOCK - 1)

    p = len(prompt)
    with torch.no_grad():
        out = ref_target(torch.tensor([prompt]), output_hidden_states=True)
        feats = extract_context_feature(out.hidden_states, ref_draft.target_layer_ids)[:, p - window:]
        noise = ref_target.get_input_embeddings()(torch.tensor([[bonus] + [ref_draft.mask_token_id] * (BLOCK - 1)]))
        pos = torch.arange(p - window, p + BLOCK)[None]
        hidden = ref_draft(target_hidden=feats, noise_embedding=noise, position_ids=pos, use_cache=False)
        ref = ref_draft.compute_logits(hidden[:, 1:], ref_target.lm_head)[0].numpy()
    assert rel_err(ours, ref) < 1e-3
    full = reference_draft_logits(ref_target, ref_draft, prompt, bonus)
    assert rel_err(ours, full) > 1e-3  # the window made a difference


def test_block_size_one_and_the_last_steps_positions(pair):
    """Any block size gives the plain greedy text. The last step's committed positions
    wait in the target's feature rows for the drafter's next graph (the run ends without
    one; block size 1 drafts nothing, and the drafter stays behind by every step's while
    they fit): an append takes them, and the drafter holds every committed position."""
    target, draft = load(pair)
    prompt = prompts(1, seed=41)[0]
    ar, _ = greedy_generate(target, prompt, 24)
    for b in (1, 2, BLOCK):
        out, stats = speculative_generate(target, draft, prompt, 24, block_size=b)
        assert out == ar
        last = stats.accepted_lengths[-1]
        lag = target.n_past - draft.n_ctx_tokens  # block size 1: at most what the 16 feature rows keep
        assert 0 < lag <= (16 if b == 1 else last)
        draft.append()
        assert draft.n_ctx_tokens == target.n_past


def test_chain_steps_reuse_one_target_graph(pair):
    """The commit rides in the next verify as inputs, so the verify graph of one step
    serves the next: only the prefill chunks, the first two verifies (without and with
    a commit to carry) and the last blocks, which shrink to the tokens still wanted,
    build a graph. The drafter's accepted context rows ride in its next propose, padded
    to the block size, so its propose graph is reused as well."""
    target, draft = load(pair)
    prompt = prompts(1, seed=51)[0]
    before, draft_before = target.info(), draft.info()
    out, stats = speculative_generate(target, draft, prompt, 96)
    after, draft_after = target.info(), draft.info()
    graphs = after["n_graphs"] - before["n_graphs"]
    builds = after["n_graph_builds"] - before["n_graph_builds"]
    assert graphs >= len(stats.accepted_lengths) >= 20
    assert builds <= 2 + 2 + (BLOCK - 1), f"{builds} of {graphs} target graphs were built"
    graphs = draft_after["n_graphs"] - draft_before["n_graphs"]
    builds = draft_after["n_graph_builds"] - draft_before["n_graph_builds"]
    # the prefill's context appends and the final flush build their own graphs
    assert graphs >= len(stats.accepted_lengths) >= 20
    assert builds <= 2 + 1 + (BLOCK - 1) + 1, f"{builds} of {graphs} drafter graphs were built"


def test_device_block_handoff_errors(pair):
    """A chain row without tokens reads the drafter's block on the device: wrong
    pairings and reads past the block are refused with a reason."""
    target, draft = load(pair)
    other, _ = load(pair)
    target.prefill(prompts(1, seed=71)[0], LOGITS_LAST, on_chunk=lambda start, n: draft.append())
    with pytest.raises(Exception, match="fewer than"):
        target.step([Rows(0, CHAIN, n=2)], draft)  # nothing proposed yet
    draft.propose(5, 4, read=False)
    with pytest.raises(Exception, match="another target"):
        other.step([Rows(0, CHAIN, n=4)], draft)
    with pytest.raises(Exception, match="fewer than"):
        target.step([Rows(0, CHAIN, n=5)], draft)
    with pytest.raises(Exception, match="block tokens requested"):
        draft.block(6)
    target.step([Rows(0, CHAIN, n=4)], draft)
    block = draft.block(4)
    assert block[0] == 5
    # the same tokens verified from the host give the same logits
    logits = target.logits(0, 4)
    target.commit(0)
    target.verify(block)
    assert np.array_equal(target.logits(0, 4), logits)


def window_reference_logits(ref_target, ref_draft, context, bonus, window):
    """z-lab's drafter on the last `window` context positions only."""
    from dflash.model import extract_context_feature

    p = len(context)
    with torch.no_grad():
        out = ref_target(torch.tensor([context]), output_hidden_states=True)
        feats = extract_context_feature(out.hidden_states, ref_draft.target_layer_ids)[:, max(0, p - window):]
        noise = ref_target.get_input_embeddings()(torch.tensor([[bonus] + [ref_draft.mask_token_id] * (BLOCK - 1)]))
        pos = torch.arange(max(0, p - window), p + BLOCK)[None]
        hidden = ref_draft(target_hidden=feats, noise_embedding=noise, position_ids=pos, use_cache=False)
        return ref_draft.compute_logits(hidden[:, 1:], ref_target.lm_head)[0].numpy()


@pytest.mark.parametrize("n_ubatch", [8, 32])
def test_drafter_ring_window_matches_reference_across_wraparound(pair, n_ubatch):
    """With a window W the drafter keeps W + block positions in a ring: every step,
    after the ring has wrapped several times (and with prefill chunks longer than the
    ring), its logits equal the reference drafter run on the last W positions."""
    ref_target, ref_draft = reference_models(pair)
    meta = read_draft_metadata(pair["draft"])
    window = 9
    target = Target(pair["target"], TargetConfig(n_ctx=256, n_ubatch=n_ubatch, n_verify=BLOCK, kv_type="f32",
                                                 feature_layers=meta["target_layers"]))
    draft = Draft(pair["draft"], target, DraftConfig(kv_type="f32", window=window))
    context = prompts(1, seed=32)[0] + list(range(300, 330))
    target.prefill(context, LOGITS_LAST, on_chunk=lambda s, n: draft.append())
    bonus = int(target.choices()[0])
    for step, keep in enumerate([1, 3, 8, 2, 5, 8, 1, 4]):
        block = [bonus] + draft.propose(bonus)
        ref = window_reference_logits(ref_target, ref_draft, context, bonus, window)
        assert rel_err(draft.logits(0, BLOCK - 1), ref) < 1e-3, f"step {step}"
        target.verify(block)
        bonus = int(target.choices(0, BLOCK)[keep - 1])
        target.commit(keep)
        draft.append()  # in a graph of its own (the next propose would take them too)
        context += block[:keep]


def test_lossless_with_a_drafter_window_shorter_than_the_prompt(pair):
    target, _ = load(pair)
    draft = Draft(pair["draft"], target, DraftConfig(kv_type="f32", window=6))
    with Parity(target) as parity:
        for prompt in prompts(4, seed=33):
            prompt = prompt + list(range(400, 420))
            ar, _ = greedy_generate(target, prompt, 64)
            spec, _ = speculative_generate(target, draft, prompt, 64)
            parity.check(prompt, ar, spec)
