"""SwiGLU MLP, the feed-forward of every block: w1 projects to [gate | input] (2 x hidden),
y = w3(silu(gate) * input). "mlp_mem" also exports the input half as GMU memory (ArchScale's SambaY-MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from archscale.config import ModelConfig
from archscale.models.mixers.base import BIAS, MATRIX, OUTPUT, ForwardContext, MixerSpec, SaveEnv, register


class SwiGLU(nn.Module):
    def __init__(self, n_embd: int, hidden: int, bias: bool = False, export_memory: bool = False):
        super().__init__()
        self.hidden = hidden
        self.export_memory = export_memory
        self.w1 = nn.Linear(n_embd, 2 * hidden, bias=bias)
        self.w3 = nn.Linear(hidden, n_embd, bias=bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        gate, inp = self.w1(x).chunk(2, dim=-1)
        if self.export_memory and ctx is not None:
            ctx.memory = inp
        return self.w3(F.silu(gate) * inp)


def build(config: ModelConfig, layer_idx: int, kind: str) -> SwiGLU:
    return SwiGLU(config.n_embd, config.intermediate_size, bias=config.bias, export_memory=kind == "mlp_mem")


def swiglu_saved(config: ModelConfig, kind: str, env: SaveEnv) -> dict[str, float]:
    """Per token: w1's input (d), its output [gate | input] (2 hidden), silu(gate) and w3's input (hidden each),
    all in the activation dtype. Checkpointed, "mlp_mem" keeps its exported input half (a view of w1's output)."""
    hidden, a = config.intermediate_size, env.act_bytes
    if env.act_ckpt:
        return {"gmu_memory": a * 2 * hidden} if kind == "mlp_mem" else {}
    return {"ffn": a * (config.n_embd + 4 * hidden)}


SPEC = register(MixerSpec(
    name="swiglu",
    slot="ffn",
    kinds=("mlp", "mlp_mem"),
    build=build,
    roles=(("w1.weight", MATRIX), ("w3.weight", OUTPUT), ("*.bias", BIAS)),
    flops=lambda config, kind, seq_len: {},
    description="SwiGLU feed-forward (hidden 4d); 'mlp_mem' exports its input half as GMU memory",
    tests=("tests/test_model.py::test_swiglu_matches_formula",),
    varlen="exact: per position",
    memory_width=lambda config, kind: config.intermediate_size if kind == "mlp_mem" else 0,
    saved=swiglu_saved,
))
