"""Two published hybrids from outside ArchScale, built from the layout specs shipped in `archscale/layouts/`, match
their reference code (the pure-PyTorch paths of `transformers`) in fp32 logits within 1e-4 on CPU:

- Jamba (Lieber et al. 2024; `transformers.JambaForCausalLM`): Mamba-1 with RMSNorms on dt, B and C, one NoPE
  attention layer in eight, a mixture of experts (softmax over all experts, then the top 2, not renormalised) in
  every other layer;
- Bamba (IBM et al. 2024; `transformers.BambaForCausalLM`): Mamba-2 with attention on every ninth layer from
  layer 9 (Bamba-9B: 9, 18, 27), partial RoPE on half of each head.

The transformers model is drawn at random (weights re-drawn so that every part matters: norm gains != 1, logits of
order 1-10) and copied into ours through an explicit name mapping in which every transformers parameter is used
once and every one of ours is written in full. Each hybrid has negative controls: a plausible wrong mapping, a
swapped layer, or an option turned off move the logits by far more than the tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from archscale.config import LAYOUTS, ModelConfig  # noqa: E402
from archscale.models import GPT  # noqa: E402

TOL = 1e-4
VOCAB, B, T = 100, 2, 24


# --------------------------------------------------------------------------------------- the weight mapping
def copy_weights(hf: torch.nn.Module, ours: GPT, mapping: dict[str, tuple[str, slice | None]],
                 unused: set[str] = frozenset()) -> None:
    """Copy each transformers parameter into ours: `mapping[hf_name] = (our_name, rows)` (rows: a slice of our
    tensor's first dim, None for all of it). Every transformers parameter must be mapped, except those a negative
    control declares `unused` (a name is used once, by construction of a dict), and every row of ours written
    exactly once, except our padded vocabulary rows."""
    theirs = dict(hf.named_parameters())
    assert not set(mapping) & set(unused)
    missing, extra = set(theirs) - set(mapping) - set(unused), set(mapping) - set(theirs)
    assert not missing and not extra, (sorted(missing), sorted(extra))
    params = dict(ours.named_parameters())
    written = {name: torch.zeros(p.shape[0], dtype=torch.int) for name, p in params.items()}
    with torch.no_grad():
        for hf_name, (name, rows) in mapping.items():
            rows = rows if rows is not None else slice(0, params[name].shape[0])
            params[name][rows].copy_(theirs[hf_name])  # shapes must agree exactly (no broadcasting)
            assert params[name][rows].shape == theirs[hf_name].shape, hf_name
            written[name][rows] += 1
    vocab = ours.config.vocab_size
    for name, count in written.items():
        used = count[:vocab] if name in ("wte.weight", "lm_head.weight") else count
        assert bool((used == 1).all()), f"{name}: rows written {sorted(set(used.tolist()))} times"


def shared_mapping(n_layer: int) -> dict[str, tuple[str, slice | None]]:
    """Embedding, final norm, head and the two block norms: the same in both models."""
    m = {"model.embed_tokens.weight": ("wte.weight", slice(0, VOCAB)),
         "model.final_layernorm.weight": ("ln_f.weight", None),
         "lm_head.weight": ("lm_head.weight", slice(0, VOCAB))}
    for i in range(n_layer):
        m[f"model.layers.{i}.input_layernorm.weight"] = (f"blocks.{i}.norm_1.weight", None)
        m[f"model.layers.{i}.pre_ff_layernorm.weight"] = (f"blocks.{i}.norm_2.weight", None)
    return m


def attention_mapping(hf_prefix: str, ours: str, cfg: ModelConfig) -> dict[str, tuple[str, slice | None]]:
    """q, k, v into the rows of our fused [q | k | v] projection; o_proj into proj."""
    q, kv = cfg.n_head * cfg.head_size, cfg.n_query_groups * cfg.head_size
    return {f"{hf_prefix}.q_proj.weight": (f"{ours}.attn.weight", slice(0, q)),
            f"{hf_prefix}.k_proj.weight": (f"{ours}.attn.weight", slice(q, q + kv)),
            f"{hf_prefix}.v_proj.weight": (f"{ours}.attn.weight", slice(q + kv, q + 2 * kv)),
            f"{hf_prefix}.o_proj.weight": (f"{ours}.proj.weight", None)}


def mlp_mapping(hf_prefix: str, ours: str, hidden: int) -> dict[str, tuple[str, slice | None]]:
    """gate and up into the two halves of our w1 ([gate | input]); down into w3."""
    return {f"{hf_prefix}.gate_proj.weight": (f"{ours}.w1.weight", slice(0, hidden)),
            f"{hf_prefix}.up_proj.weight": (f"{ours}.w1.weight", slice(hidden, 2 * hidden)),
            f"{hf_prefix}.down_proj.weight": (f"{ours}.w3.weight", None)}


def same_names(hf_prefix: str, ours: str, names: list[str]) -> dict[str, tuple[str, slice | None]]:
    return {f"{hf_prefix}.{n}": (f"{ours}.{n}", None) for n in names}


# ---------------------------------------------------------------------------------------------- helpers
@torch.no_grad()
def redraw(hf: torch.nn.Module, seed: int) -> None:
    """Weights at a scale where every part matters: gains 1 + 0.2 N(0,1), matrices at PyTorch's default Linear
    variance 1/(3 fan_in), the head at 1/fan_in and the embedding N(0, 0.3^2) (logits of order 1-10), SSM vectors
    (A_log, D, dt biases) perturbed around their init. (Matrices at 1/fan_in make Mamba-2's SSM output large and
    its gated RMSNorm's input small on some tokens: transformers' own fp32 logits then differ from its fp64 ones
    by 4e-4, and no 1e-4 comparison means anything; at this scale the two fp32 models agree to ~1e-5.)"""
    g = torch.Generator().manual_seed(seed)
    for name, p in hf.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if name.endswith(("A_log", ".D", "dt_bias", "dt_proj.bias")):
            p.add_(0.3 * noise)
        elif p.dim() == 1:
            p.copy_((0.0 if name.endswith("bias") else 1.0) + 0.2 * noise)
        elif name == "model.embed_tokens.weight":
            p.copy_(0.3 * noise)
        elif name == "lm_head.weight":
            p.copy_(noise / math.sqrt(p.shape[-1]))
        else:  # Linear (out, in), experts (E, out, in), conv (C, 1, K)
            p.copy_(noise / math.sqrt(3 * p.shape[-1]))


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def max_diff(ours: GPT, hf: torch.nn.Module, idx: torch.Tensor) -> float:
    mine, theirs = ours(idx), hf(input_ids=idx).logits
    assert mine.shape == theirs.shape == (B, T, VOCAB)
    assert theirs.abs().max() > 1.0, "logits too small for the comparison to mean anything"
    return (mine - theirs).abs().max().item()


def build_ours(name: str, depth: int, **sizes) -> GPT:
    """Our model from the spec shipped in archscale/layouts/ (`--layout NAME`), at the test's small sizes."""
    assert LAYOUTS[name].source == f"{name}.yaml"
    torch.manual_seed(0)
    return GPT(ModelConfig.from_layout(name, depth, vocab_size=VOCAB, **sizes)).eval()


# ------------------------------------------------------------------------------------------------- Jamba
# The small sizes both sides get; everything else is transformers' JambaConfig default (= Jamba-v0.1: 16 experts,
# top 2, attention at index 4 of every 8, MoE on odd layers, d_state 16, eps 1e-6) and, on our side, the spec's.
JAMBA_SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                   num_hidden_layers=8)


def jamba_hf(seed: int = 0):
    config = transformers.JambaConfig(vocab_size=VOCAB, attn_implementation="eager", **JAMBA_SIZES)
    torch.manual_seed(seed)
    hf = transformers.JambaForCausalLM(config).eval()
    redraw(hf, seed)
    return hf


def jamba_ours(**overrides):
    c = JAMBA_SIZES
    return build_ours("jamba", c["num_hidden_layers"], n_embd=c["hidden_size"], n_head=c["num_attention_heads"],
                      n_query_groups=c["num_key_value_heads"], head_size=c["hidden_size"] // c["num_attention_heads"],
                      intermediate_size=c["intermediate_size"], **overrides)


def test_jamba_spec_at_depth_32_is_jamba_v01():
    """The shipped spec at depth 32 has the sizes and options of transformers' default JambaConfig (Jamba-v0.1)."""
    hf, cfg = transformers.JambaConfig(), ModelConfig.from_layout("jamba", 32)
    mamba, moe = cfg.mixer_options["mamba"], cfg.mixer_options["moe"]
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_query_groups, cfg.head_size, cfg.intermediate_size) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
        hf.hidden_size // hf.num_attention_heads, hf.intermediate_size)
    assert (cfg.norm_eps, cfg.tie_embeddings) == (hf.rms_norm_eps, hf.tie_word_embeddings)
    assert (mamba["d_state"], mamba["d_conv"], mamba["expand"]) == (hf.mamba_d_state, hf.mamba_d_conv,
                                                                     hf.mamba_expand)
    assert (moe["n_experts"], moe["top_k"], moe["aux_coef"]) == (hf.num_experts, hf.num_experts_per_tok,
                                                                 hf.router_aux_loss_coef)
    assert cfg.layer_kinds == [t if t == "mamba" else "attn" for t in hf.layers_block_type]
    assert [k == "moe" for k in cfg.ffn_kinds] == [n > 1 for n in hf.layers_num_experts]
    assert not cfg.uses_rope  # Jamba's attention has no positional encoding


MAMBA1 = ["in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight", "dt_proj.bias",
          "A_log", "D", "out_proj.weight"]


def jamba_mapping(ours: GPT) -> dict[str, tuple[str, slice | None]]:
    cfg = ours.config
    m = shared_mapping(cfg.n_layer)
    for i, (kind, ffn) in enumerate(zip(cfg.layer_kinds, cfg.ffn_kinds)):
        hf, me = f"model.layers.{i}", f"blocks.{i}"
        if kind == "attn":
            m.update(attention_mapping(f"{hf}.self_attn", f"{me}.mixer", cfg))
        else:
            m.update(same_names(f"{hf}.mamba", f"{me}.mixer", MAMBA1))
            for x in ("dt", "b", "c"):
                m[f"{hf}.mamba.{x}_layernorm.weight"] = (f"{me}.mixer.{x}_norm.weight", None)
        if ffn == "moe":
            m[f"{hf}.feed_forward.router.weight"] = (f"{me}.mlp.router.weight", None)
            m[f"{hf}.feed_forward.experts.gate_up_proj"] = (f"{me}.mlp.w1.weight", None)
            m[f"{hf}.feed_forward.experts.down_proj"] = (f"{me}.mlp.w3.weight", None)
        else:
            m.update(mlp_mapping(f"{hf}.feed_forward", f"{me}.mlp", cfg.intermediate_size))
    return m


def test_jamba_matches_transformers():
    hf, ours = jamba_hf(), jamba_ours()
    assert ours.config.layer_kinds == [t if t == "mamba" else "attn" for t in hf.config.layers_block_type]
    assert [k == "moe" for k in ours.config.ffn_kinds] == [n > 1 for n in hf.config.layers_num_experts]
    copy_weights(hf, ours, jamba_mapping(ours))
    diff = max_diff(ours, hf, tokens())
    assert diff <= TOL, f"Jamba: max |logit diff| {diff:.3e} > {TOL}"


@pytest.mark.parametrize("mistake", ["swap_mamba_layers", "swap_k_v", "default_moe_routing", "no_bcdt_norm"])
def test_jamba_negative_controls(mistake):
    """Each plausible mistake moves the logits by > 1e-2 (100x the tolerance): the Mamba mixers of layers 0 and 2
    exchanged, k and v exchanged in the attention layer, ArchScale's MoE gates (renormalised over the top 2)
    instead of Jamba's, or Mamba without the dt/B/C norms (their gains left unused). (Exchanging the B and C norm
    gains is no such mistake: only their elementwise product reaches the output, C_t . (B_s * x_s).)"""
    option = {"default_moe_routing": {"moe": {"routing": "topk_then_softmax"}},
              "no_bcdt_norm": {"mamba": {"bcdt_norm": False}}}.get(mistake, {})
    hf, ours = jamba_hf(), jamba_ours(mixer_options=option)
    mapping, unused = jamba_mapping(ours), set()
    if mistake == "no_bcdt_norm":
        unused = {k for k in mapping if ".mamba." in k and "_layernorm." in k}
        mapping = {k: v for k, v in mapping.items() if k not in unused}
    elif mistake == "swap_k_v":
        ka, kb = "model.layers.4.self_attn.k_proj.weight", "model.layers.4.self_attn.v_proj.weight"
        mapping[ka], mapping[kb] = mapping[kb], mapping[ka]
    elif mistake == "swap_mamba_layers":
        for k in [k for k in mapping if k.startswith("model.layers.0.mamba.")]:
            k2 = k.replace("layers.0.", "layers.2.")
            mapping[k], mapping[k2] = mapping[k2], mapping[k]
    copy_weights(hf, ours, mapping, unused)
    diff = max_diff(ours, hf, tokens())
    assert diff > 1e-2, f"{mistake}: diff {diff:.3e} would have passed"


# ------------------------------------------------------------------------------------------------- Bamba
# Bamba-9B's published config (ibm-ai-platform/Bamba-9B, config.json) where transformers' BambaConfig defaults
# differ from it (d_state 256 there, no attention layers by default).
BAMBA_9B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, attn_layer_indices=[9, 18, 27], mamba_n_heads=128, mamba_d_head=64,
                mamba_d_state=128, mamba_n_groups=1, mamba_chunk_size=256, rms_norm_eps=1e-5)
# The small sizes both sides get (Mamba-2 heads of 16, chunks of 8 so that T=24 spans three); the rest is
# Bamba-9B's (above) or transformers' default (expand 2, d_conv 4, RoPE base 10000 on half of each head) and, on
# our side, the spec's.
BAMBA_SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=224,
                   num_hidden_layers=20, attn_layer_indices=[9, 18], mamba_n_heads=8, mamba_d_head=16,
                   mamba_chunk_size=8)


def bamba_hf(seed: int = 0):
    config = transformers.BambaConfig(vocab_size=VOCAB, attn_implementation="eager", **{**BAMBA_9B, **BAMBA_SIZES})
    torch.manual_seed(seed)
    hf = transformers.BambaForCausalLM(config).eval()
    redraw(hf, seed)
    return hf


def bamba_ours(**overrides):
    c = BAMBA_SIZES
    head = c["hidden_size"] // c["num_attention_heads"]
    sizes = dict(n_embd=c["hidden_size"], n_head=c["num_attention_heads"], n_query_groups=c["num_key_value_heads"],
                 head_size=head, rotary_dim=head // 2, intermediate_size=c["intermediate_size"],
                 mixer_options={"mamba2": {"headdim": c["mamba_d_head"], "chunk_size": c["mamba_chunk_size"]}})
    return build_ours("bamba", c["num_hidden_layers"], **{**sizes, **overrides})


def test_bamba_spec_at_depth_32_is_bamba_9b():
    """The shipped spec at depth 32 has Bamba-9B's sizes, options and attention layers (9, 18, 27)."""
    hf, cfg = transformers.BambaConfig(**BAMBA_9B), ModelConfig.from_layout("bamba", 32)
    m2 = cfg.mixer_options["mamba2"]
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_query_groups, cfg.head_size, cfg.intermediate_size) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
        hf.hidden_size // hf.num_attention_heads, hf.intermediate_size)
    assert (cfg.norm_eps, cfg.tie_embeddings, cfg.rope_base) == (hf.rms_norm_eps, hf.tie_word_embeddings,
                                                                 hf.rope_parameters["rope_theta"])
    assert cfg.rotary_dim == int(cfg.head_size * hf.rope_parameters["partial_rotary_factor"])
    assert (int(m2["expand"] * cfg.n_embd) // m2["headdim"], m2["headdim"], m2["d_state"], m2["ngroups"],
            m2["d_conv"], m2["chunk_size"]) == (hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state,
                                                hf.mamba_n_groups, hf.mamba_d_conv, hf.mamba_chunk_size)
    assert cfg.layer_kinds == ["attn" if t == "full_attention" else "mamba2" for t in hf.layers_block_type]


MAMBA2 = ["in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight"]


def bamba_mapping(ours: GPT) -> dict[str, tuple[str, slice | None]]:
    cfg = ours.config
    m = shared_mapping(cfg.n_layer)
    for i, kind in enumerate(cfg.layer_kinds):
        hf, me = f"model.layers.{i}", f"blocks.{i}"
        if kind == "attn":
            m.update(attention_mapping(f"{hf}.self_attn", f"{me}.mixer", cfg))
        else:
            m.update(same_names(f"{hf}.mamba", f"{me}.mixer", MAMBA2))
        m.update(mlp_mapping(f"{hf}.feed_forward", f"{me}.mlp", cfg.intermediate_size))
    return m


def test_bamba_matches_transformers():
    hf, ours = bamba_hf(), bamba_ours()
    assert ours.config.layer_kinds == ["attn" if t == "full_attention" else "mamba2"
                                       for t in hf.config.layers_block_type]
    assert ours.config.layer_kinds.count("attn") == 2
    copy_weights(hf, ours, bamba_mapping(ours))
    diff = max_diff(ours, hf, tokens())
    assert diff <= TOL, f"Bamba: max |logit diff| {diff:.3e} > {TOL}"


@pytest.mark.parametrize("mistake", ["full_rope", "swap_gate_up", "swap_mamba2_layers"])
def test_bamba_negative_controls(mistake):
    """RoPE on every dim instead of half of each head; gate and up exchanged in one MLP; the Mamba-2 mixers of
    layers 7 and 8 exchanged: each moves the logits by > 1e-2 (100x the tolerance)."""
    hf = bamba_hf()
    ours = bamba_ours(**({"rotary_dim": 0} if mistake == "full_rope" else {}))
    mapping = bamba_mapping(ours)
    if mistake == "swap_gate_up":
        ka, kb = "model.layers.3.feed_forward.gate_proj.weight", "model.layers.3.feed_forward.up_proj.weight"
        mapping[ka], mapping[kb] = mapping[kb], mapping[ka]
    elif mistake == "swap_mamba2_layers":
        for k in [k for k in mapping if k.startswith("model.layers.7.mamba.")]:
            k2 = k.replace("layers.7.", "layers.8.")
            mapping[k], mapping[k2] = mapping[k2], mapping[k]
    copy_weights(hf, ours, mapping)
    diff = max_diff(ours, hf, tokens())
    assert diff > 1e-2, f"{mistake}: diff {diff:.3e} would have passed"


# ----------------------------------------------------------------------------------------- cached decoding
HYBRIDS = {"jamba": (jamba_hf, jamba_ours, jamba_mapping), "bamba": (bamba_hf, bamba_ours, bamba_mapping)}


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_cached_pieces_match_transformers(name):
    """Our cached prefill in pieces (7 tokens, one, 8, the rest: Mamba states, conv tails and K/V carried over) gives
    transformers' full-forward logits within 1e-4 too."""
    from archscale.models.cache import InferenceCache

    make_hf, make_ours, mapping = HYBRIDS[name]
    hf, ours = make_hf(), make_ours()
    copy_weights(hf, ours, mapping(ours))
    idx = tokens()
    with torch.no_grad():
        want = hf(input_ids=idx).logits
        cache = InferenceCache(capacity=T)
        got = torch.cat([ours(idx[:, a:b], cache=cache) for a, b in [(0, 7), (7, 8), (8, 16), (16, T)]], dim=1)
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"{name} (cached): max |logit diff| {diff:.3e} > {TOL}"
