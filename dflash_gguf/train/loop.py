"""The training loop: per step a seeded draw of windows and anchors (a function of the
seed and the step alone, so a resumed run repeats an uninterrupted one exactly), the
target's features and labels from our runtime, one AdamW step on the drafter; progress,
checkpoints, acceptance measurements and the final report."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .options import ScheduleOptions, TrainOptions
from .target import TrainError


def _need_torch():
    try:
        import torch
    except ImportError:
        raise TrainError("dflash-train needs PyTorch: pip install dflash-gguf[train]") from None
    return torch


def _mask_id(tokenizer, meta, spec: Optional[str], n_vocab: int) -> int:
    """--mask-token (an id or a token's text), else <|mask|>, else the first unused
    vocabulary entry (an embedding padded past the tokenizer), else the padding token
    when it is not the end-of-text token."""
    import gguf

    tokens = meta.get("tokenizer.ggml.tokens")
    if spec is not None:
        if spec.isdigit():
            mid = int(spec)
        elif spec in tokens:
            mid = tokens.index(spec)
        else:
            raise TrainError(f"--mask-token {spec!r} is neither a token id nor a token of the target's vocabulary")
        if not 0 <= mid < n_vocab:
            raise TrainError(f"--mask-token {mid} is outside the target's vocabulary (0..{n_vocab - 1})")
        return mid
    for name in ("<|mask|>", "<mask>", "[MASK]"):
        if name in tokens:
            return tokens.index(name)
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None:
        unused = np.flatnonzero(types == gguf.TokenType.UNUSED)
        if len(unused):
            return int(unused[0])
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None and pad != tokenizer.eos_id:
        return int(pad)
    raise TrainError("the target's vocabulary has no mask, unused or padding token: pass --mask-token ID")


def _fmt_time(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _check(opts: TrainOptions) -> None:
    """The options' own errors, before anything is loaded."""
    if opts.schedule.steps is None and opts.schedule.max_minutes is None:
        raise TrainError("give a budget: --steps N and/or --max-minutes M")
    if opts.drafter.block_size < 2:
        raise TrainError("--block-size must be at least 2")
    if opts.corpus.ctx_size < opts.drafter.block_size + 1:
        raise TrainError(f"-c {opts.corpus.ctx_size} must exceed --block-size {opts.drafter.block_size}")
    if opts.drafter.draft_vocab < 0:
        raise TrainError(f"--draft-vocab must be 0 (the whole head) or more, got {opts.drafter.draft_vocab}")
    if opts.objective.top_k_labels < 0:
        raise TrainError(f"--top-k-labels must be 0 (argmax labels) or more, got {opts.objective.top_k_labels}")


@dataclass
class _Plan:
    """What the target GGUF and the data fix before the first step."""

    meta: dict  # read_target_meta's, with n_vocab
    embd: np.ndarray  # the target's token embedding, vocabulary x hidden
    head: np.ndarray  # its LM head
    mask_id: int
    data: object  # data.Dataset: train windows, held-out documents, sha256
    layer_ids: list  # the target layers whose features the drafter reads
    gamma: float
    shape: object  # model.DrafterShape

    def settings(self, opts: TrainOptions) -> dict:
        return _settings(opts, self.layer_ids, self.gamma, self.shape, self.mask_id, self.data.sha256)


def _plan(opts: TrainOptions, say) -> _Plan:
    """The target's shape, vocabulary and mask token, the data's windows and the drafter's shape."""
    from ..chat.templates import ChatTemplate
    from ..runtime.tokenizer import Tokenizer
    from . import recipe
    from .model import default_shape
    from .target import embedding_and_head, read_target_meta

    meta = read_target_meta(opts.model)
    embd, head = embedding_and_head(meta["gguf"])
    meta["n_vocab"] = embd.shape[0]
    if opts.objective.top_k_labels > meta["n_vocab"]:
        raise TrainError(f"--top-k-labels {opts.objective.top_k_labels} exceeds the vocabulary ({meta['n_vocab']})")
    tokenizer = Tokenizer(opts.model)
    mask_id = _mask_id(tokenizer, meta["gguf"], opts.drafter.mask_token, meta["n_vocab"])
    template = ChatTemplate.of_tokenizer(tokenizer, tokenizer.chat_template) if tokenizer.chat_template else None

    def render(messages):
        if template is None:
            raise TrainError("--data has chats, but the target GGUF has no chat template")
        return template.render(messages, add_generation_prompt=False)

    data = load_data(opts, tokenizer, render)
    if opts.corpus.regenerate:
        from .data import regenerate

        say(f"dflash-train: regenerating {len(data.train)} windows with the target")
        regenerate(data, opts.model, max(1, opts.corpus.ctx_size // 4), opts.runtime.threads, opts.runtime.device, say)
    layer_ids = list(opts.drafter.target_layer_ids) if opts.drafter.target_layer_ids else \
        recipe.target_layer_ids(meta["n_layer"], opts.drafter.draft_layers)
    if any(not 0 <= i < meta["n_layer"] for i in layer_ids):
        raise TrainError(f"target layer ids {layer_ids} must lie in 0..{meta['n_layer'] - 1}")
    gamma = opts.objective.gamma or recipe.default_gamma(opts.drafter.block_size)
    shape = default_shape(meta["n_embd"], len(layer_ids), opts.drafter.draft_layers, meta["rope_theta"], meta["eps"])
    return _Plan(meta, embd, head, mask_id, data, layer_ids, gamma, shape)


class _Objective:
    """A step's loss: the drafter's block predictions through the target's head, against the
    target's greedy tokens (or its top-k distribution), weighted by block position."""

    def __init__(self, torch, opts: TrainOptions, plan: _Plan, dev):
        from . import recipe

        self.torch, self.opts, self.dev, self.meta, self.mask_id = torch, opts, dev, plan.meta, plan.mask_id
        self.embd = torch.from_numpy(plan.embd)  # looked up on the host: only the batch's rows go to the device
        self.head = torch.from_numpy(plan.head).to(dev)
        counts = torch.bincount(torch.from_numpy(np.concatenate(plan.data.train).astype(np.int64)),
                                minlength=plan.meta["n_vocab"])
        kept = recipe.kept_vocab(counts, opts.objective.loss_vocab)
        self.head_tokens = _head_tokens(opts, counts.numpy())  # --draft-vocab's set, or None
        self.kept = None if kept is None else kept.to(dev)
        self.weights = recipe.position_weights(opts.drafter.block_size, plan.gamma).to(dev)

    def __call__(self, model, x, feats, greedy, top, gen):
        """(loss, accuracy per block position, labels counted) of windows `x`."""
        from . import recipe

        B, objective = self.opts.drafter.block_size, self.opts.objective
        noise, pos, mask, labels, exact, anchors = recipe.anchor_batch(x, greedy, objective.anchors, B, self.mask_id,
                                                                        gen)
        soft_ids = soft_probs = None
        if objective.top_k_labels:
            soft_ids, soft_probs = (recipe.label_rows(self.torch.stack(rows), anchors, B).to(self.dev)
                                    for rows in zip(*top))
        # the block's tokens embedded as the target embeds them (Gemma: scaled)
        feats, noise_embd, pos, mask, labels, exact = (
            t.to(self.dev) for t in (feats, self.embd[noise] * self.meta["embd_scale"], pos, mask, labels, exact))
        hidden = model(feats, noise_embd, pos, mask)
        S = hidden.shape[0]
        hidden = hidden.view(S, -1, B, hidden.shape[-1])[:, :, 1:]
        logits, sub_labels, soft_ids = recipe.subset_logits(hidden, self.head, labels, self.kept, soft_ids)
        logits = recipe.softcap(logits, self.meta["softcap"])
        loss, acc = recipe.weighted_loss(logits, sub_labels, exact, self.weights,
                                         None if soft_ids is None else (soft_ids, soft_probs))
        return loss, acc, labels.numel()


class _Windows:
    """The training windows' target passes (features, greedy tokens, top-k), and each step's
    seeded draw of them: a function of the seed and the step alone, so that a resumed run
    repeats an uninterrupted one. Runs whose features fit 2 GiB of host memory in bf16 keep
    every window's (half the bytes of f32, and the same rounding whether a window's features
    were just computed or kept); larger runs recompute them each step, in f32."""

    def __init__(self, torch, opts: TrainOptions, plan: _Plan):
        from .target import TargetFeatures

        self.torch, self.opts, self.train = torch, opts, plan.data.train
        self.features = TargetFeatures(opts.model, plan.layer_ids, opts.corpus.ctx_size, opts.runtime.threads,
                                       opts.runtime.device, opts.objective.top_k_labels)
        self.kept: dict[int, tuple] = {}
        self.keep = len(self.train) * opts.corpus.ctx_size * len(plan.layer_ids) * plan.meta["n_embd"] * 2 <= 2 << 30
        self.dtype = torch.bfloat16 if self.keep else torch.float32

    def target_pass(self, i: int):
        entry = self.kept.get(i)
        if entry is None:
            feats, greedy, top = self.features(self.train[i])
            from_np = self.torch.from_numpy
            entry = (from_np(feats).to(self.dtype), from_np(greedy), top and tuple(from_np(a) for a in top))
            if self.keep:
                self.kept[i] = entry
        return (entry[0].float(), *entry[1:])

    def draw(self, step: int):
        """(windows' tokens, features, greedy tokens, top-k, the anchors' generator) of `step`."""
        torch, opts = self.torch, self.opts
        rng = np.random.default_rng([opts.seed, step])
        gen = torch.Generator().manual_seed(int(rng.integers(1 << 62)))
        pick = rng.integers(0, len(self.train), size=opts.schedule.batch)
        x = torch.from_numpy(np.stack([self.train[i] for i in pick]).astype(np.int64))
        feats, greedy, top = zip(*(self.target_pass(int(i)) for i in pick))
        return x, torch.stack(feats), torch.stack(greedy), top, gen

    def close(self):
        self.features.close()


@dataclass
class _Progress:
    """Where a run is: its steps, loss curve, acceptance measurements and time, what a
    checkpoint keeps besides the weights."""

    t_start: float
    step: int = 0
    curve: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    elapsed_before: float = 0.0  # seconds trained before a --resume

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.t_start


def _drafter(torch, opts: TrainOptions, plan: _Plan, dev, progress: _Progress):
    """The drafter and its optimizer, fresh or from --resume (whose settings must match)."""
    from .model import Drafter

    torch.manual_seed(opts.seed)
    model = Drafter(plan.shape)
    model.init_weights(opts.seed)
    model.to(dev)
    optim = torch.optim.AdamW(model.parameters(), lr=opts.schedule.lr, betas=(0.9, 0.95), weight_decay=0.01)
    if opts.files.resume:
        ck = torch.load(opts.files.resume, map_location="cpu", weights_only=False)
        if ck["settings"] != plan.settings(opts):
            raise TrainError(f"--resume {opts.files.resume}: the checkpoint was made with other settings or data")
        model.load_state_dict(ck["model"])
        optim.load_state_dict(ck["optim"])
        progress.step, progress.curve, progress.evals, progress.elapsed_before = \
            ck["step"], ck["curve"], ck["evals"], ck["elapsed"]
    return model, optim


def _learning_rate(schedule: ScheduleOptions, step: int, warmup: int, deadline: Optional[float], now: float) -> float:
    """Cosine over the step budget, or over the time budget when only that is given."""
    from . import recipe

    if schedule.steps:
        return recipe.cosine_lr(schedule.lr, step, schedule.steps, warmup)
    return recipe.timed_lr(schedule.lr, step, 1 - (deadline - now) / (schedule.max_minutes * 60))


def _write_report(opts: TrainOptions, plan: _Plan, progress: _Progress, objective: _Objective) -> tuple:
    """(the run's report, where it was written)."""
    data = plan.data
    report = {
        "settings": plan.settings(opts),
        "data": {"sha256": data.sha256, "files": data.n_files, "documents": data.n_docs, "tokens": data.n_tokens,
                 "windows": len(data.train), "heldout_documents": len(data.heldout)},
        "steps": progress.step, "minutes": round(progress.elapsed() / 60, 3),
        "curve": progress.curve, "acceptance": progress.evals, "heldout_al": progress.evals[-1]["al"],
        "loss_vocabulary": None if objective.kept is None else int(len(objective.kept)),
        "output": opts.files.output, "hf_out": opts.files.hf_out,
    }
    report_path = opts.files.report or os.path.splitext(opts.files.output)[0] + ".json"
    Path(report_path).write_text(json.dumps(report, indent=1) + "\n")
    return report, report_path


def train(opts: TrainOptions, on_step: Optional[Callable[[int, dict], None]] = None) -> dict:
    """Train a DFlash drafter for the target GGUF opts.model; writes opts.files.output
    (GGUF), the report (JSON) and, with hf_out, z-lab's HF layout. Returns the report.
    on_step(step, record) runs after each step (a KeyboardInterrupt raised there or by
    the user saves a checkpoint first)."""
    torch = _need_torch()
    from . import export
    from .evaluate import AcceptanceProbe

    _check(opts)
    schedule, files, runtime, block = opts.schedule, opts.files, opts.runtime, opts.drafter.block_size
    dev = _torch_device(torch, runtime.train_device)
    progress = _Progress(time.perf_counter())
    if runtime.threads:
        torch.set_num_threads(runtime.threads)
    torch.set_flush_denormal(True)
    say = print if runtime.progress else (lambda *a, **k: None)
    plan = _plan(opts, say)
    meta = plan.meta
    objective = _Objective(torch, opts, plan, dev)
    model, optim = _drafter(torch, opts, plan, dev, progress)
    windows = _Windows(torch, opts, plan)
    probe = AcceptanceProbe(opts.model, plan.layer_ids, block, plan.data.heldout[:opts.evaluation.eval_prompts],
                            min(64, opts.corpus.ctx_size), opts.evaluation.eval_tokens, runtime.threads, runtime.device)

    def state_np():
        return {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}

    def write_gguf(path):
        export.write_gguf(path, state_np(), plan.shape, meta, opts.model, plan.layer_ids, block,
                          plan.mask_id, files.outtype, objective.head_tokens, opts.corpus.ctx_size)

    def measure(at_step: int):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "draft.gguf")
            write_gguf(path)
            r = probe.measure(path)
        r.update(step=at_step, minutes=progress.elapsed() / 60)
        progress.evals.append(r)
        return r

    def save_checkpoint():
        ck = {"settings": plan.settings(opts), "step": progress.step, "model": model.state_dict(),
              "optim": optim.state_dict(), "curve": progress.curve, "evals": progress.evals,
              "elapsed": progress.elapsed()}
        tmp = files.checkpoint_path + ".tmp"
        torch.save(ck, tmp)
        os.replace(tmp, files.checkpoint_path)

    say(f"dflash-train: target {meta['name']} ({meta['arch']}, {meta['n_layer']} layers, hidden {meta['n_embd']}, "
        f"vocab {meta['n_vocab']}); drafter {plan.shape.layers} layers, block {block}, target layers "
        f"{plan.layer_ids}, mask token {plan.mask_id}, gamma {plan.gamma:g}; data {plan.data.n_docs} documents, "
        f"{len(plan.data.train)} windows of {opts.corpus.ctx_size}, {len(plan.data.heldout)} held out; loss vocabulary "
        f"{'all' if objective.kept is None else len(objective.kept)}")
    if not progress.evals:
        say(f"  held-out AL before training: {measure(progress.step)['al']:.3f}")

    warmup = max(1, min(100, (schedule.steps or 0) // 10))
    deadline = None if schedule.max_minutes is None else \
        progress.t_start + schedule.max_minutes * 60 - progress.elapsed_before
    last_ck = last_eval = time.perf_counter()
    bar = _Bar(schedule.steps, deadline, runtime.progress)
    model.train()
    try:
        while (schedule.steps is None or progress.step < schedule.steps) and \
                (deadline is None or time.perf_counter() < deadline):
            t0 = time.perf_counter()
            x, feats, greedy, top, gen = windows.draw(progress.step)
            for g in optim.param_groups:
                g["lr"] = _learning_rate(schedule, progress.step, warmup, deadline, t0)
            loss, acc, n_labels = objective(model, x, feats, greedy, top, gen)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            progress.step += 1
            rec = {"step": progress.step, "loss": float(loss.detach()), "acc": [round(float(a), 4) for a in acc],
                   "tok_s": n_labels / (time.perf_counter() - t0)}
            progress.curve.append({"step": progress.step, "loss": round(rec["loss"], 5), "acc": rec["acc"]})
            bar.update(progress.step, rec, progress.evals[-1]["al"] if progress.evals else None)
            if on_step is not None:
                on_step(progress.step, rec)
            now = time.perf_counter()
            if opts.evaluation.eval_every and now - last_eval >= opts.evaluation.eval_every * 60:
                model.eval()
                bar.note(f"step {progress.step}: held-out AL {measure(progress.step)['al']:.3f}")
                model.train()
                last_eval = time.perf_counter()
            if files.checkpoint_every and now - last_ck >= files.checkpoint_every * 60:
                save_checkpoint()
                last_ck = time.perf_counter()
    except KeyboardInterrupt:
        save_checkpoint()
        bar.close()
        windows.close()
        probe.close()
        raise
    bar.close()
    windows.close()
    model.eval()
    save_checkpoint()
    write_gguf(files.output)
    if not progress.evals or progress.evals[-1]["step"] != progress.step:
        measure(progress.step)
    probe.close()
    if files.hf_out:
        export.write_hf(files.hf_out, state_np(), plan.shape, meta, plan.layer_ids, block, plan.mask_id,
                         opts.corpus.ctx_size)
    report, report_path = _write_report(opts, plan, progress, objective)
    say(f"dflash-train: {progress.step} steps, held-out AL {progress.evals[0]['al']:.3f} -> "
        f"{progress.evals[-1]['al']:.3f}; wrote {files.output} and {report_path}")
    return report


def _head_tokens(opts: TrainOptions, counts: np.ndarray):
    """--draft-vocab's kept set: the special tokens and the data's commonest, chosen as
    the runtime's --spec-draft-vocab chooses them (None: the file carries none)."""
    if not opts.drafter.draft_vocab:
        return None
    from ..speculation.draft_simple import kept_tokens

    try:
        return kept_tokens(opts.model, opts.drafter.draft_vocab, counts)
    except ValueError as e:
        raise TrainError(str(e).replace("--spec-draft-vocab", "--draft-vocab")) from None


def load_data(opts: TrainOptions, tokenizer, render):
    from .data import load_dataset

    corpus = opts.corpus
    return load_dataset(corpus.data, tokenizer, render, corpus.ctx_size, opts.seed, opts.evaluation.eval_prompts)


def _torch_device(torch, name: str):
    """torch's device for the drafter, or one clear line where this torch lacks it."""
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise TrainError(f"--train-device {name}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"--train-device {name}: this torch ({torch.__version__}) sees no CUDA device")
    return dev


def _settings(opts, layer_ids, gamma, shape, mask_id, data_sha) -> dict:
    """What determines the run's result (a resume must match it)."""
    corpus, drafter, objective, schedule = opts.corpus, opts.drafter, opts.objective, opts.schedule
    out = {"seed": opts.seed, "steps": schedule.steps, "regenerate": corpus.regenerate,
           "block_size": drafter.block_size, "draft_layers": drafter.draft_layers, "lr": schedule.lr,
           "ctx_size": corpus.ctx_size, "batch": schedule.batch, "anchors": objective.anchors,
           "loss_vocab": objective.loss_vocab, "top_k_labels": objective.top_k_labels,
           "draft_vocab": drafter.draft_vocab}
    out.update(model=os.path.basename(opts.model), model_sha256_head=_head_hash(opts.model), layer_ids=layer_ids,
               gamma=gamma, mask_id=mask_id, shape=shape.to_dict(), data_sha256=data_sha)
    return out


def _head_hash(path: str) -> str:
    """sha256 of the file's first MiB and its size: which target, cheaply."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    h.update(str(os.path.getsize(path)).encode())
    return h.hexdigest()[:16]


class _Bar:
    """tqdm with loss, accuracy per block position, tokens/s, held-out AL and an ETA by
    the step budget or the time budget, whichever ends first."""

    def __init__(self, steps, deadline, enabled: bool):
        from tqdm import tqdm

        self.steps, self.deadline = steps, deadline
        self.t0 = time.perf_counter()
        self.first = None
        self.bar = tqdm(total=steps, disable=not enabled, dynamic_ncols=True, bar_format=
                        "{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}" if steps else "{n_fmt} steps{postfix}")
        self.loss, self.acc = None, None

    def update(self, step, rec, al):
        now = time.perf_counter()
        if self.first is None:
            self.first = (step - 1, self.t0)
        s0, t0 = self.first
        per = (now - t0) / max(1, step - s0)
        eta = []
        if self.steps:
            eta.append(per * (self.steps - step))
        if self.deadline:
            eta.append(self.deadline - now)
        # one step's loss and accuracy are noisy (a few windows): show moving averages
        a = 0.1 if self.loss is not None else 1.0
        self.loss = rec["loss"] if self.loss is None else (1 - a) * self.loss + a * rec["loss"]
        self.acc = list(rec["acc"]) if self.acc is None else [(1 - a) * o + a * n for o, n in zip(self.acc, rec["acc"])]
        acc = "/".join(f"{x:.2f}" for x in self.acc[:4])
        post = f"loss {self.loss:.3f} acc@k {acc} {rec['tok_s']:.0f} tok/s"
        if al is not None:
            post += f" AL {al:.2f}"
        post += f" eta {_fmt_time(min(eta))}" if eta else ""
        self.bar.set_postfix_str(post, refresh=False)
        self.bar.update(1)

    def note(self, text):
        self.bar.write(text)

    def close(self):
        self.bar.close()
