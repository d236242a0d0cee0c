"""Norms computed in fp32 (the residual stream is fp32; autocast casts the output for the next matmul):
RMSNorm (every architecture but one) and LayerNorm (Phi4-mini-Flash)."""

import torch
import torch.nn.functional as F
from torch import nn

from archscale.kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # fp32; the fused kernel on CPU (kernels/rms_norm.py)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    return {"rmsnorm": RMSNorm, "layernorm": LayerNorm}[kind](dim, eps)
