"""Differential attention (Diff Transformer, as in SambaY-DA and Phi4-mini-Flash; ArchScale's model code (`lit_gpt/`)).

Heads are paired, "(H two) D -> H/2 pairs": pair p holds heads 2p and 2p+1. Each pair computes two softmax maps
A1 = softmax(q1 k1^T) and A2 = softmax(q2 k2^T) over the pair's keys, both applied to the pair's values [v1 | v2]
(width 2*hd), and returns RMSNorm_{2hd}(A1 V - lambda A2 V) * (1 - lambda_init), with
lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init and lambda_init = 0.8 - 0.6 exp(-0.3 layer_idx).
K/V heads pair the same way, so GQA keeps its ratio (both head counts must be even).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from archscale.models.norm import RMSNorm


def lambda_init_for(layer_idx: int) -> float:
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


class DifferentialAttention(nn.Module):
    def __init__(self, head_size: int, layer_idx: int, eps: float = 1e-5):
        super().__init__()
        self.lambda_init = lambda_init_for(layer_idx)
        self.lambda_q1 = nn.Parameter(torch.empty(head_size))
        self.lambda_k1 = nn.Parameter(torch.empty(head_size))
        self.lambda_q2 = nn.Parameter(torch.empty(head_size))
        self.lambda_k2 = nn.Parameter(torch.empty(head_size))
        self.subln = RMSNorm(2 * head_size, eps)  # the head-pair norm
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            nn.init.normal_(p, 0.0, 0.1)
        self.subln.reset_parameters()

    def lam(self) -> torch.Tensor:
        l1 = torch.exp(torch.dot(self.lambda_q1.float(), self.lambda_k1.float()))
        l2 = torch.exp(torch.dot(self.lambda_q2.float(), self.lambda_k2.float()))
        return l1 - l2 + self.lambda_init

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """q (B, H, Tq, hd), k/v (B, G, Tk, hd) -> (B, H, Tq, hd), pairs laid out as (H/2, 2*hd)."""
        B, H, Tq, hd = q.shape
        v_pair = torch.cat([v[:, 0::2], v[:, 1::2]], dim=-1)  # (B, G/2, Tk, 2hd)
        a1 = attend(q[:, 0::2], k[:, 0::2], v_pair)  # (B, H/2, Tq, 2hd)
        a2 = attend(q[:, 1::2], k[:, 1::2], v_pair)
        lam = self.lam()
        y = self.subln(a1.float() - lam * a2.float()) * (1.0 - self.lambda_init)
        # (B, H/2, Tq, 2hd) -> (B, H, Tq, hd) so the caller's (B, T, H*hd) reshape keeps pairs contiguous
        return y.to(q.dtype).view(B, H // 2, Tq, 2, hd).permute(0, 1, 3, 2, 4).reshape(B, H, Tq, hd)
