"""gpt-oss targets through the generic runtime, with a DFlash drafter.

The tiny checkpoint (gptoss_fixtures) has YaRN RoPE whose correction range is not rounded
(gpt-oss's truncate: false), learned attention sinks, attention and expert biases, 8
experts of which 4 run per token with the SwiGLU clamp cutting some pre-activations, and
a sliding window of 8 on every other layer, which every prompt exceeds. Oracles:
transformers' GptOssForCausalLM (logits, greedy generation), transformers' MXFP4
dequantization and gguf-py's (the experts' blocks), llama.cpp's converter (the GGUF, byte
for byte, float and MXFP4 checkpoints), llama-quantize (MXFP4_MOE), libllama (logits and
greedy output with an f32 cache; llama.cpp always rounds the YaRN range, so it is
compared on a checkpoint that rounds it too), plain greedy decoding (chain, tree, several
sequences, checkpoints) and z-lab's dflash package (reference loop acceptance)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from helpers.arch_checks import (assert_chain_and_tree_lossless, assert_same_gguf, assert_tree_verify_matches_each_path,
                                 our_logits, rel_err)
from helpers.fixtures import hf_model, llama_cpp_quantize, open_llama, read_gguf
from helpers.gptoss_fixtures import BLOCK, WINDOW, make_drafter, make_gptoss, make_gptoss_mxfp4
from helpers.loops import greedy_generate, speculative_generate
from helpers.reference_loop import History, RecomputingTarget
from helpers.target_workers import run_isolated

from dflash_gguf import DflashError
from dflash_gguf.convert.quant import OUTTYPES
from dflash_gguf.runtime.drafter import Draft, DraftConfig, read_draft_metadata
from dflash_gguf.runtime.target import Target, TargetConfig


def prompts(n, seed=0, lo=12, hi=40):
    """Random prompts longer than the sliding window (ids of trained BPE tokens)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(300, 1000, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def with_config(src, dst, **changes):
    """A copy of checkpoint `src` whose config.json has `changes` (dicts merged one level)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


@pytest.fixture(scope="module")
def pair(tmp_path_factory, convert_model):
    root = tmp_path_factory.mktemp("gptoss")
    target_dir = make_gptoss(root / "target")
    draft_dir = make_drafter(root / "draft", target_dir)
    mxfp4_dir = make_gptoss_mxfp4(root / "mxfp4", target_dir)
    return {
        "root": root, "target_dir": target_dir, "draft_dir": draft_dir, "mxfp4_dir": mxfp4_dir,
        "target": convert_model(target_dir, "f32"),
        "mxfp4": convert_model(mxfp4_dir, "f32"),
        "draft": convert_model(draft_dir, "f32", "--target-model-dir", str(target_dir)),
    }


@pytest.fixture(scope="module")
def rounded(pair, convert_model):
    """The checkpoints with YaRN's correction range rounded (truncate: true), as llama.cpp
    always rounds it: float and MXFP4."""
    root = pair["root"]
    dirs = {kind: with_config(pair[f"{kind}_dir"], root / f"rounded-{kind}", rope_parameters={"truncate": True})
            for kind in ("target", "mxfp4")}
    return {kind: (d, convert_model(d, "f32")) for kind, d in dirs.items()}


def load(path, draft_path, n_ctx=512, n_verify=BLOCK, n_ubatch=16, **kw):
    meta = read_draft_metadata(draft_path)
    target = Target(str(path), TargetConfig(n_ctx=n_ctx, n_ubatch=n_ubatch, n_verify=n_verify, kv_type="f32",
                                            feature_layers=meta["target_layers"], **kw))
    return target, Draft(str(draft_path), target, DraftConfig(kv_type="f32", top_k=4))


def llama_f32(path, **kw):
    """libllama with f32 caches, the precision our f32 runs have."""
    return open_llama(path, logits_all=True, n_threads=2, type_k=0, type_v=0, **kw)


# ---- against transformers --------------------------------------------------------------------

def test_logits_match_transformers_with_sinks_window_and_clamp(pair):
    model = hf_model(pair["target_dir"])
    tokens = prompts(1, seed=1)[0] + list(range(400, 440))
    pre = []  # the largest expert pre-activation of each layer, over every expert

    def record(m, args, out):
        gate_up = torch.einsum("th,xhf->xtf", args[0], m.gate_up_proj) + m.gate_up_proj_bias[:, None]
        pre.append(float(gate_up.abs().max()))

    hooks = [layer.mlp.experts.register_forward_hook(record) for layer in model.model.layers]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([tokens])).logits[0].float().numpy()
    for h in hooks:
        h.remove()
    assert max(pre) > 7.0  # the SwiGLU clamp cuts some pre-activations
    assert model.config.layer_types[0] == "sliding_attention" and model.config.sliding_window < len(tokens)
    assert rel_err(our_logits(pair["target"], tokens), ref) < 1e-4


def test_greedy_equals_transformers_token_for_token(pair):
    model = hf_model(pair["target_dir"])
    target = Target(pair["target"], TargetConfig(n_ctx=256, kv_type="f32"))
    for prompt in prompts(1, seed=2):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                 pad_token_id=0)
        assert greedy_generate(target, prompt, 32)[0] == out[0, len(prompt):].tolist()


def test_rounded_yarn_range_is_recorded_and_applied(pair, rounded):
    """truncate: true is written as rope.scaling.yarn_truncate (gpt-oss's own configs leave
    it false, which the runtime assumes and llama.cpp's converter cannot say); each file
    has its own checkpoint's logits, and the two differ."""
    d, path = rounded["target"]
    assert read_gguf(path)[0]["gpt-oss.rope.scaling.yarn_truncate"][1] is True
    assert "gpt-oss.rope.scaling.yarn_truncate" not in read_gguf(pair["target"])[0]
    tokens = prompts(1, seed=3)[0] + list(range(500, 560))
    with torch.no_grad():
        ref = hf_model(d)(input_ids=torch.tensor([tokens])).logits[0].float().numpy()
    ours = our_logits(path, tokens)
    assert rel_err(ours, ref) < 1e-4
    assert rel_err(our_logits(pair["target"], tokens), ours) > 1e-4


# ---- the converter against llama.cpp's ----------------------------------------------------------

@pytest.mark.parametrize("kind", ["target", "mxfp4"])
def test_our_gguf_matches_llama_cpp_converter(pair, kind, llama_cpp_convert):
    """Same keys, types, tensor names, shapes and bytes as llama.cpp's own converter, from
    the float checkpoint and from its MXFP4 form (the experts' blocks kept)."""
    (_, ours_t), _ = assert_same_gguf(pair[kind], llama_cpp_convert(pair[f"{kind}_dir"], "f32", "gpt-4o"))
    assert ours_t["blk.0.ffn_gate_exps.weight"][0] == ("MXFP4" if kind == "mxfp4" else "F32")


def test_llama_cpp_converted_file_loads_and_agrees(pair, llama_cpp_convert):
    tokens = prompts(1, seed=4)[0]
    theirs = llama_cpp_convert(pair["target_dir"], "f32", "gpt-4o")
    assert rel_err(our_logits(theirs, tokens), our_logits(pair["target"], tokens)) < 1e-6


@pytest.mark.parametrize("kind", ["target", "mxfp4"])
def test_llama_cpp_decodes_our_file_as_we_do(rounded, kind):
    """libllama on our file (llama.cpp's YaRN range is the rounded one): the same logits,
    MXFP4 experts included, and the same greedy continuations. MXFP4 products round
    their activations to q8_0 (in either engine), so a row whose routing is a near tie
    may go another way after a last-bit difference upstream (the same engine does that
    between batch sizes): there, most rows agree to float precision."""
    path = rounded[kind][1]
    tokens = prompts(1, seed=5)[0] + list(range(600, 630))
    prompt = prompts(1, seed=6)[0]
    llm = llama_f32(path, n_ctx=256)
    try:
        llm.eval(tokens)
        theirs = np.array(llm.scores[:len(tokens)], dtype=np.float32)
        llm.reset()
        llm.eval(prompt)
        expected = []
        for _ in range(24):
            expected.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([expected[-1]])
    finally:
        llm.close()
    row_err = np.abs(our_logits(path, tokens) - theirs).max(1) / np.abs(theirs).max()
    if kind == "target":
        assert row_err.max() < 1e-5
    else:
        assert np.mean(row_err < 1e-5) > 0.9, row_err
    target = Target(str(path), TargetConfig(n_ctx=256, kv_type="f32"))
    assert greedy_generate(target, prompt, 24)[0] == expected


# ---- MXFP4 --------------------------------------------------------------------------------------

def test_mxfp4_blocks_dequantize_as_transformers_does(pair):
    """The experts of the MXFP4 checkpoint, as our file holds them and gguf-py dequantizes
    them, are transformers' dequantization of the published blocks (gate and up split)."""
    from gguf import GGMLQuantizationType, dequantize
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ckpt = load_file(str(pair["mxfp4_dir"] / "model.safetensors"))
    _, tensors = read_gguf(pair["mxfp4"])
    for layer in (0, 3):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = convert_moe_packed_tensors(ckpt[p + "gate_up_proj_blocks"], ckpt[p + "gate_up_proj_scales"],
                                             dtype=torch.float32).numpy()  # [experts, hidden, 2 ffn]
        down = convert_moe_packed_tensors(ckpt[p + "down_proj_blocks"], ckpt[p + "down_proj_scales"],
                                          dtype=torch.float32).numpy()     # [experts, ffn, hidden]
        want = {"ffn_gate_exps": gate_up[..., 0::2], "ffn_up_exps": gate_up[..., 1::2], "ffn_down_exps": down}
        for name, ref in want.items():
            kind, shape, data = tensors[f"blk.{layer}.{name}.weight"]
            assert kind == "MXFP4"
            ours = dequantize(data, GGMLQuantizationType.MXFP4).reshape(shape[::-1])
            assert np.array_equal(ours, ref.transpose(0, 2, 1)), name


def test_mxfp4_moe_outtype_matches_llama_quantize(pair, convert_model, tmp_path):
    """--outtype mxfp4_moe quantizes a float checkpoint as llama-quantize's MXFP4_MOE does:
    experts MXFP4, other matrices q8_0, vectors, biases and routers f32; the same bytes."""
    ours_kv, ours_t = read_gguf(convert_model(pair["target_dir"], "mxfp4_moe"))
    ref = llama_cpp_quantize(pair["target"], tmp_path / "ref.gguf", int(OUTTYPES["mxfp4_moe"][0]))
    ref_kv, ref_t = read_gguf(ref)
    assert ours_kv["general.file_type"] == ref_kv["general.file_type"]
    assert {n: v[0] for n, v in ours_t.items()} == {n: v[0] for n, v in ref_t.items()}
    assert ours_t["blk.0.ffn_down_exps.weight"][0] == "MXFP4" and ours_t["output.weight"][0] == "Q8_0"
    for name, (_, _, data) in ref_t.items():
        assert np.array_equal(ours_t[name][2].ravel(), data.ravel()), name


def test_mxfp4_target_decodes_exactly_and_speculates(pair):
    target, draft = load(pair["mxfp4"], pair["draft"], n_verify=BLOCK + 1)
    assert_chain_and_tree_lossless(target, draft, prompts(1, seed=7), n_new=32)


# ---- speculative decoding -----------------------------------------------------------------------

def test_tree_verify_matches_decoding_each_path(pair):
    """Tree nodes see only their ancestors (sinks and all), sliding layers only the window
    behind each node's position p + depth; committing a path leaves the caches as if
    decoded."""
    target, _ = load(pair["target"], pair["draft"])
    assert_tree_verify_matches_each_path(target, pair["target"], prompts(1, seed=8)[0],
                                         [311, 312, 313, 314, 315, 316, 317], [321, 322])


def test_chain_and_tree_are_lossless(pair):
    target, draft = load(pair["target"], pair["draft"], n_verify=BLOCK + 1)
    assert_chain_and_tree_lossless(target, draft, prompts(2, seed=9), n_new=32)


def test_acceptance_lengths_match_reference_loop(pair, monkeypatch):
    import time

    import dflash.model as ref
    from dflash.model import DFlashDraftModel

    # transformers' sliding caches cannot be cropped back past their window: the oracle
    # recomputes the target from the committed tokens instead (the loop is untouched)
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)
    make_cache = ref._make_cache
    monkeypatch.setattr(ref, "_make_cache", lambda cfg: History() if getattr(cfg, "model_type", "") == "gpt_oss"
                        else make_cache(cfg))
    ref_target = RecomputingTarget(hf_model(pair["target_dir"]))
    ref_draft = DFlashDraftModel.from_pretrained(str(pair["draft_dir"]), dtype=torch.float32).eval()
    target, draft = load(pair["target"], pair["draft"])
    for prompt in prompts(1, seed=10):
        res = ref.dflash_generate(ref_draft, ref_target, torch.tensor([prompt]), 32, None, temperature=0.0,
                                  return_stats=True)
        ours, stats = speculative_generate(target, draft, prompt, 32)
        assert ours == res.output_ids[0, len(prompt):].tolist()
        assert stats.accepted_lengths == list(res.acceptance_lengths)


def test_sequences_in_a_batch_decode_as_alone(pair):
    """-np: a chain, a tree and a plain decode in one batch of three slots, each emitting
    what it emits alone."""
    from helpers.decoding_checks import decode_alone, decode_batch

    kinds, texts = ["chain", "tree", "plain"], prompts(3, seed=11)
    one = load(pair["target"], pair["draft"], n_verify=16)
    many = load(pair["target"], pair["draft"], n_verify=16, n_seq=3)
    alone = [decode_alone(*one, kind, text, 24)[0] for kind, text in zip(kinds, texts)]
    outs, _ = decode_batch(*many, [(kind, text, 24, None) for kind, text in zip(kinds, texts)])
    assert outs == alone


def test_checkpoint_restores_sliding_caches(pair):
    """A prefix checkpoint taken past several windows, restored after another prompt: the
    continuation (chain decoding, drafter included) and its acceptance are a cold run's."""
    from dflash_gguf.runtime.checkpoints import PrefillSaver, PrefixCheckpoints
    from dflash_gguf.decoding.requests import GenerationStats, Placement, Request, collect
    from helpers.loops import prefill_prompt, speculative_steps

    prompt, other = prompts(1, seed=12, lo=40, hi=41)[0], prompts(1, seed=13, lo=30, hi=31)[0]
    target, draft = load(pair["target"], pair["draft"])

    def run(reused=0):
        stats = GenerationStats()
        return collect(speculative_steps(target, draft, Request(prompt, 24), stats, where=Placement(reused=reused))), stats

    cold, cold_stats = run()
    target.reset()
    draft.reset()
    store = PrefixCheckpoints(1 << 30, every=16)
    marks = store.positions(len(prompt), 0)
    prefill_prompt(target, prompt, 0, draft, PrefillSaver(marks, lambda n: store.save(prompt[:n], target, draft)))
    target.reset()
    draft.reset()
    speculative_generate(target, draft, other, 16)
    found = store.lookup(prompt, 32, True)
    assert found.n_past == 32
    found.restore(target, draft)
    warm, warm_stats = run(reused=32)
    assert warm == cold and warm_stats.accepted_lengths == cold_stats.accepted_lengths


def test_sampling_with_penalties_runs_under_speculation(pair):
    """Sampled chain and tree decoding with penalties: the same seed gives the same tokens
    (sampling on the device is seeded), and the penalties change what is drawn."""
    from dflash_gguf import Engine, SamplingParams

    with Engine(str(pair["target"]), str(pair["draft"]), n_ctx=256, kv_type="f32", tree_budget=4) as engine:
        prompt = prompts(1, seed=14)[0]
        plain = SamplingParams(temperature=0.8, top_k=20, seed=3)
        penalized = SamplingParams(temperature=0.8, top_k=20, seed=3, repeat_penalty=1.5, presence_penalty=1.0)
        def run(sampling):
            return engine.generate(prompt, max_tokens=24, sampling=sampling, stop_tokens=()).tokens

        a = run(plain)
        assert len(a) == 24 and run(plain) == a and run(penalized) != a


def test_sliding_layers_keep_only_their_window(pair):
    """Two sliding layers in rings of window + ubatch rows, two full layers over the
    context; each cache has a verify's rows spare after it (a tree's rows past a ring's
    end)."""
    from dflash_gguf.engine.memory import plan_memory

    n_ctx, n_ubatch = 4096, 64
    plan = plan_memory(pair["target"], None, TargetConfig(n_ctx=n_ctx, n_ubatch=n_ubatch, n_verify=16, kv_type="f32"))
    row = 2 * 2 * 32 * 4  # K and V of 2 KV heads of 32 f32 values
    spare = 16
    assert sum(d.parts["kv_cache"] for d in plan.devices) == row * (2 * (WINDOW + n_ubatch + spare) + 2 * (n_ctx + spare))


# ---- bad input ------------------------------------------------------------------------------------

def test_unknown_quantization_is_refused(pair, tmp_path, capfd):
    from dflash_gguf.convert.cli import main

    d = with_config(pair["target_dir"], tmp_path / "fp8", quantization_config={"quant_method": "fp8"})
    assert main([str(d), "--outfile", str(tmp_path / "x.gguf")]) == 2
    err = capfd.readouterr().err
    assert "'fp8'" in err and "mxfp4" in err and "Traceback" not in err
    # MXFP4 blocks without the config saying so
    d = with_config(pair["mxfp4_dir"], tmp_path / "unsaid", quantization_config=None)
    assert main([str(d), "--outfile", str(tmp_path / "y.gguf")]) == 2
    assert "quant_method 'mxfp4'" in capfd.readouterr().err


def test_drafter_for_another_gpt_oss_size_is_refused(pair, tmp_path, convert_model, capfd):
    """A deeper target with the same tokenizer and width (20b's drafter next to 120b):
    refused when converting and when loading."""
    from dflash_gguf.convert.cli import main

    deeper = make_gptoss(tmp_path / "deeper", layers=6, seed=5)
    assert main([str(pair["draft_dir"]), "--target-model-dir", str(deeper), "--outfile", str(tmp_path / "d.gguf")]) == 2
    assert "4-layer target" in capfd.readouterr().err
    meta = read_draft_metadata(pair["draft"])
    target = Target(str(convert_model(deeper, "f32")), TargetConfig(n_ctx=128, feature_layers=meta["target_layers"]))
    with pytest.raises(DflashError, match="4 layers.*has 6: wrong target/drafter pair"):
        Draft(str(pair["draft"]), target)


def test_context_past_yarn_is_refused(pair):
    with pytest.raises(DflashError, match="past what YaRN covers"):
        Target(pair["target"], TargetConfig(n_ctx=32 * 4096 + 1))


# ---- serving ---------------------------------------------------------------------------------------

def test_harmony_through_the_server(pair, tmp_path, published_template):
    """dflash-server on the gpt-oss pair: the chat template is the GGUF's (the published
    gpt-oss one), the turn is harmony's (the prompt transformers renders, reasoning effort
    included), and the reply is the engine's generation read by the harmony parser."""
    from helpers.chat_fixtures import transformers_render
    from helpers.chat_fixtures import GPT_OSS, llama_cpp_messages
    from helpers.servers import WEATHER, ServerProcess, template_messages

    from dflash_gguf.chat.assistant import prepare_turn
    from dflash_gguf.engine.engine import Engine
    from dflash_gguf.chat.toolcalls import format_of

    source = published_template(GPT_OSS)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]
    kwargs = {"reasoning_effort": "high"}
    with Engine(str(pair["target"]), str(pair["draft"]), n_ctx=512, n_threads=1) as engine:
        template = engine.chat_template(tools=True)
        assert template.harmony and format_of(template) == "harmony"
        turn = prepare_turn(template, template_messages(messages), tools=WEATHER, template_kwargs=kwargs)
        assert turn.tool_format == "harmony" and "Reasoning: high" in turn.prompt
        assert turn.prompt == transformers_render(source, llama_cpp_messages(messages), WEATHER,
                                                  bos_token="<|startoftext|>", eos_token="<|return|>", **kwargs)
        gen = engine.generate(turn.prompt, 16)
        parser = turn.parser()
        parser.feed(gen.text)
        parser.finish()
        want = parser.reply
    s = ServerProcess(tmp_path, "-m", str(pair["target"]), "-md", str(pair["draft"]), "-c", "512", "-t", "1",
                      "--checkpoint-mib", "0")
    try:
        assert s.http.get("/props").json()["chat_template"] == source
        resp = s.client.chat.completions.create(model="x", messages=messages, tools=WEATHER, max_tokens=16,
                                                temperature=0, extra_body=kwargs)
        message = resp.choices[0].message
        assert resp.usage.completion_tokens == gen.stats.generated_tokens
        assert (message.model_extra.get("reasoning_content"), message.content) == \
            (want.reasoning or None, want.content or None)
    finally:
        s.stop()
    assert s.proc.returncode == 0 and "Traceback" not in s.text


def test_partial_offload_matches_the_cpu(pair, rpc_endpoint):
    """Sinks, expert biases, the clamped SwiGLU, MXFP4 experts and the YaRN factors on
    ggml's RPC device (the tests' stand-in for a GPU) for half the layers: the CPU's
    logits and tokens."""
    placements = [{"device": "CPU", "n_gpu_layers": -1}, {"device": "RPC0", "n_gpu_layers": 2}]
    res = run_isolated("offload_trace", rpc_endpoint, str(pair["mxfp4"]), str(pair["draft"]), placements, 16)
    cpu, *offloaded = res["runs"]
    for place, r in zip(placements[1:], offloaded):
        for stage, (a, b) in enumerate(zip(r["logits"], cpu["logits"])):
            err = np.abs(np.asarray(a) - np.asarray(b)).max()
            assert err < 1e-4, f"ngl {place['n_gpu_layers']}, stage {stage}: logits differ by {err}"
        assert r["chain"] == cpu["chain"] and r["tree"] == cpu["tree"], place
