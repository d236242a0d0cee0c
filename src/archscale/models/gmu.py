"""Gated Memory Unit (SambaY, spec §2.1): out = out_proj(silu(in_proj(x)) * memory).

The memory is an earlier layer's output for the same positions (the pre-gate SSM output of the last
self-decoder Mamba layer, width d_mem = 2d), so a GMU layer costs O(d) per decoded token and keeps no state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GMU(nn.Module):
    def __init__(self, n_embd: int, d_mem: int, bias: bool = False):
        super().__init__()
        self.in_proj = nn.Linear(n_embd, d_mem, bias=bias)
        self.out_proj = nn.Linear(d_mem, n_embd, bias=bias)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        gate = F.silu(self.in_proj(x))
        return self.out_proj(gate * memory.to(gate.dtype))
