"""kernels/short_conv.py (the mixers' causal depthwise conv + SiLU with a hand-written backward) against
`F.conv1d` through autograd, which is independent of it. fp32; values and gradients within 1e-5 of each tensor's
largest entry (the sums run in another order)."""

import pytest
import torch
import torch.nn.functional as F

from archscale.kernels.short_conv import causal_conv1d


def oracle(xp, w, bias, doc_ids, silu):
    """F.conv1d over (b, c, K-1+t); with documents, one conv per output step over its window with the inputs of
    other documents (and the steps before the row, which belong to none) zeroed."""
    K = w.shape[1]
    T = xp.shape[1] - (K - 1)
    conv = lambda z: F.conv1d(z.transpose(1, 2), w[:, None], bias, groups=w.shape[0]).transpose(1, 2)  # noqa: E731
    if doc_ids is None:
        out = conv(xp)
    else:
        rows = []
        for b in range(xp.shape[0]):
            pieces = []
            for t in range(T):  # the output at t sees only inputs of its own document
                keep = torch.ones(K, 1, dtype=xp.dtype)
                for j in range(1, K):
                    keep[K - 1 - j] = float(t - j >= 0 and bool(doc_ids[b, t - j] == doc_ids[b, t]))
                pieces.append(conv(xp[b:b + 1, t:t + K] * keep))
            rows.append(torch.cat(pieces, 1))
        out = torch.cat(rows, 0)
    return F.silu(out) if silu else out


def grads_of(fn, xp, w, bias, doc_ids, silu):
    leaves = [t.detach().clone().requires_grad_() for t in (xp, w, bias) if t is not None]
    out = fn(*leaves[:2], leaves[2] if bias is not None else None, doc_ids, silu)
    weight = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * weight).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def assert_close(got, want, rtol=1e-5):
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max() <= rtol * (w.abs().max() + 1e-12)


@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("T,K", [(1, 4), (9, 4), (17, 3), (5, 1)])
def test_matches_conv1d_values_and_grads(T, K, bias, silu):
    gen = torch.Generator().manual_seed(T * 10 + K)
    xp = torch.randn(2, K - 1 + T, 6, generator=gen)        # the first K-1 steps: a state's tail, not zeros
    w, b = torch.randn(6, K, generator=gen), torch.randn(6, generator=gen) if bias else None
    assert_close(grads_of(causal_conv1d, xp, w, b, None, silu), grads_of(oracle, xp, w, b, None, silu))


@pytest.mark.parametrize("silu", [True, False])
def test_documents_match_per_document_conv(silu):
    gen = torch.Generator().manual_seed(3)
    K, T = 4, 13
    xp = torch.randn(2, K - 1 + T, 5, generator=gen)
    xp[:, :K - 1] = 0                                          # a training forward: no state before the rows
    w, b = torch.randn(5, K, generator=gen), torch.randn(5, generator=gen)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3], [5] * 6 + [6] * 7])
    got = grads_of(causal_conv1d, xp, w, b, doc_ids, silu)
    assert_close(got, grads_of(oracle, xp, w, b, doc_ids, silu))
    leaky = causal_conv1d(xp, w, b, None, silu)                 # the control: without labels the taps cross
    assert (leaky[:, 3:5] - got[0][:, 3:5]).abs().max() > 1e-2


def test_too_short_input_is_rejected():
    with pytest.raises(ValueError, match="fewer than"):
        causal_conv1d(torch.zeros(1, 2, 3), torch.zeros(3, 4))
