"""kernels/short_conv.py (the mixers' causal depthwise conv + SiLU, hand-written backward) against `F.conv1d`
through autograd, which is independent of it: both implementations (the C++ kernel, where it built, and the
torch path). fp32; values and gradients within 1e-5 of each tensor's largest entry (the sums run in another
order)."""

import pytest
import torch
import torch.nn.functional as F

from archscale.kernels import scan_cpu
from archscale.kernels.short_conv import CONV, causal_conv1d

IMPLS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(not scan_cpu.available(),
                                                                 reason="the CPU kernel did not build"))]


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


def conv_of(impl, prefix=None):
    """causal_conv1d with this impl, the whole history given (prefix K-1) unless told otherwise."""
    def fn(xp, w, bias, doc_ids, silu):
        return causal_conv1d(xp, w, bias, doc_ids, silu, prefix=w.shape[1] - 1 if prefix is None else prefix,
                             impl=impl)
    return fn


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
@pytest.mark.parametrize("T,K", [(1, 4), (9, 4), (17, 3), (5, 1), (70, 4)])  # 70: the C++ backward's tiles
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_conv1d_values_and_grads(impl, T, K, bias, silu):
    gen = torch.Generator().manual_seed(T * 10 + K)
    xp = torch.randn(2, K - 1 + T, 6, generator=gen)        # the first K-1 steps: a state's tail, not zeros
    w, b = torch.randn(6, K, generator=gen), torch.randn(6, generator=gen) if bias else None
    rtol = 1e-5 * max(1, T // 16)  # the weight and bias gradients sum 2 T rows: rounding grows with T
    assert_close(grads_of(conv_of(impl), xp, w, b, None, silu), grads_of(oracle, xp, w, b, None, silu), rtol)


@pytest.mark.parametrize("prefix", [0, 1, 2])
@pytest.mark.parametrize("impl", IMPLS)
def test_shorter_history_reads_zeros(impl, prefix):
    """prefix < K-1: the missing history steps read 0 (and their gradient is not asked for): equal to the full
    history with those steps zeroed, and the given ones keep their gradient."""
    gen = torch.Generator().manual_seed(prefix)
    K, T = 4, 7
    x = torch.randn(3, prefix + T, 5, generator=gen)
    w, b = torch.randn(5, K, generator=gen), torch.randn(5, generator=gen)
    padded = torch.cat([torch.zeros(3, K - 1 - prefix, 5), x], 1)
    got, want = grads_of(conv_of(impl, prefix), x, w, b, None, True), grads_of(oracle, padded, w, b, None, True)
    want[1] = want[1][:, K - 1 - prefix:]
    assert_close(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_bf16_input(impl):
    """x a column slice of a wider tensor (as q|k|v split from one projection) in bf16: the output comes back
    in bf16, equal to the fp32 conv of the same (bf16-rounded) values to bf16's precision."""
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(2, 11, 12, generator=gen).bfloat16()
    w = torch.randn(6, 4, generator=gen)
    out = causal_conv1d(wide[..., 3:9], w, None, None, True, impl=impl)
    assert out.dtype == torch.bfloat16
    ref = oracle(torch.cat([torch.zeros(2, 3, 6), wide[..., 3:9].float()], 1), w, None, None, True)
    assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()


@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("impl", IMPLS)
def test_documents_match_per_document_conv(impl, silu):
    gen = torch.Generator().manual_seed(3)
    K, T = 4, 13
    xp = torch.randn(2, K - 1 + T, 5, generator=gen)
    xp[:, :K - 1] = 0                                          # a training forward: no state before the rows
    w, b = torch.randn(5, K, generator=gen), torch.randn(5, generator=gen)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3], [5] * 6 + [6] * 7])
    got = grads_of(conv_of(impl), xp, w, b, doc_ids, silu)
    assert_close(got, grads_of(oracle, xp, w, b, doc_ids, silu))
    leaky = conv_of(impl)(xp, w, b, None, silu)                 # the control: without labels the taps cross
    assert (leaky[:, 3:5] - got[0][:, 3:5]).abs().max() > 1e-2
    xp2 = xp.clone()
    xp2[:, :K - 1] = torch.randn(2, K - 1, 5, generator=gen)   # documents ignore the history too
    assert torch.equal(conv_of(impl)(xp2, w, b, doc_ids, silu), got[0])


@pytest.mark.parametrize("impl", IMPLS)
def test_long_packed_rows_match_per_document_conv(impl):
    """Rows longer than the C++ backward's 32-row tiles, documents starting at a tile's first row (32, 64), one
    row after it and inside: a tile's input gradients read the next tile's first rows, which must be its own
    (document-bounded) gpre rows."""
    gen = torch.Generator().manual_seed(11)
    K, lengths = 4, [5, 27, 1, 2, 29, 11]                      # starts 0, 5, 32, 33, 35, 64; T = 75
    T = sum(lengths)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).expand(2, T)
    xp = torch.randn(2, K - 1 + T, 7, generator=gen)
    w, b = torch.randn(7, K, generator=gen), torch.randn(7, generator=gen)
    assert_close(grads_of(conv_of(impl), xp, w, b, doc_ids, True), grads_of(oracle, xp, w, b, doc_ids, True))


@pytest.mark.parametrize("impl", IMPLS)
def test_no_output_rows_gives_zero_history_gradients(impl):
    """History only, no new step (T = 0): an empty output, and gradients of 0, not of uninitialised memory."""
    x = torch.randn(2, 3, 5, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    out = conv_of(impl)(x, w, None, None, True)
    assert out.shape == (2, 0, 5)
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.skipif(not scan_cpu.available(), reason="the CPU kernel did not build")
def test_cpu_kernel_threads_agree_and_is_chosen():
    """auto takes the C++ kernel on CPU; it splits rows over torch's threads (each thread its own partial weight
    gradient): 1 and 2 threads agree to rounding."""
    assert CONV.resolve("auto", x=torch.zeros(1)) == "cpu"
    gen = torch.Generator().manual_seed(9)
    x, w, b = torch.randn(3, 40, 33, generator=gen), torch.randn(33, 4, generator=gen), torch.randn(33, generator=gen)
    doc_ids = torch.arange(40).div(7, rounding_mode="floor").expand(3, 40)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(grads_of(conv_of("cpu", 0), x, w, b, doc_ids, True))
    finally:
        torch.set_num_threads(threads)
    assert_close(results[1], results[0], rtol=1e-6)


@pytest.mark.parametrize("prefix", [-1, 4, 3])
def test_bad_prefix_is_rejected(prefix):
    with pytest.raises(ValueError, match="prefix must be"):
        causal_conv1d(torch.zeros(1, 2, 3), torch.zeros(3, 4), prefix=prefix)
