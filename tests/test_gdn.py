"""The Gated DeltaNet mixer: ArchScale's parameter names and shapes, the forward formula, decode state, varlen,
init, roles and FLOPs."""

import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from archscale import ModelConfig
from archscale.kernels.gated_delta import fla_available
from archscale.models.mixers.gated_deltanet import SPEC, GatedDeltaNet, GatedDeltaNetMixer, GDNState

TINY = dict(head_dim=8)  # 2 heads of K 8, V 16 at d_model 32


def make(d_model=32, heads=2, seed=0, **kw):
    torch.manual_seed(seed)
    return GatedDeltaNet(d_model, heads, **{**TINY, **kw})


# ------------------------------------------------------------------------------- ArchScale's names and shapes
def archscale_shapes(d):
    """ArchScale's `lit_gpt/gated_deltanet.py` (commit 1fbcceb) as `model.py:get_rnn` builds it: num_heads =
    ceil(int(0.75 d) / 256), head_dim 256, expand_v 2 (head_v_dim 512), num_v_heads = num_heads,
    use_short_conv (fla ShortConvolution = depthwise nn.Conv1d, conv_size 4, no bias), use_gate (g_proj), the
    norm `RMSNormGated(value_dim)` (mamba-ssm, one weight over all heads), `o_proj`; in registration order."""
    h = math.ceil(int(0.75 * d) / 256)
    kd, vd = h * 256, h * 512
    return {"A_log": (h,), "dt_bias": (h,), "q_proj.weight": (kd, d), "k_proj.weight": (kd, d),
            "v_proj.weight": (vd, d), "a_proj.weight": (h, d), "b_proj.weight": (h, d),
            "q_conv1d.weight": (kd, 1, 4), "k_conv1d.weight": (kd, 1, 4), "v_conv1d.weight": (vd, 1, 4),
            "g_proj.weight": (vd, d), "norm.weight": (vd,), "o_proj.weight": (d, vd)}


@pytest.mark.parametrize("arch", ["mambay", "sambay"])  # ar 120 / 124 at d16 (gdny: 120, sgdny: 126)
def test_default_rule_names_and_shapes_at_d16(arch):
    """The default head rule on the meta device at ArchScale's d16 widths: 6 heads of 256 (key_dim 1536,
    value_dim 3072 = the nGMU's d_mem ceil(int(0.75 d)/256) * 256 * 2 in ArchScale's Block)."""
    for ar in (120, 126):
        cfg = ModelConfig.from_arch(arch, 16, ar=ar)
        with torch.device("meta"):
            m = GatedDeltaNetMixer(cfg, 0, "gdn_mem")
        assert [(n, tuple(p.shape)) for n, p in m.named_parameters()] == list(archscale_shapes(cfg.n_embd).items())
        assert m.num_heads == 6 and SPEC.memory_width(cfg, "gdn_mem") == 3072 == math.ceil(int(cfg.n_embd * .75)
                                                                                             / 256) * 256 * 2
        assert SPEC.memory_width(cfg, "gdn") == 0


ARCHSCALE_GIT = Path(os.environ.get("ARCHSCALE_GIT", "/work/.mirror/microsoft+ArchScale/repo"))


def _archscale_source():
    if not ARCHSCALE_GIT.exists():
        return None
    out = subprocess.run(["git", f"--git-dir={ARCHSCALE_GIT}", "show", "1fbcceb:lit_gpt/gated_deltanet.py"],
                         capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None


def _import_archscale_gdn(monkeypatch, source):
    """ArchScale's module with small torch stand-ins for its CUDA-only imports: fla's ShortConvolution (a
    depthwise causal nn.Conv1d + silu, as fla's), mamba-ssm's gated RMSNorm (norm after the gate, one group),
    fla's chunk / fused_recurrent_gated_delta_rule (our sequential reference, same arguments)."""
    from archscale.kernels.gated_delta import gated_delta_rule

    class ShortConvolution(nn.Conv1d):
        def __init__(self, hidden_size, kernel_size, bias=False, activation="silu"):
            super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, padding=kernel_size - 1,
                             bias=bias)

        def forward(self, x, cache=None, output_final_state=False, cu_seqlens=None):
            return F.silu(super().forward(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)), None

    class RMSNormGated(nn.Module):
        def __init__(self, hidden, eps=1e-5, norm_before_gate=True):
            super().__init__()
            assert not norm_before_gate
            self.eps, self.weight = eps, nn.Parameter(torch.ones(hidden))

        def forward(self, x, z):
            y = x.float() * F.silu(z.float())
            return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)

    def rule(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
             use_qk_l2norm_in_kernel=False):
        assert cu_seqlens is None
        return gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                                use_qk_l2norm=use_qk_l2norm_in_kernel, impl="ref")

    mods = {"fla": types.ModuleType("fla"), "fla.layers": types.ModuleType("fla.layers"),
            "fla.layers.utils": types.SimpleNamespace(get_unpad_data=None, index_first_axis=None, pad_input=None),
            "fla.modules": types.SimpleNamespace(FusedRMSNormGated=None, RMSNorm=None,
                                                 ShortConvolution=ShortConvolution),
            "fla.ops": types.ModuleType("fla.ops"),
            "fla.ops.gated_delta_rule": types.SimpleNamespace(chunk_gated_delta_rule=rule,
                                                              fused_recurrent_gated_delta_rule=rule),
            "mamba_ssm": types.ModuleType("mamba_ssm"), "mamba_ssm.ops": types.ModuleType("mamba_ssm.ops"),
            "mamba_ssm.ops.triton": types.ModuleType("mamba_ssm.ops.triton"),
            "mamba_ssm.ops.triton.layernorm_gated": types.SimpleNamespace(RMSNorm=RMSNormGated),
            "lit_gpt": types.ModuleType("lit_gpt"),
            "lit_gpt.gated_memory_unit": types.SimpleNamespace(swiglu=None)}
    mods["lit_gpt"].__path__ = []
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    module = types.ModuleType("lit_gpt.gated_deltanet")
    module.__package__ = "lit_gpt"
    exec(compile(source, "lit_gpt/gated_deltanet.py", "exec"), module.__dict__)
    return module.GatedDeltaNet


def test_archscale_module_names_shapes_and_forward(monkeypatch):
    """Built from ArchScale's own file (skipped where its repository is not at hand; ARCHSCALE_GIT points to a
    git dir): parameter names/shapes at d16 equal ours (meta device), and with the same weights the forward
    and the exported GMU memory equal ours at a tiny width (fp32, 1e-5)."""
    source = _archscale_source()
    if source is None:
        pytest.skip(f"ArchScale's repository is not at {ARCHSCALE_GIT}")
    theirs_cls = _import_archscale_gdn(monkeypatch, source)
    d = 1920  # gdny_d16
    with torch.device("meta"):
        theirs = theirs_cls(hidden_size=d, num_heads=math.ceil(int(d * 0.75) / 256), head_dim=256, mode="chunk",
                            gmu_save=True, use_short_conv=True, allow_neg_eigval=True)
        ours = GatedDeltaNetMixer(ModelConfig.from_arch("mambay", 16), 0, "gdn_mem")
    assert [(n, p.shape) for n, p in theirs.named_parameters()] == [(n, p.shape) for n, p in ours.named_parameters()]

    torch.manual_seed(0)
    theirs = theirs_cls(hidden_size=32, num_heads=2, head_dim=8, gmu_save=True, use_short_conv=True,
                        allow_neg_eigval=True).eval()  # eval: ArchScale asserts chunk mode when training
    ours = make(gmu_save=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 80, 32)
    want, want_mem = theirs(x)
    got, mem = ours(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mem, want_mem, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ the formula
def formula(m: GatedDeltaNet, x):
    """The layer written out step by step (its own conv, l2norm and recurrence loops; no kernel code)."""
    B, T, _ = x.shape
    H, K, V = m.num_heads, m.head_k_dim, m.head_v_dim

    def conv(t, c):
        return F.silu(F.conv1d(t.transpose(1, 2), c.weight, groups=t.shape[-1], padding=3)[..., :T].transpose(1, 2))

    q = conv(x @ m.q_proj.weight.T, m.q_conv1d).reshape(B, T, H, K)
    k = conv(x @ m.k_proj.weight.T, m.k_conv1d).reshape(B, T, H, K)
    v = conv(x @ m.v_proj.weight.T, m.v_conv1d).reshape(B, T, H, V)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(K)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = 2 * torch.sigmoid(x @ m.b_proj.weight.T)
    decay = torch.exp(-torch.exp(m.A_log) * F.softplus(x @ m.a_proj.weight.T + m.dt_bias))
    S = torch.zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = S * decay[:, t, :, None, None]
        pred = (S * k[:, t, :, :, None]).sum(-2)                             # what S predicts for k_t
        S = S + k[:, t, :, :, None] * (beta[:, t, :, None] * (v[:, t] - pred))[:, :, None, :]
        outs.append((S * q[:, t, :, :, None]).sum(-2))
    o = torch.stack(outs, 1).reshape(B, T, H * V)
    y = o * F.silu(x @ m.g_proj.weight.T)
    y = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * m.norm.weight
    return y @ m.o_proj.weight.T, o


@pytest.mark.parametrize("impl", ["ref", "chunked"])
def test_module_matches_formula_with_reference_kernel(impl):
    m = make(gmu_save=True, impl=impl, chunk_size=16)
    with torch.no_grad():
        m.norm.weight.uniform_(0.5, 1.5)  # not all ones, so a missing norm weight shows
    x = torch.randn(2, 37, 32)
    got, mem = m(x)
    want, want_mem = formula(m, x)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(mem, want_mem, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("gmu_save", [False, True])
def test_pieces_with_state_equal_one_call(gmu_save):
    """Prefill 11 (chunked, initial state 0), single steps (the T == 1 path), then 9 more at once."""
    m = make(gmu_save=gmu_save, chunk_size=4)
    x = torch.randn(2, 30, 32)
    want, want_mem = m(x)
    state = GDNState.empty(2, m)
    pieces = [m(x[:, :11], state)] + [m(x[:, i:i + 1], state) for i in range(11, 21)] + [m(x[:, 21:], state)]
    torch.testing.assert_close(torch.cat([p[0] for p in pieces], 1), want, atol=2e-5, rtol=1e-4)
    if gmu_save:
        torch.testing.assert_close(torch.cat([p[1] for p in pieces], 1), want_mem, atol=2e-5, rtol=1e-4)
    else:
        assert all(p[1] is None for p in pieces)


def test_causal():
    m = make()
    x = torch.randn(1, 20, 32)
    y = x.clone()
    y[:, 12] += 1.0
    a, b = m(x)[0], m(y)[0]
    assert torch.equal(a[:, :12], b[:, :12])
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3


def test_packed_equals_separate_values_and_grads():
    """Documents of 6 and 13 tokens packed in one row: outputs and every parameter gradient equal the two
    separate runs (fp32: 2e-5; gradients 5e-5 of the largest entry + 1e-6, as tests/test_varlen.py: A_log and
    dt_bias sum over every position); the control without doc_ids leaks through
    the conv and the state."""
    m = make(chunk_size=8)
    x = torch.randn(1, 19, 32)
    docs = torch.tensor([[0] * 6 + [1] * 13])
    w = torch.randn(1, 19, 32)
    out, _ = m(x, doc_ids=docs)
    (out * w).sum().backward()
    packed = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    a, b = m(x[:, :6])[0], m(x[:, 6:])[0]
    ((a * w[:, :6]).sum() + (b * w[:, 6:]).sum()).backward()
    torch.testing.assert_close(out, torch.cat([a, b], 1), atol=2e-5, rtol=1e-4)
    for n, p in m.named_parameters():
        err = (packed[n] - p.grad).abs().max().item()
        assert err <= 5e-5 * p.grad.abs().max().item() + 1e-6, (n, err)
    with torch.no_grad():
        leak = m(x)[0][:, 6:] - b
    assert leak.abs().max() > 1e-3
    with pytest.raises(ValueError, match="decoding"):
        m(x, GDNState.empty(1, m), doc_ids=docs)


def test_init_is_the_layers_own():
    """ArchScale's (fla's) init: A_log = log U(0, 16), softplus(dt_bias) log-uniform in [1e-3, 0.1], conv taps
    U(+-1/sqrt(4)) (nn.Conv1d's default, fan_in 4), norm weight 1, Linears PyTorch's default."""
    m = GatedDeltaNet(64, 64, head_dim=4)
    A = m.A_log.exp()
    assert 0 < A.min() and A.max() <= 16 and A.mean().sub(8).abs() < 2
    dt = F.softplus(m.dt_bias)
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001
    for c in (m.q_conv1d, m.k_conv1d, m.v_conv1d):
        assert c.bias is None and c.weight.abs().max() <= 0.5 and c.weight.std() > 0.2
    assert torch.equal(m.norm.weight, torch.ones_like(m.norm.weight))
    assert abs(m.q_proj.weight.std().item() - 1 / math.sqrt(3 * 64)) < 0.01


def test_roles_follow_archscale_group_rule():
    """Our roles put every parameter in the optimizer group ArchScale's name rule gives (vector-like iff the
    full name lacks "weight" or contains conv1d / wte / lm_head / norm / ln / layernorm)."""
    def vector_like(name):
        return "weight" not in name or any(s in name for s in ("conv1d", "wte", "lm_head", "norm", "ln",
                                                                 "layernorm"))
    for rel, _ in make().named_parameters():
        role = SPEC.role_of(rel)
        assert role is not None, rel
        assert (role.group == "vector") == vector_like(f"blocks.3.mixer.{rel}"), rel
    assert SPEC.role_of("o_proj.weight").init == "output"


@pytest.mark.parametrize("T,chunk", [(100, 16), (64, 64), (37, 64)])
def test_flops_match_flop_counter(T, chunk):
    """SPEC.flops (non-elementwise terms) + 2 x the Linear weights == FlopCounterMode's matmul/conv count of
    one forward, within 5% (terms named *_solve, triangular solves, are left out: the counter does not see them)."""
    cfg = ModelConfig.from_arch("mambay", 4, ar=8, mixer_options={"gdn": {"head_dim": 8, "num_heads": 2,
                                                                          "chunk_size": chunk}})
    m = GatedDeltaNetMixer(cfg, 0, "gdn")
    x = torch.randn(1, T, cfg.n_embd)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        m.forward(x, __import__("archscale.models.mixers", fromlist=["x"]).ForwardContext(0, None, None))
    measured = counter.get_total_flops() / T
    terms = SPEC.flops(cfg, "gdn", T)
    linear = sum(p.numel() for n, p in m.named_parameters() if n.endswith("proj.weight"))
    predicted = 2 * linear + sum(v for k, v in terms.items() if not k.endswith(("_elementwise", "_solve")))
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured, terms)


@pytest.mark.parametrize("impl", ["chunked", "cpu"])
@pytest.mark.parametrize("T,chunk", [(100, 16), (64, 64), (37, 16)])
def test_scan_flops_match_flop_counter_on_the_kernel(T, chunk, impl):
    """The "scan" term alone against the counter on the chunked kernel's forward, at head widths above the chunk
    (where the state products dominate): within 1%; on the torch path (aten's products) and on the C++ loops
    (their registered FLOPs, factors included). Dropping any one product's FLOPs fails it."""
    from archscale.kernels import scan_cpu
    from archscale.kernels.gated_delta import gated_delta_rule
    if impl == "cpu" and not scan_cpu.available():
        pytest.skip(f"the C++ CPU module did not build: {scan_cpu.unavailable_reason()}")
    cfg = ModelConfig.from_arch("mambay", 4, ar=8, mixer_options={"gdn": {"head_dim": 32, "num_heads": 2,
                                                                          "chunk_size": chunk}})
    H, K, V = 2, 32, 64                                                     # expand_v 2
    x = [torch.randn(1, T, H, d) for d in (K, K, V)] + [-torch.rand(1, T, H), torch.rand(1, T, H)]
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        gated_delta_rule(*x, impl=impl, chunk_size=chunk)
    assert SPEC.flops(cfg, "gdn", T)["scan"] * T == pytest.approx(counter.get_total_flops(), rel=0.01)


def test_options_are_checked():
    from archscale.errors import UserError
    cfg = ModelConfig.from_arch("mambay", 4, ar=8, mixer_options={"gdn": {"head_size": 8}})
    with pytest.raises(UserError, match="unknown field"):
        GatedDeltaNetMixer(cfg, 0, "gdn")


def test_bf16_autocast_keeps_recurrence_in_fp32():
    m = make()
    x = torch.randn(2, 24, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = m(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), m(x)[0], atol=5e-2, rtol=5e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not fla_available(), reason="needs CUDA and flash-linear-attention (fla)")
def test_fla_module_matches_chunked_on_cuda():
    m = make(64, 2, head_dim=32).cuda()
    x = torch.randn(2, 150, 64, device="cuda")
    got = m(x)[0]
    m.impl = "chunked"
    torch.testing.assert_close(got, m(x)[0], atol=2e-3, rtol=2e-3)
