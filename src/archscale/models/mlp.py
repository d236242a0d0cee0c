"""SwiGLU MLP: w1 projects to [gate | input] (2 x hidden), y = w3(silu(gate) * input)."""

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    def __init__(self, n_embd: int, hidden: int, bias: bool = False):
        super().__init__()
        self.hidden = hidden
        self.w1 = nn.Linear(n_embd, 2 * hidden, bias=bias)
        self.w3 = nn.Linear(hidden, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, inp = self.w1(x).chunk(2, dim=-1)
        return self.w3(F.silu(gate) * inp)
