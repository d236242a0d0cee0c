"""Causal self-attention with grouped-query heads (GQA) and RoPE.

One fused projection `attn: d -> (H + 2G) * hd`, laid out as [q (H*hd) | k (G*hd) | v (G*hd)].
Attention runs through `F.scaled_dot_product_attention` (flash/memory-efficient kernels where the backend has
them); flash-attn is used on CUDA when installed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from archscale.models.rope import apply_rope

try:  # optional CUDA kernel
    from flash_attn import flash_attn_func  # type: ignore
except Exception:  # pragma: no cover - not installable without CUDA
    flash_attn_func = None

# `enable_gqa` arrived in torch 2.5.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_query_groups: int, head_size: int, bias: bool = False,
                 attn_scale_mult: float = 1.0, use_rope: bool = True):
        super().__init__()
        self.n_head, self.n_query_groups, self.head_size = n_head, n_query_groups, head_size
        self.attn = nn.Linear(n_embd, (n_head + 2 * n_query_groups) * head_size, bias=bias)
        self.proj = nn.Linear(n_head * head_size, n_embd, bias=bias)
        self.scale = attn_scale_mult / math.sqrt(head_size)
        self.use_rope = use_rope

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, G, hd = self.n_head, self.n_query_groups, self.head_size
        # q and k are adjacent in the fused output, so RoPE rotates both in one call (half the elementwise
        # kernels of rotating them separately), on the (B, T, heads, hd) layout before the transpose.
        qk, v = self.attn(x).split(((H + G) * hd, G * hd), dim=-1)
        qk = qk.view(B, T, H + G, hd)
        if self.use_rope:
            qk = apply_rope(qk, cos.unsqueeze(1), sin.unsqueeze(1))
        q, k = qk.split((H, G), dim=2)
        y = self._attend(q.transpose(1, 2), k.transpose(1, 2), v.view(B, T, G, hd).transpose(1, 2))
        return self.proj(y.transpose(1, 2).reshape(B, T, H * hd))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (B, H, T, hd); k, v: (B, G, T, hd) -> (B, H, T, hd)."""
        if flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  softmax_scale=self.scale, causal=True)
            return out.transpose(1, 2)
        if self.n_query_groups != self.n_head:
            if q.device.type == "cpu" and _SDPA_HAS_GQA:
                # The CPU flash kernel reads the shared K/V heads in place: faster than expanding them (fewer
                # copies forward, no reduction of the expanded grads backward; see docs/BENCHMARKS.md).
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            # Elsewhere expand K/V to all heads: not every CUDA SDPA backend accepts grouped heads.
            rep = self.n_head // self.n_query_groups
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
