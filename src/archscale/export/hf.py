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

HF's vocab_size is our *padded* vocab size (the extra rows are exported as they are); our `GPT` slices its
logits to `vocab_size`, so compare or decode on the first `vocab_size` columns only. The mu-P multipliers
(`residual_scale`, `logit_scale`, `attn_scale_mult`) have no Llama equivalent, so configs that use them are
refused rather than exported wrong. `transformers` is an optional extra (`pip install archscale[hf]`) and is
imported only inside these functions.
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


def _check_exportable(cfg: ModelConfig) -> None:
    if cfg.arch != "transformer":
        raise UserError(f"model config {cfg.name}: only the Transformer++ ('transformer') can be exported to "
                        f"Llama, not {cfg.arch!r}")
    odd = [f"{name}={getattr(cfg, name)}" for name in _MULTIPLIERS if getattr(cfg, name) != 1.0]
    if odd:
        raise UserError(f"model config {cfg.name}: Llama cannot represent the multipliers {', '.join(odd)}; "
                        "only models trained with all of residual_scale, logit_scale and attn_scale_mult equal "
                        "to 1.0 (standard parametrization) can be exported")


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
        vocab_size=cfg.padded_vocab_size,
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
    """Our `GPT`'s weights under `LlamaForCausalLM` names (detached copies, contiguous, same dtype/device).

    Tied embeddings give one tensor stored under both `model.embed_tokens.weight` and `lm_head.weight`.
    """
    cfg: ModelConfig = model.config
    _check_exportable(cfg)
    H, G, hd = cfg.n_head, cfg.n_query_groups, cfg.head_size
    sizes = (H * hd, G * hd, G * hd)

    def copy(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone(memory_format=torch.contiguous_format)

    def split(t: torch.Tensor | None, parts: tuple[int, ...]) -> tuple[torch.Tensor | None, ...]:
        if t is None:
            return (None,) * len(parts)
        return tuple(copy(p) for p in t.split(parts, dim=0))

    sd: dict[str, torch.Tensor] = {}
    embed = copy(model.wte.weight)
    sd["model.embed_tokens.weight"] = embed
    for i, block in enumerate(model.blocks):
        p = f"model.layers.{i}"
        attn, mlp = block.mixer, block.mlp
        sd[f"{p}.input_layernorm.weight"] = copy(block.norm_1.weight)
        qw, kw, vw = split(attn.attn.weight, sizes)
        qb, kb, vb = split(attn.attn.bias, sizes)
        _linear(sd, f"{p}.self_attn.q_proj", qw, qb)
        _linear(sd, f"{p}.self_attn.k_proj", kw, kb)
        _linear(sd, f"{p}.self_attn.v_proj", vw, vb)
        _linear(sd, f"{p}.self_attn.o_proj", copy(attn.proj.weight),
                None if attn.proj.bias is None else copy(attn.proj.bias))
        sd[f"{p}.post_attention_layernorm.weight"] = copy(block.norm_2.weight)
        halves = (mlp.hidden, mlp.hidden)
        gw, uw = split(mlp.w1.weight, halves)
        gb, ub = split(mlp.w1.bias, halves)
        _linear(sd, f"{p}.mlp.gate_proj", gw, gb)
        _linear(sd, f"{p}.mlp.up_proj", uw, ub)
        _linear(sd, f"{p}.mlp.down_proj", copy(mlp.w3.weight),
                None if mlp.w3.bias is None else copy(mlp.w3.bias))
    sd["model.norm.weight"] = copy(model.ln_f.weight)
    sd["lm_head.weight"] = embed if cfg.tie_embeddings else copy(model.lm_head.weight)
    return sd


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
