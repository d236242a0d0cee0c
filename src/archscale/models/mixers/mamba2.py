"""Mamba-2 token mixer (Dao & Gu 2024, SSD), as ArchScale builds it (`lit_gpt/mamba2.py` via `get_rnn`).

    z, xBC, dt = split(in_proj(x))                 (B, T, d_inner), (B, T, d_inner + 2 g n), (B, T, heads)
    x, B, C = split(silu(causal depthwise conv1d(xBC)))                    (the conv runs over [x, B, C])
    y = SSD(x, dt, A=-exp(A_log), B, C, D, dt_bias)                         (per head; D*x skip included)
    out = out_proj(norm(y * silu(z)))                    (gated RMSNorm, norm after the gate: norm_before_gate=False)

Sizes as ArchScale's `get_rnn`: d_state 128, headdim 64, ngroups 1, d_conv 4, chunk 256, and
expand = 8 ceil(2d / 64 / 8) 64 / d, i.e. d_inner = 2d rounded up to a multiple of 512 (computed here in integers:
ArchScale's float expression truncates to one less, 511 or 1023, for some widths, which its module then rejects;
wherever its module builds the two agree). Parameter names and shapes equal ArchScale's module. With
``gmu_save`` ("mamba2_mem") the forward also returns y (the SSM output with the D skip, before the gated norm,
width d_inner) as the nGMU memory; otherwise the memory is None. Projections run in the input's dtype (autocast
friendly); the scan and the norm run in fp32.

Decoding: pass a `Mamba2State`; the forward continues from it for any number of tokens (T == 1: a single-step
update; T > 1: the chunked scan from the state) and updates it in place, so one call over a sequence equals
calls over its pieces. Variable-length training: `doc_ids` restarts the conv window and the SSM state at every
document start (the SSD scan's sequence index), so nothing crosses a document boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from archscale.config import ModelConfig
from archscale.errors import UserError
from archscale.kernels import scan_cpu
from archscale.kernels.gated_norm import GatedRMSNorm
from archscale.kernels.short_conv import causal_conv1d
from archscale.kernels.ssd import TORCH_CHUNK, chunk_layout, cuda_ssd_available, ssd_scan, ssd_state_update
from archscale.models.mixers.base import (MATRIX, OUTPUT, VECTOR, ForwardContext, KernelRef, MixerSpec, SaveEnv,
                                         options_of, register)


@dataclass
class Mamba2State:
    """Recurrent state of one Mamba-2 layer: the last d_conv-1 conv inputs and the SSM state (fp32)."""

    conv: Tensor  # (B, conv_dim, d_conv - 1), in the activation dtype
    ssm: Tensor   # (B, nheads, headdim, d_state), fp32

    @classmethod
    def empty(cls, batch: int, module: "Mamba2", device=None, dtype=None) -> "Mamba2State":
        device = device if device is not None else module.A_log.device
        dtype = dtype if dtype is not None else module.in_proj.weight.dtype
        return cls(conv=torch.zeros(batch, module.conv_dim, module.d_conv - 1, device=device, dtype=dtype),
                   ssm=torch.zeros(batch, module.nheads, module.headdim, module.d_state, device=device,
                                   dtype=torch.float32))


class Mamba2(nn.Module):
    def __init__(self, d_model: int, d_inner: int, *, d_state: int = 128, d_conv: int = 4, headdim: int = 64,
                 ngroups: int = 1, chunk_size: int = 256, gmu_save: bool = False, scan_impl: str = "auto",
                 dt_min: float = 1e-3, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 A_init_range: tuple[float, float] = (1.0, 16.0)):
        super().__init__()
        if d_inner % headdim or (d_inner // headdim) % ngroups:
            raise UserError(f"mamba2: d_inner={d_inner} must be a multiple of headdim={headdim} and give a head "
                            f"count divisible by ngroups={ngroups}")
        self.d_model, self.d_inner, self.d_state, self.d_conv = d_model, d_inner, d_state, d_conv
        self.headdim, self.ngroups, self.nheads = headdim, ngroups, d_inner // headdim
        self.chunk_size, self.gmu_save, self.scan_impl = chunk_size, gmu_save, scan_impl
        self.dt_min, self.dt_max, self.dt_init_floor, self.A_init_range = dt_min, dt_max, dt_init_floor, A_init_range
        self.conv_dim = d_inner + 2 * ngroups * d_state
        # in_proj output order as ArchScale / mamba-ssm: [z, x, B, C, dt]
        self.in_proj = nn.Linear(d_model, 2 * d_inner + 2 * ngroups * d_state + self.nheads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=d_conv, groups=self.conv_dim,
                                padding=d_conv - 1, bias=True)
        self.dt_bias = nn.Parameter(torch.empty(self.nheads))
        self.A_log = nn.Parameter(torch.empty(self.nheads))
        self.D = nn.Parameter(torch.empty(self.nheads))
        self.norm = GatedRMSNorm(d_inner, group_size=d_inner // ngroups, eps=1e-5)
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """mamba-ssm's Mamba2 init: dt log-uniform in [dt_min, dt_max] (floored) stored as its inverse softplus in
        dt_bias, A = U(A_init_range) per head (A_log = log A), D = 1, norm weight 1; Linears and the conv keep
        PyTorch's default init."""
        for m in (self.in_proj, self.conv1d, self.out_proj, self.norm):
            m.reset_parameters()
        dt = torch.exp(torch.rand(self.nheads, device=self.dt_bias.device, dtype=torch.float32)
                       * (math.log(self.dt_max) - math.log(self.dt_min)) + math.log(self.dt_min))
        dt = dt.clamp(min=self.dt_init_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
        A = torch.empty(self.nheads, device=self.A_log.device, dtype=torch.float32).uniform_(*self.A_init_range)
        self.A_log.copy_(torch.log(A))
        nn.init.ones_(self.D)

    def forward(self, x: Tensor, state: Mamba2State | None = None,
                doc_ids: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """x (B, T, d_model) -> (out (B, T, d_model), memory (B, T, d_inner) if gmu_save else None).

        `doc_ids` (B, T): document label per token of a packed sequence; conv taps and the SSM state restart
        wherever it changes."""
        Bsz, T, _ = x.shape
        if doc_ids is not None and state is not None:
            raise ValueError("doc_ids is for training-style forwards, not for decoding with a state")
        h, p, g, n = self.nheads, self.headdim, self.ngroups, self.d_state
        z, xBC, dt = torch.split(self.in_proj(x), [self.d_inner, self.conv_dim, h], dim=-1)
        xBC = self._conv(xBC, state, doc_ids)                                  # (B, T, conv_dim)
        xs, Bm, Cm = torch.split(xBC, [self.d_inner, g * n, g * n], dim=-1)
        A = -torch.exp(self.A_log.float())
        if state is not None and T == 1:
            y = ssd_state_update(state.ssm, xs[:, 0].unflatten(-1, (h, p)), dt[:, 0], A, Bm[:, 0].unflatten(-1, (g, n)),
                                 Cm[:, 0].unflatten(-1, (g, n)), D=self.D, dt_bias=self.dt_bias, dt_softplus=True)
        else:
            y = ssd_scan(xs.unflatten(-1, (h, p)), dt, A, Bm.unflatten(-1, (g, n)), Cm.unflatten(-1, (g, n)),
                         self.chunk_size, D=self.D, dt_bias=self.dt_bias, dt_softplus=True, seq_idx=doc_ids,
                         initial_state=None if state is None else state.ssm,
                         return_final_state=state is not None, impl=self.scan_impl)
            if state is not None:
                y, final = y
                state.ssm.copy_(final)
        y = y.reshape(Bsz, T, self.d_inner)
        memory = y if self.gmu_save else None
        return self.out_proj(self.norm(y, z)), memory

    def _conv(self, xs: Tensor, state: Mamba2State | None, doc_ids: Tensor | None) -> Tensor:
        """silu(causal depthwise conv) over xs (B, T, conv_dim) by `kernels.short_conv` (PyTorch's CPU depthwise
        conv backward took 37x its forward in a training step here). With a state: prepend its inputs and store
        the new tail. With doc_ids: taps reaching into an earlier document are zeroed."""
        K = self.d_conv
        if state is None:
            return causal_conv1d(xs, self.conv1d.weight[:, 0], self.conv1d.bias, doc_ids, silu=True)
        xp = torch.cat([state.conv.transpose(1, 2).to(xs.dtype), xs], dim=1)      # (B, K-1+T, conv_dim)
        state.conv = xp[:, xp.shape[1] - (K - 1):].transpose(1, 2).clone()
        return causal_conv1d(xp, self.conv1d.weight[:, 0], self.conv1d.bias, doc_ids, silu=True, prefix=K - 1)


@dataclass
class Mamba2Options:
    """Mamba-2's config fields (`ModelConfig.mixer_options["mamba2"]`); ArchScale's values by default.
    expand 0 means ArchScale's rule (d_inner = 2 n_embd rounded up to a multiple of 512)."""

    d_state: int = 128
    d_conv: int = 4
    headdim: int = 64
    ngroups: int = 1
    chunk_size: int = 256
    expand: float = 0.0


def options(config: ModelConfig) -> Mamba2Options:
    return options_of(config, SPEC)


def d_inner(config: ModelConfig) -> int:
    """ArchScale's `8 * ceil(2d / 64 / 8) * 64` (its expand times d), or int(expand * d) when expand is set."""
    opts = options(config)
    if opts.expand:
        return int(opts.expand * config.n_embd)
    return 512 * math.ceil(2 * config.n_embd / 512)


class Mamba2Mixer(Mamba2):
    """Mamba-2 speaking the block's (x, ctx) protocol: its state lives in the inference cache, and with
    `gmu_save` ("mamba2_mem") its pre-norm SSM output becomes the nGMU memory of the layers after it."""

    def __init__(self, config: ModelConfig, layer_idx: int, kind: str):
        opts = options(config)
        super().__init__(config.n_embd, d_inner(config), d_state=opts.d_state, d_conv=opts.d_conv,
                         headdim=opts.headdim, ngroups=opts.ngroups, chunk_size=opts.chunk_size,
                         gmu_save=kind == "mamba2_mem")
        self.layer_idx = layer_idx

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        state = ctx.state(self.layer_idx, lambda: Mamba2State.empty(x.shape[0], self, x.device, x.dtype))
        out, memory = super().forward(x, state, doc_ids=ctx.doc_ids)
        if memory is not None:
            ctx.memory = memory
        return out


def mamba2_flops(config: ModelConfig, kind: str, seq_len: int) -> dict[str, float]:
    """Per token, for the chunked scan at this length (Q = its chunk length, nc chunks, padded to nc Q):
    "scan": its matmuls per chunk, C B^T (2 Q^2 g n), the intra-chunk product (2 Q^2 d_inner), the chunk states
    and the read-out of the incoming states (2 Q n d_inner each); "conv": the depthwise conv over [x, B, C];
    "conv_elementwise": the depthwise conv over [x, B, C] (shifted multiply-adds, not a convolution op);
    "scan_elementwise": decays, masks, state passing, D skip and the gated norm (not matmuls)."""
    opts = options(config)
    di, n, g = d_inner(config), opts.d_state, opts.ngroups
    h = di // opts.headdim
    nc, Q = chunk_layout(seq_len, min(opts.chunk_size, TORCH_CHUNK))
    per_chunk = 2.0 * Q * Q * (g * n + di) + 4.0 * Q * n * di
    elementwise = nc * (5.0 * h * Q * Q + 4.0 * di * n) / seq_len + 12.0 * di
    return {"scan": nc * per_chunk / seq_len, "conv_elementwise": 2.0 * (di + 2 * g * n) * opts.d_conv,
            "scan_elementwise": elementwise}


def mamba2_saved(config: ModelConfig, kind: str, env: SaveEnv) -> dict[str, float]:
    """Per token, what the layer keeps for its backward (measured with `memory_measure.saved_by_block`).
    "mamba2_mem" also keeps its fp32 output (the nGMU memory) across a checkpointed block; without checkpointing
    that tensor is the gated norm's saved input, already counted.

    On CUDA (mamba-ssm's kernel recomputes its chunk factors): in_proj's input and output, the conv and silu
    outputs, the scan's fp32 inputs and output and the gated norm's fp32 input (7.5 d_inner elements in the
    activation dtype + 30 B per d_inner channel in fp32) and B/C (33 B per group state, fp32). On CPU, see
    `_cpu_saved`."""
    opts = options(config)
    di = d_inner(config)
    memory = {"gmu_memory": 4 * di} if kind == "mamba2_mem" else {}
    if env.act_ckpt:
        return memory
    if env.device == "cpu":  # the memory is the norm's fp32 input: counted there
        return _cpu_saved(config, opts, di, env)
    return {"mamba2": env.act_bytes * 7.5 * di + 30 * di + 33 * 2 * opts.ngroups * opts.d_state}


def _cpu_saved(config: ModelConfig, opts: Mamba2Options, di: int, env: SaveEnv) -> dict[str, float]:
    """With the C++ SSD kernel (`scan_cpu.ssd_chunks`): in_proj's and out_proj's inputs (activation dtype); the
    conv kernel's fp32 input (x, B, C); dt and its softplus (fp32, per head); the scan's fp32 x, B and C (views
    of the conv output in fp32, copies under autocast: the same bytes); the gated norm kernel's fp32 inputs and
    its per-group scale; and the kernel's own: the state entering every chunk and the final one (p x n per head)
    and C B^T per chunk and group (Q x Q), per token at this length."""
    g, n, h = opts.ngroups, opts.d_state, di // opts.headdim
    nc, Q = chunk_layout(env.seq_len, min(opts.chunk_size, TORCH_CHUNK))
    tokens = max(env.seq_len, 1)
    layer = (env.act_bytes * (config.n_embd + di) + 4 * (di + 2 * g * n) + 8 * h + 4 * (di + 2 * g * n)
             + 8 * di + 4 * g)
    return {"mamba2": layer, "scan_chunks": 4.0 * (di * n * (nc + 1) + g * nc * Q * Q) / tokens}


SPEC = register(MixerSpec(
    name="mamba2",
    kinds=("mamba2", "mamba2_mem"),
    build=Mamba2Mixer,
    options=Mamba2Options,
    # ArchScale's _init_weights: in_proj / out_proj are Linears (SP: N(0, 0.02) x w_init0, out_proj / sqrt(2L);
    # mu-P: PyTorch's default x w_init0); the conv, dt_bias, A_log, D and the norm keep Mamba-2's own init.
    roles=(("in_proj.weight", MATRIX), ("out_proj.weight", OUTPUT), ("conv1d.*", VECTOR), ("dt_bias", VECTOR),
           ("A_log", VECTOR), ("D", VECTOR), ("norm.weight", VECTOR)),
    flops=mamba2_flops,
    description="Mamba-2 (SSD) with a gated RMSNorm; 'mamba2_mem' also exports its pre-norm SSM output as nGMU "
                "memory (SambaY-2, MambaY-2)",
    tests=("tests/test_ssd.py::test_chunked_matches_reference_values_and_grads",
           "tests/test_mamba2.py::test_parity_with_transformers_mamba2_mixer"),
    state=Mamba2State,
    varlen="exact: the conv taps and the SSM state restart at every document start (SSD sequence index)",
    memory_width=lambda config, kind: d_inner(config) if kind == "mamba2_mem" else 0,
    saved=mamba2_saved,
    kernels=(KernelRef("mamba_ssm.mamba_chunk_scan_combined", cuda_ssd_available,
                       "archscale.kernels.ssd._ssd_ref",
                       "tests/test_mamba2.py::test_cuda_kernel_module_matches_reference",
                       "on a CUDA machine: pip install mamba-ssm causal-conv1d (extra `cuda`)"),
             KernelRef("archscale.kernels.ssd, impl cpu (C++ ssd_cpu.cpp, kernels/scan_cpu.py's module)",
                       scan_cpu.available, "archscale.kernels.ssd._ssd_ref (and the chunked torch path)",
                       "tests/test_ssd.py::test_chunked_matches_reference_values_and_grads",
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
