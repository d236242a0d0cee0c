"""GDNY and SGDNY (ArchScale's Gated DeltaNet YOCO layouts): layouts, sizes against ArchScale's law, init stds,
optimizer groups, FLOPs against FlopCounterMode, and training through `archscale pretrain`. (Causality, cached
decoding and packed == separate run for them in tests/test_architectures.py and tests/test_varlen.py.)"""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from archscale import GPT, ModelConfig
from archscale.cli import main
from archscale.config import layer_kinds
from archscale.models import accounting
from archscale.models.model import non_embedding_params
from archscale.scaling_rules import n_mult

SMALL = {"gdn": {"head_dim": 16, "num_heads": 2, "chunk_size": 16}}  # tests' widths; defaults are ArchScale's


def small(arch, **kw):
    return ModelConfig.from_arch(arch, 8, ar=8, vocab_size=97, block_size=64, sliding_window=5,
                                 mixer_options=SMALL, **kw)


def test_layouts():
    assert layer_kinds("gdny", 8) == ["gdn"] * 4 + ["gdn_mem", "kv", "ngmu", "cross"]
    assert layer_kinds("sgdny", 12) == ["gdn", "swa"] * 3 + ["gdn_mem", "kv", "ngmu", "cross", "ngmu", "cross"]


@pytest.mark.parametrize("arch,ar,width,tol", [("gdny", 120, 1920, 0.02), ("sgdny", 126, 2016, 0.06)])
def test_d16_sizes_and_law(arch, ar, width, tol):
    """d16 as ArchScale builds it (6 GDN heads of 256, the nGMU's d_mem 3072); its law 16 ar^2 + 64 ar is that
    of an all-RNN self-decoder, so for SGDNY (half the self-decoder SWA) it overestimates by 5.4% at d16."""
    cfg = ModelConfig.from_name(f"{arch}_d16")
    assert cfg.n_embd == width == ar * 16
    with torch.device("meta"):
        model = GPT(cfg)
    mem_layer = cfg.layer_kinds.index("gdn_mem")
    assert model.blocks[mem_layer].mixer.value_dim == 3072
    assert model.blocks[mem_layer + 2].mixer.in_proj.weight.shape == (3072, width)  # the nGMU
    assert model.blocks[mem_layer + 2].mixer.norm.weight.shape == (3072,)
    n = non_embedding_params(cfg)
    assert abs(n_mult(arch) * 16**3 - n) / n < tol


@pytest.mark.parametrize("scheme", ["sp", "mup"])
def test_init_stds_are_drawn(scheme):
    """What `init_stds()` reports is what GPT.reset_parameters drew, for every GDN Linear (SP: N(0, 0.02),
    o_proj / sqrt(2L); mu-P: PyTorch's default U(+-1/sqrt(fan_in))), and the layer's own params keep its init."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_arch("gdny", 8, ar=32, vocab_size=97, init_scheme=scheme,
                                mixer_options={"gdn": {"head_dim": 64, "num_heads": 4}})
    model = GPT(cfg)
    stds = model.init_stds()
    mixer = model.blocks[0].mixer
    for rel in ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj"):
        w = getattr(mixer, rel).weight
        want = stds[f"gdn.{rel}.weight"]
        assert abs(w.std().item() - want) < 0.06 * want, (rel, w.std().item(), want)
    residual = 1 / math.sqrt(2 * cfg.n_layer)
    if scheme == "sp":
        assert stds["gdn.q_proj.weight"] == pytest.approx(0.02)
        assert stds["gdn.o_proj.weight"] == pytest.approx(0.02 * residual)
    else:
        assert stds["gdn.q_proj.weight"] == pytest.approx(1 / math.sqrt(3 * cfg.n_embd))
        assert stds["gdn.o_proj.weight"] == pytest.approx(1 / math.sqrt(3 * mixer.value_dim))
    assert torch.equal(mixer.norm.weight, torch.ones_like(mixer.norm.weight))
    assert mixer.A_log.exp().max() <= 16 and mixer.q_conv1d.weight.abs().max() <= 0.5


@pytest.mark.parametrize("arch", ["gdny", "sgdny"])
def test_optimizer_groups_follow_archscale_name_rule(arch):
    def vector_like(name):
        return "weight" not in name or any(s in name for s in ("conv1d", "wte", "lm_head", "norm", "ln",
                                                                 "layernorm"))
    model = GPT(small(arch))
    for name, _, role in accounting.named_roles(model):
        assert (role.group == "vector") == vector_like(name), name


@pytest.mark.parametrize("arch", ["gdny", "sgdny"])
def test_flops_match_flop_counter(arch):
    """accounting.flops_breakdown (all but the *_elementwise terms) == FlopCounterMode's count of one forward,
    within 5% (the counter sees matmuls and convolutions)."""
    model = GPT(small(arch)).eval()
    T = 48
    idx = torch.randint(0, 97, (1, T))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(idx)
    measured = counter.get_total_flops() / T
    terms = accounting.flops_breakdown(model, T)
    predicted = sum(v for k, v in terms.items() if not k.endswith("_elementwise"))
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured, terms)


@pytest.mark.slow
def test_pretrain_trains(dataset, tmp_path):
    """`archscale pretrain --train_model gdny --depth 4` at ArchScale's sizes (ar 120: width 480, 2 heads of
    256) runs and lowers the loss (sgdny: the same mixers, trained in tests/test_architectures.py)."""
    arch = "gdny"
    import csv
    from tests.test_train import args
    run = tmp_path / "run"
    argv = args(dataset, run, "--resume", "none")
    argv[argv.index("--train_model") + 1] = arch
    argv[argv.index("--depth") + 1] = "4"
    argv[argv.index("--max_tokens") + 1] = "2560"
    assert main(argv) == 0
    with open(run / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["train_loss"]]
    assert len(rows) >= 5 and all(math.isfinite(float(r["train_loss"])) for r in rows)
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
