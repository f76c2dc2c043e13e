#!/usr/bin/env python3
"""Train the benchmark's weak drafter: the demo drafter's recipe (training/train_demo.py)
stopped early, against the bundled demo target, so that chain acceptance is low (the
bundled one: 1.35 tokens per target pass on train_demo.py's check prompts, against 4.5
for the demo drafter).

    .venv/bin/python training/train_weak_drafter.py --out /tmp/weak-120.gguf     # 120 steps, ~10 min
    .venv/bin/python training/train_weak_drafter.py --steps 150 --resume .cache/train_weak_drafter/draft \
        --work-dir .cache/train_weak_drafter2            # 150 more: dflash_gguf/data/demo-draft-weak.gguf
    .venv/bin/python training/train_weak_drafter.py --steps 150 --lr 5e-4 \
        --resume-gguf dflash_gguf/data/demo-draft-weak.gguf --out /tmp/weak-more.gguf   # more, from the bundled file

Why a weak pair: with a strong drafter every engine amortises its fixed per-step cost
(drafting, graph launches, host syncs) over many accepted tokens; with AL about 2 that
cost decides who is faster. dflash-bench measures any pair; docs/benchmarks.md names the runs on both.

The drafter has the demo drafter's architecture (2 layers, block 8, target layers
0, 1, 2), so its propose costs the same; only its training is shorter: --steps optimizer
steps with the same cosine schedule compressed to them, on fewer on-policy sequences, in
float32 on one thread without torch.compile (which on a shared 2-core machine took
longer to compile than the whole run). The bundled file took two legs (the second
--resume'd from the first's checkpoint, with a schedule of its own), as above.
The target is the demo target's HF copy (tests/data/demo-hf/target, bf16 values of the
bundled q8_0 target's weights); on-policy continuations come from the bundled
demo-target.gguf. Seeded; a few minutes on two cores.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import train_demo as demo  # training/train_demo.py, beside this file

ROOT = demo.ROOT
HF_TARGET = ROOT / "tests" / "data" / "demo-hf" / "target"
DEMO_TARGET_GGUF = demo.DATA_DIR / "demo-target.gguf"
DEFAULT_OUT = demo.DATA_DIR / "demo-draft-weak.gguf"


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120, help="drafter optimizer steps (default 120; the demo: 2000)")
    p.add_argument("--onpolicy-seqs", type=int, default=64, help="on-policy sequences (default 64; the demo: 1536)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"drafter GGUF (default {DEFAULT_OUT})")
    p.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "train_weak_drafter")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared machine, OpenMP threads that wait for a descheduled "
                        "peer make 2 threads far slower than 1)")
    p.add_argument("--compile", action="store_true", help="torch.compile the steps (pays only for long runs)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fast only when compiled)")
    p.add_argument("--resume", type=Path, help="start from this drafter checkpoint (an earlier run's "
                   "WORK_DIR/draft) instead of random weights: a second leg of training, with its own schedule")
    p.add_argument("--resume-gguf", type=Path, help="start from the weights of this drafter GGUF (e.g. the bundled "
                   "one; q8_0 matrices are dequantized) when its checkpoint is gone")
    p.add_argument("--lr", type=float, default=2e-3,
                   help="peak learning rate (default 2e-3, the demo's; a resumed leg at the full rate first loses "
                        "ground: from the bundled file, the loss rose from 1.6 to 2.4 over its first 30 steps)")
    a = p.parse_args(argv)
    a.out = a.out.resolve()  # the runtime check runs from /

    args = demo.parse_args(["--draft-steps", str(a.steps), "--draft-lr", str(a.lr),
                            "--onpolicy-seqs", str(a.onpolicy_seqs),
                            "--threads", str(a.threads), "--work-dir", str(a.work_dir), "--log-every", "10"]
                           + ([] if a.compile else ["--no-compile"]) + ([] if a.bf16 else ["--no-bf16"]))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import numpy as np
    import torch
    import transformers
    from tokenizers import Tokenizer
    from transformers import Qwen3_5ForCausalLM

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # see train_demo.py: Gated DeltaNet decays reach denormals
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    transformers.logging.set_verbosity_error()
    demo.patch_transformers()
    for f in (HF_TARGET / "config.json", DEMO_TARGET_GGUF):
        if not f.exists():
            raise SystemExit(f"missing {f}: the bundled demo pair and its HF copy are needed")

    t_start = time.perf_counter()
    a.work_dir.mkdir(parents=True, exist_ok=True)
    draft_dir = a.work_dir / "draft"
    _, train_docs, heldout_docs = demo.build_corpus(False)
    tok = Tokenizer.from_file(str(HF_TARGET / "tokenizer.json"))
    train_stream = demo.encode_stream(tok, train_docs, args.seed)
    heldout_stream = demo.encode_stream(tok, heldout_docs, args.seed)
    demo.log(f"tokens: train {len(train_stream) / 1e6:.2f}M, held-out {len(heldout_stream) / 1e6:.2f}M")
    target = Qwen3_5ForCausalLM.from_pretrained(str(HF_TARGET), dtype=torch.float32).eval()

    rng = np.random.default_rng(args.seed + 4)
    prompts = demo.sample_prompts(tok, train_stream, args.onpolicy_seqs, rng, 16, args.seq_len // 2)
    gen_train = demo.generate_onpolicy(DEMO_TARGET_GGUF, prompts, args.seq_len, args.threads, "on-policy data")
    prompts = demo.sample_prompts(tok, heldout_stream, 8, rng, 16, args.seq_len // 2)
    gen_heldout = demo.generate_onpolicy(DEMO_TARGET_GGUF, prompts, args.seq_len, args.threads, "on-policy held-out")

    if a.resume and a.resume_gguf:
        raise SystemExit("give --resume or --resume-gguf, not both")
    if a.resume_gguf:
        fresh = demo.make_drafter
        source = a.resume_gguf.resolve()
        demo.make_drafter = lambda *args_: drafter_from_gguf(fresh(*args_), source)
        demo.log(f"drafter: resuming from the weights of {source}")
    if a.resume:
        from dflash.model import DFlashDraftModel

        resume_from = a.resume.resolve()
        if resume_from == draft_dir.resolve():
            raise SystemExit("--resume must not be this run's own WORK_DIR/draft (it is rewritten): "
                             "give the second leg another --work-dir")
        demo.make_drafter = lambda *_: DFlashDraftModel.from_pretrained(str(resume_from), dtype=torch.float32)
        demo.log(f"drafter: resuming from {resume_from}")
    t0 = time.perf_counter()
    if draft_dir.exists():
        import shutil

        shutil.rmtree(draft_dir)
    _, dinfo = demo.train_drafter(args, target, tok, train_stream, heldout_stream, gen_train, gen_heldout, draft_dir)
    train_s = time.perf_counter() - t0

    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(a.out.name + ".tmp")
    demo.run([demo.converter_bin(), str(draft_dir), "--target-model-dir", str(HF_TARGET), "--outfile", str(tmp),
              "--outtype", "q8_0", "--force", "--name", "dflash-gguf weak demo drafter", "--threads", "2"])
    verify = demo.verify_runtime(DEMO_TARGET_GGUF, tmp, args.verify_tokens, args.threads)
    tmp.replace(a.out)
    al = [r["mean_accepted"] for r in verify] if verify else []
    resumed = a.resume or a.resume_gguf
    info = {"steps": a.steps, "resumed_from": str(resumed) if resumed else None, "onpolicy_seqs": a.onpolicy_seqs,
            "train_seconds": train_s,
            "total_seconds": time.perf_counter() - t_start, "drafter": dinfo,
            "runtime_al": al, "runtime_al_mean": sum(al) / len(al) if al else None,
            "lossless": all(r["lossless"] for r in verify) if verify else None}
    (a.work_dir / "weak_info.json").write_text(json.dumps(info, indent=2))
    demo.log(f"wrote {a.out} ({a.out.stat().st_size / 1e6:.2f} MB); drafter trained in {demo.fmt_time(train_s)}, "
             f"mean runtime AL {info['runtime_al_mean'] if al else float('nan'):.2f}; info: {a.work_dir / 'weak_info.json'}")
    return 0 if info["lossless"] is not False else 1


# HF DFlash drafter names -> the dflash GGUF's (convert/models/dflash.py writes them; rows are
# not permuted for NeoX-style RoPE, which the demo drafter uses)
_GGUF_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
               "norm.weight": "output_norm.weight"}
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight"}


def drafter_from_gguf(drafter, path: Path):
    """`drafter` (a fresh DFlashDraftModel of the GGUF's architecture) with the GGUF's
    weights, dequantized to float32; every parameter must be found, with its shape."""
    import gguf
    import numpy as np
    import torch

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    state = {}
    for name, param in drafter.state_dict().items():
        if name.startswith("layers."):
            _, il, rest = name.split(".", 2)
            gname = f"blk.{il}.{_GGUF_LAYER_NAMES[rest]}"
        else:
            gname = _GGUF_NAMES[name]
        if gname not in tensors:
            raise SystemExit(f"{path}: no tensor {gname} (for {name})")
        t = tensors[gname]
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(param.shape))
        state[name] = torch.from_numpy(np.ascontiguousarray(values))
    drafter.load_state_dict(state)
    return drafter


if __name__ == "__main__":
    sys.exit(main())
