"""Transformer++ model: sizes, parameter counts, causality, multipliers, and that it can learn."""

import math

import pytest
import torch
import torch.nn.functional as F

from archscale import GPT, ModelConfig
from archscale.models.model import non_embedding_params
from archscale.errors import UserError

# Spec §2.2 (non-embedding parameters, counted from the module shapes).
SPEC_PARAMS = {8: 121.7e6, 12: 410.6e6, 16: 973.1e6, 20: 1.90e9, 24: 3.28e9}


def tiny(**kw):
    base = dict(n_embd=64, n_head=4, n_query_groups=2, head_size=16, intermediate_size=128, vocab_size=97,
                block_size=32)
    base.update(kw)
    return ModelConfig.from_name("transformer_d2", **base)


@pytest.mark.parametrize("depth", sorted(SPEC_PARAMS))
def test_param_counts_match_spec(depth):
    cfg = ModelConfig.from_name(f"transformer_d{depth}")
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_query_groups, cfg.head_size) == (
        depth, 128 * depth, depth, depth // 4, 128)
    assert cfg.intermediate_size == 4 * cfg.n_embd
    with torch.device("meta"):
        model = GPT(cfg)
    counted = model.num_params(non_embedding=True)
    assert counted == non_embedding_params(cfg)
    # the spec rounds to 4 significant digits (3 for the billions)
    assert abs(counted - SPEC_PARAMS[depth]) / SPEC_PARAMS[depth] < 0.003, counted
    # untied vocab 32000 adds 2 * V * d (vocab is padded to a multiple of 64: 32000 already is)
    assert model.num_params(non_embedding=False) - counted == 2 * 32000 * cfg.n_embd


def test_param_count_law_transformer():
    # N(d) = 14.5 * ar^2 * d^3 plus the norms (spec §3)
    for d in (8, 16):
        cfg = ModelConfig.from_name(f"transformer_d{d}")
        assert non_embedding_params(cfg) - (2 * d + 1) * cfg.n_embd == 14.5 * 128**2 * d**3


def test_tied_embeddings_share_storage():
    model = GPT(tiny(tie_embeddings=True))
    assert model.lm_head.weight is model.wte.weight
    assert sum(p.numel() for p in model.parameters()) == model.num_params(False)
    assert model.num_params(False) - model.num_params(True) == model.wte.weight.numel()


def test_logits_shape_and_padding():
    cfg = tiny()
    assert cfg.padded_vocab_size == 128
    model = GPT(cfg)
    out = model(torch.randint(0, 97, (3, 11)))
    assert out.shape == (3, 11, 97)


def test_causality():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    idx = torch.randint(0, 97, (2, 24))
    ref = model(idx)
    for t in (0, 5, 23):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 97
        out = model(changed)
        assert torch.equal(out[:, :t], ref[:, :t]), f"position {t} leaked into the past"
        assert not torch.allclose(out[:, t], ref[:, t]), "changing a token must change its own logits"


def test_rope_makes_attention_order_aware():
    # Without positions, a one-layer model's last-token output is invariant to permuting the earlier tokens.
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=1, init_std=0.5)).eval()
    a = torch.tensor([[3, 7, 11, 5]])
    b = torch.tensor([[11, 3, 7, 5]])
    assert not torch.allclose(model(a)[0, -1], model(b)[0, -1], atol=1e-5)
    nope = GPT(tiny(n_layer=1, init_std=0.5)).eval()
    nope.load_state_dict(model.state_dict())
    for blk in nope.blocks:
        blk.mixer.use_rope = False  # negative control: the same check must see no difference
    torch.testing.assert_close(nope(a)[0, -1], nope(b)[0, -1], rtol=1e-5, atol=1e-5)


def test_multipliers_change_the_function():
    torch.manual_seed(0)
    idx = torch.randint(0, 97, (1, 8))
    base = GPT(tiny())
    state = base.state_dict()
    for field, value in (("residual_scale", 0.5), ("logit_scale", 0.25), ("attn_scale_mult", 2.0)):
        other = GPT(tiny(**{field: value}))
        other.load_state_dict(state)
        assert not torch.allclose(base(idx), other(idx)), field
    half = GPT(tiny(logit_scale=0.5))
    half.load_state_dict(state)
    torch.testing.assert_close(half(idx), 0.5 * base(idx), rtol=1e-5, atol=1e-6)


def test_sp_init_statistics():
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("transformer_d4", n_embd=256, vocab_size=512)
    model = GPT(cfg)
    assert abs(model.blocks[0].mixer.attn.weight.std().item() - 0.02) < 0.001
    assert abs(model.blocks[0].mlp.w3.weight.std().item() - 0.02 / math.sqrt(8)) < 0.0005
    assert abs(model.wte.weight.std().item() - 1e-4) < 1e-5
    assert torch.all(model.blocks[0].norm_1.weight == 1)


def test_flops_per_token():
    cfg = tiny()
    model = GPT(cfg)
    norms = (2 * cfg.n_layer + 1) * cfg.n_embd  # vector-like, not matmul weights
    n = model.num_params() - norms + cfg.padded_vocab_size * cfg.n_embd
    attn = cfg.n_layer * 4 * cfg.n_head * cfg.head_size * 32
    assert model.flops_per_token(32) == 3 * (2 * n + attn)
    assert model.flops_per_token(32, training=False) == 2 * n + attn


def test_bad_configs_are_user_errors():
    with pytest.raises(UserError, match="unknown --train_model"):
        ModelConfig.from_name("transfomer_d8")
    with pytest.raises(UserError, match="multiple of n_query_groups"):
        tiny(n_head=4, n_query_groups=3)
    with pytest.raises(UserError, match="must look like"):
        ModelConfig.from_name("transformer")
    with pytest.raises(UserError, match="unknown ModelConfig field"):
        ModelConfig.from_name("transformer_d2", widht=3)


def test_memorises_a_short_text():
    """A tiny model overfits a repeated 48-token sequence: loss from ~ln(97)=4.6 to < 0.05 in 150 steps."""
    torch.manual_seed(0)
    model = GPT(tiny(init_scheme="sp"))
    seq = torch.randint(0, 97, (1, 49))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    first = None
    for step in range(150):
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 4.0
    assert loss.item() < 0.05, loss.item()


def test_swiglu_matches_formula():
    from archscale.models.mixers.swiglu import SwiGLU
    torch.manual_seed(0)
    mlp = SwiGLU(12, 20)
    x = torch.randn(3, 12)
    gate, inp = (x @ mlp.w1.weight.T).split(20, dim=-1)
    torch.testing.assert_close(mlp(x), (F.silu(gate) * inp) @ mlp.w3.weight.T, rtol=1e-5, atol=1e-6)
