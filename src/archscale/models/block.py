"""Pre-norm block: x += s * mixer(norm_1(x)); x += s * mlp(norm_2(x)). The residual stream stays fp32."""

from __future__ import annotations

import torch
from torch import nn

from archscale.config import ModelConfig
from archscale.models.attention import CausalSelfAttention
from archscale.models.mlp import SwiGLU
from archscale.models.norm import RMSNorm


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.residual_scale = config.residual_scale
        self.norm_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.mixer = CausalSelfAttention(config.n_embd, config.n_head, config.n_query_groups, config.head_size,
                                         bias=config.bias, attn_scale_mult=config.attn_scale_mult)
        self.norm_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = SwiGLU(config.n_embd, config.intermediate_size, bias=config.bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s = self.residual_scale
        h = self.mixer(self.norm_1(x), cos, sin)
        x = x + (h if s == 1.0 else s * h)
        h = self.mlp(self.norm_2(x))
        return x + (h if s == 1.0 else s * h)
