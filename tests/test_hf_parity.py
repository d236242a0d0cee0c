"""Numerical parity of our Transformer++ with `transformers.LlamaForCausalLM` (via `archscale.export.hf`).

Weights are re-drawn at a scale that makes every part of the network matter (norm gains != 1, logits of order
1-10); the SP init's tiny embedding would make almost any mapping look "close". The negative controls show the
1e-4 tolerance is tight enough to catch the classic export bugs (k/v or gate/up swapped, interleaved RoPE rows,
one perturbed weight).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from archscale.config import ModelConfig  # noqa: E402
from archscale.errors import UserError  # noqa: E402
from archscale.export import to_llama_config, to_llama_model, to_llama_state_dict  # noqa: E402
from archscale.models import GPT  # noqa: E402

TOL = 1e-4
VOCAB = 1000  # padded to 1024 in our GPT; the export drops the padding rows, so HF has exactly 1000
B, T = 2, 33


def make_model(seed: int = 0, **overrides) -> GPT:
    base = dict(n_layer=2, n_embd=128, n_head=4, n_query_groups=2, head_size=32, vocab_size=VOCAB)
    base.update(overrides)
    cfg = ModelConfig.from_name(f"transformer_d{base['n_layer']}", **base)
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm gains and biases
                gain = name.startswith("ln_f.") or ".norm_" in name
                p.copy_((1.0 if gain else 0.0) + 0.2 * torch.randn_like(p))
            elif name == "wte.weight":  # also the lm_head when tied: keep those logits O(10), not O(100)
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return model.eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def max_diff(model: GPT, hf, idx: torch.Tensor) -> float:
    ours = model(idx)
    theirs = hf(input_ids=idx).logits
    assert ours.shape == (B, T, VOCAB)
    assert theirs.shape == (B, T, VOCAB)
    return (ours - theirs).abs().max().item()


def load_state(model: GPT, state: dict[str, torch.Tensor], attn: str = "eager", **config_overrides):
    import transformers

    hf_config = to_llama_config(model.config, attn_implementation=attn, **config_overrides)
    hf = transformers.LlamaForCausalLM(hf_config)
    hf.load_state_dict(state, strict=True)
    return hf.eval()


CASES = {
    # id: (overrides, attention implementation)
    "mqa-d2-w128-untied": (dict(n_query_groups=1), "eager"),
    "gqa2-d3-w64-tied-base640k": (dict(n_layer=3, n_embd=64, n_query_groups=2, tie_embeddings=True,
                                       rope_base=640000.0), "sdpa"),
    "mha-d2-w256-untied-base640k": (dict(n_embd=256, n_query_groups=4, rope_base=640000.0), "sdpa"),
    "gqa2-d4-w128-untied-eps1e-6": (dict(n_layer=4, norm_eps=1e-6), "eager"),
    "mha-d2-w128-tied": (dict(n_query_groups=4, tie_embeddings=True), "eager"),
    "mqa-d2-w128-bias": (dict(n_query_groups=1, bias=True), "sdpa"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_llama(case):
    overrides, attn = CASES[case]
    model = make_model(**overrides)
    hf = to_llama_model(model, attn_implementation=attn)
    assert hf.config._attn_implementation == attn
    if model.config.tie_embeddings:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
    idx = tokens()
    scale = model(idx).abs().max().item()
    assert scale > 1.0, "logits too small for the comparison to mean anything"
    diff = max_diff(model, hf, idx)
    assert diff <= TOL, f"{case}: max |logit diff| {diff:.3e} > {TOL}"


def test_state_dict_covers_llama_exactly():
    import transformers

    for tie in (False, True):
        model = make_model(tie_embeddings=tie, bias=True)
        ours = to_llama_state_dict(model)
        hf = transformers.LlamaForCausalLM(to_llama_config(model.config))
        expected = hf.state_dict()
        assert set(ours) == set(expected)
        for k, v in ours.items():
            assert v.shape == expected[k].shape, k
            assert v.is_contiguous()
        assert (ours["lm_head.weight"] is ours["model.embed_tokens.weight"]) == tie


def test_qkv_split_is_not_symmetric():
    """With G != H the three slices have different shapes, and with G > 1 swapping k and v still fits shapes.

    So a wrong split either fails to load or changes the logits: the parity above can't pass by accident.
    """
    model = make_model(n_query_groups=2)  # H=4, G=2, hd=32: q 128 rows, k 64, v 64
    cfg = model.config
    state = to_llama_state_dict(model)
    w = model.blocks[0].mixer.attn.weight
    H, G, hd = cfg.n_head, cfg.n_query_groups, cfg.head_size
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (H * hd, cfg.n_embd)
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (G * hd, cfg.n_embd)
    assert torch.equal(state["model.layers.0.self_attn.q_proj.weight"], w[: H * hd])
    assert torch.equal(state["model.layers.0.self_attn.k_proj.weight"], w[H * hd: (H + G) * hd])
    assert torch.equal(state["model.layers.0.self_attn.v_proj.weight"], w[(H + G) * hd:])
    assert not torch.equal(state["model.layers.0.self_attn.k_proj.weight"],
                           state["model.layers.0.self_attn.v_proj.weight"])

    # Splitting as if it were MHA ([q | k | v] in equal thirds) cannot even be loaded.
    bad = dict(state)
    third = w.shape[0] // 3
    bad["model.layers.0.self_attn.q_proj.weight"] = w[:third].clone()
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_state(model, bad)


def _swap(state, a, b, layer=0):
    bad = dict(state)
    ka, kb = f"model.layers.{layer}.{a}.weight", f"model.layers.{layer}.{b}.weight"
    bad[ka], bad[kb] = state[kb], state[ka]
    return bad


def _interleave_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The HF<->Meta RoPE permutation: half-rotation rows (i, i + hd/2) -> adjacent pairs (2i, 2i + 1)."""
    hd = w.shape[0] // n_heads
    return w.view(n_heads, 2, hd // 2, -1).transpose(1, 2).reshape(w.shape)


NEGATIVE = ["swap_k_v", "swap_gate_up", "interleaved_rope", "perturbed_norm", "wrong_rope_theta"]


@pytest.mark.parametrize("mistake", NEGATIVE)
def test_negative_control_wrong_mapping_fails(mistake):
    model = make_model(n_query_groups=2, rope_base=640000.0)
    state = to_llama_state_dict(model)
    idx = tokens()
    assert max_diff(model, load_state(model, state), idx) <= TOL  # the right mapping passes ...
    overrides = {}
    if mistake == "swap_k_v":
        bad = _swap(state, "self_attn.k_proj", "self_attn.v_proj")
    elif mistake == "swap_gate_up":
        bad = _swap(state, "mlp.gate_proj", "mlp.up_proj")
    elif mistake == "interleaved_rope":
        bad = dict(state)
        for name, heads in (("q_proj", model.config.n_head), ("k_proj", model.config.n_query_groups)):
            key = f"model.layers.1.self_attn.{name}.weight"
            bad[key] = _interleave_rope_rows(state[key], heads)
    elif mistake == "perturbed_norm":
        bad = dict(state)
        key = "model.layers.1.post_attention_layernorm.weight"
        noise = torch.randn(state[key].shape, generator=torch.Generator().manual_seed(0))
        bad[key] = state[key] + 1e-2 * noise
    else:  # right weights, but Llama's default RoPE base instead of ours
        bad, overrides = state, {"rope_theta": 10000.0}
    diff = max_diff(model, load_state(model, bad, **overrides), idx)  # ... and each plausible mistake is caught
    assert diff > 1e-3, f"{mistake}: diff {diff:.3e} would have passed"


def test_padded_vocab_rows_are_dropped_and_restored():
    from archscale.export import from_llama_state_dict

    model = make_model()
    assert model.config.padded_vocab_size == 1024 > VOCAB
    state = to_llama_state_dict(model)
    assert torch.equal(state["model.embed_tokens.weight"], model.wte.weight[:VOCAB])
    assert to_llama_config(model.config).vocab_size == VOCAB
    back = from_llama_state_dict(state, model.config)
    assert back["wte.weight"].shape == (1024, model.config.n_embd)
    assert torch.equal(back["wte.weight"][:VOCAB], model.wte.weight[:VOCAB])
    assert not back["wte.weight"][VOCAB:].any()
    restored = GPT(model.config)
    restored.load_state_dict(back, strict=True)
    assert torch.equal(restored.eval()(tokens()), model(tokens()))


def test_rope_base_and_eps_reach_the_config():
    cfg = ModelConfig.from_name("transformer_d2", n_embd=64, n_head=2, n_query_groups=1, head_size=32,
                                vocab_size=VOCAB, rope_base=640000.0, norm_eps=1e-6, block_size=512)
    hf_cfg = to_llama_config(cfg)
    theta = hf_cfg.rope_parameters["rope_theta"] if getattr(hf_cfg, "rope_parameters", None) else hf_cfg.rope_theta
    assert theta == 640000.0
    assert hf_cfg.rms_norm_eps == 1e-6 and hf_cfg.max_position_embeddings == 512
    assert hf_cfg.num_key_value_heads == 1 and hf_cfg.head_dim == 32


@pytest.mark.parametrize("field", ["residual_scale", "logit_scale", "attn_scale_mult"])
def test_each_multiplier_is_folded(field):
    model = make_model(**{field: 0.5})
    diff = max_diff(model, to_llama_model(model), tokens())
    assert diff <= TOL, f"{field}: {diff:.3e}"


@pytest.mark.parametrize("field,value", [("norm_class", "layernorm"), ("nope", True), ("rope_scaling", 2.0)])
def test_what_llama_cannot_express_is_refused(field, value):
    model = make_model(**{field: value})
    with pytest.raises(UserError, match=field):
        to_llama_config(model.config)
    with pytest.raises(UserError, match=field):
        to_llama_state_dict(model)


@pytest.mark.parametrize("tie", [False, True])
def test_save_pretrained_round_trip(tmp_path, tie):
    import transformers

    model = make_model(tie_embeddings=tie)
    to_llama_model(model).save_pretrained(tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert max_diff(model, hf, tokens()) <= TOL


def test_bf16_export_keeps_tie():
    model = make_model(tie_embeddings=True)
    hf = to_llama_model(model, dtype=torch.bfloat16)
    assert hf.lm_head.weight.dtype == torch.bfloat16
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
