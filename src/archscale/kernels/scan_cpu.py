"""The Mamba-1 selective scan as a fused C++ loop on CPU (`csrc/selective_scan_cpu.cpp`), built on first use.

The chunked PyTorch scan is memory-bound on CPU: it writes (steps, batch, d_inner, d_state) tensors many times
per step. The C++ kernel keeps each channel's d_state-long state in registers and writes only y, so a Mamba
layer costs about what its projections cost (figures in docs/BENCHMARKS.md). It is compiled once per machine
with torch's C++ extension builder (a C++ compiler and `ninja`; ~30-60 s, cached under
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``). When it cannot be built the scan falls back to
the chunked path with one warning; ``ARCHSCALE_SCAN_IMPL=chunked`` keeps it off (and skips the build). Its results are checked against
the step-by-step reference (values and gradients) in tests/test_selective_scan.py.
"""

from __future__ import annotations

import hashlib
import platform
import sys
import warnings
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("csrc") / "selective_scan_cpu.cpp"
BLOCK = 64  # steps whose states the backward recomputes at a time (64 x d_state floats per channel)
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=fast"]
_state: dict[str, object] = {}


def _machine_tag() -> str:
    """The module is built with -march=native: a home directory shared by different CPUs gets one per CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            info = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        info = ""
    return hashlib.sha1(f"{platform.machine()} {info} {FLAGS}".encode()).hexdigest()[:10]


def _load():
    if "module" not in _state:
        _state["module"], _state["error"] = None, None
        try:
            from torch.utils.cpp_extension import load

            print("archscale: building the CPU selective-scan kernel (once per machine, ~30-60 s) ...",
                  file=sys.stderr, flush=True) if not _built_before() else None
            _state["module"] = load(name=f"archscale_scan_cpu_{_machine_tag()}", sources=[str(SOURCE)],
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


# Custom ops, so torch.compile traces through the kernel instead of breaking the graph at a pybind call.
@torch.library.custom_op("archscale::selective_scan_cpu_fwd", mutates_args=())
def _fwd(u: Tensor, dt: Tensor, A: Tensor, Bt: Tensor, Ct: Tensor, h0: Tensor, keep: Tensor,
         block: int) -> tuple[Tensor, Tensor, Tensor]:
    y, last, starts = _load().forward(u, dt, A, Bt, Ct, h0, keep, block, torch.get_num_threads())
    return y, last, starts


@_fwd.register_fake
def _(u, dt, A, Bt, Ct, h0, keep, block):
    b, d, L = u.shape
    return u.new_empty(b, d, L), h0.new_empty(h0.shape), u.new_empty(b, d, -(-L // block), A.shape[1])


@torch.library.custom_op("archscale::selective_scan_cpu_bwd", mutates_args=())
def _bwd(gy: Tensor, glast: Tensor, u: Tensor, dt: Tensor, A: Tensor, Bt: Tensor, Ct: Tensor, keep: Tensor,
         starts: Tensor, block: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    out = _load().backward(gy, glast, u, dt, A, Bt, Ct, keep, starts, block, torch.get_num_threads())
    return tuple(out)


@_bwd.register_fake
def _(gy, glast, u, dt, A, Bt, Ct, keep, starts, block):
    return (torch.empty_like(u), torch.empty_like(dt), torch.empty_like(A), torch.empty_like(Bt),
            torch.empty_like(Ct), torch.empty_like(glast))


def _setup(ctx, inputs, output):
    u, dt, A, Bt, Ct, h0, keep, block = inputs
    ctx.save_for_backward(u, dt, A, Bt, Ct, keep, output[2])
    ctx.block = block


def _backward(ctx, gy, glast, _gstarts):
    u, dt, A, Bt, Ct, keep, starts = ctx.saved_tensors
    gy = gy.contiguous() if gy is not None else torch.zeros_like(u)
    glast = glast.contiguous() if glast is not None else u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    gu, gdt, gA, gB, gC, gh0 = _bwd(gy, glast, u, dt, A, Bt, Ct, keep, starts, ctx.block)
    return gu, gdt, gA, gB, gC, gh0, None, None


_fwd.register_autograd(_backward, setup_context=_setup)


def scan(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, h0: Tensor | None, reset: Tensor | None):
    """Shapes as `selective_scan._scan_ref`: u, dt (b, d, L) fp32 with softplus and bias applied; A (d, n);
    B, C (b, n, L); h0 (b, d, n) or None; reset (b, L) bool or None. Returns y (b, d, L), last (b, d, n)."""
    b, d, L = u.shape
    if h0 is None:
        h0 = u.new_zeros(b, d, A.shape[1])
    keep = u.new_empty(0) if reset is None else (~reset).to(u.dtype).contiguous()
    if L == 0:
        return u.new_zeros(b, d, 0), h0
    y, last, _ = _fwd(u.contiguous(), dt.contiguous(), A.contiguous(), B.transpose(1, 2).contiguous(),
                      C.transpose(1, 2).contiguous(), h0.contiguous(), keep, BLOCK)
    return y, last
