"""The short causal depthwise convolution of Mamba-2 and Gated DeltaNet (+ its SiLU), with a hand-written backward.

    pre[b, t, c] = bias[c] + sum_j w[c, K-1-j] * x[b, P+t-j, c] * same_doc(t-j, t)    (j = 0..K-1, taps back in time)
    out          = silu(pre)                                                        (if silu)

The first P = `prefix` steps of x (0 <= P < K) are history: a decoding state's tail, before the outputs' own
steps; taps reaching before x read 0. ``doc_ids`` (b, t) zeroes the taps that reach into an earlier document
(and the history). Computed in fp32, returned in x's dtype.

Implementations (``impl=``, or ``ARCHSCALE_CONV_IMPL`` for auto):

- ``"cpu"``: the fused C++ kernel of `kernels/scan_cpu.py` (the module Mamba-1's scan and conv are built in):
  one pass over x each way, threaded over rows, document bounds as a per-step tap count; with K = 4 (the
  mixers' default) all of an output row's taps in one pass over its channels, four rows at a time where all
  their taps are in reach; the backward in 32-row tiles, its pre-activation gradient never a whole tensor. The Python path below spent ~90 ms
  of a ~2.2 s GDNY d4 training step in its per-tap passes (docs/BENCHMARKS.md).
- ``"torch"`` (the reference; CUDA and wherever the kernel did not build): K multiply-adds into one buffer and
  the activation in place; the backward is one silu backward, K multiply-adds for dx and K dot products for dw.
  Why not ``F.conv1d``: PyTorch's CPU depthwise-conv backward (``aten::convolution_backward``) took a quarter of
  a whole GDNY training step here; why not shifted copies through autograd: autograd keeps one product per tap.

Both are checked against ``F.conv1d`` through autograd in tests/test_short_conv.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from archscale.kernels import scan_cpu
from archscale.kernels.dispatch import Dispatch, Impl


CONV = Dispatch("causal_conv1d", (Impl("cpu", scan_cpu.unavailable_for), Impl("torch")), env_var="ARCHSCALE_CONV_IMPL")
IMPLS = CONV.choices


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, doc_ids: Tensor | None = None,
                  silu: bool = False, prefix: int = 0, impl: str = "auto") -> Tensor:
    """x (b, prefix + t, c), its first `prefix` steps history; weight (c, K) (tap K-1 = now); bias (c,) or None;
    doc_ids (b, t) or None. Returns (b, t, c) in x's dtype."""
    K = weight.shape[1]
    if not 0 <= prefix < K or x.shape[1] < prefix:
        raise ValueError(f"causal_conv1d: prefix must be in [0, {K}) and at most the input's {x.shape[1]} steps "
                         f"(got {prefix})")
    if CONV.resolve(impl, x=x) == "cpu":
        back = None if doc_ids is None else _steps_into_document(doc_ids, K)
        wT = weight.float().t().contiguous()                                   # (K, c): one tap per row
        out = scan_cpu.conv_rows(x, wT, None if bias is None else bias.float(), prefix, back, silu)
        return out.to(x.dtype)
    xp = F.pad(x, (0, 0, K - 1 - prefix, 0)) if prefix < K - 1 else x         # the reference: K-1 steps before
    return _CausalConv.apply(xp, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), doc_ids, silu)


def _steps_into_document(doc_ids: Tensor, K: int) -> Tensor:
    """(b, t) int32: how many steps back each position's document began, capped at K-1 (the taps it may use)."""
    t = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    began = torch.where(start, t, torch.zeros_like(t)).cummax(1).values
    return (t - began).clamp_(max=K - 1).to(torch.int32)


def _tap_masks(doc_ids: Tensor | None, K: int, dtype: torch.dtype) -> list[Tensor | None]:
    """Per tap j (steps back): (b, t, 1) 1.0 where the input j steps back is in the same document, else 0."""
    if doc_ids is None:
        return [None] * K
    T = doc_ids.shape[1]
    dp = F.pad(doc_ids, (K - 1, 0), value=-1)
    return [None] + [(dp[:, K - 1 - j:K - 1 - j + T] == doc_ids).to(dtype).unsqueeze(-1) for j in range(1, K)]


class _CausalConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xp, w, bias, doc_ids, silu):
        K = w.shape[1]
        T = xp.shape[1] - (K - 1)
        masks = _tap_masks(doc_ids, K, xp.dtype)
        pre = xp[:, K - 1:] * w[:, K - 1]
        if bias is not None:
            pre += bias
        for j in range(1, K):                                                # the input j steps back
            tap = xp[:, K - 1 - j:K - 1 - j + T]
            pre.addcmul_(tap if masks[j] is None else tap * masks[j], w[:, K - 1 - j])
        ctx.save_for_backward(xp, w, pre if silu else None, *(m for m in masks if m is not None))
        ctx.silu, ctx.has_bias, ctx.has_docs = silu, bias is not None, doc_ids is not None
        return F.silu(pre) if silu else pre

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        xp, w, pre, *kept = ctx.saved_tensors
        K = w.shape[1]
        T = xp.shape[1] - (K - 1)
        masks = [None] + kept if ctx.has_docs else [None] * K
        dpre = torch.ops.aten.silu_backward(dout, pre) if ctx.silu else dout.contiguous()
        dxp = torch.zeros_like(xp) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(w) if ctx.needs_input_grad[1] else None
        for j in range(K):
            g = dpre if masks[j] is None else dpre * masks[j]
            lo = K - 1 - j
            if dxp is not None:
                dxp[:, lo:lo + T].addcmul_(g, w[:, lo])
            if dw is not None:
                dw[:, lo] = (g * xp[:, lo:lo + T]).sum((0, 1))
        dbias = dpre.sum((0, 1)) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dxp, dw, dbias, None, None
