"""Pre-norm block: x += s * mixer(norm_1(x)); x += s * mlp(norm_2(x)). The residual stream stays fp32.

Every block has its own SwiGLU MLP, whatever its mixer (spec §2.1). The mixer is chosen by the layer's kind
(`ModelConfig.layer_kinds`): attention (full, sliding-window, YOCO KV, cross), Mamba-1, or GMU.
"""

from __future__ import annotations

import torch
from torch import nn

from archscale.config import ModelConfig
from archscale.models.attention import Attention, ForwardContext
from archscale.models.gmu import GMU
from archscale.models.mamba import Mamba, MambaState
from archscale.models.mlp import SwiGLU
from archscale.models.norm import make_norm


class MambaMixer(Mamba):
    """Mamba-1 speaking the block's (x, ctx) protocol: its state lives in the inference cache, and with
    `gmu_save` its pre-gate SSM output becomes the GMU memory of the layers after it."""

    def __init__(self, config: ModelConfig, layer_idx: int, gmu_save: bool):
        super().__init__(config.n_embd, d_state=config.d_state, d_conv=config.d_conv, expand=config.mamba_expand,
                         gmu_save=gmu_save)
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        state = None
        if ctx.cache is not None:
            state = ctx.cache.layer(self.layer_idx, lambda: MambaState.empty(x.shape[0], self, x.device, x.dtype))
        out, memory = super().forward(x, state, doc_ids=ctx.doc_ids)
        if memory is not None:
            ctx.memory = memory
        return out


class GMUMixer(GMU):
    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.memory is None:
            raise RuntimeError("GMU layer runs before the layer that saves its memory")
        return super().forward(x, ctx.memory)


def make_mixer(config: ModelConfig, layer_idx: int, kind: str) -> nn.Module:
    if kind in ("attn", "swa", "kv", "cross"):
        return Attention(config, layer_idx, kind)
    if kind in ("mamba", "mamba_mem"):
        return MambaMixer(config, layer_idx, gmu_save=kind == "mamba_mem")
    if kind == "gmu":
        return GMUMixer(config.n_embd, config.mamba_expand * config.n_embd, bias=config.bias)
    raise ValueError(f"unknown layer kind {kind!r}")


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = config.layer_kinds[layer_idx]
        self.residual_scale = config.residual_scale
        self.norm_1 = make_norm(config.norm_class, config.n_embd, config.norm_eps)
        self.mixer = make_mixer(config, layer_idx, self.kind)
        self.norm_2 = make_norm(config.norm_class, config.n_embd, config.norm_eps)
        self.mlp = SwiGLU(config.n_embd, config.intermediate_size, bias=config.bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        s = self.residual_scale
        h = self.mixer(self.norm_1(x), ctx)
        x = x + (h if s == 1.0 else s * h)
        h = self.mlp(self.norm_2(x))
        return x + (h if s == 1.0 else s * h)
