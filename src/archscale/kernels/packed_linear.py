"""Linear layers with their weight pre-packed in oneDNN's blocked layout, for CPU inference (decoding, serving).

A decode step multiplies a few rows (one per sequence) by every weight. PyTorch's `F.linear` on CPU re-packs the
weight into the GEMM's blocked layout on every call, which at those row counts costs as much as the product: at
16 rows it reads the weights at ~6 GB/s on a core whose read bandwidth is ~30 GB/s (`docs/SERVING.md`). Packed
once (`Tensor.to_mkldnn()`, the layout oneDNN's GEMM reads directly), the same product ran 1.1-1.8x faster at 1
row and 1.6-1.8x at 16 (one thread, weights of 0.5-8M parameters); vLLM's CPU backend packs its weights too.

`pack_linears(model)` swaps every plain `nn.Linear` of an fp32 CPU model for a `PackedLinear`, which keeps the
dense `weight` (and `bias`) as they were, so code that reads a weight directly (a tied embedding, a fused
projection that concatenates weights) still sees the same tensor; the packed copy is extra memory of the size of
those weights. Inference only: the packed product has no backward. The reference is `F.linear`, and the two
agree to fp32 rounding (the sums run in another order): `tests/test_packed_linear.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def available() -> bool:
    return torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward with the weight packed once; `weight` / `bias` are the original module's tensors."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        with torch.no_grad():
            self.packed = linear.weight.detach().to_mkldnn()  # a plain attribute: not a parameter, not saved

    def forward(self, x: Tensor) -> Tensor:
        if not self._packed_path(x):
            return F.linear(x, self.weight, self.bias)  # training, autocast or another device: the reference
        flat = x.reshape(-1, self.in_features)
        y = torch._C._nn.mkldnn_linear(flat.to_mkldnn(), self.packed, self.bias).to_dense()
        return y.view(*x.shape[:-1], self.out_features)

    def _packed_path(self, x: Tensor) -> bool:
        """fp32 CPU inputs outside autocast and without autograd (autocast would run F.linear in bf16)."""
        grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        return (x.dtype == torch.float32 and x.device.type == "cpu" and not grad
                and not torch.is_autocast_enabled("cpu"))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packable(module: nn.Module) -> bool:
    """A plain fp32 CPU `nn.Linear` (not a subclass, not a quantized or meta weight)."""
    w = getattr(module, "weight", None)
    return (type(module) is nn.Linear and type(w) in (nn.Parameter, Tensor) and w.dtype == torch.float32
            and w.device.type == "cpu")


def pack_linears(model: nn.Module) -> int:
    """Swap every packable `nn.Linear` in `model` for a `PackedLinear`, in place; returns how many (0 when
    oneDNN is not in this torch build)."""
    if not available():
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if packable(child)]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
