"""Gated Memory Units (SambaY; ArchScale's `gated_memory_unit.py`).

    GMU  ("gmu"):  out = out_proj(silu(in_proj(x)) * memory)
    nGMU ("ngmu"): out = out_proj(RMSNorm(memory * silu(in_proj(x))))   (gated RMSNorm, norm after the gate)

The memory is an earlier layer's output for the same positions (the pre-gate SSM output of the last self-decoder
RNN layer, an attention output before its projection, or an MLP's input half; `memory_source` finds it), so a GMU
layer costs O(d) per decoded token and keeps no state. nGMU is what ArchScale uses for Mamba-2 / Gated DeltaNet
memories.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from archscale.config import ModelConfig
from archscale.models.mixers.base import (BIAS, MATRIX, OUTPUT, VECTOR, ForwardContext, MixerSpec, SaveEnv,
                                         memory_source, register)
from archscale.models.norm import RMSNorm


class GMU(nn.Module):
    def __init__(self, n_embd: int, d_mem: int, bias: bool = False, use_norm: bool = False, eps: float = 1e-5):
        super().__init__()
        self.in_proj = nn.Linear(n_embd, d_mem, bias=bias)
        self.out_proj = nn.Linear(d_mem, n_embd, bias=bias)
        self.norm = RMSNorm(d_mem, eps) if use_norm else None

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        gate = F.silu(self.in_proj(x))
        if self.norm is None:
            return self.out_proj(gate * memory.to(gate.dtype))
        y = self.norm(memory.float() * gate.float()).to(gate.dtype)
        return self.out_proj(y)


class GMUMixer(GMU):
    def __init__(self, config: ModelConfig, layer_idx: int, kind: str):
        _, d_mem = memory_source(config, layer_idx)
        super().__init__(config.n_embd, d_mem, bias=config.bias, use_norm=kind == "ngmu", eps=config.norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.memory is None:
            raise RuntimeError("GMU layer runs before the layer that saves its memory")
        return super().forward(x, ctx.memory)


def gmu_saved(config: ModelConfig, kind: str, env: SaveEnv) -> dict[str, float]:
    """Per token: in_proj's input (d) and, over the memory width m, the gate, its silu and out_proj's input in the
    activation dtype (GMU); nGMU's gated norm runs in fp32 instead: the fp32 memory, gate, product, normalised
    product and out_proj's input (5 m fp32) plus the norm's 1/rms; on CPU the RMSNorm kernel keeps no normalised
    product (4 m fp32). Nothing outlives a checkpointed block."""
    if env.act_ckpt:
        return {}
    d, m, a = config.n_embd, memory_source(config, config.layer_kinds.index(kind))[1], env.act_bytes
    if kind == "ngmu":
        return {"gmu": a * d + 4 * ((4 if env.device == "cpu" else 5) * m + 1)}
    return {"gmu": a * (d + 3 * m)}


SPEC = register(MixerSpec(
    name="gmu",
    kinds=("gmu", "ngmu"),
    build=GMUMixer,
    roles=(("in_proj.weight", MATRIX), ("out_proj.weight", OUTPUT), ("*.bias", BIAS), ("norm.weight", VECTOR)),
    flops=lambda config, kind, seq_len: {},  # two matmuls (counted from the parameters) and elementwise gating
    description="Gated Memory Unit: gates an earlier layer's memory with silu(in_proj(x)); 'ngmu' adds a gated "
                "RMSNorm after the gate (for Mamba-2 / Gated DeltaNet memories)",
    tests=("tests/test_attention.py::test_gmu_matches_formula", "tests/test_attention.py::test_ngmu_matches_formula"),
    varlen="exact: per position (the memory it reads is already document-masked)",
    needs=(("gmu", ("memory",)), ("ngmu", ("memory",))),
    saved=gmu_saved,
))
