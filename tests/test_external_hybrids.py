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

from archscale.config import ARCHITECTURES, ArchSpec, ModelConfig  # noqa: E402
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


def build_ours(monkeypatch, name: str, layout, ffn_layout, **cfg) -> GPT:
    """TEMPORARY until the layout language lands: a test-local ArchSpec."""
    monkeypatch.setitem(ARCHITECTURES, name, ArchSpec(16, name, layout, lambda ar: 0.0, ffn_layout=ffn_layout))
    config = ModelConfig(name=name, arch=name, **cfg)
    torch.manual_seed(0)
    return GPT(config).eval()


# ------------------------------------------------------------------------------------------------- Jamba
JAMBA = dict(n_layer=8, n_embd=64, n_head=4, n_query_groups=2, head_size=16, intermediate_size=96, n_experts=4,
             d_state=8)


def jamba_hf(seed: int = 0, **overrides):
    c = JAMBA
    config = transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=c["n_embd"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["n_layer"], num_attention_heads=c["n_head"], num_key_value_heads=c["n_query_groups"],
        num_experts=c["n_experts"], num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=8, attn_layer_offset=4, mamba_d_state=c["d_state"], mamba_d_conv=4, mamba_expand=2,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="eager", **overrides)
    torch.manual_seed(seed)
    hf = transformers.JambaForCausalLM(config).eval()
    redraw(hf, seed)
    return hf


def jamba_ours(monkeypatch, **mamba):
    c = JAMBA
    return build_ours(
        monkeypatch, "jambatest", lambda L: ["attn" if i % 8 == 4 else "mamba" for i in range(L)],
        lambda L: ["moe" if i % 2 == 1 else "mlp" for i in range(L)],
        n_layer=c["n_layer"], n_embd=c["n_embd"], n_head=c["n_head"], n_query_groups=c["n_query_groups"],
        head_size=c["head_size"], intermediate_size=c["intermediate_size"], vocab_size=VOCAB, norm_eps=1e-6,
        nope=True, mixer_options={"mamba": {"d_state": c["d_state"], "bcdt_norm": True, **mamba},
                                  "moe": {"n_experts": c["n_experts"], "top_k": 2, "routing": "softmax_then_topk",
                                          "fine_grained": False}})


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


def test_jamba_matches_transformers(monkeypatch):
    hf, ours = jamba_hf(), jamba_ours(monkeypatch)
    assert ours.config.layer_kinds == [t if t == "mamba" else "attn" for t in hf.config.layers_block_type]
    assert [k == "moe" for k in ours.config.ffn_kinds] == [n > 1 for n in hf.config.layers_num_experts]
    copy_weights(hf, ours, jamba_mapping(ours))
    diff = max_diff(ours, hf, tokens())
    assert diff <= TOL, f"Jamba: max |logit diff| {diff:.3e} > {TOL}"


@pytest.mark.parametrize("mistake", ["swap_mamba_layers", "swap_k_v", "default_moe_routing", "no_bcdt_norm"])
def test_jamba_negative_controls(monkeypatch, mistake):
    """Each plausible mistake moves the logits by > 1e-2 (100x the tolerance): the Mamba mixers of layers 0 and 2
    exchanged, k and v exchanged in the attention layer, ArchScale's MoE gates (renormalised over the top 2)
    instead of Jamba's, or Mamba without the dt/B/C norms (their gains left unused). (Exchanging the B and C norm
    gains is no such mistake: only their elementwise product reaches the output, C_t . (B_s * x_s).)"""
    hf = jamba_hf()
    ours = jamba_ours(monkeypatch, bcdt_norm=mistake != "no_bcdt_norm")
    mapping, unused = jamba_mapping(ours), set()
    if mistake == "no_bcdt_norm":
        unused = {k for k in mapping if ".mamba." in k and "_layernorm." in k}
        mapping = {k: v for k, v in mapping.items() if k not in unused}
    elif mistake == "default_moe_routing":
        for block in ours.blocks:
            if block.ffn_kind == "moe":
                block.mlp.routing = "topk_then_softmax"
    elif mistake == "swap_k_v":
        ka, kb = "model.layers.4.self_attn.k_proj.weight", "model.layers.4.self_attn.v_proj.weight"
        mapping[ka], mapping[kb] = mapping[kb], mapping[ka]
    else:
        for k in [k for k in mapping if k.startswith("model.layers.0.mamba.")]:
            k2 = k.replace("layers.0.", "layers.2.")
            mapping[k], mapping[k2] = mapping[k2], mapping[k]
    copy_weights(hf, ours, mapping, unused)
    diff = max_diff(ours, hf, tokens())
    assert diff > 1e-2, f"{mistake}: diff {diff:.3e} would have passed"


# ------------------------------------------------------------------------------------------------- Bamba
BAMBA = dict(n_layer=20, n_embd=64, n_head=4, n_query_groups=2, head_size=16, intermediate_size=224, d_state=16,
             headdim=16, chunk_size=8)


def bamba_hf(seed: int = 0, **overrides):
    c = BAMBA
    config = transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=c["n_embd"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["n_layer"], num_attention_heads=c["n_head"], num_key_value_heads=c["n_query_groups"],
        attn_layer_indices=[i for i in range(c["n_layer"]) if i % 9 == 0 and i], mamba_expand=2,
        mamba_n_heads=2 * c["n_embd"] // c["headdim"], mamba_d_head=c["headdim"], mamba_n_groups=1,
        mamba_d_state=c["d_state"], mamba_d_conv=4, mamba_chunk_size=c["chunk_size"], rms_norm_eps=1e-5,
        tie_word_embeddings=False, attn_implementation="eager", **overrides)
    torch.manual_seed(seed)
    hf = transformers.BambaForCausalLM(config).eval()
    redraw(hf, seed)
    return hf


def bamba_ours(monkeypatch, **overrides):
    c = BAMBA
    cfg = dict(n_layer=c["n_layer"], n_embd=c["n_embd"], n_head=c["n_head"], n_query_groups=c["n_query_groups"],
               head_size=c["head_size"], intermediate_size=c["intermediate_size"], vocab_size=VOCAB, norm_eps=1e-5,
               rotary_dim=c["head_size"] // 2,
               mixer_options={"mamba2": {"d_state": c["d_state"], "headdim": c["headdim"], "expand": 2.0,
                                         "chunk_size": c["chunk_size"]}})
    cfg.update(overrides)
    return build_ours(monkeypatch, "bambatest", lambda L: ["attn" if i % 9 == 0 and i else "mamba2" for i in range(L)],
                      lambda L: ["mlp"] * L, **cfg)


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


def test_bamba_matches_transformers(monkeypatch):
    hf, ours = bamba_hf(), bamba_ours(monkeypatch)
    assert ours.config.layer_kinds == ["attn" if t == "full_attention" else "mamba2"
                                       for t in hf.config.layers_block_type]
    assert ours.config.layer_kinds.count("attn") == 2
    copy_weights(hf, ours, bamba_mapping(ours))
    diff = max_diff(ours, hf, tokens())
    assert diff <= TOL, f"Bamba: max |logit diff| {diff:.3e} > {TOL}"


@pytest.mark.parametrize("mistake", ["full_rope", "swap_gate_up", "swap_mamba2_layers"])
def test_bamba_negative_controls(monkeypatch, mistake):
    """RoPE on every dim instead of half of each head; gate and up exchanged in one MLP; the Mamba-2 mixers of
    layers 7 and 8 exchanged: each moves the logits by > 1e-2 (100x the tolerance)."""
    hf = bamba_hf()
    ours = bamba_ours(monkeypatch, **({"rotary_dim": 0} if mistake == "full_rope" else {}))
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
def test_cached_pieces_match_transformers(monkeypatch, name):
    """Our cached prefill in pieces (7 tokens, one, 8, the rest: Mamba states, conv tails and K/V carried over) gives
    transformers' full-forward logits within 1e-4 too."""
    from archscale.models.cache import InferenceCache

    make_hf, make_ours, mapping = HYBRIDS[name]
    hf, ours = make_hf(), make_ours(monkeypatch)
    copy_weights(hf, ours, mapping(ours))
    idx = tokens()
    with torch.no_grad():
        want = hf(input_ids=idx).logits
        cache = InferenceCache(capacity=T)
        got = torch.cat([ours(idx[:, a:b], cache=cache) for a, b in [(0, 7), (7, 8), (8, 16), (16, T)]], dim=1)
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"{name} (cached): max |logit diff| {diff:.3e} > {TOL}"
