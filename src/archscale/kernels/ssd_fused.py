"""The intra-chunk part of the SSD chunked scan (kernels/ssd.py, step 1) as one autograd node with a hand-written
backward: the (Q, Q) decays, their product with C B^T and the masked "attention" product, for all chunks at once.

    decay[l, s] = exp(acum_l - acum_s) for s < l (and in one document), 1 for s = l, 0 above
    M = decay * (C B^T)                     (per head; heads of a group share C B^T)
    y_l = sum_s M[l, s] X_s                 (X = dt x)

Why: through autograd these Q x Q x heads tensors are the largest elementwise work of the scan (a difference, a
mask, an exp, the diagonal, a product; in the backward the same again plus reductions), each one pass over memory.
Here the forward forms the decays in place (clamped at -87: exp's underflow path runs ~15x slower on CPU, and
exp(-87) ~ 1.6e-38 is below anything the sums resolve) and the backward is two batched products and three passes:

    dM = dy X^T;  dX = M^T dy;  d(C B^T) = sum_heads dM * decay;  E = dM * M (strictly lower);
    d acum_l = sum_s E[l, s] - sum_s E[s, l]

The diagonal (exactly 1, independent of A) gets no gradient path into acum, as in the autograd form.
"""

from __future__ import annotations

import torch
from torch import Tensor


def intra_chunk(acum: Tensor, CB: Tensor, X: Tensor, keep: Tensor | None) -> Tensor:
    """acum (b, c, h, Q) within-chunk cumulative dt * A; CB (b, c, g, Q, Q) = C_l . B_s; X (b, c, Q, g, h/g, p);
    keep (b, c, 1, Q, Q) bool (same document) or None. Returns y (b, c, Q, g, h/g, p)."""
    return _IntraChunk.apply(acum, CB, X, keep)


def _decays(acum: Tensor, keep: Tensor | None) -> Tensor:
    """(b, c, h, Q, Q): exp(acum_l - acum_s) on and below the diagonal (1 on it), 0 above and across documents."""
    decay = (acum[..., :, None] - acum[..., None, :]).tril_().clamp_(min=-87.0).exp_().tril_()
    return decay if keep is None else decay.mul_(keep)


class _IntraChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, acum, CB, X, keep):
        b, c, g, Q, _ = CB.shape
        hg, p = X.shape[-2:]
        decay = _decays(acum, keep).view(b, c, g, hg, Q, Q)
        M = decay * CB[:, :, :, None]
        Xt = X.permute(0, 1, 3, 4, 2, 5)                                      # (b, c, g, k, s, p)
        y = M @ Xt                                                            # (b, c, g, k, l, p)
        ctx.save_for_backward(decay, M, Xt)
        return y.permute(0, 1, 4, 2, 3, 5)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        decay, M, Xt = ctx.saved_tensors
        b, c, g, hg, Q, _ = M.shape
        dyt = dy.permute(0, 1, 3, 4, 2, 5)                                    # (b, c, g, k, l, p)
        dM = dyt @ Xt.transpose(-1, -2)                                       # (b, c, g, k, l, s)
        dX = (M.transpose(-1, -2) @ dyt).permute(0, 1, 4, 2, 3, 5)
        dCB = (dM * decay).sum(3) if ctx.needs_input_grad[1] else None
        E = dM.mul_(M).tril_(-1).view(b, c, g * hg, Q, Q)                    # d(acum_l - acum_s), s < l
        dacum = E.sum(-1) - E.sum(-2)
        return dacum, dCB, dX, None
