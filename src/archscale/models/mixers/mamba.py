"""Mamba-1 token mixer (Gu & Dao 2023), parameter names as mamba-ssm's `Mamba` (and HF's `MambaMixer`).

    xz = in_proj(x);  x, z = split(xz)                        (B, T, d_inner) each
    x  = silu(causal depthwise conv1d(x))                      (one fused C++ pass with the CPU scan kernel)
    dt, B, C = split(x_proj(x));  dt = dt_proj.weight @ dt   (dt_proj.bias is the scan's delta_bias)
    (with ``bcdt_norm``, Jamba's variant: dt, B, C each pass an RMSNorm before that, `dt_norm`, `b_norm`, `c_norm`)
    y  = selective_scan(x, dt, A=-exp(A_log), B, C, D)       (the SSM output, including the D*x skip)
    out = out_proj(y * silu(z))

With ``gmu_save=True`` the forward also returns ``y`` (pre-gate) as the GMU memory of SambaY; otherwise the
memory is None. Projections run in the input's dtype (autocast friendly); the scan always runs in fp32.

Decoding: pass a `MambaState` (``MambaState.empty(batch, module, device, dtype)``); the forward continues from
it for any number of tokens and updates it in place, so one call over a sequence equals calls over its pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from archscale.config import ModelConfig
from archscale.kernels import scan_cpu
from archscale.kernels.selective_scan import (cuda_scan_available, runs_cpu_kernel, selective_scan,
                                              selective_state_update)
from archscale.models.mixers.base import (MATRIX, OUTPUT, VECTOR, ForwardContext, KernelRef, MixerSpec, SaveEnv,
                                         options_of, register)
from archscale.models.norm import RMSNorm


@dataclass
class MambaState:
    """Recurrent state of one Mamba layer: the last d_conv-1 conv inputs and the SSM state (fp32)."""

    conv: Tensor  # (B, d_inner, d_conv - 1), in the activation dtype
    ssm: Tensor   # (B, d_inner, d_state), fp32

    @classmethod
    def empty(cls, batch: int, module: "Mamba", device=None, dtype=None) -> "MambaState":
        device = device if device is not None else module.A_log.device
        dtype = dtype if dtype is not None else module.in_proj.weight.dtype
        return cls(conv=torch.zeros(batch, module.d_inner, module.d_conv - 1, device=device, dtype=dtype),
                   ssm=torch.zeros(batch, module.d_inner, module.d_state, device=device, dtype=torch.float32))


class Mamba(nn.Module):
    def __init__(self, d_model: int, *, d_state: int = 16, d_conv: int = 4, expand: int = 2,
                 dt_rank: int | None = None, gmu_save: bool = False, scan_impl: str = "auto",
                 dt_min: float = 1e-3, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 bcdt_norm: bool = False, norm_eps: float = 1e-6):
        super().__init__()
        self.d_model, self.d_state, self.d_conv = d_model, d_state, d_conv
        self.d_inner = expand * d_model
        self.dt_rank = math.ceil(d_model / 16) if dt_rank is None else dt_rank
        self.gmu_save, self.scan_impl = gmu_save, scan_impl
        self.dt_min, self.dt_max, self.dt_init_floor = dt_min, dt_max, dt_init_floor

        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=False)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, kernel_size=d_conv, groups=self.d_inner,
                                padding=d_conv - 1, bias=True)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.d_inner, d_state))
        self.D = nn.Parameter(torch.empty(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)
        # Jamba (Lieber et al. 2024) normalises dt, B and C after x_proj, for stability at scale
        self.dt_norm = self.b_norm = self.c_norm = None
        if bcdt_norm:
            self.dt_norm = RMSNorm(self.dt_rank, norm_eps)
            self.b_norm, self.c_norm = RMSNorm(d_state, norm_eps), RMSNorm(d_state, norm_eps)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """mamba-ssm's init: dt log-uniform in [dt_min, dt_max] (floored) as inverse softplus in dt_proj.bias,
        dt_proj.weight ~ U(+-dt_rank^-0.5), A = -(1..N) per channel (S4D-real), D = 1; the rest PyTorch's default."""
        for m in (self.in_proj, self.conv1d, self.x_proj, self.out_proj):
            m.reset_parameters()
        std = self.dt_rank ** -0.5
        nn.init.uniform_(self.dt_proj.weight, -std, std)
        dt = torch.exp(torch.rand(self.d_inner, device=self.dt_proj.bias.device, dtype=torch.float32)
                       * (math.log(self.dt_max) - math.log(self.dt_min)) + math.log(self.dt_min))
        dt = dt.clamp(min=self.dt_init_floor)
        self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
        A = torch.arange(1, self.d_state + 1, dtype=torch.float32, device=self.A_log.device)
        self.A_log.copy_(torch.log(A).expand(self.d_inner, -1))
        nn.init.ones_(self.D)

    def forward(self, x: Tensor, state: MambaState | None = None,
                doc_ids: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """x (B, T, d_model) -> (out (B, T, d_model), memory (B, T, d_inner) if gmu_save else None).

        `doc_ids` (B, T): document index per token of a packed sequence (variable-length training); the conv
        window and the SSM state restart at every document, so no information crosses a boundary."""
        T = x.shape[1]
        if doc_ids is not None and state is not None:
            raise ValueError("doc_ids is for training-style forwards, not for decoding with a state")
        # split on the feature dim, then transpose views (B, d_inner, T): the gradients meet again in a plain cat
        # of two (B, T, d_inner) halves, with no transposed copy of the whole (B, T, 2*d_inner) for in_proj
        xs, z = (t.transpose(1, 2) for t in self.in_proj(x).chunk(2, dim=-1))
        reset = None
        if doc_ids is not None:
            xs = F.silu(self._doc_conv(xs, doc_ids))
            reset = torch.zeros_like(doc_ids, dtype=torch.bool)
            reset[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        elif state is None and runs_cpu_kernel(self.scan_impl, xs, self.d_state):
            xs = scan_cpu.conv_silu(xs, self.conv1d.weight, self.conv1d.bias)  # fused, in (B, T, d_inner) rows
        else:
            xs = F.silu(self._conv(xs, state))                                # (B, d_inner, T)
        dt, Bm, Cm = torch.split(self.x_proj(xs.transpose(1, 2)), [self.dt_rank, self.d_state, self.d_state],
                                 dim=-1)
        if self.dt_norm is not None:  # the norms compute in fp32; the projections keep the activation dtype
            dt, Bm, Cm = (norm(t).to(t.dtype) for norm, t in ((self.dt_norm, dt), (self.b_norm, Bm),
                                                                (self.c_norm, Cm)))
        dt = F.linear(dt, self.dt_proj.weight).transpose(1, 2)                # (B, d_inner, T); bias: in the scan
        A = -torch.exp(self.A_log.float())
        gate = None if self.gmu_save else z
        if state is not None and T == 1:
            y = selective_state_update(state.ssm, xs[..., 0], dt[..., 0], A, Bm[:, 0], Cm[:, 0], self.D,
                                       z=None if gate is None else gate[..., 0], dt_bias=self.dt_proj.bias,
                                       dt_softplus=True).unsqueeze(-1)
        else:
            y = selective_scan(xs, dt, A, Bm.transpose(1, 2), Cm.transpose(1, 2), D=self.D.float(), z=gate,
                               delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
                               initial_state=None if state is None else state.ssm,
                               return_last_state=state is not None, impl=self.scan_impl, reset=reset)
            if state is not None:
                y, state.ssm = y
        y = y.transpose(1, 2)                                                 # (B, T, d_inner)
        if self.gmu_save:
            memory = y
            y = y * F.silu(z.transpose(1, 2))
        else:
            memory = None
        return self.out_proj(y), memory

    def _doc_conv(self, xs: Tensor, doc_ids: Tensor) -> Tensor:
        """The causal depthwise conv with taps that reach into an earlier document zeroed."""
        K, T = self.d_conv, xs.shape[-1]
        w = self.conv1d.weight[:, 0].to(xs.dtype)                             # (d_inner, K); tap K-1 = now
        xp = F.pad(xs, (K - 1, 0))
        dp = F.pad(doc_ids, (K - 1, 0), value=-1)
        out = xs * w[:, K - 1, None]
        for k in range(1, K):                                                  # the input k steps back
            same = (dp[:, K - 1 - k:K - 1 - k + T] == doc_ids).to(xs.dtype).unsqueeze(1)
            out = out + xp[..., K - 1 - k:K - 1 - k + T] * same * w[:, K - 1 - k, None]
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias.to(xs.dtype)[:, None]
        return out

    def _conv(self, xs: Tensor, state: MambaState | None) -> Tensor:
        """Causal depthwise conv over (B, d_inner, T); with a state, prepend its inputs and store the new tail."""
        T = xs.shape[-1]
        if state is None:
            return self.conv1d(xs)[..., :T]
        full = torch.cat([state.conv.to(xs.dtype), xs], dim=-1)              # (B, d_inner, d_conv-1+T)
        state.conv = full[..., full.shape[-1] - (self.d_conv - 1):].clone()
        w = self.conv1d.weight
        bias = self.conv1d.bias
        return F.conv1d(full, w.to(xs.dtype), None if bias is None else bias.to(xs.dtype), groups=self.d_inner)


@dataclass
class MambaOptions:
    """Mamba-1's config fields (`ModelConfig.mixer_options["mamba"]`); ArchScale's values by default."""

    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    # Jamba's RMSNorms on dt, B and C after x_proj (eps: ModelConfig.norm_eps); off in ArchScale's Mamba
    bcdt_norm: bool = False


class MambaMixer(Mamba):
    """Mamba-1 speaking the block's (x, ctx) protocol: its state lives in the inference cache, and with
    `gmu_save` ("mamba_mem") its pre-gate SSM output becomes the GMU memory of the layers after it."""

    def __init__(self, config: ModelConfig, layer_idx: int, kind: str):
        opts = options(config)
        super().__init__(config.n_embd, d_state=opts.d_state, d_conv=opts.d_conv, expand=opts.expand,
                         gmu_save=kind == "mamba_mem", bcdt_norm=opts.bcdt_norm, norm_eps=config.norm_eps)
        self.layer_idx = layer_idx

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        state = ctx.state(self.layer_idx, lambda: MambaState.empty(x.shape[0], self, x.device, x.dtype))
        out, memory = super().forward(x, state, doc_ids=ctx.doc_ids)
        if memory is not None:
            ctx.memory = memory
        return out


def options(config: ModelConfig) -> MambaOptions:
    return options_of(config, SPEC)


def mamba_flops(config: ModelConfig, kind: str, seq_len: int) -> dict[str, float]:
    """Per token: the selective scan (~9 * d_inner * d_state: discretise, update, read out) and the depthwise
    causal conv (2 * d_inner * d_conv)."""
    opts = options(config)
    d_inner = opts.expand * config.n_embd
    return {"scan_elementwise": 9.0 * d_inner * opts.d_state, "conv": 2.0 * d_inner * opts.d_conv}


def mamba_saved(config: ModelConfig, kind: str, env: SaveEnv) -> dict[str, float]:
    """Per token: in_proj's input and output, the conv output, x_proj's input and dt, the scan's fp32 inputs
    (u, delta, z) and its B/C (7 d_inner + dt_rank + 6 d_state in the activation dtype, 3 d_inner fp32; measured
    with `memory_measure.saved_by_block`), plus per layer the fp32 A = -exp(A_log) and its scan copies.
    "mamba_mem" also keeps its fp32 pre-gate output (the GMU memory), which outlives a checkpointed block."""
    opts = options(config)
    di, a = opts.expand * config.n_embd, env.act_bytes
    memory = {"gmu_memory": 4 * di} if kind == "mamba_mem" else {}
    if env.act_ckpt:
        return memory
    dt_rank = math.ceil(config.n_embd / 16)
    return {"mamba": a * (7 * di + dt_rank + 6 * opts.d_state) + 4 * 3 * di, **memory,
            "per_layer": 6.5 * di * opts.d_state}


SPEC = register(MixerSpec(
    name="mamba",
    kinds=("mamba", "mamba_mem"),
    build=MambaMixer,
    options=MambaOptions,
    # dt_proj.weight is a matrix like any Linear (ArchScale re-initialises it under SP; under mu-P it keeps
    # Mamba's own U(+-dt_rank^-0.5) init times w_init0); dt_proj.bias, A_log, D and the conv are the SSM's own.
    roles=(("in_proj.weight", MATRIX), ("x_proj.weight", MATRIX), ("dt_proj.weight", MATRIX),
           ("out_proj.weight", OUTPUT), ("dt_proj.bias", VECTOR), ("conv1d.*", VECTOR), ("A_log", VECTOR),
           ("D", VECTOR), ("dt_norm.weight", VECTOR), ("b_norm.weight", VECTOR), ("c_norm.weight", VECTOR)),
    flops=mamba_flops,
    description="Mamba-1 selective SSM; 'mamba_mem' also exports its pre-gate SSM output as GMU memory (SambaY)",
    tests=("tests/test_selective_scan.py::test_chunked_matches_ref_fp32",
           "tests/test_mamba.py::test_parity_with_transformers_mamba_mixer",
           "tests/test_mamba.py::test_bcdt_norm_matches_transformers_jamba_mamba_mixer"),
    mup_init_std=lambda config, rel: (math.ceil(config.n_embd / 16) ** -0.5 / math.sqrt(3)
                                      if rel == "dt_proj.weight" else None),
    state=MambaState,
    varlen="exact: the conv taps and the SSM state restart at every document start",
    memory_width=lambda config, kind: options(config).expand * config.n_embd if kind == "mamba_mem" else 0,
    saved=mamba_saved,
    kernels=(KernelRef("mamba_ssm.selective_scan_fn", cuda_scan_available,
                       "archscale.kernels.selective_scan._scan_ref",
                       "tests/test_mamba.py::test_cuda_kernel_module_matches_reference",
                       "on a CUDA machine: pip install mamba-ssm causal-conv1d (extra `cuda`)"),
             KernelRef("archscale.kernels.scan_cpu (C++, built on first use)", scan_cpu.available,
                       "archscale.kernels.selective_scan._scan_ref",
                       "tests/test_selective_scan.py::test_chunked_matches_ref_fp32",
                       "install a C++ compiler (apt-get install g++, or set CXX); it is built on first use"),
             KernelRef("archscale.kernels.scan_cpu.conv_silu (C++, same module)", scan_cpu.available,
                       "torch.nn.functional.conv1d + silu (Mamba._conv)",
                       "tests/test_selective_scan.py::test_conv_silu_matches_torch",
                       "install a C++ compiler (apt-get install g++, or set CXX); it is built on first use")),
))
