"""The plain RMSNorm of every architecture's pre-norms, fp32::

    out = x / sqrt(mean(x^2) + eps) * weight

Implementations (``impl=``, or ``ARCHSCALE_NORM_IMPL`` for auto, the variable the gated norm reads too):

- ``"cpu"``: the fused C++ kernel of `kernels/scan_cpu.py`: one pass over each row forward, two backward; it
  saves only one scale per row. torch's `F.rms_norm` on CPU runs through autograd as ~5 ops forward and ~8
  backward, each a pass over (b, L, d).
- ``"torch"`` (the reference; CUDA, wherever the kernel did not build, and inside `torch.compile`, whose own
  fusion of the norm needs no kernel and which a call into the C++ module would break into several graphs):
  `F.rms_norm`.

Both are checked against each other and against float64 in tests/test_rms_norm.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from archscale.kernels import scan_cpu
from archscale.kernels.dispatch import Dispatch, Impl


def _cpu_unavailable(x: Tensor, **call) -> str:
    return "needs at least (tokens, channels)" if x.dim() < 2 else scan_cpu.unavailable_for(x, **call)


RMS_NORM = Dispatch("rms_norm", (Impl("cpu", _cpu_unavailable), Impl("torch")), env_var="ARCHSCALE_NORM_IMPL")


def rms_norm(x: Tensor, weight: Tensor, eps: float, impl: str = "auto") -> Tensor:
    """x (..., d), weight (d,). Returns (..., d) in fp32."""
    if not torch.compiler.is_compiling() and RMS_NORM.resolve(impl, x=x) == "cpu":
        d = x.shape[-1]
        rows = x if x.dim() == 3 else x.reshape(-1, 1, d)
        return scan_cpu.rms_norm_rows(rows, weight, eps).view(x.shape)
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
