"""kernels/gated_norm.py (the gated RMSNorm of Mamba-2 and Gated DeltaNet) against the formula through autograd
in float64, which is independent of both implementations: the C++ kernel (where it built) and the torch path.
fp32; values and gradients within 2e-5 of each tensor's largest entry (fp32 sums in another order)."""

import pytest
import torch
import torch.nn.functional as F

from archscale.kernels import scan_cpu
from archscale.kernels.gated_norm import NORM, GatedRMSNorm, gated_rms_norm

IMPLS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(not scan_cpu.available(),
                                                                 reason="the CPU kernel did not build"))]


def oracle(x, z, w, group, eps):
    """Written out in float64: RMSNorm over each group of x * silu(z), times w."""
    y = (x * z * torch.sigmoid(z)).double()
    yg = y.unflatten(-1, (-1, group))
    out = yg / torch.sqrt((yg * yg).mean(-1, keepdim=True) + eps)
    return out.flatten(-2) * w.double()


def grads(fn, *tensors):
    """fn's output and the gradients of a weighted sum of it w.r.t. every input (fp32)."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return [out.detach().float()] + [t.grad.float() for t in leaves]


def assert_close(got, want, rtol=2e-5):
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert (g - w).abs().max() <= rtol * (w.abs().max() + 1e-12)


def inputs(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, z = (torch.randn(shape, generator=gen) * 2 for _ in range(2))
    w = 1 + 0.5 * torch.randn(shape[-1], generator=gen)
    return x, z, w


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("group", [None, 16, 64])
def test_matches_formula_values_and_grads(impl, group):
    x, z, w = inputs((3, 37, 64))
    g = group or 64
    got = grads(lambda a, b, c: gated_rms_norm(a, b, c, group, 1e-5, impl=impl), x, z, w)
    want = grads(lambda a, b, c: oracle(a.double(), b.double(), c.double(), g, 1e-5), x, z, w)
    assert_close(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_inputs_and_other_ranks(impl):
    """x and z as column slices of one projection's output (the mixers' layout), a 2-D and a 4-D input."""
    x, z, w = inputs((2, 9, 48))
    both = torch.cat([x, z], -1).requires_grad_()
    assert not both[..., :48].is_contiguous()
    out = gated_rms_norm(both[..., :48], both[..., 48:], w, 16, impl=impl)
    (out * out.detach()).sum().backward()
    xd, zd = (t.detach().double().requires_grad_() for t in (x, z))
    want = oracle(xd, zd, w, 16, 1e-5)
    (want * want.detach()).sum().backward()
    assert_close([out.detach(), both.grad], [want.detach().float(), torch.cat([xd.grad, zd.grad], -1).float()],
                 rtol=2e-5)
    for shape in ((7, 48), (2, 3, 4, 48)):
        x, z, w = inputs(shape, seed=1)
        assert_close(grads(lambda a, b, c: gated_rms_norm(a, b, c, 48, impl=impl), x, z, w),
                     grads(lambda a, b, c: oracle(a.double(), b.double(), c.double(), 48, 1e-5), x, z, w))


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_input_returns_bf16(impl):
    x, z, w = inputs((2, 5, 32))
    out = gated_rms_norm(x.bfloat16(), z.bfloat16(), w, impl=impl)
    assert out.dtype == torch.bfloat16
    want = oracle(x.bfloat16().float(), z.bfloat16().float(), w, 32, 1e-5)
    assert (out.float() - want).abs().max() <= 1e-2 * want.abs().max()


@pytest.mark.skipif(not scan_cpu.available(), reason="the CPU kernel did not build")
def test_threads_agree():
    """Rows split over threads; the weight gradient's per-thread partials summed: 1 and 2 threads agree."""
    x, z, w = inputs((4, 64, 32))
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(grads(lambda a, b, c: gated_rms_norm(a, b, c, impl="cpu"), x, z, w))
    finally:
        torch.set_num_threads(before)
    assert_close(outs[0], outs[1], rtol=1e-6)


def test_module_matches_the_formula_and_is_what_the_mixers_use():
    from archscale.models.mixers.gated_deltanet import GatedDeltaNet
    from archscale.models.mixers.mamba2 import Mamba2

    norm = GatedRMSNorm(64, group_size=32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(inputs((64,))[2])
    x, z, _ = inputs((2, 3, 64))
    assert_close([norm(x, z)], [oracle(x, z, norm.weight.detach(), 32, 1e-6).float()])
    assert isinstance(Mamba2(32, 64, d_state=8, headdim=16, ngroups=2).norm, GatedRMSNorm)
    assert isinstance(GatedDeltaNet(32, 2, head_dim=8).norm, GatedRMSNorm)


def test_bad_group_is_one_line():
    x, z, w = inputs((2, 3, 10))
    with pytest.raises(ValueError, match="does not divide"):
        gated_rms_norm(x, z, w, 4)


def test_dispatch_auto_and_env(monkeypatch):
    x = torch.zeros(2, 3, 4)
    assert NORM.resolve("auto", x=x) == ("cpu" if scan_cpu.available() else "torch")
    monkeypatch.setenv("ARCHSCALE_NORM_IMPL", "torch")
    assert NORM.resolve("auto", x=x) == "torch"
