"""Gated DeltaNet token mixer (Yang, Kautz & Hatamizadeh 2024), as ArchScale builds it (its
`lit_gpt/gated_deltanet.py`, the flash-linear-attention layer with a full-width gated RMSNorm, made by `get_rnn`
with num_heads = ceil(int(0.75 d) / 256), head_dim 256, short convs, negative eigenvalues allowed)::

    q, k, v = silu(conv_q(q_proj x)), silu(conv_k(k_proj x)), silu(conv_v(v_proj x))   causal depthwise, 4 taps
    beta    = 2 sigmoid(b_proj x)                     (x2: allow_neg_eigval, eigenvalues of I - beta k k^T in (-1, 1])
    g       = -exp(A_log) softplus(a_proj x + dt_bias)                     the gate in log space, per head
    o       = gated_delta_rule(l2norm(q) / sqrt(K), l2norm(k), v, g, beta)   (kernels/gated_delta.py)
    out     = o_proj(RMSNorm(o * silu(g_proj x)))     one RMSNorm over all heads' values, after the gate

Widths: key_dim = num_heads * head_dim, value_dim = 2 * key_dim (expand_v 2). With ``gmu_save`` ("gdn_mem") the
kernel output ``o`` (before the gate and the norm; width value_dim) is the GMU memory of the layers after it, which
ArchScale gates with an nGMU. Projections run in the input's dtype (autocast friendly); the recurrence and the
norm in fp32.

Decoding keeps the last 3 conv inputs and the (heads, K, V) state in `GDNState`; one call over a sequence equals
calls over its pieces. Varlen (`ctx.doc_ids`): conv taps and the state restart at every document start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from archscale.config import ModelConfig
from archscale.errors import UserError
from archscale.kernels import scan_cpu
from archscale.kernels.gated_delta import fla_available, gated_delta_rule, gated_delta_step
from archscale.kernels.gated_norm import GatedRMSNorm
from archscale.kernels.short_conv import causal_conv1d
from archscale.models.mixers.base import (MATRIX, OUTPUT, VECTOR, ForwardContext, KernelRef, MixerSpec, SaveEnv,
                                         options_of, register)


@dataclass
class GDNOptions:
    """Gated DeltaNet's config fields (`ModelConfig.mixer_options["gdn"]`); ArchScale's values by default.
    num_heads None = ArchScale's rule ceil(int(0.75 n_embd) / 256) (whatever head_dim is: tests shrink both)."""

    head_dim: int = 256
    num_heads: int | None = None
    expand_v: float = 2.0
    conv_size: int = 4
    allow_neg_eigval: bool = True
    norm_eps: float = 1e-5  # the layer's own default (get_rnn passes none)
    chunk_size: int = 64
    impl: str = "auto"  # kernels/gated_delta.py: auto | ref | chunked | fla


def heads(config: ModelConfig, opts: GDNOptions) -> int:
    return opts.num_heads if opts.num_heads is not None else math.ceil(int(config.n_embd * 0.75) / 256)


def widths(config: ModelConfig, opts: GDNOptions) -> tuple[int, int, int, int]:
    """(num_heads, head_k_dim, head_v_dim, value_dim)."""
    h = heads(config, opts)
    head_v = int(opts.head_dim * opts.expand_v)
    if not math.isclose(opts.head_dim * opts.expand_v, head_v, rel_tol=1e-5):
        raise UserError(f"mixer_options.gdn: expand_v={opts.expand_v} x head_dim={opts.head_dim} is not an integer")
    return h, opts.head_dim, head_v, h * head_v


@dataclass
class GDNState:
    """Recurrent state of one layer: the last conv_size-1 inputs of the q|k|v convs and the delta-rule state."""

    conv: Tensor  # (B, 2 key_dim + value_dim, conv_size - 1), in the activation dtype
    ssm: Tensor   # (B, heads, head_k_dim, head_v_dim), fp32

    @classmethod
    def empty(cls, batch: int, module: "GatedDeltaNet", device=None, dtype=None) -> "GDNState":
        device = device if device is not None else module.A_log.device
        dtype = dtype if dtype is not None else module.q_proj.weight.dtype
        channels = 2 * module.key_dim + module.value_dim
        return cls(conv=torch.zeros(batch, channels, module.conv_size - 1, device=device, dtype=dtype),
                   ssm=torch.zeros(batch, module.num_heads, module.head_k_dim, module.head_v_dim, device=device,
                                   dtype=torch.float32))


class GatedDeltaNet(nn.Module):
    """Parameter names and shapes as ArchScale's `GatedDeltaNet` (q/k/v/a/b/g/o_proj, A_log, dt_bias,
    q/k/v_conv1d, norm)."""

    def __init__(self, d_model: int, num_heads: int, *, head_dim: int = 256, expand_v: float = 2.0,
                 conv_size: int = 4, allow_neg_eigval: bool = True, norm_eps: float = 1e-5,
                 gmu_save: bool = False, chunk_size: int = 64, impl: str = "auto"):
        super().__init__()
        self.num_heads, self.head_k_dim, self.head_v_dim = num_heads, head_dim, int(head_dim * expand_v)
        self.key_dim, self.value_dim = num_heads * head_dim, num_heads * self.head_v_dim
        self.conv_size, self.allow_neg_eigval, self.gmu_save = conv_size, allow_neg_eigval, gmu_save
        self.chunk_size, self.impl = chunk_size, impl
        self.q_proj = nn.Linear(d_model, self.key_dim, bias=False)
        self.k_proj = nn.Linear(d_model, self.key_dim, bias=False)
        self.v_proj = nn.Linear(d_model, self.value_dim, bias=False)
        self.a_proj = nn.Linear(d_model, num_heads, bias=False)
        self.b_proj = nn.Linear(d_model, num_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_heads))
        conv = dict(kernel_size=conv_size, padding=conv_size - 1, bias=False)  # fla's ShortConvolution
        self.q_conv1d = nn.Conv1d(self.key_dim, self.key_dim, groups=self.key_dim, **conv)
        self.k_conv1d = nn.Conv1d(self.key_dim, self.key_dim, groups=self.key_dim, **conv)
        self.v_conv1d = nn.Conv1d(self.value_dim, self.value_dim, groups=self.value_dim, **conv)
        self.g_proj = nn.Linear(d_model, self.value_dim, bias=False)
        self.norm = GatedRMSNorm(self.value_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, d_model, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """ArchScale's (fla's) construction-time init: A = U(0, 16) stored as log A; dt log-uniform in
        [1e-3, 0.1] floored at 1e-4, stored as its inverse softplus in dt_bias; the rest PyTorch's defaults."""
        for m in (self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj, self.q_conv1d, self.k_conv1d,
                  self.v_conv1d, self.g_proj, self.norm, self.o_proj):
            m.reset_parameters()
        dev = self.A_log.device
        self.A_log.copy_(torch.empty(self.num_heads, device=dev).uniform_(0, 16).log())
        dt_min, dt_max, dt_floor = 1e-3, 0.1, 1e-4
        dt = torch.exp(torch.rand(self.num_heads, device=dev) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min)).clamp(min=dt_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus

    def forward(self, x: Tensor, state: GDNState | None = None,
                doc_ids: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """x (B, T, d_model) -> (out (B, T, d_model), memory (B, T, value_dim) if gmu_save else None)."""
        B, T, _ = x.shape
        if doc_ids is not None and state is not None:
            raise ValueError("doc_ids is for training-style forwards, not for decoding with a state")
        qkv, a, b = self._qkvab(x)  # (B, T, C), (B, T, heads) twice
        qkv = self._conv(qkv, state, doc_ids)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (t.reshape(B, T, self.num_heads, self.head_k_dim) for t in (q, k))
        v = v.reshape(B, T, self.num_heads, self.head_v_dim)
        beta = b.float().sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2.0
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if state is not None and T == 1:
            o = gated_delta_step(state.ssm, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])[:, None]
        else:
            reset = None
            if doc_ids is not None:
                reset = torch.zeros_like(doc_ids, dtype=torch.bool)
                reset[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
            o, last = gated_delta_rule(q, k, v, g, beta, initial_state=None if state is None else state.ssm,
                                       output_final_state=state is not None, reset=reset, impl=self.impl,
                                       chunk_size=self.chunk_size)
            if state is not None:
                state.ssm = last
        o = o.reshape(B, T, self.value_dim)
        memory = o if self.gmu_save else None
        return self.o_proj(self.norm(o, self.g_proj(x))), memory

    def _qkvab(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q|k|v, a and b in one product (the five weights side by side: one gemm each way; a and b, one column
        per head, on their own ran six gemms a layer at under 20 GFLOP/s). Weights that are tensor subclasses (a
        quantized export's) cannot be concatenated, so they run as five projections."""
        projs = (self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj)
        if all(type(p.weight) in (nn.Parameter, Tensor) for p in projs):
            out = F.linear(x, torch.cat([p.weight for p in projs]))
            return out.split([2 * self.key_dim + self.value_dim, self.num_heads, self.num_heads], dim=-1)
        return torch.cat([p(x) for p in projs[:3]], dim=-1), self.a_proj(x), self.b_proj(x)

    def _weights(self, dtype: torch.dtype) -> Tensor:
        """The three depthwise conv kernels stacked like the q|k|v channels: (2 key_dim + value_dim, taps)."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0].to(dtype)

    def _conv(self, xs: Tensor, state: GDNState | None, doc_ids: Tensor | None) -> Tensor:
        """silu(causal depthwise conv) over xs (B, T, C) by `kernels.short_conv` (PyTorch's CPU depthwise conv
        backward took a quarter of a GDNY training step); with a state, prepend its inputs and keep the new tail;
        with doc_ids, taps reaching into an earlier document are zeroed."""
        K = self.conv_size
        if state is None:
            return causal_conv1d(xs, self._weights(xs.dtype), None, doc_ids, silu=True)
        xp = torch.cat([state.conv.transpose(1, 2).to(xs.dtype), xs], dim=1)       # (B, K-1+T, C)
        state.conv = xp[:, xp.shape[1] - (K - 1):].transpose(1, 2).clone()
        return causal_conv1d(xp, self._weights(xs.dtype), None, doc_ids, silu=True, prefix=K - 1)


class GatedDeltaNetMixer(GatedDeltaNet):
    """Gated DeltaNet speaking the block's (x, ctx) protocol; "gdn_mem" exports its kernel output as memory."""

    def __init__(self, config: ModelConfig, layer_idx: int, kind: str):
        opts = options(config)
        super().__init__(config.n_embd, heads(config, opts), head_dim=opts.head_dim, expand_v=opts.expand_v,
                         conv_size=opts.conv_size, allow_neg_eigval=opts.allow_neg_eigval, norm_eps=opts.norm_eps,
                         gmu_save=kind == "gdn_mem", chunk_size=opts.chunk_size, impl=opts.impl)
        self.layer_idx = layer_idx

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        state = ctx.state(self.layer_idx, lambda: GDNState.empty(x.shape[0], self, x.device, x.dtype))
        out, memory = super().forward(x, state, doc_ids=ctx.doc_ids)
        if memory is not None:
            ctx.memory = memory
        return out


def options(config: ModelConfig) -> GDNOptions:
    return options_of(config, SPEC)


def gdn_flops(config: ModelConfig, kind: str, seq_len: int) -> dict[str, float]:
    """Per token, the products the chunked kernel runs for a sequence of `seq_len` (padded to n whole chunks of
    C = min(chunk_size, next power of two >= seq_len)), per head: in every chunk [k; q] k^T (4 C^2 K), the
    delta-rule writes Tb z and the intra-chunk output A u (2 C^2 V each); the state read [k; q] S and the state
    update k^T u (6 C K V) in all chunks but one (training starts from a zero state and keeps no final one);
    the unit-triangular solve ("scan_solve", ~C^3 / 3, which FlopCounterMode does not count); plus the depthwise
    convs. The decode step costs ~6 K V per head. "scan_elementwise": gates, l2norms, decays and the gated
    norm (not matmuls)."""
    opts = options(config)
    H, K, V, value_dim = widths(config, opts)
    T = max(seq_len, 1)
    C = min(opts.chunk_size, 1 << (T - 1).bit_length())
    n = -(-T // C)
    scan = n * (4 * C * C * K + 4 * C * C * V) + (n - 1) * 6 * C * K * V
    return {"scan": H * scan / T,
            "scan_solve": H * n * C ** 3 / 3 / T,
            "conv": 2.0 * opts.conv_size * (2 * H * K + value_dim),
            "scan_elementwise": 12.0 * H * (K + V) + 8.0 * value_dim}


def gdn_saved(config: ModelConfig, kind: str, env: SaveEnv) -> dict[str, float]:
    """Per token: the input cast once per product (q|k|v|a|b and g: 2 d in the activation dtype; autocast does not share
    casts of activations); per q|k|v channel the projections, conv and silu outputs and the kernel's fp32 l2-normed
    inputs and factors (4 elements in the activation dtype + 17 B fp32, measured); per head the chunked kernel's
    fp32 chunk-by-chunk products (C per token, 24.5 B each; C = the chunk length at this sequence length) and its
    fp32 (K, V) state at every chunk start (4 K V / C per token); on CPU, 12 B less per value channel: the gated
    norm's C++ kernel (kernels/gated_norm.py) keeps its two fp32 inputs where autograd keeps four fp32
    intermediates. The rule's C++ path (impl "cpu") keeps 8 B less per value channel than counted here (z where
    the torch loop keeps k S, q S and u); not subtracted, so the count bounds both paths. "gdn_mem" keeps its output (the GMU memory, fp32) across a checkpointed block."""
    opts = options(config)
    H, K, V, value_dim = widths(config, opts)
    memory = {"gmu_memory": 4 * value_dim} if kind == "gdn_mem" else {}
    if env.act_ckpt:
        return memory
    C = min(opts.chunk_size, 1 << (max(env.seq_len, 1) - 1).bit_length())
    channels = 2 * H * K + value_dim
    norm_kernel = 12 * value_dim if env.device == "cpu" else 0
    return {"gdn_inputs": env.act_bytes * 2 * config.n_embd, "gdn": (env.act_bytes * 4 + 17) * channels - norm_kernel,
            "gdn_chunks": 24.5 * H * C, "gdn_states": 4 * H * K * V / C}


SPEC = register(MixerSpec(
    name="gdn",
    kinds=("gdn", "gdn_mem"),
    build=GatedDeltaNetMixer,
    options=GDNOptions,
    # every Linear is a matrix (ArchScale re-initialises them all under SP; under mu-P they keep PyTorch's
    # default x w_init0); o_proj is its output projection (/ sqrt(2L)); A_log, dt_bias, the convs and the norm
    # keep the layer's own init and are vector-like by ArchScale's name rule ("conv1d", "norm", no "weight")
    roles=(("q_proj.weight", MATRIX), ("k_proj.weight", MATRIX), ("v_proj.weight", MATRIX),
           ("a_proj.weight", MATRIX), ("b_proj.weight", MATRIX), ("g_proj.weight", MATRIX),
           ("o_proj.weight", OUTPUT), ("A_log", VECTOR), ("dt_bias", VECTOR), ("?_conv1d.weight", VECTOR),
           ("norm.weight", VECTOR)),
    flops=gdn_flops,
    description="Gated DeltaNet (gated delta rule, short convs, negative eigenvalues); 'gdn_mem' also exports "
                "its pre-gate output as GMU memory (GDNY)",
    tests=("tests/test_gated_delta.py::test_chunked_matches_ref",
           "tests/test_gated_delta.py::test_matches_transformers_qwen3_next",
           "tests/test_gdn.py::test_module_matches_formula_with_reference_kernel"),
    state=GDNState,
    varlen="exact: the conv taps and the delta-rule state restart at every document start",
    memory_width=lambda config, kind: widths(config, options(config))[3] if kind == "gdn_mem" else 0,
    saved=gdn_saved,
    kernels=(KernelRef("fla.chunk_gated_delta_rule", fla_available,
                       "archscale.kernels.gated_delta._recurrence_ref",
                       "tests/test_gated_delta.py::test_fla_kernel_matches_chunked",
                       "on a CUDA machine: pip install flash-linear-attention (extra `cuda`)"),
             KernelRef("archscale.kernels.gated_delta, impl cpu (C++ chunk loop, kernels/scan_cpu.py's module)",
                       scan_cpu.available, "archscale.kernels.gated_delta._recurrence_ref",
                       "tests/test_gated_delta.py::test_chunked_matches_ref",
                       "install a C++ compiler (apt-get install g++, or set CXX); it is built on first use"),
             KernelRef("archscale.kernels.short_conv, impl cpu (C++, kernels/scan_cpu.py's module)", scan_cpu.available,
                       "archscale.kernels.short_conv._CausalConv (impl torch)",
                       "tests/test_short_conv.py::test_matches_conv1d_values_and_grads",
                       "install a C++ compiler (apt-get install g++, or set CXX); it is built on first use"),
             KernelRef("archscale.kernels.gated_norm, impl cpu (C++, kernels/scan_cpu.py's module)", scan_cpu.available,
                       "archscale.kernels.gated_norm.reference (impl torch)",
                       "tests/test_gated_norm.py::test_matches_formula_values_and_grads",
                       "install a C++ compiler (apt-get install g++, or set CXX); it is built on first use")),
))
