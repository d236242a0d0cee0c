"""Export a Transformer++ `GPT` to Hugging Face `transformers.LlamaForCausalLM`.

Our Transformer++ is a Llama: pre-norm RMSNorm, half-rotation RoPE, GQA, SwiGLU. Only the parameter layout
differs:

    ours                                   LlamaForCausalLM
    wte.weight                             model.embed_tokens.weight
    blocks.i.norm_1.weight                 model.layers.i.input_layernorm.weight
    blocks.i.mixer.attn  rows [q | k | v]  model.layers.i.self_attn.{q,k,v}_proj
    blocks.i.mixer.proj                    model.layers.i.self_attn.o_proj
    blocks.i.norm_2.weight                 model.layers.i.post_attention_layernorm.weight
    blocks.i.mlp.w1  rows [gate | input]   model.layers.i.mlp.{gate,up}_proj
    blocks.i.mlp.w3                        model.layers.i.mlp.down_proj
    ln_f.weight                            model.norm.weight
    lm_head.weight                         lm_head.weight (tied to embed_tokens when tie_embeddings)

HF's vocab_size is our `vocab_size`: the padding rows of the embedding and lm_head (never a real token; our
`GPT` slices its logits to `vocab_size`) are dropped, so the two softmaxes run over the same tokens. The mu-P /
mu-P++ multipliers are folded exactly into the weights: `attn_scale_mult` into the query rows (softmax scale
mult/sqrt(hd) = 1/sqrt(hd) on q * mult; RoPE is linear, so scaling before it is the same), `residual_scale` into
the two output projections of every block (o_proj, down_proj), `logit_scale` into the final norm's gain (not the
lm_head, which may be the tied embedding). `from_llama_state_dict` is the inverse (with the multipliers then
1.0). Configs Llama cannot express (other mixers, LayerNorm, q/v-only biases, NoPE, RoPE scaling) are refused
here; `archscale export --format hf` sends them to the archscale wrapper (`export/hf_model.py`) instead.
`transformers` is an optional extra (`pip install archscale[hf]`) and is imported only inside these functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from archscale.config import ModelConfig
from archscale.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from transformers import LlamaConfig, LlamaForCausalLM

_MULTIPLIERS = ("residual_scale", "logit_scale", "attn_scale_mult")


def llama_incompatibility(cfg: ModelConfig) -> str | None:
    """Why `cfg` cannot be a `LlamaForCausalLM` (None when it can)."""
    if cfg.arch != "transformer" or set(cfg.layer_kinds) != {"attn"}:
        return f"only the Transformer++ ('transformer') is a Llama, not {cfg.arch!r}"
    per_layer = lambda name: any(layer.get(name, getattr(cfg, name)) for layer in cfg.layers)  # noqa: E731
    checks = {"norm_class": cfg.norm_class != "rmsnorm", "attn_bias": cfg.attn_bias, "nope": per_layer("nope"),
              "use_da": per_layer("use_da"), "rope_scaling": cfg.rope_scaling != 1.0,
              "rotary_dim": cfg.rotary_dim not in (0, cfg.head_size),
              "ffn_kind": set(cfg.ffn_kinds) != {"mlp"}}  # a mixture of experts is not a Llama MLP
    odd = [f"{k}={getattr(cfg, k)}" for k, bad in checks.items() if bad]
    return f"Llama has no equivalent of {', '.join(odd)}" if odd else None


def _check_exportable(cfg: ModelConfig) -> None:
    why = llama_incompatibility(cfg)
    if why:
        raise UserError(f"model config {cfg.name}: cannot be exported to Llama: {why}")


def _import_transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise UserError("exporting to Hugging Face needs the optional 'transformers' package: "
                        "pip install 'archscale[hf]'") from e
    return transformers


def to_llama_config(cfg: ModelConfig, **overrides: Any) -> "LlamaConfig":
    """The `transformers.LlamaConfig` with the same shapes and numerics as `cfg`.

    `overrides` are passed through to `LlamaConfig` (e.g. `bos_token_id`, `eos_token_id` for your tokenizer,
    `attn_implementation`).
    """
    _check_exportable(cfg)
    transformers = _import_transformers()
    kwargs: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.n_embd,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_query_groups,
        head_dim=cfg.head_size,
        hidden_act="silu",
        max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=float(cfg.rope_base),  # transformers 5 folds this into rope_parameters
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=cfg.bias,  # our `bias` adds biases to attn, proj, w1 and w3: all of Llama's linears
        mlp_bias=cfg.bias,
        initializer_range=cfg.init_std,
    )
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


def _linear(sd: dict[str, torch.Tensor], prefix: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    sd[f"{prefix}.weight"] = weight
    if bias is not None:
        sd[f"{prefix}.bias"] = bias


def to_llama_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our `GPT`'s weights under `LlamaForCausalLM` names (detached copies, contiguous, same dtype/device),
    with the mu-P multipliers folded in and the vocabulary padding rows dropped.

    Tied embeddings give one tensor stored under both `model.embed_tokens.weight` and `lm_head.weight`.
    """
    cfg: ModelConfig = model.config
    _check_exportable(cfg)
    H, G, hd, V = cfg.n_head, cfg.n_query_groups, cfg.head_size, cfg.vocab_size
    sizes = (H * hd, G * hd, G * hd)
    res = cfg.residual_scale

    def copy(t: torch.Tensor | None, scale: float = 1.0) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.detach().clone(memory_format=torch.contiguous_format)
        return t if scale == 1.0 else t.mul_(scale)

    def split(t: torch.Tensor | None, parts: tuple[int, ...]) -> tuple[torch.Tensor | None, ...]:
        return (None,) * len(parts) if t is None else tuple(copy(p) for p in t.split(parts, dim=0))

    sd: dict[str, torch.Tensor] = {}
    embed = copy(model.wte.weight[:V])
    sd["model.embed_tokens.weight"] = embed
    for i, block in enumerate(model.blocks):
        p = f"model.layers.{i}"
        attn, mlp = block.mixer, block.mlp
        sd[f"{p}.input_layernorm.weight"] = copy(block.norm_1.weight)
        qw, kw, vw = split(attn.attn.weight, sizes)
        qb, kb, vb = split(attn.attn.bias, sizes)
        _linear(sd, f"{p}.self_attn.q_proj", qw.mul_(cfg.attn_scale_mult),
                None if qb is None else qb.mul_(cfg.attn_scale_mult))
        _linear(sd, f"{p}.self_attn.k_proj", kw, kb)
        _linear(sd, f"{p}.self_attn.v_proj", vw, vb)
        _linear(sd, f"{p}.self_attn.o_proj", copy(attn.proj.weight, res), copy(attn.proj.bias, res))
        sd[f"{p}.post_attention_layernorm.weight"] = copy(block.norm_2.weight)
        halves = (mlp.hidden, mlp.hidden)
        gw, uw = split(mlp.w1.weight, halves)
        gb, ub = split(mlp.w1.bias, halves)
        _linear(sd, f"{p}.mlp.gate_proj", gw, gb)
        _linear(sd, f"{p}.mlp.up_proj", uw, ub)
        _linear(sd, f"{p}.mlp.down_proj", copy(mlp.w3.weight, res), copy(mlp.w3.bias, res))
    sd["model.norm.weight"] = copy(model.ln_f.weight, cfg.logit_scale)
    sd["lm_head.weight"] = embed if cfg.tie_embeddings else copy(model.lm_head.weight[:V])
    return sd


def from_llama_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of `to_llama_state_dict`: `GPT` names for `cfg` (whose multipliers must be 1.0: they are in
    the weights now); the vocabulary padding rows come back as zeros. Raises KeyError for a missing tensor."""
    if any(getattr(cfg, m) != 1.0 for m in _MULTIPLIERS):
        raise ValueError("from_llama_state_dict wants a config with the multipliers folded (all 1.0)")
    out: dict[str, torch.Tensor] = {}

    def pad_vocab(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(cfg.padded_vocab_size - t.shape[0], t.shape[1])]) \
            if t.shape[0] < cfg.padded_vocab_size else t

    def cat(names: list[str], what: str) -> torch.Tensor | None:
        keys = [f"{n}.{what}" for n in names]
        return torch.cat([sd[k] for k in keys]) if all(k in sd for k in keys) else None

    out["wte.weight"] = pad_vocab(sd["model.embed_tokens.weight"])
    for i in range(cfg.n_layer):
        p, q = f"model.layers.{i}", f"blocks.{i}"
        qkv = [f"{p}.self_attn.{n}_proj" for n in "qkv"]
        gate_up = [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"]
        pairs = {f"{q}.norm_1.weight": sd[f"{p}.input_layernorm.weight"],
                 f"{q}.mixer.attn.weight": cat(qkv, "weight"), f"{q}.mixer.attn.bias": cat(qkv, "bias"),
                 f"{q}.mixer.proj.weight": sd[f"{p}.self_attn.o_proj.weight"],
                 f"{q}.mixer.proj.bias": sd.get(f"{p}.self_attn.o_proj.bias"),
                 f"{q}.norm_2.weight": sd[f"{p}.post_attention_layernorm.weight"],
                 f"{q}.mlp.w1.weight": cat(gate_up, "weight"), f"{q}.mlp.w1.bias": cat(gate_up, "bias"),
                 f"{q}.mlp.w3.weight": sd[f"{p}.mlp.down_proj.weight"],
                 f"{q}.mlp.w3.bias": sd.get(f"{p}.mlp.down_proj.bias")}
        out.update({k: v for k, v in pairs.items() if v is not None})
    out["ln_f.weight"] = sd["model.norm.weight"]
    out["lm_head.weight"] = out["wte.weight"] if cfg.tie_embeddings else pad_vocab(sd["lm_head.weight"])
    return out


def to_llama_model(model: nn.Module, dtype: torch.dtype = torch.float32, **config_overrides: Any) -> "LlamaForCausalLM":
    """A `LlamaForCausalLM` holding `model`'s weights (strict load: every key must match), in eval mode.

    Save it with `.save_pretrained(path)`; `config_overrides` go to `to_llama_config`.
    """
    transformers = _import_transformers()
    hf_config = to_llama_config(model.config, **config_overrides)
    device = next(model.parameters()).device
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_config)
    state = {k: v.to(dtype) for k, v in to_llama_state_dict(model).items()}
    hf.load_state_dict(state, strict=True, assign=True)
    if model.config.tie_embeddings:
        hf.tie_weights()
    # Non-persistent buffers (RoPE inv_freq) were created on meta: rebuild the rotary module for real.
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_config)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:  # pragma: no cover - would mean a transformers version added state we do not fill in
        raise RuntimeError(f"LlamaForCausalLM tensors left uninitialised after loading: {left}")
    return hf.to(device).eval()
