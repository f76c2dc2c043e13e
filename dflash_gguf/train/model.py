"""The DFlash drafter in torch, parameter for parameter z-lab's DFlashDraftModel (same
names, so the state dict is their HF checkpoint and convert/models/dflash_tensors.py's tensor map
applies): fc fuses the target's captured layers, hidden_norm normalizes that context,
each Qwen3 layer projects context and block rows with its own k/v weights (k_norm and
RoPE on both, the layer's input norm on the block rows only) and attends without a
causal mask; norm is the final norm. Embedding and LM head are the target's, passed in
(frozen), never parameters of this module."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DrafterShape:
    hidden: int
    n_feat: int  # target layers fused by fc
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float
    eps: float = 1e-6

    def to_dict(self) -> dict:
        return asdict(self)


def default_shape(hidden: int, n_feat: int, layers: int, rope_theta: float, eps: float) -> DrafterShape:
    """z-lab's proportions (Qwen3-8B's drafter: head_dim 128, 4 query heads per KV head,
    FFN 3x hidden), with smaller heads for small targets."""
    head_dim = 128 if hidden >= 1024 else 64 if hidden >= 256 else 32
    heads = max(1, hidden // head_dim)
    kv_heads = heads // 4 if heads % 4 == 0 and heads >= 8 else heads // 2 if heads % 2 == 0 else heads
    return DrafterShape(hidden, n_feat, layers, heads, kv_heads, head_dim, 3 * hidden, rope_theta, eps)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Attention(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.eps)
        self.k_norm = RMSNorm(s.head_dim, s.eps)

    def forward(self, x, ctx, cos, sin, mask):
        s, (S, Q, _), L = self.s, x.shape, ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(S, Q, s.heads, s.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], 1).view(S, L + Q, s.kv_heads, s.head_dim)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], 1).view(S, L + Q, s.kv_heads, s.head_dim)
        k, v = self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        c, n = cos[:, None], sin[:, None]  # [S, 1, L+Q, D]
        q = q * c[:, :, L:] + rotate_half(q) * n[:, :, L:]
        k = k * c + rotate_half(k) * n
        rep = s.heads // s.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(S, Q, -1))


class MLP(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.ffn, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.ffn, bias=False)
        self.down_proj = nn.Linear(s.ffn, s.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)

    def forward(self, x, ctx, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    def __init__(self, s: DrafterShape):
        super().__init__()
        self.shape = s
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden, s.eps)
        self.fc = nn.Linear(s.n_feat * s.hidden, s.hidden, bias=False)
        self.hidden_norm = RMSNorm(s.hidden, s.eps)
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float64) / s.head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def init_weights(self, seed: int) -> None:
        """Seeded init: norms at 1, matrices N(0, 0.02) as transformers initializes Qwen3."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if p.ndim == 1:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)

    def forward(self, features, noise_embedding, position_ids, mask):
        """features [S, L, n_feat*hidden] (the context), noise_embedding [S, Q, hidden]
        (the blocks' embedded tokens), position_ids [S, L+Q], mask [S, 1, Q, L+Q] (True:
        visible). Returns the final-normed hidden states [S, Q, hidden]."""
        ctx = self.hidden_norm(self.fc(features))
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().to(ctx.dtype), emb.sin().to(ctx.dtype)
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, mask)
        return self.norm(x)
