"""Mamba-2's SSD scan: the C++ CPU kernel and the chunked torch path (and the decode step, and mamba-ssm's kernel
when present) against the sequential reference, which is itself checked against a scalar loop and transformers' independent torch SSD.

Tolerances (fp32): values within 1e-5 of each output's largest entry, gradients within 1e-4 of each gradient's
largest entry (the chunked path sums in another order and forms decays as exp of differences of cumulative sums;
measured errors are ~1e-6 relative).
"""

import importlib.util
import math

import pytest
import torch

import archscale.kernels.ssd as ssd
from archscale.kernels import scan_cpu
from archscale.kernels.ssd import ssd_scan, ssd_state_update


def make_inputs(b, L, h, p, g, n, *, seed=0, dt_shift=0.0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    return {"x": r(b, L, h, p), "dt": r(b, L, h) + dt_shift, "A": -torch.exp(r(h) * 0.5),
            "B": r(b, L, g, n), "C": r(b, L, g, n), "D": r(h), "dt_bias": r(h) * 0.3,
            "initial_state": r(b, h, p, n)}


def doc_labels(b, L, seed, p_start=0.15):
    """Nondecreasing document labels per row (row 0 always has a start mid-way)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.rand(b, L, generator=gen) < p_start
    starts[:, 0] = False
    starts[0, L // 2] = L > 1
    return starts.long().cumsum(-1) * 3 + 7  # any labels: only changes matter


def run(impl, inputs, use, chunk=8, seq_idx=None, grads=True):
    """y, final state, and the gradients of a generic loss w.r.t. every floating input used."""
    t = {k: v.detach().clone().requires_grad_(grads) for k, v in inputs.items()}
    kw = {k: t[k] for k in ("D", "dt_bias", "initial_state") if k in use}
    y, last = ssd_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, dt_softplus=True, seq_idx=seq_idx,
                       return_final_state=True, impl=impl, **kw)
    out = {"y": y.detach(), "last": last.detach()}
    if grads:
        wy = torch.linspace(-1, 1, y.numel()).view_as(y)  # every output element weighted differently
        ((y * wy).sum() + (last * torch.cos(last.detach())).sum()).backward()
        for k in ("x", "dt", "A", "B", "C", *kw):
            out["grad_" + k] = t[k].grad
    return out


def assert_close(got, want, rtol_values=1e-5, rtol_grads=1e-4):
    for k in want:
        assert got[k] is not None and torch.isfinite(got[k]).all(), k
        scale = want[k].abs().max().item() + 1e-12
        err = (got[k] - want[k]).abs().max().item()
        tol = (rtol_grads if k.startswith("grad_") else rtol_values) * scale
        assert err <= tol, f"{k}: max err {err:.3g} > {tol:.3g} (scale {scale:.3g})"


OPTIONALS = [(), ("D",), ("dt_bias",), ("initial_state",), ("D", "dt_bias", "initial_state")]


@pytest.fixture(params=["cpu", "fused", "autograd"])
def fast(request, monkeypatch):
    """The impl under test: the C++ kernel ("cpu"), or the chunked torch path with either form of its
    intra-chunk step, `ssd_fused.intra_chunk` (hand-written backward, its default) or the same maths through
    autograd."""
    if request.param == "cpu":
        if not scan_cpu.available():
            pytest.skip(f"the C++ CPU module did not build: {scan_cpu.unavailable_reason()}")
        return "cpu"
    monkeypatch.setattr(ssd, "FUSED_INTRA", request.param == "fused")
    return "chunked"


@pytest.mark.parametrize("shape,chunk", [((2, 1, 2, 3, 1, 4), 8), ((1, 7, 2, 3, 2, 5), 8), ((2, 37, 4, 3, 2, 5), 8),
                                         ((2, 33, 4, 4, 1, 6), 16), ((1, 70, 2, 8, 1, 16), 24)])
@pytest.mark.parametrize("use", OPTIONALS, ids=lambda u: "+".join(u) or "plain")
def test_chunked_matches_reference_values_and_grads(shape, chunk, use, fast):
    """Lengths below, at and not multiple of the chunk (balanced chunks: padded ends in torch, a shorter last
    chunk in the kernel), groups shared by heads."""
    inputs = make_inputs(*shape, seed=sum(shape))
    assert_close(run(fast, inputs, use, chunk), run("ref", inputs, use, chunk))


@pytest.mark.parametrize("L,chunk", [(1, 4), (9, 4), (40, 7), (150, 32)])
def test_document_resets_chunked_equals_reference(L, chunk, fast):
    inputs = make_inputs(2, L, 4, 3, 2, 5, seed=L)
    seq = doc_labels(2, L, seed=L)
    use = ("D", "dt_bias", "initial_state")
    assert_close(run(fast, inputs, use, chunk, seq), run("ref", inputs, use, chunk, seq))


def test_packed_equals_separate_and_the_leak_control(fast):
    """Each document of a packed row equals that document scanned alone (values and input gradients); without
    the sequence index the second document sees the first (the control)."""
    torch.manual_seed(0)
    la, lb = 23, 30
    inputs = make_inputs(1, la + lb, 4, 3, 1, 5, seed=5)
    seq = torch.tensor([[0] * la + [1] * lb])
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items() if k != "initial_state"}
    x, dt, A, B, C = (leaves[k] for k in ("x", "dt", "A", "B", "C"))
    kw = dict(D=leaves["D"], dt_bias=leaves["dt_bias"], dt_softplus=True, impl=fast)
    w = torch.randn(1, la + lb, 4, 3)
    packed = ssd_scan(x, dt, A, B, C, 8, seq_idx=seq, **kw)
    grads_packed = torch.autograd.grad((packed * w).sum(), [x, dt, B, C])
    a = ssd_scan(x[:, :la], dt[:, :la], A, B[:, :la], C[:, :la], 8, **kw)
    b = ssd_scan(x[:, la:], dt[:, la:], A, B[:, la:], C[:, la:], 8, **kw)
    grads_alone = torch.autograd.grad((a * w[:, :la]).sum() + (b * w[:, la:]).sum(), [x, dt, B, C])
    torch.testing.assert_close(packed[:, :la], a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed[:, la:], b, rtol=1e-5, atol=1e-6)
    for g1, g2 in zip(grads_packed, grads_alone):
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        leaky = ssd_scan(x, dt, A, B, C, 8, **kw)
    assert (leaky[:, la:] - b).abs().max() > 1e-2  # 1e3x the masked error: state does cross without seq_idx


def test_chunk_length_does_not_change_the_result(fast):
    inputs = make_inputs(2, 61, 4, 3, 2, 5, seed=3)
    seq = doc_labels(2, 61, seed=3)
    use = ("D", "dt_bias", "initial_state")
    want = run(fast, inputs, use, 61, seq)
    for chunk in (1, 5, 16, 31, 64):
        assert_close(run(fast, inputs, use, chunk, seq), want)


def test_strong_decay_is_stable(fast):
    """dt * A of about -100 per step: decays underflow to exactly 0, nothing overflows (no exp of a positive
    number is ever formed)."""
    inputs = make_inputs(2, 40, 4, 3, 1, 5, seed=4, dt_shift=40.0)
    inputs["A"] = -torch.full((4,), 2.5)
    use = ("D", "initial_state")
    got, want = run(fast, inputs, use, 16), run("ref", inputs, use, 16)
    assert all(torch.isfinite(v).all() for v in got.values())
    assert_close(got, want)


def test_reference_matches_scalar_loop():
    """The reference against the recurrence written out element by element (h = 2 heads sharing g = 1 group)."""
    b, L, h, p, g, n = 1, 5, 2, 2, 1, 3
    inp = make_inputs(b, L, h, p, g, n, seed=9)
    seq = torch.tensor([[0, 0, 0, 1, 1]])
    y, last = ssd_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 4, D=inp["D"], dt_bias=inp["dt_bias"],
                       dt_softplus=True, seq_idx=seq, initial_state=inp["initial_state"], return_final_state=True,
                       impl="ref")
    H = inp["initial_state"][0].clone()
    for t in range(L):
        for i in range(h):
            dt = math.log1p(math.exp(inp["dt"][0, t, i] + inp["dt_bias"][i]))
            decay = 0.0 if t == 3 else math.exp(dt * inp["A"][i])
            for j in range(p):
                for k in range(n):
                    H[i, j, k] = decay * H[i, j, k] + dt * inp["x"][0, t, i, j] * inp["B"][0, t, 0, k]
                want = sum(H[i, j, k] * inp["C"][0, t, 0, k] for k in range(n)) + inp["D"][i] * inp["x"][0, t, i, j]
                assert abs(y[0, t, i, j] - want) < 1e-5
    torch.testing.assert_close(last[0], H, rtol=1e-5, atol=1e-6)


def test_reference_matches_transformers_torch_ssd():
    """transformers' `mamba2_chunk_scan` (its pure-torch SSD, written independently) agrees with our reference."""
    pytest.importorskip("transformers")
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    inp = make_inputs(2, 45, 4, 3, 2, 5, seed=11)
    y, last = ssd_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 16, D=inp["D"], dt_bias=inp["dt_bias"],
                       dt_softplus=True, initial_state=inp["initial_state"], return_final_state=True, impl="ref")
    y_hf, last_hf = mamba2_chunk_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 16, D=inp["D"],
                                      dt_bias=inp["dt_bias"], dt_softplus=True, initial_states=inp["initial_state"],
                                      return_final_states=True)
    torch.testing.assert_close(y, y_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, last_hf, rtol=1e-5, atol=1e-5)


def test_state_update_matches_scan():
    """T single steps from a state == one scan from that state (the decode path)."""
    inp = make_inputs(2, 6, 4, 3, 2, 5, seed=12)
    want, want_last = ssd_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 4, D=inp["D"],
                               dt_bias=inp["dt_bias"], dt_softplus=True, initial_state=inp["initial_state"],
                               return_final_state=True, impl="ref")
    state = inp["initial_state"].clone()
    got = torch.stack([ssd_state_update(state, inp["x"][:, t], inp["dt"][:, t], inp["A"], inp["B"][:, t],
                                        inp["C"][:, t], D=inp["D"], dt_bias=inp["dt_bias"]) for t in range(6)], 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, want_last, rtol=1e-5, atol=1e-6)


def test_dtypes_and_no_grad_path(fast):
    inp = make_inputs(1, 20, 2, 4, 1, 8, seed=13)
    with torch.no_grad():
        want = ssd_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 8, impl="ref")
        got = ssd_scan(inp["x"].bfloat16(), inp["dt"].bfloat16(), inp["A"], inp["B"].bfloat16(),
                       inp["C"].bfloat16(), 8, impl=fast)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2 * want.abs().max().item())


def test_unknown_impl_and_env_override(monkeypatch):
    inp = make_inputs(1, 5, 2, 2, 1, 3)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 4)
    with pytest.raises(ValueError, match="unknown impl"):
        ssd_scan(*args, impl="fast")
    with pytest.raises(ValueError, match="mamba-ssm"):
        ssd_scan(*args, impl="cuda")  # CPU tensors
    monkeypatch.setenv("ARCHSCALE_SCAN_IMPL", "nope")
    with pytest.raises(ValueError, match="ARCHSCALE_SCAN_IMPL"):
        ssd_scan(*args)
    calls = []
    monkeypatch.setenv("ARCHSCALE_SCAN_IMPL", "ref")
    monkeypatch.setattr(ssd, "_ssd_ref", lambda *a: calls.append(1) or (a[0], a[0][:, 0, :, :, None]))
    ssd_scan(*args)
    assert calls  # "auto" followed the environment
    calls.clear()
    ssd_scan(*args, impl="chunked")
    assert not calls  # an explicit impl is never overridden


def test_flops_of_the_chunked_path_are_its_matmuls(fast):
    """The "scan" FLOPs the mixer reports (per token) == what FlopCounterMode counts in one chunked scan (the
    kernel's products through its registered formula: the same gemms, and two per forward one in the backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    b, L, h, p, g, n, chunk = 2, 100, 4, 8, 1, 16, 32
    inp = {k: v.requires_grad_() for k, v in make_inputs(b, L, h, p, g, n).items()}
    with FlopCounterMode(display=False) as counter:
        y = ssd_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk, D=inp["D"], impl=fast)
    nc, Q = ssd.chunk_layout(L, chunk)
    assert (nc, Q) == (4, 25)
    di = h * p
    want = nc * (2 * Q * Q * (g * n + di) + 4 * Q * n * di) * b
    assert counter.get_total_flops() == want
    if fast == "cpu":
        with FlopCounterMode(display=False) as counter:
            y.sum().backward()
        assert counter.get_total_flops() == 2 * want


HAS_KERNEL = torch.cuda.is_available() and importlib.util.find_spec("mamba_ssm") is not None


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_KERNEL, reason="needs CUDA and the mamba-ssm package")
def test_cuda_kernel_matches_reference():
    inputs = {k: v.cuda() for k, v in make_inputs(2, 300, 4, 64, 1, 32, seed=21).items()}
    seq = doc_labels(2, 300, seed=21).cuda()
    use = ("D", "dt_bias", "initial_state")
    for seq_idx in (None, seq):
        # different summation order and exp implementations on GPU
        assert_close(run("cuda", inputs, use, 64, seq_idx), run("ref", inputs, use, 64, seq_idx),
                     rtol_values=1e-3, rtol_grads=1e-3)
        state = inputs["initial_state"].clone()
        y = ssd_state_update(state, inputs["x"][:, 0], inputs["dt"][:, 0], inputs["A"], inputs["B"][:, 0],
                             inputs["C"][:, 0], D=inputs["D"], dt_bias=inputs["dt_bias"])
        want = ssd_scan(inputs["x"][:, :1], inputs["dt"][:, :1], inputs["A"], inputs["B"][:, :1],
                        inputs["C"][:, :1], 4, D=inputs["D"], dt_bias=inputs["dt_bias"], dt_softplus=True,
                        initial_state=inputs["initial_state"], impl="ref")
        torch.testing.assert_close(y, want[:, 0], rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not scan_cpu.available(), reason="the C++ CPU module did not build")
def test_kernel_is_the_same_on_one_thread_and_two():
    """One (batch, group) pair: on two threads the kernel's backward splits the group's heads into two partial
    sums (slots), on one it accumulates in place; values and gradients agree, and match the reference."""
    inputs = make_inputs(1, 45, 4, 3, 1, 5, seed=21)
    use = ("D", "dt_bias", "initial_state")
    seq = doc_labels(1, 45, seed=21)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run("cpu", inputs, use, 16, seq)
        torch.set_num_threads(2)
        two = run("cpu", inputs, use, 16, seq)
    finally:
        torch.set_num_threads(before)
    assert_close(two, one, rtol_values=1e-6, rtol_grads=1e-6)
    assert_close(one, run("ref", inputs, use, 16, seq))
