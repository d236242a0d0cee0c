"""kernels/rms_norm.py (every architecture's pre-norm) against the formula in float64, which is independent of
both implementations: the C++ kernel (where it built) and torch's F.rms_norm. Values and gradients within 2e-5
of each tensor's largest entry (fp32 sums in another order)."""

import pytest
import torch

from archscale.kernels import scan_cpu
from archscale.kernels.rms_norm import RMS_NORM, rms_norm
from archscale.models.norm import RMSNorm
from tests.test_gated_norm import assert_close, grads

IMPLS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(not scan_cpu.available(),
                                                                 reason="the CPU kernel did not build"))]


def oracle(x, w, eps):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def inputs(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * 3, 1 + 0.5 * torch.randn(shape[-1], generator=gen)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(3, 37, 64), (2, 5, 13), (7, 48), (2, 3, 4, 40), (1, 1, 3)])
def test_matches_formula_values_and_grads(impl, shape):
    x, w = inputs(shape)
    assert_close(grads(lambda a, b: rms_norm(a, b, 1e-5, impl=impl), x, w),
                 grads(lambda a, b: oracle(a, b, 1e-5), x, w))


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_input_and_bf16(impl):
    """x as a column slice of a wider tensor (copied for the kernel only when its channel stride is not 1) and a
    bf16 input (the norm computes in fp32 and returns fp32, as F.rms_norm on x.float())."""
    x, w = inputs((2, 9, 96))
    w = w[:48]
    xs = x.clone().requires_grad_()
    out = rms_norm(xs[..., 16:64], w, 1e-5, impl=impl)
    (out * out.detach()).sum().backward()
    xd = x[..., 16:64].double().requires_grad_()
    want = oracle(xd, w, 1e-5)
    (want * want.detach()).sum().backward()
    assert_close([out.detach(), xs.grad[..., 16:64]], [want.detach().float(), xd.grad.float()])
    assert xs.grad[..., :16].abs().max() == 0
    y = rms_norm(x[..., :48].bfloat16(), w, 1e-5, impl=impl)
    assert y.dtype == torch.float32
    assert_close([y], [oracle(x[..., :48].bfloat16().float(), w, 1e-5).float()])


@pytest.mark.skipif(not scan_cpu.available(), reason="the CPU kernel did not build")
def test_module_uses_the_kernel_and_the_environment_picks(monkeypatch):
    """RMSNorm (the model's) runs the kernel by default on CPU; ARCHSCALE_NORM_IMPL=torch gives F.rms_norm; the
    two agree. An unknown name is a one-line error."""
    norm = RMSNorm(24)
    x = inputs((2, 6, 24), seed=3)[0]
    calls = []
    real = scan_cpu.rms_norm_rows
    monkeypatch.setattr(scan_cpu, "rms_norm_rows", lambda *a: calls.append(1) or real(*a))
    fused = norm(x)
    assert calls
    monkeypatch.setenv("ARCHSCALE_NORM_IMPL", "torch")
    calls.clear()
    assert torch.allclose(norm(x), fused, rtol=1e-6, atol=1e-6) and not calls
    monkeypatch.setenv("ARCHSCALE_NORM_IMPL", "nope")
    with pytest.raises(ValueError, match="ARCHSCALE_NORM_IMPL"):
        norm(x)
    assert "cpu" in RMS_NORM.choices


@pytest.mark.skipif(not scan_cpu.available(), reason="the CPU kernel did not build")
def test_the_same_on_one_thread_and_two():
    """The weight's gradient sums per-thread partials: 1 and 2 threads agree to rounding."""
    x, w = inputs((4, 33, 64), seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = grads(lambda a, b: rms_norm(a, b, 1e-5, impl="cpu"), x, w)
        torch.set_num_threads(2)
        two = grads(lambda a, b: rms_norm(a, b, 1e-5, impl="cpu"), x, w)
    finally:
        torch.set_num_threads(before)
    assert_close(two, one, rtol=1e-6)
