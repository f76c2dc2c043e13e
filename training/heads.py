"""What training/train_mtp.py and training/train_eagle3.py share: the frozen demo target
(recovered exactly from the bundled GGUF, training/target_from_gguf.py), its own greedy
continuations as data, training-time test over all positions of a sequence at once,
the held-out estimate of chain acceptance, llama.cpp's measured acceptance, and the
README section of a head.

Both heads draft autoregressively: step 1 of the row at anchor a reads the target's
state at a (the MTP head its last hidden state, EAGLE3 three layers' hidden states) and
the token after it, x[a+1], and predicts the target's next token; step k reads step
k-1's own output hidden state and the token step k-1 drafted. In llama.cpp (and in
decoding) the head's KV cache holds the step-1 rows of every position before the anchor
and the anchor's own rows of the steps before; `ttt_attention` gives each row exactly
those keys, so one forward per step trains every anchor of a sequence.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import train_demo as demo  # training/train_demo.py, beside this file

ROOT = demo.ROOT
DATA_DIR = demo.DATA_DIR
DEMO_TARGET_GGUF = DATA_DIR / "demo-target.gguf"
HF_TEMPLATE = ROOT / "tests" / "data" / "demo-hf" / "target"
log, fmt_time = demo.log, demo.fmt_time


def seed_everything(seed: int, threads: int) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # see train_demo.py: Gated DeltaNet decays reach denormals
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    transformers.logging.set_verbosity_error()
    demo.patch_transformers()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---- the frozen target --------------------------------------------------------------------

def target_checkpoint(work: Path, gguf: Path = DEMO_TARGET_GGUF) -> Path:
    """The f32 checkpoint whose conversion gives `gguf`'s model tensors byte for byte (made
    once per GGUF; an MTP head in the GGUF is not part of it)."""
    from target_from_gguf import recover

    out = work / "demo-target"  # its name is what a drafter converted against it records
    stamp = out / "source.sha256"
    sha = file_sha256(gguf)
    if not (stamp.exists() and stamp.read_text() == sha):
        log(f"target: recovering the f32 checkpoint of {gguf.name} into {out}")
        recover(gguf, HF_TEMPLATE, out)
        stamp.write_text(sha)
    return out


def load_target(directory: Path):
    import torch
    from transformers import Qwen3_5ForCausalLM

    target = Qwen3_5ForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target


def corpus_streams(tok, seed: int, quick: bool):
    _, train_docs, heldout_docs = demo.build_corpus(quick)
    return demo.encode_stream(tok, train_docs, seed), demo.encode_stream(tok, heldout_docs, seed)


def onpolicy(work: Path, tok, streams, n_train: int, n_heldout: int, seq_len: int, seed: int, threads: int):
    """(train, held-out) int32 [n, seq_len]: corpus prompts of 16..seq_len/2 tokens continued
    greedily by the bundled target (dflash_gguf runtime), as train_demo.py's drafter data;
    kept in `work`, keyed by the target file, for the other head's run."""
    import numpy as np

    model = file_sha256(DEMO_TARGET_GGUF)[:12]
    path = work / f"onpolicy-{model}-{n_train}-{n_heldout}-{seq_len}-{seed}.npz"
    if path.exists():
        data = np.load(path)
        return data["train"], data["heldout"]
    rng = np.random.default_rng(seed + 4)
    train_stream, heldout_stream = streams
    prompts = demo.sample_prompts(tok, train_stream, n_train, rng, 16, seq_len // 2)
    train = demo.generate_onpolicy(DEMO_TARGET_GGUF.resolve(), prompts, seq_len, threads, "on-policy data")
    prompts = demo.sample_prompts(tok, heldout_stream, n_heldout, rng, 16, seq_len // 2)
    heldout = demo.generate_onpolicy(DEMO_TARGET_GGUF.resolve(), prompts, seq_len, threads, "on-policy held-out")
    np.savez(path, train=train, heldout=heldout)
    return train, heldout


def target_states(target, seqs, what, batch: int = 8, bf16: bool = True):
    """Run the frozen target over `seqs` once: (what(hidden_states) per sequence as bf16,
    greedy next tokens int64). hidden_states[0] is the embedding output, [i] the output
    of layer i-1 (the input of layer i), the last one after the final norm."""
    import torch

    feats, greedy = [], []
    with torch.no_grad():
        for i in range(0, len(seqs), batch):
            x = torch.from_numpy(seqs[i:i + batch].astype("int64"))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = target(input_ids=x, output_hidden_states=True)
            feats.append(what(out.hidden_states).to(torch.bfloat16))
            greedy.append(out.logits.float().argmax(-1))
    return torch.cat(feats), torch.cat(greedy)


# ---- training-time test --------------------------------------------------------------------

def ttt_attention(q, k, v, cache: list, scale: float):
    """Attention of one training-time-test step, for all anchors at once.

    q [B, H, A, d], k/v [B, Hkv, A, d] (RoPE applied), row a = anchor a. `cache` holds the
    (k, v) of the earlier steps, cache[0] step 1's. Row a of step 1 sees the step-1 rows of
    anchors <= a; of step s > 1, those plus row a of steps 2..s. (k, v) is appended."""
    import torch

    rep = q.shape[1] // k.shape[1]
    expand = (lambda t: t.repeat_interleave(rep, dim=1)) if rep > 1 else (lambda t: t)
    steps = cache + [(k, v)]
    k1, v1 = expand(steps[0][0]), expand(steps[0][1])
    A = q.shape[2]
    causal = torch.ones(A, A, dtype=torch.bool, device=q.device).tril()
    scores = [(q @ k1.transpose(-1, -2)).float().masked_fill(~causal, float("-inf"))]
    scores += [(q * expand(kj)).sum(-1, keepdim=True).float() for kj, _ in steps[1:]]
    p = (torch.cat(scores, -1) * scale).softmax(-1).to(q.dtype)
    out = p[..., :A] @ v1
    for j, (_, vj) in enumerate(steps[1:]):
        out = out + p[..., A + j:A + j + 1] * expand(vj)
    cache.append((k, v))
    return out


def ttt_rows(x, greedy, steps: int):
    """Inputs and labels of every training-time-test step, anchors a = 0..L-2.

    Step s feeds token x[a+s] (s = 1: the token after the anchor; later: the token the
    previous step should have drafted) and is labelled with the target's greedy token
    greedy[a+s]. That label is the target's greedy continuation from the anchor only while
    the sequence stays on the target's greedy path in between (x[a+j+1] == greedy[a+j],
    0 < j < s) and a+s < L: `valid` marks it. Returns [(tokens, labels, valid)] per step."""
    import torch

    B, L = x.shape
    A = L - 1
    on_path = torch.cat([x[:, 1:] == greedy[:, :-1], torch.zeros(B, 1, dtype=torch.bool)], 1)  # on_path[t]: x[t+1] == greedy[t]
    a = torch.arange(A)
    out = []
    exact = torch.ones(B, A, dtype=torch.bool)
    for s in range(1, steps + 1):
        idx = (a + s).clamp(max=L - 1)
        if s > 1:
            exact = exact & on_path[:, (a + s - 1).clamp(max=L - 1)]
        valid = exact & (a + s <= L - 1)
        out.append((x[:, idx], greedy[:, idx], valid))
    return out


def chain_metrics(correct: list, valid: list) -> dict:
    """Per-step accuracy and chain acceptance from per-step `correct` and `valid` masks
    [B, A] of anchors whose every step has a label (the chain estimate needs them all)."""
    import torch

    full = valid[-1]  # validity only shrinks with the step
    chain = torch.ones_like(full)
    acc, accept = [], []
    for c, v in zip(correct, valid):
        acc.append(float((c & v).sum() / v.sum().clamp_min(1)))
        chain = chain & c
        accept.append(float((chain & full).sum() / full.sum().clamp_min(1)))
    return {"acc": acc, "accept_chain": accept, "est_al": 1 + sum(accept), "anchors": int(full.sum())}



# ---- llama.cpp's measurement ---------------------------------------------------------------

def speculative_counts(target: Path, draft: Path | None, spec_type: str, n_max: int, n_predict: int,
                       threads: int) -> list[dict]:
    """llama-speculative-simple, greedy, on each prompt of dflash_gguf/bench/prompts.py with
    --spec-draft-n-max n_max and p-min 0: its drafted and accepted counts per prompt."""
    from dflash_gguf.tools import llama_cpp_tree
    from dflash_gguf.bench.llama_cpp import parse_speculative, run_parsed
    from dflash_gguf.bench.prompts import PROMPTS

    exe = llama_cpp_tree.tool("llama-speculative-simple")
    if exe is None:
        raise SystemExit("llama-speculative-simple is not built: .venv/bin/python scripts/llama_cpp_build.py "
                         "llama-speculative-simple")
    t = str(threads)
    rows = []
    for name, text in PROMPTS:
        cmd = [str(exe), "-m", str(target), "-c", "1024", "-n", str(n_predict), "-t", t, "-tb", t, "--temp", "0",
               "--spec-type", spec_type, "--spec-draft-n-max", str(n_max), "--spec-draft-n-min", "0",
               "--spec-draft-p-min", "0", "-p", text]
        if draft is not None:
            cmd += ["-md", str(draft), "-td", t, "-tbd", t]
        _, r = run_parsed(cmd, parse_speculative, "rounds", attempts=6)  # see run_parsed: lost log lines
        rows.append({"prompt": name, "n_drafted": r["n_drafted"], "n_accept": r["n_accept"],
                     "n_predict": r["n_predict"], "target_passes": r["rounds"]})
        log(f"llama.cpp {spec_type}: {name}: accepted {r['n_accept']} of {r['n_drafted']} drafted, "
            f"{r['n_predict']} tokens in {r['rounds']} target passes")
    return rows


def counts_table(rows: list[dict]) -> list[str]:
    lines = ["| prompt | drafted | accepted | accepted / drafted | tokens | target passes | tokens per pass |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['prompt']} | {r['n_drafted']} | {r['n_accept']} | "
                     f"{r['n_accept'] / max(1, r['n_drafted']):.2f} | {r['n_predict']} | {r['target_passes']} | "
                     f"{r['n_predict'] / max(1, r['target_passes']):.2f} |")
    drafted, accepted = sum(r["n_drafted"] for r in rows), sum(r["n_accept"] for r in rows)
    tokens, passes = sum(r["n_predict"] for r in rows), sum(r["target_passes"] for r in rows)
    lines.append(f"| **all** | {drafted} | {accepted} | {accepted / max(1, drafted):.2f} | {tokens} | {passes} | "
                 f"{tokens / max(1, passes):.2f} |")
    return lines


def metrics_table(m: dict) -> list[str]:
    ks = range(1, len(m["acc"]) + 1)
    return [
        "| draft step k | " + " | ".join(str(k) for k in ks) + " |",
        "|---|" + "---:|" * len(m["acc"]),
        "| accuracy at step k (anchors with a greedy label at k) | "
        + " | ".join(f"{x:.3f}" for x in m["acc"]) + " |",
        "| P(drafts 1..k all right) (anchors with labels at every step) | " + " | ".join(f"{x:.3f}" for x in m["accept_chain"]) + " |",
    ]


def write_readme_section(title: str, body: list[str]) -> None:
    """Put `## title` and `body` into dflash_gguf/data/README.md, replacing a section of
    that title (up to the next `## `), else appending it. train_demo.py keeps every section
    from its weak-drafter section on, which comes before these."""
    readme = DATA_DIR / "README.md"
    text = readme.read_text(encoding="utf-8")
    head = f"## {title}\n"
    section = head + "\n" + "\n".join(body).rstrip("\n") + "\n"
    if head in text:
        start = text.index(head)
        end = text.find("\n## ", start + len(head))
        text = text[:start] + section + (text[end:] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    readme.write_text(text, encoding="utf-8")


def save_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")

