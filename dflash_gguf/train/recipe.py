"""The DFlash training recipe (the paper, arXiv:2602.06036, and SpecForge's
specforge/core/dflash.py): target layer ids spread over the depth as z-lab spreads
them, random anchors (many per sequence, all in one forward), the block mask, and the
cross-entropy weighted exp(-(k-1)/gamma) over block positions k = 1..B-1."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..convert.models.dflash_target import build_target_layer_ids

# SpecForge's defaults: gamma 7 for block 16, 5 for 10, 4 for 8
_GAMMAS = {16: 7.0, 10: 5.0, 8: 4.0}
# weight of a label the target gives after text that left its own greedy path inside the
# block (the drafter never sees such a context when it serves): kept, but less
INEXACT_WEIGHT = 0.25


def default_gamma(block_size: int) -> float:
    return _GAMMAS.get(block_size, 7.0 * block_size / 16)


def target_layer_ids(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """z-lab's spread (HF ids: the output of layer id), duplicates dropped (a shallow
    target gives the same id twice, which would only widen fc with a copy)."""
    ids = build_target_layer_ids(n_target_layers, n_draft_layers)
    return list(dict.fromkeys(min(max(i, 0), n_target_layers - 2) for i in ids))


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """exp(-(k-1)/gamma) for k = 1..B-1: early drafts gate every later one."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def anchor_batch(x: torch.Tensor, greedy: torch.Tensor, n_anchors: int, block: int, mask_id: int,
                 gen: torch.Generator):
    """Blocks for `n_anchors` random anchors per sequence.

    x: [S, L] tokens; greedy[:, t] = the target's argmax after x[:, :t+1]. An anchor at p
    (1 <= p <= L-B+1) is the block [x[p], MASK x (B-1)] at positions p..p+B-1; it sees
    the context features of positions < p and its own block (both directions). Its label
    at block position k is greedy[p+k-1], which is the target's own continuation of
    x[:p+1] only while x agrees with the target in between: `exact` marks those.
    Returns noise [S, A*B], position_ids [S, L+A*B], mask [S, 1, A*B, L+A*B] (True:
    visible), labels [S, A, B-1], exact [S, A, B-1] and the anchors p [S, A]."""
    S, L = x.shape
    hi = L - block + 1
    if hi < 1:
        raise ValueError(f"sequences of {L} tokens are too short for a block of {block}")
    n_anchors = min(n_anchors, hi)
    p = torch.rand(S, hi, generator=gen).topk(n_anchors, dim=1).indices.sort(dim=1).values + 1
    k = torch.arange(block)
    pos = p[:, :, None] + k                                                    # [S, A, B]
    noise = torch.full((S, n_anchors, block), mask_id, dtype=torch.long)
    noise[:, :, 0] = x.gather(1, p)
    labels = label_rows(greedy, p, block)
    agree = x[:, 1:] == greedy[:, :-1]                                         # agree[t-1]: x[t] == greedy[t-1]
    agree_at = agree.gather(1, (pos[:, :, 1:-1] - 1).reshape(S, -1)).view(S, n_anchors, block - 2)
    exact = torch.cat([torch.ones(S, n_anchors, 1, dtype=torch.bool), agree_at.cumprod(-1).bool()], -1)
    q_block = torch.arange(n_anchors).repeat_interleave(block)                 # [Q]
    ctx_vis = torch.arange(L)[None, None, :] < p[:, q_block][:, :, None]       # [S, Q, L]
    own = (q_block[:, None] == q_block[None, :]).expand(S, -1, -1)             # [S, Q, Q]
    mask = torch.cat([ctx_vis, own], -1)[:, None]
    position_ids = torch.cat([torch.arange(L).expand(S, L), pos.reshape(S, -1)], 1)
    return noise.reshape(S, -1), position_ids, mask, labels, exact, p


def label_rows(rows: torch.Tensor, anchors: torch.Tensor, block: int) -> torch.Tensor:
    """rows [S, L, ...] (per-position target outputs) at the labels' positions of
    anchor_batch's blocks: [S, A, B-1, ...] (label k of the anchor at p is row p+k-1)."""
    S, A = anchors.shape
    idx = (anchors[:, :, None] + torch.arange(block - 1)).reshape(S, -1)       # [S, A*(B-1)]
    idx = idx.view(S, -1, *([1] * (rows.dim() - 2))).expand(-1, -1, *rows.shape[2:])
    return rows.gather(1, idx).view(S, A, block - 1, *rows.shape[2:])


def weighted_loss(logits: torch.Tensor, labels: torch.Tensor, exact: torch.Tensor, weights: torch.Tensor,
                  soft: tuple | None = None):
    """Cross-entropy per label weighted by block position (weights [B-1]) and by
    exactness; returns (loss, per-position accuracy over exact labels [B-1]). soft: the
    target's top-k (ids into logits' last axis [S, A, B-1, K], probabilities [..., K]):
    the cross-entropy against that distribution (its KL to the drafter's, plus the
    teacher's entropy, a constant) instead of against the argmax."""
    if soft is None:
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none")
    else:
        ids, probs = soft
        ce = -(probs * F.log_softmax(logits.float(), -1).gather(-1, ids)).sum(-1)
    w = weights * torch.where(exact, 1.0, INEXACT_WEIGHT)
    loss = (ce.view_as(w) * w).sum() / w.sum()
    correct = (logits.argmax(-1) == labels) & exact
    acc = correct.float().sum((0, 1)) / exact.float().sum((0, 1)).clamp_min(1)
    return loss, acc


def kept_vocab(counts: torch.Tensor, n: int) -> torch.Tensor | None:
    """The loss's vocabulary for a large target vocabulary: the `n` tokens most frequent
    in the training data (the rest of a 150K vocabulary is mostly never the target's
    argmax on this data). None: the whole vocabulary (n == 0 or not smaller)."""
    if n <= 0 or n >= counts.numel():
        return None
    return counts.topk(n).indices.sort().values


def subset_logits(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, kept: torch.Tensor | None,
                  soft_ids: torch.Tensor | None = None):
    """Logits over the whole head, or over `kept` plus this batch's labels and top-k ids
    (both remapped into that set). Returns (logits, labels, soft_ids)."""
    if kept is None:
        return hidden @ head.T, labels, soft_ids
    extra = [labels.reshape(-1)] + ([] if soft_ids is None else [soft_ids.reshape(-1)])
    cand = torch.unique(torch.cat([kept, *extra]))
    return (hidden @ head[cand].T, torch.searchsorted(cand, labels),
            None if soft_ids is None else torch.searchsorted(cand, soft_ids))


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """A target's final logit softcap (Gemma's cap * tanh(logits / cap)), which the
    drafter's head applies as the target's does; 0: none."""
    return cap * torch.tanh(logits / cap) if cap > 0 else logits


def cosine_lr(peak: float, step: int, steps: int, warmup: int, floor: float = 0.1) -> float:
    """A step budget's schedule: linear warmup, then cosine to floor*peak over `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def timed_lr(peak: float, step: int, done: float, warmup: int = 20, floor: float = 0.1) -> float:
    """A time budget's schedule (no step budget to plan by): linear warmup over the first
    `warmup` steps, times a cosine from peak to floor*peak over the fraction `done` of the
    budget spent. A slow step (a large target on a CPU) must not spend the budget warming up."""
    cos = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, done))))
    return peak * min(1.0, (step + 1) / warmup) * cos
