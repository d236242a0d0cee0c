"""The gated RMSNorm of Mamba-2 and Gated DeltaNet (mamba-ssm's ``RMSNormGated`` with norm_before_gate=False,
which both ArchScale modules use), over groups of channels::

    y   = x * silu(z)
    out = y / sqrt(mean_group(y^2) + eps) * weight          (fp32; returned in x's dtype)

Implementations (``impl=``, or ``ARCHSCALE_NORM_IMPL`` for auto):

- ``"cpu"``: the fused C++ kernel of `kernels/scan_cpu.py` (the module Mamba-1's scan and the short conv are
  built in): one pass over each row forward, two backward, the row in L1; the per-row scale is all it saves.
  Through autograd the same maths is ~7 passes over (b, L, d) forward and ~12 backward: at GDNY d4's shapes
  (B4 x T512, 1024 channels) ~14 ms per layer forward + backward against the kernel's ~5.6
  (benchmarks/gated_norm.py).
- ``"torch"`` (the reference; CUDA and wherever the kernel did not build): the formula through autograd.

Both are checked against each other and against autograd in float64 in tests/test_gated_norm.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from archscale.kernels import scan_cpu
from archscale.kernels.dispatch import Dispatch, Impl


def _cpu_unavailable(x: Tensor, **call) -> str:
    return "needs at least (tokens, channels)" if x.dim() < 2 else scan_cpu.unavailable_for(x, **call)


NORM = Dispatch("gated_rms_norm", (Impl("cpu", _cpu_unavailable), Impl("torch")), env_var="ARCHSCALE_NORM_IMPL")
IMPLS = NORM.choices


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, group_size: int | None = None, eps: float = 1e-5,
                   impl: str = "auto") -> Tensor:
    """x, z (..., d); weight (d,); group_size divides d (None: one group). Returns (..., d) in x's dtype."""
    d = x.shape[-1]
    group = d if group_size is None else group_size
    if group <= 0 or d % group:
        raise ValueError(f"gated_rms_norm: group_size {group_size} does not divide the width {d}")
    if NORM.resolve(impl, x=x) == "cpu":
        rows = lambda t: t.reshape(-1, 1, d) if t.dim() != 3 else t  # noqa: E731  (b, L, d) views as they are
        out = scan_cpu.gated_norm_rows(rows(x), rows(z), weight, group, eps)
        return out.view(x.shape).to(x.dtype)
    return reference(x, z, weight, group, eps)


def reference(x: Tensor, z: Tensor, weight: Tensor, group: int, eps: float) -> Tensor:
    """The formula through autograd, fp32."""
    y = x.float() * F.silu(z.float())
    y = F.rms_norm(y.unflatten(-1, (-1, group)), (group,), eps=eps).flatten(-2)
    return (y * weight.float()).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x * silu(z)) * weight over groups of `group_size` channels (None: one group), as mamba-ssm's
    ``RMSNormGated(norm_before_gate=False)``; the parameter is ``weight`` (dim,), initialised to 1."""

    def __init__(self, dim: int, group_size: int | None = None, eps: float = 1e-5):
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        return gated_rms_norm(x, z, self.weight, self.group_size, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
