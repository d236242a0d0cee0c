"""The Mamba-1 selective scan as a fused C++ loop on CPU (`csrc/selective_scan_cpu.cpp`), built on first use.

The chunked PyTorch scan is memory-bound on CPU: it writes (steps, batch, d_inner, d_state) tensors many times
per step. The C++ kernel keeps each channel's d_state-long state in registers and writes only y, so a Mamba
layer costs about what its projections cost (figures in docs/BENCHMARKS.md). It is compiled once per machine
with torch's C++ extension builder (a C++ compiler and `ninja`; about a minute, cached under
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``). When it cannot be built the scan falls back to
the chunked path with one warning; ``ARCHSCALE_SCAN_IMPL=chunked`` keeps it off (and skips the build). Its
results are checked against the step-by-step reference (values and gradients) in tests/test_selective_scan.py.

The same module holds the Mamba layer's causal depthwise conv + silu (`conv_silu`), fused over (b, L, d) rows:
torch's depthwise conv needs a (b, d, L) copy of its input, and its backward ran on one thread whatever the
thread count: conv, silu and their copies took ~50 ms per layer forward + backward at mamba_d4's shapes (B4 x
T512, d_inner 912; 1-thread profile), the fused pair ~13 ms. Checked against `nn.Conv1d` + silu in the same
test file.
"""

from __future__ import annotations

import hashlib
import math
import platform
import sys
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

SOURCE = Path(__file__).with_name("csrc") / "selective_scan_cpu.cpp"
# one module; the headers beside them declare the other files' functions for the bindings
SOURCES = [SOURCE] + [SOURCE.with_name(f"{name}_cpu.cpp") for name in ("ssd", "cross_entropy", "gated_delta")]
BLOCK = 64  # steps whose states the backward recomputes at a time (64 x d_state floats per channel)
MAX_STATE = 256  # the kernel's d_state bound (its stack buffers; csrc MAX_STATE); larger runs the chunked path
# -fopenmp: the kernel's parallel loops run in torch's own OpenMP pool (at::parallel_for; nothing is linked, the
# runtime torch loaded serves them). Apple's clang has no -fopenmp: there the loops stay vectorised but serial.
FLAGS = ["-O3", "-march=native", "-fopenmp" if sys.platform.startswith("linux") else "-fopenmp-simd",
         "-ffp-contract=fast"]
_state: dict[str, object] = {}
_lock = threading.Lock()  # one build per process, whichever thread asks first (see build_in_background)


def _machine_tag() -> str:
    """The module is built with -march=native: a home directory shared by different CPUs gets one per CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            info = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        info = ""
    return hashlib.sha1(f"{platform.machine()} {info} {FLAGS}".encode()).hexdigest()[:10]


def _load():
    with _lock:
        return _load_locked()


def build_in_background() -> threading.Thread:
    """Start building (or loading) the kernel on a daemon thread, so a caller with other work first (the demo's
    data preparation and Transformer++ run) does not wait for the compiler later."""
    thread = threading.Thread(target=_load, name="archscale-scan-build", daemon=True)
    thread.start()
    return thread


def _load_locked():
    if "module" not in _state:
        _state["module"], _state["error"] = None, None
        try:
            from torch.utils.cpp_extension import load

            if not _built_before():
                print("archscale: building the CPU selective-scan kernel (once per machine, about a minute) ...",
                      file=sys.stderr, flush=True)
            _state["module"] = load(name=f"archscale_scan_cpu_{_machine_tag()}", sources=[str(x) for x in SOURCES],
                                    extra_cflags=FLAGS, verbose=False)
        except Exception as e:  # no compiler / ninja, or a failed build: the chunked path still works
            _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            warnings.warn(f"archscale: the CPU selective-scan kernel could not be built ({_state['error']}); "
                          "using the slower chunked PyTorch scan", RuntimeWarning, stacklevel=3)
    return _state["module"]


def _built_before() -> bool:
    from torch.utils.cpp_extension import _get_build_directory

    try:
        build = Path(_get_build_directory(f"archscale_scan_cpu_{_machine_tag()}", verbose=False))
    except Exception:
        return False
    return any(build.glob("*.so"))


def available() -> bool:
    """The kernel is built (building it now if needed)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    return None if _load() is not None else str(_state.get("error"))


def unavailable_for(x: Tensor, **_) -> str:
    """A `Dispatch` predicate for the kernels of this module: why they cannot run on `x` here ("" when they can)."""
    if x.device.type != "cpu":
        return "runs on CPU tensors only"
    return "" if available() else f"needs the C++ CPU module, which did not build ({unavailable_reason()})"


# Custom ops, so torch.compile traces through the kernel instead of breaking the graph at a pybind call.
# Absent optional inputs (h0, keep, D, z) are passed as empty tensors.
@torch.library.custom_op("archscale::selective_scan_cpu_fwd", mutates_args=())
def _fwd(u: Tensor, dt: Tensor, A: Tensor, Bt: Tensor, Ct: Tensor, h0: Tensor, keep: Tensor, D: Tensor, z: Tensor,
         block: int) -> tuple[Tensor, Tensor, Tensor]:
    y, last, starts = _load().forward(u, dt, A, Bt, Ct, h0, keep, D, z, block, torch.get_num_threads())
    return y, last, starts


@_fwd.register_fake
def _(u, dt, A, Bt, Ct, h0, keep, D, z, block):
    b, d, L = u.shape
    n = A.shape[1]
    return u.new_empty(b, L, d), u.new_empty(b, d, n), u.new_empty(b, d, -(-L // block), n)


@torch.library.custom_op("archscale::selective_scan_cpu_bwd", mutates_args=())
def _bwd(gy: Tensor, glast: Tensor, u: Tensor, dt: Tensor, A: Tensor, Bt: Tensor, Ct: Tensor, keep: Tensor,
         D: Tensor, z: Tensor, starts: Tensor,
         block: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    out = _load().backward(gy, glast, u, dt, A, Bt, Ct, keep, D, z, starts, block, torch.get_num_threads())
    return tuple(out)


@_bwd.register_fake
def _(gy, glast, u, dt, A, Bt, Ct, keep, D, z, starts, block):
    b, d, L = u.shape
    return (u.new_empty(b, L, d), u.new_empty(b, L, d), torch.empty_like(A), torch.empty_like(Bt),
            torch.empty_like(Ct), u.new_empty(b, d, A.shape[1]), u.new_empty(d),
            u.new_empty(b, L, d) if z.numel() else u.new_empty(0))


def _setup(ctx, inputs, output):
    u, dt, A, Bt, Ct, h0, keep, D, z, block = inputs
    ctx.save_for_backward(u, dt, A, Bt, Ct, keep, D, z, output[2])
    ctx.block, ctx.has_h0 = block, h0.numel() > 0


def _backward(ctx, gy, glast, _gstarts):
    u, dt, A, Bt, Ct, keep, D, z, starts = ctx.saved_tensors
    b, d, L = u.shape
    gy = gy.transpose(1, 2) if gy is not None else u.new_zeros(b, d, L)   # y is (b, L, d): read as (b, d, L)
    glast = glast.contiguous() if glast is not None else u.new_zeros(b, d, A.shape[1])
    gu, gdt, gA, gB, gC, gh0, gD, gz = _bwd(gy, glast, u, dt, A, Bt, Ct, keep, D, z, starts, ctx.block)
    # gu, gdt and gz come back (b, L, d), the layout of the Mamba layer's u, dt and z: read as (b, d, L)
    return (gu.transpose(1, 2), gdt.transpose(1, 2), gA, gB, gC, gh0 if ctx.has_h0 else None, None,
            gD if D.numel() else None, gz.transpose(1, 2) if z.numel() else None, None)


_fwd.register_autograd(_backward, setup_context=_setup)


def _f32(x: Tensor | None, like: Tensor) -> Tensor:
    return like.new_empty(0) if x is None else x.float()


def fused_scan(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, z: Tensor | None,
               h0: Tensor | None, reset: Tensor | None):
    """`selective_scan`'s scan, D skip and silu(z) gate in one kernel call, from dt with bias and softplus
    applied. u, dt, z (b, d, L) in any layout and dtype (computed in fp32); A (d, n); B, C (b, n, L); D (d);
    h0 (b, d, n); reset (b, L) bool. Returns y (b, d, L) fp32, a view of (b, L, d) storage (what out_proj
    reads without a copy), and the last state (b, d, n) fp32."""
    b, d, L = u.shape
    uf = u.float()
    if L == 0:
        last = h0.float() if h0 is not None else uf.new_zeros(b, d, A.shape[1])
        return uf.new_zeros(b, d, 0), last
    keep = uf.new_empty(0) if reset is None else (~reset).to(torch.float32).contiguous()
    y, last, _ = _fwd(uf, dt.float(), A.float().contiguous(), B.float().transpose(1, 2).contiguous(),
                      C.float().transpose(1, 2).contiguous(), _f32(h0, uf).contiguous(), keep,
                      _f32(D, uf).contiguous(), _f32(z, uf), BLOCK)
    return y.transpose(1, 2), last


# The mixers' causal depthwise conv (+ silu), fused in the same module: Mamba's (the scan's input, `conv_silu`)
# and, through kernels/short_conv.py, Mamba-2's and Gated DeltaNet's.
@torch.library.custom_op("archscale::conv_silu_cpu_fwd", mutates_args=())
def _conv_fwd(x: Tensor, wT: Tensor, bias: Tensor, prefix: int, back: Tensor, silu: bool) -> Tensor:
    return _load().conv_silu_forward(x, wT, bias, prefix, back, silu, torch.get_num_threads())


@_conv_fwd.register_fake
def _(x, wT, bias, prefix, back, silu):
    return x.new_empty(x.shape[0], x.shape[1] - prefix, x.shape[2])


@torch.library.custom_op("archscale::conv_silu_cpu_bwd", mutates_args=())
def _conv_bwd(gout: Tensor, x: Tensor, wT: Tensor, bias: Tensor, prefix: int, back: Tensor,
              silu: bool) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(_load().conv_silu_backward(gout, x, wT, bias, prefix, back, silu, torch.get_num_threads()))


@_conv_bwd.register_fake
def _(gout, x, wT, bias, prefix, back, silu):
    return x.new_empty(x.shape), torch.empty_like(wT), torch.empty_like(bias)


def _conv_setup(ctx, inputs, output):
    x, wT, bias, prefix, back, silu = inputs
    ctx.save_for_backward(x, wT, bias, back)
    ctx.prefix, ctx.silu = prefix, silu


def _conv_backward(ctx, gout):
    x, wT, bias, back = ctx.saved_tensors
    gx, gw, gb = _conv_bwd(_unit_channel_stride(gout), x, wT, bias, ctx.prefix, back, ctx.silu)
    return gx, gw, (gb if bias.numel() else None), None, None, None


_conv_fwd.register_autograd(_conv_backward, setup_context=_conv_setup)


def _unit_channel_stride(x: Tensor) -> Tensor:
    """x (b, L, d) as float32 with stride 1 over d (a copy only when it is not already so)."""
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def conv_rows(x: Tensor, wT: Tensor, bias: Tensor | None, prefix: int = 0, back: Tensor | None = None,
              silu: bool = True) -> Tensor:
    """The kernel's causal depthwise conv over (b, prefix + L, d) rows, fp32: the first `prefix` rows (< K) are
    history, steps before x read 0; `back` (b, L) int32 bounds each output's taps (its position in its
    document, for packed sequences). wT (K, d) fp32 contiguous (tap K-1 = now); bias (d) fp32 or None. Returns
    (b, L, d) fp32 contiguous; differentiable in x, wT and bias."""
    bf = bias.contiguous() if bias is not None else wT.new_empty(0)
    kept = back.to(torch.int32).contiguous() if back is not None else wT.new_empty(0, dtype=torch.int32)
    return _conv_fwd(_unit_channel_stride(x), wT, bf, prefix, kept, silu)


def conv_silu(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """silu(causal depthwise conv1d(x)) as Mamba computes it (`nn.Conv1d(d, d, K, groups=d, padding=K-1)`, the
    first L outputs), with no state. x (b, d, L) in any layout and dtype (best: a transposed view of (b, L, d)
    storage, as the Mamba layer passes); weight (d, 1, K); bias (d) or None. Computed in fp32; returns (b, d, L)
    in x's dtype, a view of (b, L, d) storage (the layout the scan kernel's gradient comes back in)."""
    wT = weight.float()[:, 0].t().contiguous()                                # (K, d): one tap per row
    out = conv_rows(x.transpose(1, 2), wT, None if bias is None else bias.float())
    return out.transpose(1, 2).to(x.dtype)


# The gated RMSNorm after Mamba-2's scan and Gated DeltaNet's delta rule (through kernels/gated_norm.py).
@torch.library.custom_op("archscale::gated_norm_cpu_fwd", mutates_args=())
def _norm_fwd(x: Tensor, z: Tensor, w: Tensor, group: int, eps: float) -> tuple[Tensor, Tensor]:
    out, rstd = _load().gated_norm_forward(x, z, w, group, eps, torch.get_num_threads())
    return out, rstd


@_norm_fwd.register_fake
def _(x, z, w, group, eps):
    return x.new_empty(x.shape), x.new_empty(*x.shape[:2], x.shape[2] // group)


@torch.library.custom_op("archscale::gated_norm_cpu_bwd", mutates_args=())
def _norm_bwd(gout: Tensor, x: Tensor, z: Tensor, w: Tensor, rstd: Tensor,
              group: int) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(_load().gated_norm_backward(gout, x, z, w, rstd, group, torch.get_num_threads()))


@_norm_bwd.register_fake
def _(gout, x, z, w, rstd, group):
    return x.new_empty(x.shape), x.new_empty(x.shape), torch.empty_like(w)


def _norm_setup(ctx, inputs, output):
    x, z, w, group, eps = inputs
    ctx.save_for_backward(x, z, w, output[1])
    ctx.group = group


def _norm_backward(ctx, gout, _grstd):
    x, z, w, rstd = ctx.saved_tensors
    gx, gz, gw = _norm_bwd(_unit_channel_stride(gout), x, z, w, rstd, ctx.group)
    return gx, gz, gw, None, None


_norm_fwd.register_autograd(_norm_backward, setup_context=_norm_setup)


def gated_norm_rows(x: Tensor, z: Tensor, w: Tensor, group: int, eps: float) -> Tensor:
    """RMSNorm(x * silu(z)) * w over groups of `group` channels, fp32: x, z (b, L, d) with any batch / time
    strides (copied only when the channel stride is not 1); w (d). Returns (b, L, d) fp32 contiguous;
    differentiable in x, z and w."""
    return _norm_fwd(_unit_channel_stride(x), _unit_channel_stride(z), w.float().contiguous(), group, eps)[0]


# The plain RMSNorm (through kernels/rms_norm.py).
@torch.library.custom_op("archscale::rms_norm_cpu_fwd", mutates_args=())
def _rms_fwd(x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    out, rstd = _load().rms_norm_forward(x, w, eps, torch.get_num_threads())
    return out, rstd


@_rms_fwd.register_fake
def _(x, w, eps):
    return x.new_empty(x.shape), x.new_empty(*x.shape[:2], 1)


@torch.library.custom_op("archscale::rms_norm_cpu_bwd", mutates_args=())
def _rms_bwd(gout: Tensor, x: Tensor, w: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return tuple(_load().rms_norm_backward(gout, x, w, rstd, torch.get_num_threads()))


@_rms_bwd.register_fake
def _(gout, x, w, rstd):
    return x.new_empty(x.shape), torch.empty_like(w)


def _rms_setup(ctx, inputs, output):
    x, w, eps = inputs
    ctx.save_for_backward(x, w, output[1])


def _rms_backward(ctx, gout, _grstd):
    x, w, rstd = ctx.saved_tensors
    gx, gw = _rms_bwd(_unit_channel_stride(gout), x, w, rstd)
    return gx, gw, None


_rms_fwd.register_autograd(_rms_backward, setup_context=_rms_setup)


def rms_norm_rows(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * w over the last dim, fp32: x (b, L, d) with any batch / time strides; w (d).
    Returns (b, L, d) fp32 contiguous; differentiable in x and w."""
    return _rms_fwd(_unit_channel_stride(x.float()), w.float().contiguous(), eps)[0]


# The language-model loss (through kernels/cross_entropy.py): row losses and the gradient, in one pass.
@torch.library.custom_op("archscale::cross_entropy_cpu_fwd", mutates_args=())
def cross_entropy_rows(logits: Tensor, targets: Tensor, ignore_index: int,
                       label_smoothing: float) -> tuple[Tensor, Tensor, Tensor]:
    """logits (N, V) fp32, unit inner stride; targets (N,) int64. Returns (row losses (N,), d mean / d logits
    (N, V), the number of rows not ignored (a float32 scalar)). Not differentiable itself:
    kernels/cross_entropy.py hands the gradient to autograd."""
    losses, grad, n_valid = _load().cross_entropy_forward(logits, targets.contiguous(), ignore_index,
                                                          label_smoothing, torch.get_num_threads())
    return losses, grad, n_valid


@cross_entropy_rows.register_fake
def _(logits, targets, ignore_index, label_smoothing):
    return logits.new_empty(logits.shape[0]), logits.new_empty(logits.shape), logits.new_empty(())


def scale_loss_grad(grad: Tensor, factor: Tensor) -> Tensor:
    """grad *= factor in place (a one-element tensor, read in C++: no host read on the Python side), skipped when
    it is exactly 1."""
    _load().cross_entropy_scale_grad(grad, factor.float(), torch.get_num_threads())
    return grad


# Mamba-2's SSD chunked scan (through kernels/ssd.py). Absent optional inputs (starts, D, h0) are empty tensors.
@torch.library.custom_op("archscale::ssd_cpu_fwd", mutates_args=())
def _ssd_fwd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, starts: Tensor, D: Tensor, h0: Tensor,
             chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    y, states, CB = _load().ssd_forward(x, dt, A, B, C, starts, D, h0, chunk, torch.get_num_threads())
    return y, states, CB


@_ssd_fwd.register_fake
def _(x, dt, A, B, C, starts, D, h0, chunk):
    b, L, h, p = x.shape
    g, n = B.shape[2:]
    nc = -(-L // chunk)
    return x.new_empty(b, L, h, p), x.new_empty(b, nc + 1, h, p, n), x.new_empty(b, g, nc, chunk, chunk)


@torch.library.custom_op("archscale::ssd_cpu_bwd", mutates_args=())
def _ssd_bwd(gy: Tensor, glast: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, starts: Tensor,
             D: Tensor, states: Tensor, CB: Tensor, has_h0: bool,
             chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(_load().ssd_backward(gy, glast, x, dt, A, B, C, starts, D, states, CB, has_h0, chunk,
                                      torch.get_num_threads()))


@_ssd_bwd.register_fake
def _(gy, glast, x, dt, A, B, C, starts, D, states, CB, has_h0, chunk):
    b, L, h, p = x.shape
    return (x.new_empty(x.shape), x.new_empty(dt.shape), x.new_empty(b, h), x.new_empty(B.shape),
            x.new_empty(C.shape), x.new_empty(b, h, p) if D.numel() else x.new_empty(0),
            x.new_empty(b, h, p, B.shape[-1]) if has_h0 else x.new_empty(0))


def _ssd_setup(ctx, inputs, output):
    x, dt, A, B, C, starts, D, h0, chunk = inputs
    ctx.set_materialize_grads(False)  # no zero-filled gradient for the states and C B^T nobody reads
    ctx.save_for_backward(x, dt, A, B, C, starts, D, output[1], output[2])
    ctx.chunk, ctx.has_h0 = chunk, h0.numel() > 0


def _ssd_backward(ctx, gy, gstates, _gCB):
    x, dt, A, B, C, starts, D, states, CB = ctx.saved_tensors
    glast = x.new_empty(0) if gstates is None else gstates[:, -1].contiguous()  # only the final state is seen
    gy = x.new_zeros(x.shape) if gy is None else _dense_rows(gy)
    dx, ddt, dA, dB, dC, dD, dh0 = _ssd_bwd(gy, glast, x, dt, A, B, C, starts, D, states, CB, ctx.has_h0,
                                            ctx.chunk)
    return (dx, ddt, dA.sum(0), dB, dC, None, dD.sum(0) if D.numel() else None, dh0 if ctx.has_h0 else None,
            None)


_ssd_fwd.register_autograd(_ssd_backward, setup_context=_ssd_setup)


def _dense_rows(t: Tensor) -> Tensor:
    """t with its last two dims dense (what the kernel reads per row); any batch and time strides are kept."""
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def ssd_chunks(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk: int, starts: Tensor | None,
               D: Tensor | None, h0: Tensor | None) -> tuple[Tensor, Tensor]:
    """The SSD chunked scan (kernels/ssd.py's semantics) on the C++ kernel, fp32 inputs: x (b, L, h, p); dt
    (b, L, h) after bias and softplus; A (h,); B, C (b, L, g, n); starts (b, L) bool or None; D (h, p) or None;
    h0 (b, h, p, n) or None; chunks of `chunk` steps (the last may be shorter). Returns (y (b, L, h, p), the final
    state (b, h, p, n)), differentiable in every tensor but starts."""
    empty = x.new_empty(0)
    y, states, _ = _ssd_fwd(_dense_rows(x), dt.contiguous(), A.contiguous(), _dense_rows(B), _dense_rows(C),
                            empty.bool() if starts is None else starts.contiguous(),
                            empty if D is None else D.contiguous(), empty if h0 is None else h0.contiguous(), chunk)
    return y, states[:, -1]


def _ssd_forward_flops(x_shape, B_shape, chunk: int) -> int:
    """The chunked algorithm's products (what FlopCounterMode counts in kernels/ssd.py's torch path): per chunk of
    Q steps, C B^T (2 Q^2 g n), the intra-chunk product (2 Q^2 h p), the chunk's state and the read-out of the
    entering state (2 Q n h p each; the kernel skips the first chunk's read-out of a zero state, counted here
    as in the torch path)."""
    b, L, h, p = x_shape
    g, n = B_shape[2:]
    nc = -(-L // chunk) if L else 0
    return b * nc * (2 * chunk * chunk * (g * n + h * p) + 4 * chunk * n * h * p)


@register_flop_formula(torch.ops.archscale.ssd_cpu_fwd)
def _(x_shape, dt_shape, A_shape, B_shape, C_shape, starts_shape, D_shape, h0_shape, chunk, *args, **kwargs):
    return _ssd_forward_flops(x_shape, B_shape, chunk)


@register_flop_formula(torch.ops.archscale.ssd_cpu_bwd)
def _(gy_shape, glast_shape, x_shape, dt_shape, A_shape, B_shape, *args, **kwargs):
    chunk = args[-1]  # (C, starts, D, states, CB, has_h0, chunk): every forward product has two in the backward
    return 2 * _ssd_forward_flops(x_shape, B_shape, chunk)


# The gated delta rule's chunk loop (through kernels/gated_delta.py's chunked form). With document masks the
# per-chunk factors come from torch (gated_delta_cpu_*); without them the loops make the keys' and queries' layout
# and the factors too (gated_delta_chunk_*). Absent h0 / dlast / dh0 are empty tensors.
@torch.library.custom_op("archscale::gated_delta_cpu_fwd", mutates_args=())
def gated_delta_scan(kq: Tensor, v: Tensor, eG: Tensor, eGe: Tensor, a: Tensor, Tb: Tensor, A: Tensor, h0: Tensor,
                     scale: float, need_last: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`gated_delta._scan` on the C++ module: (o, states, kqS, u) as there."""
    o, states, kqS, u = _load().gated_delta_scan_forward(kq, v, eG, eGe, a, Tb, A, h0, scale, need_last,
                                                         torch.get_num_threads())
    return o, states, kqS, u


@gated_delta_scan.register_fake
def _(kq, v, eG, eGe, a, Tb, A, h0, scale, need_last):
    n, b, h, C2, K = kq.shape
    V = v.shape[-1]
    return (v.new_empty(b, n * C2 // 2, h, V), kq.new_empty(n + 1, b, h, K, V), kq.new_empty(n, b, h, C2, V),
            kq.new_empty(n, b, h, C2 // 2, V))


@torch.library.custom_op("archscale::gated_delta_cpu_bwd", mutates_args=())
def gated_delta_scan_backward(kq: Tensor, v: Tensor, eG: Tensor, eGe: Tensor, a: Tensor, Tb: Tensor, A: Tensor,
                              states: Tensor, kqS: Tensor, u: Tensor, do: Tensor, dlast: Tensor, scale: float,
                              zero_start: bool, want_dh0: bool) -> list[Tensor]:
    """`gated_delta._scan_backward` on the C++ module: [dkq, dv, gG, gGe, ga, dTb, dA, dh0 (empty unless
    want_dh0)]."""
    return list(_load().gated_delta_scan_backward(kq, v, eG, eGe, a, Tb, A, states, kqS, u, do, dlast, scale,
                                                  zero_start, want_dh0, torch.get_num_threads()))


@gated_delta_scan_backward.register_fake
def _(kq, v, eG, eGe, a, Tb, A, states, kqS, u, do, dlast, scale, zero_start, want_dh0):
    n, b, h, C2, K = kq.shape
    dh0 = kq.new_empty(b, h, K, v.shape[-1]) if want_dh0 else kq.new_empty(0)
    return [torch.empty_like(kq), v.new_empty(v.shape), torch.empty_like(eG), torch.empty_like(eGe),
            torch.empty_like(a), torch.empty_like(Tb), torch.empty_like(A), dh0]


@torch.library.custom_op("archscale::gated_delta_chunk_fwd", mutates_args=())
def gated_delta_chunk(k: Tensor, q: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: Tensor, chunk: int, scale: float,
                      normalise: bool, need_last: bool) -> list[Tensor]:
    """`gated_delta._KeysOverQueries`, `_factors` and `_scan` in one C++ pass (no document masks): [o, states, z,
    kq, rs, P, M, T, eG, eGe, a, Tb, A], z = v - eG k S per chunk (n, b, h, C, V) in place of `_scan`'s kqS and u.
    k, q (b, t, h, K) fp32; g, beta chunk-major (n, b, h, C), contiguous."""
    return list(_load().gated_delta_chunk_forward(k, q, v, g, beta, h0, chunk, scale, normalise, need_last,
                                                  torch.get_num_threads()))


@gated_delta_chunk.register_fake
def _(k, q, v, g, beta, h0, chunk, scale, normalise, need_last):
    b, t, h, K = k.shape
    n, C, V = t // chunk, chunk, v.shape[-1]
    square = k.new_empty(n, b, h, C, C)
    return [v.new_empty(b, t, h, V), k.new_empty(n + 1, b, h, K, V), k.new_empty(n, b, h, C, V),
            k.new_empty(n, b, h, 2 * C, K), k.new_empty(n, b, h, 2 * C),
            k.new_empty(n, b, h, 2 * C, C), square, torch.empty_like(square), torch.empty_like(g),
            torch.empty_like(g), k.new_empty(n, b, h), torch.empty_like(square), torch.empty_like(square)]


@torch.library.custom_op("archscale::gated_delta_chunk_bwd", mutates_args=())
def gated_delta_chunk_backward(kq: Tensor, rs: Tensor, v: Tensor, beta: Tensor, P: Tensor, M: Tensor, T: Tensor,
                               eG: Tensor, eGe: Tensor, a: Tensor, Tb: Tensor, A: Tensor, states: Tensor, z: Tensor,
                               do: Tensor, dlast: Tensor, scale: float, normalise: bool, zero_start: bool,
                               want_dh0: bool) -> list[Tensor]:
    """The backward of `gated_delta_chunk` in one C++ pass: [dk, dq, dv, dg, dbeta, dh0 (empty unless want_dh0)],
    dk, dq (b, t, h, K), dg and dbeta chunk-major."""
    return list(_load().gated_delta_chunk_backward(kq, rs, v, beta, P, M, T, eG, eGe, a, Tb, A, states, z, do, dlast,
                                                   scale, normalise, zero_start, want_dh0, torch.get_num_threads()))


@gated_delta_chunk_backward.register_fake
def _(kq, rs, v, beta, P, M, T, eG, eGe, a, Tb, A, states, z, do, dlast, scale, normalise, zero_start, want_dh0):
    n, b, h, C2, K = kq.shape
    dk = kq.new_empty(b, n * C2 // 2, h, K)
    dh0 = kq.new_empty(b, h, K, v.shape[-1]) if want_dh0 else kq.new_empty(0)
    return [dk, torch.empty_like(dk), v.new_empty(v.shape), torch.empty_like(beta), torch.empty_like(beta), dh0]


def _gated_delta_flops(kq_shape, v_shape, has_h0: bool, need_last: bool) -> int:
    """The torch loop's products (`gated_delta._scan`): per chunk and (row, head) [k; q] S (skipped for the
    first chunk without h0), Tb z and A u, and the state write k^T (eGe u) (skipped for the last chunk unless
    the final state is asked for)."""
    n, b, h, C2, K = kq_shape
    C, V = C2 // 2, v_shape[-1]
    reads = n - (0 if has_h0 else 1)
    writes = n - (0 if need_last else 1)
    return b * h * (reads * 2 * C2 * K * V + n * 2 * (2 * C * C * V) + writes * 2 * K * C * V)


def _gated_delta_backward_flops(kq_shape, v_shape, has_dlast: bool, zero_start: bool, want_dh0: bool) -> int:
    """`gated_delta._scan_backward`'s products: per chunk A^T do, do u^T, du z^T and Tb^T du; d[kS; qS] S^T
    (not for a zero entering state); where a state gradient enters the chunk k dS and (eGe u) dS^T; and the
    state gradient's kq^T d[kS; qS] (not for the first chunk unless dh0 is wanted)."""
    n, b, h, C2, K = kq_shape
    C, V = C2 // 2, v_shape[-1]
    with_dS = n - (0 if has_dlast else 1)
    reads = n - (1 if zero_start else 0)
    writes = n - (0 if want_dh0 else 1)
    return b * h * (n * 4 * (2 * C * C * V) + reads * 2 * C2 * V * K + with_dS * 2 * (2 * C * K * V)
                    + writes * 2 * K * C2 * V)


@register_flop_formula(torch.ops.archscale.gated_delta_cpu_fwd)
def _(kq_shape, v_shape, eG_shape, eGe_shape, a_shape, Tb_shape, A_shape, h0_shape, scale, need_last, *args,
      **kwargs):
    return _gated_delta_flops(kq_shape, v_shape, math.prod(h0_shape) > 0, need_last)


@register_flop_formula(torch.ops.archscale.gated_delta_cpu_bwd)
def _(kq_shape, v_shape, eG_shape, eGe_shape, a_shape, Tb_shape, A_shape, states_shape, kqS_shape, u_shape,
      do_shape, dlast_shape, scale, zero_start, want_dh0, *args, **kwargs):
    return _gated_delta_backward_flops(kq_shape, v_shape, math.prod(dlast_shape) > 0, zero_start, want_dh0)


def _factor_flops(kq_shape) -> int:
    """`gated_delta._factors`' product: [k; q] k^T per chunk and (row, head)."""
    n, b, h, C2, K = kq_shape
    return b * h * n * 2 * C2 * (C2 // 2) * K


def _factor_backward_flops(kq_shape) -> int:
    """`gated_delta._factors_backward`'s products: T^T X T^T (two C^3 products), dP k and dP^T kq."""
    n, b, h, C2, K = kq_shape
    C = C2 // 2
    return b * h * n * (2 * 2 * C ** 3 + 2 * 2 * C2 * C * K)


@register_flop_formula(torch.ops.archscale.gated_delta_chunk_fwd)
def _(k_shape, q_shape, v_shape, g_shape, beta_shape, h0_shape, chunk, scale, normalise, need_last, *args,
      **kwargs):
    b, t, h, K = k_shape
    kq_shape = (t // chunk, b, h, 2 * chunk, K)
    return _factor_flops(kq_shape) + _gated_delta_flops(kq_shape, v_shape, math.prod(h0_shape) > 0, need_last)


@register_flop_formula(torch.ops.archscale.gated_delta_chunk_bwd)
def _(kq_shape, rs_shape, v_shape, beta_shape, P_shape, M_shape, T_shape, eG_shape, eGe_shape, a_shape, Tb_shape,
      A_shape, states_shape, z_shape, do_shape, dlast_shape, scale, normalise, zero_start, want_dh0, *args,
      **kwargs):
    n, b, h, C, V = z_shape
    remade_u = b * h * n * 2 * C * C * V  # u = Tb z again per chunk: u is not saved
    return remade_u + _factor_backward_flops(kq_shape) + _gated_delta_backward_flops(
        kq_shape, v_shape, math.prod(dlast_shape) > 0, zero_start, want_dh0)
