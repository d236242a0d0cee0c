"""Pre-norm block: x += s * mixer(norm_1(x)); x += s * ffn(norm_2(x)). The residual stream stays fp32.

The mixer and the feed-forward are chosen by the layer's record (`ModelConfig.layers`: kinds and options) from the
registry in `models/mixers/`; every block has its own feed-forward (SwiGLU), whatever its mixer.
"""

from __future__ import annotations

import torch
from torch import nn

from archscale.config import ModelConfig
from archscale.models.mixers import ForwardContext, spec_for
from archscale.models.norm import make_norm


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = config.layer_kinds[layer_idx]
        self.ffn_kind = config.ffn_kinds[layer_idx]
        self.residual_scale = config.residual_scale
        layer = config.layer_config(layer_idx)  # this layer's options (window, NoPE, ...) as config fields
        self.norm_1 = make_norm(config.norm_class, config.n_embd, config.norm_eps)
        self.mixer = spec_for(self.kind).build(layer, layer_idx, self.kind)
        self.norm_2 = make_norm(config.norm_class, config.n_embd, config.norm_eps)
        self.mlp = spec_for(self.ffn_kind, "ffn").build(layer, layer_idx, self.ffn_kind)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        s = self.residual_scale
        h = self.mixer(self.norm_1(x), ctx)
        x = x + (h if s == 1.0 else s * h)
        h = self.mlp(self.norm_2(x), ctx)
        return x + (h if s == 1.0 else s * h)
