"""Rotary position embedding (half-rotation layout, as Llama/HF), applied in fp32."""

from __future__ import annotations

import torch


def rope_cache(seq_len: int, head_size: int, base: float, device=None,
               linear_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq_len, head_size // 2), fp32. `linear_scaling` F > 1 is position interpolation:
    position p is rotated as p / F, so a model trained at length N sees positions up to F*N in range."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, device=device, dtype=torch.float32) / head_size))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32) / linear_scaling
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (i, i + hd/2) of x's last dim in fp32 and returns x's dtype.

    x: (..., hd) with cos/sin (T, rd/2) broadcastable to x[..., :rd/2]: e.g. x (B, H, T, hd) with cos (T, rd/2),
    or x (B, T, H, hd) with cos.unsqueeze(1) (T, 1, rd/2). rd = hd normally; rd < hd is partial RoPE: only
    x[..., :rd] rotates (`ModelConfig.rotary_dim`, as Llama-family `partial_rotary_factor`).
    """
    rotary = 2 * cos.shape[-1]
    if rotary < x.shape[-1]:  # partial RoPE (`ModelConfig.rotary_dim`): the first dims rotate, the rest pass
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
