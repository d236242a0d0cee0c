"""The mixer contract, enforced: every parameter has a role, every layer kind a mixer with FLOPs and reference
tests; roles reproduce ArchScale's optimizer groups and init rules for every architecture; the per-architecture
checks fail on a model whose mixers output zeros; `archscale.config` imports no model code."""

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from archscale import GPT, ModelConfig
from archscale.config import ARCHITECTURES
from archscale.errors import UserError
from archscale.models import accounting
from archscale.models.mixers import REGISTRY, spec_for
from archscale.models.mixers.base import MATRIX, MixerSpec, register
from archscale.scaling_rules import BaseHyperparameters, resolve_parametrization
from archscale.train.optim import param_groups
from model_checks import check_every_parameter_learns, check_information_flows

ROOT = Path(__file__).resolve().parents[1]
ARCHS = sorted(ARCHITECTURES)


def small(arch, depth=8, ar=32, **kw):
    base = dict(vocab_size=97, block_size=64)
    if ARCHITECTURES[arch].sliding_window:
        base["sliding_window"] = 64
    if arch == "phi4miniflash":
        base.update(n_head=8, n_query_groups=4, head_size=8)
    base.update(kw)
    return ModelConfig.from_arch(arch, depth, ar=ar, **base)


# ------------------------------------------------------------------------------------------- the contract
def test_every_layer_kind_of_every_architecture_has_a_mixer_with_flops():
    for arch in ARCHS:
        cfg = small(arch)
        for kind in cfg.layer_kinds:
            assert callable(spec_for(kind).flops), (arch, kind)
        for kind in cfg.ffn_kinds:
            assert callable(spec_for(kind, "ffn").flops), (arch, kind)


def test_every_mixer_names_reference_tests_that_exist():
    for spec in REGISTRY.values():
        assert spec.tests, spec.name
        named = list(spec.tests) + [k.test for k in spec.kernels]
        for node in named:
            path, _, name = node.partition("::")
            tree = ast.parse((ROOT / path).read_text())
            tests = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name in tests, f"{spec.name}: {node} does not exist"


def test_a_mixer_without_reference_tests_cannot_register():
    with pytest.raises(ValueError, match="no reference test"):
        register(MixerSpec(name="untested", kinds=("untested",), build=None, roles=(), flops=lambda *a: {},
                           description="", tests=()))


def test_a_parameter_without_a_role_fails_the_model_build(monkeypatch):
    spec = REGISTRY["gmu"]
    broken = MixerSpec(**{**spec.__dict__, "roles": tuple(r for r in spec.roles if not r[0].startswith("out_proj"))})
    from archscale.models.mixers import base
    monkeypatch.setitem(base._BY_KIND, ("mixer", "gmu"), broken)
    with pytest.raises(UserError, match="out_proj.weight.*has no role"):
        GPT(small("sambay"))


# ------------------------------------------------------------------------- fidelity: ArchScale's own rules
def archscale_is_vector_like(name):
    """ArchScale's optimizer split (pretrain.py): vector-like iff the name lacks "weight" or contains one of
    conv1d, wte, lm_head, norm, ln, layernorm."""
    return "weight" not in name or any(p in name for p in ("conv1d", "wte", "lm_head", "norm", "ln", "layernorm"))


@pytest.mark.parametrize("arch", ARCHS)
def test_optimizer_groups_equal_archscales_name_rule(arch):
    model = GPT(small(arch, depth=8))
    r = resolve_parametrization("mup++", BaseHyperparameters(), 8, 8, 32)
    groups = param_groups(model, r.matrix, r.vector)
    ours = {id(p): g["name"] for g in groups for p in g["params"]}
    for name, p in model.named_parameters():
        want = "vector" if archscale_is_vector_like(name) else "matrix"
        assert ours[id(p)] == want, (name, ours[id(p)])


def archscale_std(model, name, module, cfg, scheme, tie, w):
    """The std ArchScale's `_init_weights` gives a Linear weight (independent of our roles): SP N(0, 0.02) x w;
    mu-P the construction-time init (U(+-1/sqrt(fan_in)), Mamba's dt_proj U(+-dt_rank^-0.5)) x w; the residual
    outputs (out_proj, o_proj, attention proj, w3) / sqrt(2L) unless mu-P with an untied head."""
    leaf = name.rsplit(".", 1)[-1]
    if scheme == "sp":
        std = 0.02
    elif leaf == "dt_proj":
        std = math.ceil(cfg.n_embd / 16) ** -0.5 / math.sqrt(3)
    else:
        std = 1 / math.sqrt(3 * module.in_features)
    std *= w
    if leaf in ("out_proj", "o_proj", "proj", "w3") and (scheme == "sp" or tie):
        std /= math.sqrt(2 * cfg.n_layer)
    return std


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scheme,tie,w", [("sp", False, 1.0), ("sp", False, 2.0), ("mup", False, 1.0),
                                          ("mup", True, 1.0), ("mup", False, 0.5)])
def test_drawn_stds_follow_archscales_init(arch, scheme, tie, w):
    """Every Linear weight's measured std equals ArchScale's rule (rel 12%: sampling noise of >= 2K entries), and
    `init_stds()` (the dry run's report) states the same numbers."""
    torch.manual_seed(0)
    cfg = small(arch, init_scheme=scheme, tie_embeddings=tie, w_init_mult=w)
    model = GPT(cfg)
    reported = model.init_stds()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name == "lm_head":
            continue
        want = archscale_std(model, name, module, cfg, scheme, tie, w)
        assert module.weight.std().item() == pytest.approx(want, rel=0.12), name
        spec, rel = accounting.owner(cfg, name + ".weight")
        assert reported[f"{spec.name}.{rel}"] == pytest.approx(want, rel=1e-9), name
        if module.bias is not None and not name.endswith("dt_proj"):
            assert not module.bias.any(), name
    head = model.lm_head.weight
    if tie:
        assert head is model.wte.weight and head.std().item() == pytest.approx(0.02, rel=0.05)
    elif scheme == "mup":
        assert not head.any()  # zero readout
    else:
        assert head.std().item() == pytest.approx(0.02 * w, rel=0.05)
        assert model.wte.weight.std().item() == pytest.approx(1e-4, rel=0.05)


def test_sp_reinitialises_mamba_dt_proj_like_every_linear():
    """ArchScale's SP draws dt_proj.weight from N(0, 0.02); Mamba's own U(+-dt_rank^-0.5) is 3.66x larger at d8."""
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_name("samba_d8", vocab_size=97))
    assert model.blocks[0].mixer.dt_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    bias = torch.nn.functional.softplus(model.blocks[0].mixer.dt_proj.bias)
    assert bias.min() >= 1e-3 * 0.999 and bias.max() <= 0.1 * 1.001  # the dt bias keeps Mamba's init


# ----------------------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("arch", ARCHS)
def test_flops_per_token_matches_flop_counter(arch):
    """Analytic matmul + attention + conv FLOPs of one forward equal torch's FlopCounterMode within 5% (SDPA's math
    backend, so attention shows up as bmm; terms named *_elementwise are not matmuls and *_solve are triangular
    solves, which the counter does not see: both are left out)."""
    model = GPT(small(arch)).eval()
    T = 32
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        model(torch.randint(0, 97, (1, T)))
    counted = counter.get_total_flops() / T
    terms = accounting.flops_breakdown(model, T)
    ours = sum(v for k, v in terms.items() if not k.endswith(("_elementwise", "_solve")))
    assert ours == pytest.approx(counted, rel=0.05), terms
    assert model.flops_per_token(T, training=False) == pytest.approx(sum(terms.values()))


# --------------------------------------------------------------------------------- negative control
def zero_mixers(model):
    for block in model.blocks:
        block.mixer.register_forward_hook(lambda mod, args, out: out * 0)
    return model


@pytest.mark.parametrize("arch", ["transformer", "samba", "sambay", "mamba"])
def test_per_architecture_checks_fail_on_zeroed_mixers(arch):
    torch.manual_seed(0)
    cfg = small(arch, depth=8, ar=8)
    check_information_flows(GPT(cfg).eval())  # the real model passes ...
    check_every_parameter_learns(GPT(cfg))
    with pytest.raises(AssertionError, match="did not see it"):  # ... the zeroed one fails both
        check_information_flows(zero_mixers(GPT(cfg)).eval())
    with pytest.raises(AssertionError, match="without gradient"):
        check_every_parameter_learns(zero_mixers(GPT(cfg)))


# ------------------------------------------------------------------------------------------ structure
def test_config_imports_no_model_code():
    code = "import sys, archscale.config; print([m for m in sys.modules if m.startswith('archscale.models') or m == 'torch'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]"


def test_mixer_options_are_checked():
    with pytest.raises(UserError, match="unknown field"):
        GPT(small("samba", mixer_options={"mamba": {"d_stat": 8}}))
    model = GPT(small("samba", mixer_options={"mamba": {"d_state": 8}}))
    assert model.blocks[0].mixer.A_log.shape[1] == 8


def test_old_run_configs_load_with_their_mamba_fields():
    saved = small("samba").to_dict()
    del saved["mixer_options"]
    saved.update(d_state=8, d_conv=4, mamba_expand=2)
    cfg = ModelConfig.from_dict(saved)
    assert cfg.mixer_options == {"mamba": {"d_state": 8}}
