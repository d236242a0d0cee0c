"""The architecture zoo: layouts, parameter counts, causality, cached decoding == full forward, training."""

import math

import pytest
import torch

from archscale import GPT, ModelConfig
from archscale.models.model import non_embedding_params
from archscale.config import ARCHITECTURES, layer_kinds
from archscale.errors import UserError
from archscale.models.cache import InferenceCache
from model_checks import check_every_parameter_learns, check_information_flows

ARCHS = sorted(ARCHITECTURES)
SWA_ARCHS = [a for a in ARCHS if ARCHITECTURES[a].sliding_window]


def tiny(arch, depth=8, window=5, **kw):
    """Small but complete: every layer kind of the architecture at depth 8, a window shorter than the prompts."""
    base = dict(vocab_size=97, block_size=64)
    if ARCHITECTURES[arch].sliding_window:
        base["sliding_window"] = window
    if arch == "phi4miniflash":  # keep its 2:1 GQA and LayerNorm/bias/tied preset, shrink the heads
        base.update(n_head=8, n_query_groups=4, head_size=8)
    if "gdn" in "".join(ARCHITECTURES[arch].layout(depth)):  # ArchScale's 256-wide GDN heads make width 64 slow
        base["mixer_options"] = {"gdn": {"head_dim": 16, "num_heads": 2}}
    base.update(kw)
    return ModelConfig.from_arch(arch, depth, ar=8, **base)


# ------------------------------------------------------------------------------------------------- layouts
def test_layouts_follow_the_spec():
    assert layer_kinds("transformerls", 8) == ["swa", "swa", "swa", "attn"] * 2
    assert layer_kinds("samba", 4) == ["mamba", "swa", "mamba", "swa"]
    # SambaY d8: Samba self-decoder (0..3), Mamba saving GMU memory (4), the KV layer (5), then GMU / cross
    assert layer_kinds("sambay", 8) == ["mamba", "swa", "mamba", "swa", "mamba_mem", "kv", "gmu", "cross"]
    assert layer_kinds("sambay", 12)[6:] == ["mamba_mem", "kv", "gmu", "cross", "gmu", "cross"]
    assert layer_kinds("sambayoco", 8)[4:] == ["mamba", "kv", "cross", "cross"]
    assert layer_kinds("mamba", 3) == ["mamba"] * 3
    cfg = ModelConfig.from_name("phi4miniflash_d32")
    assert (cfg.n_embd, cfg.n_head, cfg.n_query_groups, cfg.head_size, cfg.intermediate_size) == (
        2560, 40, 20, 64, 10240)
    assert (cfg.vocab_size, cfg.padded_vocab_size, cfg.sliding_window, cfg.norm_class) == (
        200064, 200064, 512, "layernorm")
    assert cfg.tie_embeddings and cfg.attn_bias and cfg.use_da and cfg.nope


def test_bad_depths_are_one_line_errors():
    with pytest.raises(UserError, match="divisible by 4"):
        ModelConfig.from_name("sambay_d6")
    with pytest.raises(UserError, match="must both be even"):
        ModelConfig.from_name("sambayda_d12")  # 3 KV heads cannot be paired


# ---------------------------------------------------------------------------------------- parameter counts
# Spec §2.2, SambaY column (non-embedding, from the module shapes).
SAMBAY_SPEC = {8: (992, 126.9e6), 12: (1488, 424.6e6), 16: (1984, 1002e6), 20: (2480, 1.95e9), 24: (2976, 3.37e9)}


@pytest.mark.parametrize("depth", sorted(SAMBAY_SPEC))
def test_sambay_param_counts_match_spec(depth):
    cfg = ModelConfig.from_name(f"sambay_d{depth}")
    width, params = SAMBAY_SPEC[depth]
    assert cfg.n_embd == width
    assert abs(non_embedding_params(cfg) - params) / params < 0.01


@pytest.mark.parametrize("depth", [8, 12, 16, 20, 24])
def test_same_depth_architectures_have_matching_sizes(depth):
    """The aspect ratios tie parameter counts across architectures: the seed's within 5% (SambaY d8 is +4.3%),
    mamba (ours) within 3%."""
    ref = non_embedding_params(ModelConfig.from_name(f"transformer_d{depth}"))
    for arch, tol in [("mamba", 0.03), ("samba", 0.05), ("sambay", 0.05), ("sambayoco", 0.06)]:
        n = non_embedding_params(ModelConfig.from_name(f"{arch}_d{depth}"))
        assert abs(n - ref) / ref < tol, (arch, n, ref)


@pytest.mark.parametrize("depth", [16, 24])
def test_param_count_laws(depth):
    """The seed's closed-form laws (used for token budgets) are large-depth asymptotes of the module counts (the
    layers around the YOCO split are not amortised): within 3% from d16 on (sambayoco, the loosest, is 4.4% low
    at d8, 2.4% at d16)."""
    from archscale.scaling_rules import n_mult
    for arch in ["transformer", "mamba", "samba", "sambay", "sambayda", "sambayoco"]:
        n = non_embedding_params(ModelConfig.from_name(f"{arch}_d{depth}"))
        assert abs(n_mult(arch) * depth**3 - n) / n < 0.03, arch


def test_phi4_mini_flash_is_3_8b():
    cfg = ModelConfig.from_name("phi4miniflash_d32")
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.lm_head.weight is model.wte.weight
    assert 3.80e9 < model.num_params(non_embedding=False) < 3.90e9  # "3.8B" with its 200K tied vocabulary
    attn = model.blocks[1].mixer  # an SWA layer: ArchScale's fused q/k/v projection and the output one are biased
    assert attn.attn.bias.shape == ((40 + 2 * 20) * 64,) and attn.proj.bias.shape == (2560,)
    assert model.blocks[31].mixer.q_proj.bias.shape == (40 * 64,)  # a cross layer: queries only


def test_cross_layers_project_queries_only():
    model = GPT(tiny("sambayoco"))
    names = {n for n, _ in model.named_parameters()}
    assert "blocks.6.mixer.q_proj.weight" in names and "blocks.6.mixer.attn.weight" not in names
    assert "blocks.5.mixer.attn.weight" in names  # the one KV layer


# ------------------------------------------------------------------------------------- forward properties
@pytest.mark.parametrize("arch", ARCHS)
def test_causal_and_information_flows(arch):
    torch.manual_seed(0)
    check_information_flows(GPT(tiny(arch)).eval())


@pytest.mark.parametrize("arch", ARCHS)
def test_every_parameter_gets_a_gradient(arch):
    torch.manual_seed(0)
    check_every_parameter_learns(GPT(tiny(arch)))


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_equals_argmax_of_full_forward(arch):
    """Cached greedy decoding == re-running the whole forward per token, with prompts longer than the window."""
    torch.manual_seed(1)
    model = GPT(tiny(arch)).eval()
    prompt = torch.randint(0, 97, (2, 13))
    with torch.no_grad():
        out = model.generate(prompt, 12)
        ref = prompt
        for _ in range(12):
            ref = torch.cat([ref, model(ref)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out.shape == (2, 25)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ["transformer", "samba", "sambay", "sambayda"])
def test_chunked_prefill_equals_one_pass(arch):
    """Feeding the sequence through the cache in pieces gives the full forward's logits at every position."""
    torch.manual_seed(2)
    model = GPT(tiny(arch)).eval()
    idx = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        full = model(idx)
        cache = InferenceCache(capacity=20)
        parts = [model(idx[:, a:b], cache=cache) for a, b in [(0, 7), (7, 8), (8, 16), (16, 20)]]
    assert cache.pos == 20
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=2e-5, rtol=1e-4)


def test_yoco_cache_holds_one_kv():
    """SambaY keeps K/V for the KV layer (full) and the SWA layers (last W-1), Mamba states, nothing else."""
    model = GPT(tiny("sambay", window=5)).eval()
    cache = InferenceCache(capacity=40)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 30)), cache=cache, last_only=True)
    kinds = model.config.layer_kinds
    assert sorted(cache.layers) == [i for i, k in enumerate(kinds) if k in ("mamba", "mamba_mem", "swa", "kv")]
    assert cache.layers[5].length == 30  # the shared KV: every position
    assert cache.layers[1].k.shape[2] == 4  # SWA: window - 1


def test_generate_stops_at_eos_and_pads():
    torch.manual_seed(3)
    model = GPT(tiny("transformer")).eval()
    prompt = torch.randint(0, 97, (3, 5))
    with torch.no_grad():
        free = model.generate(prompt, 6)
    eos = int(free[0, 6])  # row 0 emits this at its 2nd new token
    with torch.no_grad():
        out = model.generate(prompt, 6, eos_id=eos)
    row0 = out[0, 5:].tolist()
    assert row0[:2] == free[0, 5:7].tolist() and all(t == eos for t in row0[1:])


def test_sampling_top_k_top_p():
    from archscale.models.generation import sample_next
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, 1.0, top_k=2, generator=g)) for _ in range(200)}
    assert draws == {0, 1}
    # softmax mass of the top token is ~0.72: top_p 0.5 keeps it alone, 0.9 keeps two
    assert {int(sample_next(logits, 1.0, top_p=0.5, generator=g)) for _ in range(100)} == {0}
    assert {int(sample_next(logits, 1.0, top_p=0.9, generator=g)) for _ in range(300)} == {0, 1}
    assert int(sample_next(logits, 0.0)) == 0


# ----------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("arch", ARCHS)
def test_a_few_steps_lower_the_loss(arch):
    torch.manual_seed(4)
    cfg = tiny(arch, window=8)
    model = GPT(cfg)
    data = torch.arange(0, 33).repeat(4, 1) % 97  # a fixed, learnable sequence
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses
