"""The chunked selective scan (and the decode step, and mamba-ssm's kernel when present) against the reference."""

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

import archscale.kernels.scan_cpu as scan_cpu
import archscale.kernels.selective_scan as ss
from archscale.kernels.selective_scan import selective_scan, selective_state_update

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


def make_inputs(b, d, n, L, *, seed=0, dtype=torch.float32, dt_scale=0.5, dt_shift=0.0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return {
        "u": r(b, d, L).to(dtype), "delta": (r(b, d, L) * dt_scale + dt_shift).to(dtype),
        "A": -torch.exp(r(d, n) * 0.5),       # real, negative, fp32 (as the module passes it)
        "B": r(b, n, L).to(dtype), "C": r(b, n, L).to(dtype),
        "D": r(d), "z": r(b, d, L).to(dtype), "delta_bias": r(d) * 0.3,
        "initial_state": r(b, d, n),
    }


def run(impl, inputs, use, grads=True):
    """y, last state, and the gradient of a generic loss w.r.t. every input in `use` (None if no grad)."""
    t = {k: v.detach().clone().requires_grad_(grads and v.is_floating_point()) for k, v in inputs.items()}
    kw = {k: t[k] for k in ("D", "z", "delta_bias", "initial_state") if k in use}
    y, last = selective_scan(t["u"], t["delta"], t["A"], t["B"], t["C"], **kw, return_last_state=True, impl=impl)
    out = {"y": y.detach(), "last": last.detach()}
    if grads:
        # weights make every output element matter differently, so a swapped/mis-scaled gradient shows
        wy = torch.linspace(-1, 1, y.numel()).view_as(y)
        (y.float() * wy).sum().add_((last * last.detach().sign()).sum() * 0.5).backward()
        for k in ("u", "delta", "A", "B", "C", *kw):
            out["grad_" + k] = t[k].grad
    return out


def assert_close(got, want, rtol, atol_scale):
    for k in want:
        assert got[k] is not None, k
        assert torch.isfinite(got[k]).all(), k
        scale = want[k].float().abs().max().item() + 1e-12
        err = (got[k].float() - want[k].float()).abs().max().item()
        assert err <= rtol * scale + atol_scale, f"{k}: max err {err:.3g} vs scale {scale:.3g}"


OPTIONALS = [(), ("D",), ("z",), ("delta_bias",), ("initial_state",), ("D", "z", "delta_bias", "initial_state")]


def small_blocks(monkeypatch):
    """Chunks of 4 in blocks of 12 (chunked path) and blocks of 12 (C++ kernel): several chunks and blocks,
    a ragged end, and L < chunk, at test sizes."""
    monkeypatch.setattr(ss, "CHUNK", 4)
    monkeypatch.setattr(ss, "BLOCK", 12)
    monkeypatch.setattr(scan_cpu, "BLOCK", 12)


def test_cpu_kernel_builds_where_a_compiler_exists():
    """The C++ scan is what CPU training runs; with a compiler present it must build (not silently fall back)."""
    import shutil

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the chunked path is used")
    assert scan_cpu.available(), scan_cpu.unavailable_reason()


IMPLS = ["chunked", pytest.param("cpu", marks=pytest.mark.skipif(not scan_cpu.available(),
                                                                 reason="the CPU kernel did not build"))]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(2, 6, 4, 1), (1, 3, 16, 7), (2, 5, 3, 32), (3, 4, 2, 33), (2, 8, 16, 70)])
@pytest.mark.parametrize("use", OPTIONALS, ids=lambda u: "+".join(u) or "plain")
def test_chunked_matches_ref_fp32(shape, use, impl, monkeypatch):
    small_blocks(monkeypatch)
    inputs = make_inputs(*shape, seed=sum(shape))
    want = run("ref", inputs, use)
    got = run(impl, inputs, use)
    # fp32: only summation order differs; measured max rel error ~2e-6 on gradients of the longest cases
    assert_close(got, want, rtol=2e-5, atol_scale=1e-6)


@pytest.mark.parametrize("chunk,block", [(1, 1), (1, 5), (3, 3), (3, 7), (5, 20), (64, 512)])
def test_chunk_and_block_sizes_do_not_matter(chunk, block, monkeypatch):
    inputs = make_inputs(2, 4, 5, 20, seed=7)
    use = ("D", "z", "delta_bias", "initial_state")
    want = run("ref", inputs, use)
    monkeypatch.setattr(ss, "CHUNK", chunk)
    monkeypatch.setattr(ss, "BLOCK", block)
    assert_close(run("chunked", inputs, use), want, rtol=2e-5, atol_scale=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_matches_ref_bf16(impl, monkeypatch):
    monkeypatch.setattr(ss, "CHUNK", 8)
    inputs = make_inputs(2, 8, 4, 21, seed=3, dtype=torch.bfloat16)
    use = ("D", "z", "delta_bias", "initial_state")
    want, got = run("ref", inputs, use), run(impl, inputs, use)
    assert got["y"].dtype == torch.bfloat16 and got["grad_u"].dtype == torch.bfloat16
    assert got["last"].dtype == torch.float32
    # both compute in fp32 from the same bf16 inputs; y and the gradients are rounded to bf16 (8 bits) at the end
    assert_close(got, want, rtol=1e-2, atol_scale=1e-3)


@pytest.mark.parametrize("impl", IMPLS)
def test_strong_decay_is_stable(impl, monkeypatch):
    """dt up to ~60 and |A| up to ~4: dt*A ~ -250 per step; a naive exp(-cumsum(dt*A)) overflows at once (and
    the C++ kernel's exp must give 0 where expf underflows, not garbage)."""
    monkeypatch.setattr(ss, "CHUNK", 8)
    monkeypatch.setattr(ss, "BLOCK", 48)
    monkeypatch.setattr(scan_cpu, "BLOCK", 48)
    inputs = make_inputs(2, 6, 8, 100, seed=11, dt_scale=20.0, dt_shift=10.0)
    use = ("D", "z", "delta_bias", "initial_state")
    want, got = run("ref", inputs, use), run(impl, inputs, use)
    assert (F_dt := torch.nn.functional.softplus(inputs["delta"] + inputs["delta_bias"][:, None])).max() > 40
    assert F_dt.min() < 1e-3  # and very weak decay elsewhere
    assert_close(got, want, rtol=2e-5, atol_scale=1e-5)


def test_no_softplus_and_no_grad_path():
    inputs = make_inputs(2, 4, 3, 10, seed=5, dt_scale=0.1, dt_shift=0.3)  # positive dt without softplus
    a = selective_scan(inputs["u"], inputs["delta"], inputs["A"], inputs["B"], inputs["C"], delta_softplus=False,
                       impl="ref")
    with torch.no_grad():
        b = selective_scan(inputs["u"], inputs["delta"], inputs["A"], inputs["B"], inputs["C"],
                           delta_softplus=False, impl="chunked")
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # and softplus really is applied by default: the two settings differ
    c = selective_scan(inputs["u"], inputs["delta"], inputs["A"], inputs["B"], inputs["C"], impl="chunked")
    assert (c - a).abs().max() > 1e-2


def test_reference_matches_hand_computed_recurrence():
    """The oracle itself, on a case small enough to write out: d=1, n=1, no softplus."""
    u = torch.tensor([[[1.0, 2.0, -1.0]]])
    dt = torch.tensor([[[0.5, 1.0, 2.0]]])
    A = torch.tensor([[-1.0]])
    B = torch.tensor([[[1.0, 0.5, 2.0]]])
    C = torch.tensor([[[2.0, 1.0, -1.0]]])
    h, ys = 0.0, []
    for t in range(3):  # h_t = exp(dt*A) h + dt*B*u ; y = C*h + D*u with D = 0.5
        h = math.exp(dt[0, 0, t].item() * -1.0) * h + dt[0, 0, t].item() * B[0, 0, t].item() * u[0, 0, t].item()
        ys.append(C[0, 0, t].item() * h + 0.5 * u[0, 0, t].item())
    want = torch.tensor(ys).view(1, 1, 3)
    for impl in ("ref", "chunked"):
        got = selective_scan(u, dt, A, B, C, D=torch.tensor([0.5]), delta_softplus=False, impl=impl)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_state_update_matches_scan():
    b, d, n, L = 2, 6, 4, 9
    inputs = make_inputs(b, d, n, L, seed=13)
    want_y, want_last = selective_scan(inputs["u"], inputs["delta"], inputs["A"], inputs["B"], inputs["C"],
                                       D=inputs["D"], z=inputs["z"], delta_bias=inputs["delta_bias"],
                                       initial_state=inputs["initial_state"], return_last_state=True, impl="ref")
    state = inputs["initial_state"].clone()
    ys = []
    for t in range(L):
        ys.append(selective_state_update(state, inputs["u"][..., t], inputs["delta"][..., t], inputs["A"],
                                         inputs["B"][..., t], inputs["C"][..., t], inputs["D"],
                                         z=inputs["z"][..., t], dt_bias=inputs["delta_bias"], dt_softplus=True))
    torch.testing.assert_close(torch.stack(ys, -1), want_y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, want_last, rtol=1e-5, atol=1e-6)  # updated in place


def test_unknown_impl_and_env_override(monkeypatch):
    inputs = make_inputs(1, 2, 2, 3)
    args = (inputs["u"], inputs["delta"], inputs["A"], inputs["B"], inputs["C"])
    with pytest.raises(ValueError, match="chunked"):
        selective_scan(*args, impl="triton")
    calls = []
    real_ref = ss._scan_ref
    monkeypatch.setattr(ss, "_scan_ref", lambda *a: calls.append(1) or real_ref(*a))
    monkeypatch.setenv(ss.ENV_VAR, "ref")
    selective_scan(*args)                      # auto -> forced to ref
    assert calls == [1]
    selective_scan(*args, impl="chunked")      # explicit impl wins
    assert calls == [1]
    monkeypatch.setenv(ss.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match=ss.ENV_VAR):
        selective_scan(*args)
    if not torch.cuda.is_available():
        monkeypatch.delenv(ss.ENV_VAR)
        with pytest.raises(ValueError, match="mamba-ssm"):
            selective_scan(*args, impl="cuda")


HAS_KERNEL = torch.cuda.is_available() and importlib.util.find_spec("mamba_ssm") is not None


@pytest.mark.skipif(not HAS_KERNEL, reason="needs CUDA and the mamba-ssm package")
def test_cuda_kernel_matches_reference():
    inputs = {k: v.cuda() for k, v in make_inputs(2, 64, 16, 300, seed=17).items()}
    use = ("D", "z", "delta_bias")
    want = run("ref", inputs, use)
    got = run("cuda", inputs, use)
    # different summation order and exp implementations on GPU
    assert_close(got, want, rtol=1e-3, atol_scale=1e-4)
    # with an initial state the cuda impl falls back to chunked; still must equal the reference
    use = use + ("initial_state",)
    assert_close(run("cuda", inputs, use), run("ref", inputs, use), rtol=1e-4, atol_scale=1e-5)


# ------------------------------------------------------------------------------------- document resets
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("L", [1, 7, 40, 150])
def test_chunked_with_resets_equals_reference(L, impl):
    """Variable-length training: the state restarts at every document start; chunked == sequential reference
    (values and every gradient, fp32, 1e-5 relative), and == scanning each document on its own."""
    torch.manual_seed(L)
    b, d, n = 2, 6, 4
    u, delta, B, C, z = (torch.randn(*s, requires_grad=True) for s in [(b, d, L), (b, d, L), (b, n, L),
                                                                       (b, n, L), (b, d, L)])
    A = (-torch.rand(d, n) * 3 - 0.1).requires_grad_()
    D, bias = torch.randn(d, requires_grad=True), torch.randn(d, requires_grad=True)
    reset = torch.rand(b, L) < 0.15
    reset[1, L // 2] = True
    inputs = [u, delta, A, B, C, D, z, bias]
    outs = {}
    for name in ("ref", impl):
        y, last = ss.selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=bias, reset=reset, impl=name,
                                    return_last_state=True)
        grads = torch.autograd.grad((y * torch.cos(y)).sum() + last.square().sum(), inputs)
        outs[name] = (y, last, grads)
    torch.testing.assert_close(outs[impl][0], outs["ref"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[impl][1], outs["ref"][1], rtol=1e-5, atol=1e-5)
    for g1, g2 in zip(outs[impl][2], outs["ref"][2]):
        torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-5)
    # row 1 from its reset on == that tail scanned alone (nothing flows in from before)
    s = L // 2
    tail = ss.selective_scan(u[1:, :, s:], delta[1:, :, s:], A, B[1:, :, s:], C[1:, :, s:], D=D, z=z[1:, :, s:],
                             delta_bias=bias, reset=reset[1:, s:], impl="ref")
    torch.testing.assert_close(outs[impl][0][1:, :, s:], tail, rtol=1e-5, atol=1e-5)
    # negative control: without resets the tail differs
    if s > 0:
        plain = ss.selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=bias, impl="ref")
        assert (plain[1:, :, s:] - tail).abs().max() > 1e-4


@pytest.mark.skipif(not scan_cpu.available(), reason="the CPU kernel did not build")
def test_cpu_kernel_d_state_bound():
    """Above the kernel's d_state bound (its stack buffers), auto runs the chunked path, and an explicit
    impl='cpu' is refused in one line rather than overrunning a buffer."""
    inputs = make_inputs(1, 2, scan_cpu.MAX_STATE + 1, 3, seed=5)
    assert_close(run("auto", inputs, ()), run("ref", inputs, ()), rtol=2e-5, atol_scale=1e-6)
    with pytest.raises(ValueError, match="d_state up to"):
        run("cpu", inputs, (), grads=False)


@pytest.mark.skipif(not scan_cpu.available(), reason="the CPU kernel did not build")
@pytest.mark.parametrize("b,L,d,K,bias", [(2, 7, 5, 4, True), (1, 2, 3, 4, False), (3, 33, 16, 3, True),
                                          (2, 1, 8, 2, True), (1, 70, 40, 4, True)])
def test_conv_silu_matches_torch(b, L, d, K, bias):
    """The kernel's fused causal depthwise conv + silu (what the Mamba layer runs with the CPU scan) equals
    silu(nn.Conv1d(..., padding=K-1)(x)[..., :L]) computed in fp64, values and gradients of x, weight and bias;
    x is a transposed view of a wider (b, L, 2d) tensor, as in_proj's output is. L < K covers the zero padding."""
    g = torch.Generator().manual_seed(b * 100 + L)
    base = torch.randn(b, L, 2 * d, generator=g, dtype=torch.float64)
    w = torch.randn(d, 1, K, generator=g, dtype=torch.float64)
    bb = torch.randn(d, generator=g, dtype=torch.float64) if bias else None

    def reference(base, w, bb):
        return F.silu(F.conv1d(base[..., :d].transpose(1, 2), w, bb, padding=K - 1, groups=d)[..., :L])

    def kernel(base, w, bb):
        return scan_cpu.conv_silu(base[..., :d].transpose(1, 2), w, bb)

    results = []
    for fn, dtype in ((reference, torch.float64), (kernel, torch.float32)):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (base, w) + ((bb,) if bias else ())]
        y = fn(*leaves, *(() if bias else (None,)))
        (y * torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y)).sum().backward()
        results.append([y.detach()] + [t.grad for t in leaves])
    for name, got, want in zip(("y", "x", "weight", "bias"), results[1], results[0]):
        assert got.dtype == torch.float32, name
        err = (got.double() - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item() + 1e-6, f"{name}: max err {err:.3g}"


@pytest.mark.skipif(not scan_cpu.available(), reason="the CPU kernel did not build")
def test_cpu_kernel_threads_agree():
    """The kernel splits channel tiles (and the conv its rows) over torch's threads, each summing its own partial
    gradients of A, B, C, D and the conv weight: 1 and 2 threads must agree (up to the order of those sums)."""
    inputs = make_inputs(3, 40, 16, 70, seed=11)
    use = ("D", "z", "delta_bias", "initial_state")
    x = torch.randn(2, 50, 2 * 40, generator=torch.Generator().manual_seed(2))[..., :40].transpose(1, 2)
    w, bias = torch.randn(40, 1, 4), torch.randn(40)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = run("cpu", inputs, use)
            xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, bias))
            y = scan_cpu.conv_silu(xs, ws, bs)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            out.update(conv=y.detach(), conv_x=xs.grad, conv_w=ws.grad, conv_b=bs.grad)
            results.append(out)
    finally:
        torch.set_num_threads(before)
    assert_close(results[1], results[0], rtol=1e-5, atol_scale=1e-6)
