"""The Mamba-2 mixer: ArchScale's shapes and init, state carrying (pieces == one call), causality, nGMU memory,
document resets, roles / optimizer groups, FLOPs, and parity with transformers' Mamba2Mixer and (when its source
is at hand) ArchScale's own module."""

import importlib.util
import math
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from archscale.config import ModelConfig
from archscale.models.mixers.base import ForwardContext
from archscale.models.mixers.mamba2 import SPEC, Mamba2, Mamba2Mixer, Mamba2State, d_inner


def make(d_model=16, di=128, seed=0, **kw):
    torch.manual_seed(seed)
    kw = dict(dict(d_state=8, headdim=16, chunk_size=8), **kw)
    m = Mamba2(d_model, di, **kw)
    with torch.no_grad():  # make every parameter matter, including the ones whose init is degenerate
        m.D.add_(torch.randn_like(m.D) * 0.5)
        m.norm.weight.add_(torch.randn_like(m.norm.weight) * 0.2)
    return m


def config(n_embd=64, **kw):
    return ModelConfig(arch="transformer", n_layer=4, n_embd=n_embd, n_head=4, n_query_groups=1, head_size=16,
                       intermediate_size=4 * n_embd, vocab_size=97, **kw)


# ---------------------------------------------------------------------------------------- shapes and init
def test_shapes_equal_archscale_module():
    """ArchScale `lit_gpt/mamba2.py` (commit 1fbcceb) built by `get_rnn` at n_embd 496 (SambaY-2 d4): expand =
    8 ceil(2 * 496 / 512) 64 / 496, so d_inner = 1024, nheads = 1024 / 64 = 16; in_proj d -> [z, x, B, C, dt]
    = 2 * 1024 + 2 * 128 + 16 (its lines `d_in_proj = ...`); conv over conv_dim = 1024 + 2 * 128; dt_bias, A_log,
    D per head; the gated norm over d_ssm; out_proj without bias."""
    cfg = config(n_embd=496)
    with torch.device("meta"):
        m = Mamba2Mixer(cfg, 0, "mamba2_mem")
    shapes = {k: tuple(v.shape) for k, v in m.named_parameters()}
    assert shapes == {"in_proj.weight": (2320, 496), "conv1d.weight": (1280, 1, 4), "conv1d.bias": (1280,),
                      "dt_bias": (16,), "A_log": (16,), "D": (16,), "norm.weight": (1024,),
                      "out_proj.weight": (496, 1024)}
    assert SPEC.memory_width(cfg, "mamba2_mem") == 1024 and SPEC.memory_width(cfg, "mamba2") == 0


def test_d_inner_follows_archscale_expand():
    """Our integer rule == ArchScale's `int(d * (8 * ceil(d * 2 / 64 / 8) * 64 / d))` wherever its module builds
    (where that float expression lands on a multiple of headdim 64), for every even width up to 8192."""
    agree = 0
    for d in range(8, 8193, 2):
        theirs = int(d * (8 * math.ceil(d * 2 / 64 / 8) * 64 / d))
        ours = d_inner(config(n_embd=d))
        if theirs % 64 == 0:
            assert ours == theirs, d
            agree += 1
        else:
            assert ours == theirs + 1, d  # float truncation one below; ArchScale's module then fails its assert
    assert agree > 3000
    assert d_inner(config(n_embd=64, mixer_options={"mamba2": {"expand": 2}})) == 128


def test_init_is_mamba2s():
    m = Mamba2(40, 256, headdim=32)
    dt = F.softplus(m.dt_bias)
    assert m.nheads == 8 and dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5) and dt.std() > 1e-3
    A = torch.exp(m.A_log)
    assert A.min() >= 1 and A.max() <= 16 and A.std() > 0.5  # U(1, 16), not arange
    assert torch.equal(m.D, torch.ones(8)) and torch.equal(m.norm.weight, torch.ones(256))
    bound = 1 / math.sqrt(40)  # PyTorch's Linear default, kept under mu-P (ArchScale's construction-time init)
    assert m.in_proj.weight.abs().max() <= bound and m.in_proj.weight.abs().max() > 0.9 * bound


def test_roles_give_archscales_optimizer_groups():
    """Our roles' groups == ArchScale's name rule: vector-like iff the name lacks "weight" or contains conv1d,
    wte, lm_head, norm, ln or layernorm (full names as in GPT)."""
    for name, _ in Mamba2Mixer(config(), 4, "mamba2").named_parameters():
        full = f"blocks.4.mixer.{name}"
        theirs = "vector" if ("weight" not in full or any(s in full for s in (
            "conv1d", "wte", "lm_head", "norm", "ln", "layernorm"))) else "matrix"
        assert SPEC.role_of(name).group == theirs, name
    assert SPEC.role_of("out_proj.weight").init == "output" and SPEC.role_of("in_proj.weight").init == "scheme"


# ------------------------------------------------------------------------------------------- forward paths
@pytest.mark.parametrize("gmu_save", [False, True])
def test_pieces_with_state_equal_one_call(gmu_save):
    m = make(gmu_save=gmu_save)
    x = torch.randn(2, 30, 16)
    with torch.no_grad():
        out, mem = m(x)
        state = Mamba2State.empty(2, m)
        outs, mems = [], []
        for a, b in [(0, 11), (11, 12), (12, 13), (13, 30)]:  # prefill (2 chunks), two single steps, continuation
            o, me = m(x[:, a:b], state)
            outs.append(o)
            mems.append(me)
    torch.testing.assert_close(torch.cat(outs, 1), out, rtol=1e-5, atol=1e-6)  # only summation order differs
    if gmu_save:
        assert mem.shape == (2, 30, 128)
        torch.testing.assert_close(torch.cat(mems, 1), mem, rtol=1e-5, atol=1e-6)
    else:
        assert mem is None and all(me is None for me in mems)
    assert state.ssm.dtype == torch.float32 and state.ssm.shape == (2, 8, 16, 8)
    assert state.conv.shape == (2, 128 + 16, 3)
    with torch.no_grad():  # the state really carries information
        fresh, _ = m(x[:, 13:], Mamba2State.empty(2, m))
    assert (fresh - out[:, 13:]).abs().max() > 1e-3


def test_single_steps_equal_the_reference_scan():
    m = make(scan_impl="ref")
    x = torch.randn(1, 7, 16)
    with torch.no_grad():
        want, _ = m(x)
        state = Mamba2State.empty(1, m)
        got = torch.cat([m(x[:, t:t + 1], state)[0] for t in range(7)], 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_causality():
    m = make()
    x = torch.randn(2, 20, 16)
    out, _ = m(x)
    x2 = x.clone()
    x2[:, 9] += torch.randn(2, 16)
    out2, _ = m(x2)
    assert torch.equal(out[:, :9], out2[:, :9])
    assert (out[:, 10:] - out2[:, 10:]).abs().max() > 1e-4  # later positions (not only t itself) change


def test_memory_is_the_pre_norm_ssm_output():
    m = make(gmu_save=True)
    x = torch.randn(2, 9, 16)
    seen = {}
    m.norm.register_forward_hook(lambda mod, inp, out: seen.update(y=inp[0], z=inp[1]))
    out, mem = m(x)
    assert torch.equal(seen["y"], mem)  # exactly what the gated norm receives, width d_inner
    torch.testing.assert_close(out, m.out_proj(m.norm(mem, seen["z"])), rtol=0, atol=0)
    with torch.no_grad():  # it includes the D skip
        m.D.add_(1.0)
    assert (m(x)[1] - mem).abs().max() > 1e-3


def test_gated_norm_is_norm_after_gate():
    m = make()
    y, z = torch.randn(3, 128), torch.randn(3, 128)
    g = y * F.silu(z)
    want = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-5) * m.norm.weight
    torch.testing.assert_close(m.norm(y, z), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["ref", "chunked"])
def test_gradients_flow_to_every_parameter(impl):
    m = make(scan_impl=impl)
    x = torch.randn(2, 12, 16, requires_grad=True)
    out, _ = m(x)
    out.square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


def test_documents_packed_equal_separate_values_and_grads():
    """doc_ids restarts the conv taps and the SSM state: each document of a packed row == run alone (values
    and parameter gradients); without doc_ids the second one sees the first (the control)."""
    m = make(seed=3)
    a, b = torch.randn(1, 13, 16), torch.randn(1, 21, 16)
    packed = torch.cat([a, b], 1)
    doc_ids = torch.tensor([[0] * 13 + [1] * 21])
    w = torch.randn(1, 34, 16)
    out, mem = m(packed, doc_ids=doc_ids)
    (out * w).sum().backward()
    g_packed = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    oa, ob = m(a)[0], m(b)[0]
    ((oa * w[:, :13]).sum() + (ob * w[:, 13:]).sum()).backward()
    torch.testing.assert_close(out[:, :13], oa, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[:, 13:], ob, rtol=1e-5, atol=1e-6)
    for n, p in m.named_parameters():
        torch.testing.assert_close(g_packed[n], p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item()), n
    with torch.no_grad():
        leaky = m(packed)[0]
    assert (leaky[:, 13:16] - ob[:, :3]).abs().max() > 1e-2  # conv and state both leak without doc_ids
    with pytest.raises(ValueError, match="doc_ids"):
        m(packed, Mamba2State.empty(1, m), doc_ids=doc_ids)


def test_bf16_autocast_keeps_scan_in_fp32():
    m = make(gmu_save=True)
    x = torch.randn(2, 10, 16)
    want_out, want_mem = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, mem = m(x)
    assert out.dtype == torch.bfloat16 and mem.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want_out, rtol=5e-2, atol=5e-2)  # bf16 projections, fp32 scan
    torch.testing.assert_close(mem.float(), want_mem, rtol=5e-2, atol=5e-2)


def test_mixer_speaks_the_block_protocol():
    cfg = config(mixer_options={"mamba2": {"d_state": 16, "chunk_size": 8}})
    m = Mamba2Mixer(cfg, 2, "mamba2_mem")
    x = torch.randn(1, 5, 64)
    ctx = ForwardContext(pos=0, cos=None, sin=None)
    out = m(x, ctx)
    assert out.shape == (1, 5, 64) and ctx.memory.shape == (1, 5, 512) and m.d_state == 16


# -------------------------------------------------------------------------------------------------- FLOPs
def test_flops_terms_match_flop_counter():
    """SPEC.flops' "scan" == FlopCounterMode's count of one forward minus the parameter matmuls (the conv is
    elementwise multiply-adds, which it does not count)."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = config(n_embd=32, mixer_options={"mamba2": {"d_state": 16, "chunk_size": 32}})
    m = Mamba2Mixer(cfg, 0, "mamba2")
    B, T = 2, 100
    with FlopCounterMode(display=False) as counter:
        m(torch.randn(B, T, 32), ForwardContext(pos=0, cos=None, sin=None))
    terms = SPEC.flops(cfg, "mamba2", T)
    params = 2 * (m.in_proj.weight.numel() + m.out_proj.weight.numel())
    want = (terms["scan"] + params) * B * T
    assert abs(counter.get_total_flops() - want) <= 0.01 * want, (counter.get_total_flops(), want, terms)
    assert set(terms) == {"scan", "conv_elementwise", "scan_elementwise"}


# ------------------------------------------------------------------------------------ reference modules
def test_parity_with_transformers_mamba2_mixer():
    """transformers' Mamba2Mixer (torch path) with our weights loaded (same names and layout) gives our output
    within 1e-4 (fp32), including ragged chunks."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMixer

    d, di, n, p = 64, 256, 16, 32
    ours = make(d, di, d_state=n, headdim=p, chunk_size=16).eval()
    cfg = transformers.Mamba2Config(hidden_size=d, expand=di // d, num_heads=di // p, head_dim=p, state_size=n,
                                    n_groups=1, conv_kernel=4, chunk_size=16, use_conv_bias=True, use_bias=False,
                                    layer_norm_epsilon=1e-5, num_hidden_layers=1, vocab_size=32)
    hf = HFMixer(cfg, layer_idx=0).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=True)
    assert not missing and not unexpected
    x = torch.randn(2, 41, d)
    with torch.no_grad():
        want = hf(x)
        got, _ = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


ARCHSCALE_GIT = os.environ.get("ARCHSCALE_GIT_DIR", "/work/.mirror/microsoft+ArchScale/repo")


def _archscale_mamba2_class():
    """ArchScale's Mamba2 class from its repository (commit 1fbcceb), importable on CPU once the CUDA-only
    mamba-ssm modules are stand-ins: the gated norm as mamba-ssm's `rms_norm_ref`, the chunk scan as
    transformers' torch SSD. None when the repository is not at hand."""
    try:
        src = subprocess.run(["git", "--git-dir", ARCHSCALE_GIT, "show", "1fbcceb:lit_gpt/mamba2.py"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    class RMSNormGated(torch.nn.Module):
        def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
            super().__init__()
            assert not norm_before_gate
            self.eps, self.group_size = eps, group_size
            self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device))

        def forward(self, x, z):
            h = (x.float() * F.silu(z.float())).unflatten(-1, (-1, self.group_size))
            h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
            return (h.flatten(-2) * self.weight).to(x.dtype)

    def chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False, seq_idx=None,
                   cu_seqlens=None, return_final_states=False, return_varlen_states=False, **kw):
        assert z is None and seq_idx is None and cu_seqlens is None
        return mamba2_chunk_scan(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                 return_final_states=return_final_states)

    stubs = {"mamba_ssm": {}, "mamba_ssm.ops": {}, "mamba_ssm.ops.triton": {},
             "mamba_ssm.ops.triton.layernorm_gated": {"RMSNorm": RMSNormGated},
             "mamba_ssm.distributed": {}, "mamba_ssm.distributed.tensor_parallel":
                 {"ColumnParallelLinear": None, "RowParallelLinear": None},
             "mamba_ssm.distributed.distributed_utils": {"all_reduce": None, "reduce_scatter": None},
             "mamba_ssm.ops.triton.ssd_combined": {"mamba_chunk_scan_combined": chunk_scan,
                                                  "mamba_split_conv1d_scan_combined": None}}
    saved = {k: sys.modules.get(k) for k in stubs}
    try:
        for name, attrs in stubs.items():
            mod = types.ModuleType(name)
            mod.__dict__.update(attrs)
            sys.modules[name] = mod
        namespace = {"__name__": "archscale_lit_gpt_mamba2"}
        exec(compile(src, "lit_gpt/mamba2.py", "exec"), namespace)  # ArchScale's source, from its repository
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
    return namespace["Mamba2"]


def test_equals_archscales_own_module():
    """ArchScale's Mamba2 as `get_rnn` builds it (expand from its formula, gmu_save to take its unfused path):
    the same parameter names and shapes, and with our weights loaded the same output and memory (fp32)."""
    pytest.importorskip("transformers")
    cls = _archscale_mamba2_class()
    if cls is None:
        pytest.skip(f"ArchScale's repository is not at {ARCHSCALE_GIT} (set ARCHSCALE_GIT_DIR)")
    n_embd = 64
    expand = 8 * math.ceil(n_embd * 2 / 64 / 8) * 64 / n_embd   # lit_gpt/model.py get_rnn
    theirs = cls(n_embd, expand=expand, layer_idx=0, gmu_save=True, chunk_size=16).eval()
    ours = Mamba2Mixer(config(n_embd=n_embd, mixer_options={"mamba2": {"chunk_size": 16}}), 0, "mamba2_mem").eval()
    assert {k: v.shape for k, v in theirs.named_parameters()} == {k: v.shape for k, v in ours.named_parameters()}
    with torch.no_grad():
        ours.D.add_(torch.randn_like(ours.D))
        ours.norm.weight.add_(torch.randn_like(ours.norm.weight) * 0.3)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 37, n_embd)
    with torch.no_grad():
        want, want_mem = theirs(x)
        ctx = ForwardContext(pos=0, cos=None, sin=None)
        got = ours(x, ctx)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ctx.memory, want_mem, rtol=1e-4, atol=1e-4)


HAS_KERNEL = torch.cuda.is_available() and importlib.util.find_spec("mamba_ssm") is not None


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_KERNEL, reason="needs CUDA and the mamba-ssm package")
def test_cuda_kernel_module_matches_reference():
    m = make(64, 256, d_state=32, headdim=64, chunk_size=64, gmu_save=True).cuda()
    x = torch.randn(2, 200, 64, device="cuda", requires_grad=True)
    doc_ids = (torch.arange(200, device="cuda") >= 120).long().expand(2, -1)
    for docs in (None, doc_ids):
        results = {}
        for impl in ("ref", "cuda"):
            m.scan_impl = impl
            m.zero_grad()
            x.grad = None
            out, mem = m(x, doc_ids=docs)
            (out.square().sum() + mem.sum()).backward()
            results[impl] = (out.detach(), mem.detach(), x.grad.clone(), m.A_log.grad.clone())
        for got, want in zip(results["cuda"], results["ref"]):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)  # GPU exp / summation order
