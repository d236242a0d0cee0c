"""The Mamba-1 mixer: init, state carrying (pieces == one call), causality, GMU memory, HF parity, CUDA kernel."""

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from archscale.models.mixers.mamba import Mamba, MambaState


def make(d_model=16, seed=0, **kw):
    torch.manual_seed(seed)
    m = Mamba(d_model, **kw)
    with torch.no_grad():  # make every parameter matter, including the ones whose init is degenerate (D = 1)
        m.D.add_(torch.randn_like(m.D) * 0.5)
        m.A_log.add_(torch.randn_like(m.A_log) * 0.2)
    return m


def test_shapes_names_and_init():
    m = Mamba(40, d_state=8, d_conv=3, expand=2)
    assert m.d_inner == 80 and m.dt_rank == math.ceil(40 / 16) == 3
    shapes = {k: tuple(v.shape) for k, v in m.named_parameters()}
    assert shapes == {
        "in_proj.weight": (160, 40), "conv1d.weight": (80, 1, 3), "conv1d.bias": (80,),
        "x_proj.weight": (3 + 16, 80), "dt_proj.weight": (80, 3), "dt_proj.bias": (80,),
        "A_log": (80, 8), "D": (80,), "out_proj.weight": (40, 80),
    }
    torch.testing.assert_close(m.A_log, torch.log(torch.arange(1, 9.0)).expand(80, 8))
    assert torch.equal(m.D, torch.ones(80))
    dt = F.softplus(m.dt_proj.bias)
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    assert dt.std() > 0.01  # log-uniform, not constant
    assert m.dt_proj.weight.abs().max() <= 3 ** -0.5 and m.dt_proj.weight.abs().max() > 0.3


@pytest.mark.parametrize("gmu_save", [False, True])
def test_pieces_with_state_equal_one_call(gmu_save):
    m = make(gmu_save=gmu_save)
    x = torch.randn(2, 14, 16)
    with torch.no_grad():
        out, mem = m(x)
        state = MambaState.empty(2, m)
        outs, mems = [], []
        for a, b in [(0, 5), (5, 6), (6, 7), (7, 14)]:  # prefill, two decode steps (T=1 path), continuation
            o, me = m(x[:, a:b], state)
            outs.append(o)
            mems.append(me)
    # only summation order differs; measured max err ~1e-7
    torch.testing.assert_close(torch.cat(outs, 1), out, rtol=1e-5, atol=1e-6)
    if gmu_save:
        assert mem.shape == (2, 14, 32)
        torch.testing.assert_close(torch.cat(mems, 1), mem, rtol=1e-5, atol=1e-6)
    else:
        assert mem is None and all(me is None for me in mems)
    assert state.ssm.dtype == torch.float32 and state.ssm.shape == (2, 32, 16)
    assert state.conv.shape == (2, 32, 3)
    # the state really carries information: restarting from an empty state gives a different continuation
    with torch.no_grad():
        fresh, _ = m(x[:, 7:], MambaState.empty(2, m))
    assert (fresh - out[:, 7:]).abs().max() > 1e-3


def test_state_step_equals_scan_with_ref_impl():
    """The T=1 decode path (selective_state_update) against the reference scan impl of the same module."""
    m = make(scan_impl="ref")
    x = torch.randn(1, 6, 16)
    with torch.no_grad():
        want, _ = m(x)
        state = MambaState.empty(1, m)
        got = torch.cat([m(x[:, t:t + 1], state)[0] for t in range(6)], 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_causality():
    m = make()
    x = torch.randn(2, 12, 16)
    out, _ = m(x)
    x2 = x.clone()
    x2[:, 7] += torch.randn(2, 16)
    out2, _ = m(x2)
    assert torch.equal(out[:, :7], out2[:, :7])
    assert (out[:, 7:] - out2[:, 7:]).abs().max() > 1e-4


def test_gmu_memory_is_what_the_output_is_computed_from():
    m = make(gmu_save=True)
    x = torch.randn(2, 9, 16)
    seen = {}
    m.out_proj.register_forward_hook(lambda mod, inp, out: seen.update(inp=inp[0]))
    m.in_proj.register_forward_hook(lambda mod, inp, out: seen.update(z=out.chunk(2, dim=-1)[1]))
    out, mem = m(x)
    torch.testing.assert_close(seen["inp"], mem * F.silu(seen["z"]), rtol=0, atol=0)
    torch.testing.assert_close(out, m.out_proj(mem * F.silu(seen["z"])), rtol=0, atol=0)
    # memory is pre-gate and includes the D*x skip: changing D changes it
    with torch.no_grad():
        m.D.add_(1.0)
    assert (m(x)[1] - mem).abs().max() > 1e-3
    # and without gmu_save the output is the same function
    plain = make(gmu_save=False)
    plain.load_state_dict(m.state_dict())
    with torch.no_grad():
        m.D.sub_(1.0)
        plain.D.sub_(1.0)
    torch.testing.assert_close(plain(x)[0], m(x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["ref", "chunked"])
def test_gradients_flow_to_every_parameter(impl):
    m = make(scan_impl=impl)
    x = torch.randn(2, 10, 16, requires_grad=True)
    out, _ = m(x)
    out.square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


def test_bf16_autocast_keeps_scan_in_fp32():
    m = make(gmu_save=True)
    x = torch.randn(2, 8, 16)
    want_out, want_mem = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, mem = m(x)
    assert out.dtype == torch.bfloat16 and mem.dtype == torch.bfloat16
    # bf16 projections (8-bit mantissa) around an fp32 scan
    torch.testing.assert_close(out.float(), want_out, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(mem.float(), want_mem, rtol=5e-2, atol=5e-2)


def test_parity_with_transformers_mamba_mixer():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mamba.modeling_mamba import MambaMixer

    d, N, d_conv, expand = 24, 8, 4, 2
    ours = make(d, d_state=N, d_conv=d_conv, expand=expand)
    cfg = transformers.MambaConfig(hidden_size=d, state_size=N, conv_kernel=d_conv, expand=expand,
                                   time_step_rank=ours.dt_rank, use_conv_bias=True, use_bias=False,
                                   hidden_act="silu", num_hidden_layers=1, vocab_size=32)
    hf = MambaMixer(cfg, layer_idx=0).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=True)
    assert not missing and not unexpected
    x = torch.randn(2, 11, d)
    with torch.no_grad():
        want = hf(x)
        got, _ = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


JAMBA_NORMS = {"dt_layernorm.weight": "dt_norm.weight", "b_layernorm.weight": "b_norm.weight",
               "c_layernorm.weight": "c_norm.weight"}


def test_bcdt_norm_matches_transformers_jamba_mamba_mixer():
    """`bcdt_norm=True` equals transformers' JambaMambaMixer (its torch path), fp32, forward and token-by-token
    decoding, with norm gains far from 1 so that a skipped or misplaced norm shows; off, it does not match."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer

    d, N, eps = 24, 8, 1e-6
    ours = make(d, d_state=N, bcdt_norm=True, norm_eps=eps)
    with torch.no_grad():
        for norm in (ours.dt_norm, ours.b_norm, ours.c_norm):
            norm.weight.copy_(1.0 + 0.5 * torch.randn_like(norm.weight))
    cfg = transformers.JambaConfig(hidden_size=d, mamba_d_state=N, mamba_d_conv=4, mamba_expand=2,
                                   mamba_dt_rank=ours.dt_rank, rms_norm_eps=eps, num_hidden_layers=1,
                                   vocab_size=32)
    hf = JambaMambaMixer(cfg, layer_idx=0).eval()
    state = {JAMBA_NORMS.get(k, k): v for k, v in hf.state_dict().items()}
    assert set(state) == set(ours.state_dict())
    hf.load_state_dict({k: ours.state_dict()[JAMBA_NORMS.get(k, k)] for k in hf.state_dict()}, strict=True)
    x = torch.randn(2, 11, d)
    with torch.no_grad():
        want = hf(x)
        got, _ = ours(x)
        st = MambaState.empty(2, ours)
        steps = torch.cat([ours(x[:, t:t + 1], st)[0] for t in range(x.shape[1])], dim=1)
        plain = make(d, d_state=N)
        plain.load_state_dict({k: v for k, v in ours.state_dict().items() if "_norm." not in k}, strict=True)
        without = plain(x)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(steps, want, rtol=1e-5, atol=1e-5)
    assert (without - want).abs().max() > 1e-2  # negative control: the same weights without the norms


HAS_KERNEL = torch.cuda.is_available() and importlib.util.find_spec("mamba_ssm") is not None


@pytest.mark.skipif(not HAS_KERNEL, reason="needs CUDA and the mamba-ssm package")
def test_cuda_kernel_module_matches_reference():
    m = make(64, gmu_save=True).cuda()
    x = torch.randn(2, 200, 64, device="cuda", requires_grad=True)
    results = {}
    for impl in ("ref", "cuda"):
        m.scan_impl = impl
        m.zero_grad()
        x.grad = None
        out, mem = m(x)
        (out.square().sum() + mem.sum()).backward()
        results[impl] = (out.detach(), mem.detach(), x.grad.clone(), m.A_log.grad.clone())
    for got, want in zip(results["cuda"], results["ref"]):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)  # GPU exp / summation order
