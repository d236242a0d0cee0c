"""Attention mixers with grouped-query heads (GQA): full, sliding-window, the YOCO KV layer and cross-attention.

Self-attention layers ("attn", "swa", "kv") use one fused projection `attn: d -> (H + 2G) * hd`, laid out as
[q (H*hd) | k (G*hd) | v (G*hd)]. A cross-attention layer ("cross") has only its query projection `q_proj` and
reads the K/V that the single "kv" layer produced in this forward pass (YOCO: one KV cache for the whole
cross-decoder). RoPE rotates q and k in fp32 unless the architecture is NoPE. Phi4-mini-Flash adds biases on
q, v and the output projection (`attn_bias`; k has none). With `use_da`, the softmax is replaced by differential
attention (`diff_attention.py`). The kernel choice lives in `attention_ops.attend`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from archscale.config import ModelConfig
from archscale.models.attention_ops import attend
from archscale.models.cache import InferenceCache, KVCache, WindowKVCache
from archscale.models.diff_attention import DifferentialAttention
from archscale.models.rope import apply_rope


@dataclass
class ForwardContext:
    """What layers share within one forward pass."""

    pos: int  # absolute position of the first input token (0 in training; the cache length when decoding)
    cos: torch.Tensor | None  # RoPE tables broadcastable to (B, T, heads, hd/2): (T, 1, hd/2), or (B, T, 1, hd/2)
    sin: torch.Tensor | None  # with per-document positions; None for NoPE models
    doc_ids: torch.Tensor | None = None  # (B, T) document index of every token (varlen): attention stays inside
    cache: InferenceCache | None = None
    memory: torch.Tensor | None = None  # GMU memory (set by the Mamba layer with gmu_save)
    shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # YOCO K/V (B, G, T_kv, hd), key 0 = position 0


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, kind: str):
        super().__init__()
        if kind not in ("attn", "swa", "kv", "cross"):
            raise ValueError(f"not an attention kind: {kind!r}")
        H, G, hd, d = config.n_head, config.n_query_groups, config.head_size, config.n_embd
        self.kind, self.layer_idx = kind, layer_idx
        self.n_head, self.n_query_groups, self.head_size = H, G, hd
        if kind == "cross":
            self.q_proj = nn.Linear(d, H * hd, bias=config.bias)
        else:
            self.attn = nn.Linear(d, (H + 2 * G) * hd, bias=config.bias)
        if config.attn_bias:
            self.q_bias = nn.Parameter(torch.zeros(H * hd))
            if kind != "cross":
                self.v_bias = nn.Parameter(torch.zeros(G * hd))
        self.proj = nn.Linear(H * hd, d, bias=config.bias or config.attn_bias)
        self.scale = config.attn_scale_mult / math.sqrt(hd)
        self.window = config.sliding_window if kind == "swa" else 0
        self.use_rope = not config.nope
        self.diff = DifferentialAttention(hd, layer_idx, config.norm_eps) if config.use_da else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        B, T, _ = x.shape
        H, G, hd = self.n_head, self.n_query_groups, self.head_size
        q_pos0 = ctx.pos
        if self.kind == "cross":
            q = self.q_proj(x)
            if hasattr(self, "q_bias"):
                q = q + self.q_bias.to(q.dtype)
            q = q.view(B, T, H, hd)
            if self.use_rope:
                q = apply_rope(q, ctx.cos, ctx.sin)
            if ctx.shared_kv is None:
                raise RuntimeError(f"layer {self.layer_idx}: cross-attention runs before the KV layer")
            k, v = ctx.shared_kv
            q = q.transpose(1, 2)
            k_pos0 = 0
        else:
            # q and k are adjacent in the fused output, so RoPE rotates both in one call (half the elementwise
            # kernels of rotating them separately), on the (B, T, heads, hd) layout before the transpose.
            qkv = self.attn(x)
            if hasattr(self, "q_bias"):
                qkv = qkv + torch.cat([self.q_bias, torch.zeros_like(self.q_bias[:G * hd]), self.v_bias]).to(qkv.dtype)
            qk, v = qkv.split(((H + G) * hd, G * hd), dim=-1)
            qk = qk.view(B, T, H + G, hd)
            if self.use_rope:
                qk = apply_rope(qk, ctx.cos, ctx.sin)
            q, k = qk.split((H, G), dim=2)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, T, G, hd).transpose(1, 2)
            k, v, k_pos0 = self._cached(k, v, ctx)
            if self.kind == "kv":
                ctx.shared_kv = (k, v)
        docs = ctx.doc_ids  # training only (no cache): queries and keys cover the same positions

        def core(q_, k_, v_):
            return attend(q_, k_, v_, scale=self.scale, q_pos0=q_pos0, k_pos0=k_pos0, window=self.window,
                          q_docs=docs, k_docs=docs)

        y = self.diff(q, k, v, core) if self.diff is not None else core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, H * hd))

    def _cached(self, k, v, ctx: ForwardContext):
        """Add this step's K/V to the layer's cache; return the keys to attend to and the first one's position."""
        if ctx.cache is None:
            return k, v, ctx.pos
        if self.window:
            state = ctx.cache.layer(self.layer_idx, lambda: WindowKVCache(self.window))
            k, v, n_old = state.append(k, v)
            return k, v, ctx.pos - n_old
        state = ctx.cache.layer(self.layer_idx, lambda: KVCache(ctx.cache.capacity))
        k, v = state.append(k, v)
        return k, v, 0
