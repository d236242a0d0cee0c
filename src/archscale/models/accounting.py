"""What the model's parameters are, read from the mixer registry: the role of every parameter (which drives
init, optimizer groups and weight decay), the init stds the dry run reports, FLOPs per token and counts.

Roles of the parameters outside blocks' mixers and feed-forwards: the token embedding and lm_head are vector-like
with their own init (`GPT.reset_parameters`), norms are vector-like.
"""

from __future__ import annotations

import math
import re
from typing import Iterator

import torch
from torch import nn

from archscale.config import ModelConfig
from archscale.errors import UserError
from archscale.models.mixers.base import VECTOR, MixerSpec, Role, spec_for

EMBEDDING = Role("vector", "own")  # wte and lm_head: initialised by GPT.reset_parameters itself
_WRAPPERS = re.compile(r"(^|\.)(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module|module)(?=\.)")
_BLOCK = re.compile(r"blocks\.(\d+)\.(norm_1|norm_2|mixer|mlp)\.(.+)")


def clean_name(name: str) -> str:
    """A parameter name without the prefixes of compile / activation-checkpoint / DDP wrappers."""
    return _WRAPPERS.sub("", name).lstrip(".")


def owner(config: ModelConfig, name: str) -> tuple[MixerSpec | None, str]:
    """(the spec owning parameter `name`, its name relative to the MixerSpec's module); (None, name) outside blocks."""
    m = _BLOCK.fullmatch(clean_name(name))
    if m is None or m[2] in ("norm_1", "norm_2"):
        return None, clean_name(name)
    i = int(m[1])
    spec = spec_for(config.layer_kinds[i]) if m[2] == "mixer" else spec_for(config.ffn_kinds[i], "ffn")
    return spec, m[3]


def role_of(config: ModelConfig, name: str) -> Role:
    spec, rel = owner(config, name)
    if spec is not None:
        role = spec.role_of(rel)
        if role is None:
            raise UserError(f"parameter {clean_name(name)!r} has no role: add a pattern matching {rel!r} to the "
                            f"roles of mixer {spec.name!r}")
        return role
    if rel in ("wte.weight", "lm_head.weight"):
        return EMBEDDING
    if rel.startswith(("ln_f.", "blocks.")):  # final and block norms
        return VECTOR
    raise UserError(f"parameter {rel!r} has no role")


def named_roles(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, Role]]:
    """(name, parameter, role) of every distinct parameter (a tied lm_head is listed once, as wte)."""
    config = model.config if hasattr(model, "config") else None
    for name, p in model.named_parameters():
        yield name, p, role_of(config, name)


@torch.no_grad()
def apply_init(model: nn.Module, config: ModelConfig) -> None:
    """The parametrization's init of every "scheme" / "output" / "zero" parameter, after the modules' own inits.

    sp:  N(0, init_std) x w_init_mult; "output" further / sqrt(2L) (GPT-2).
    mup: the module's own init (PyTorch's default for a Linear) x w_init_mult; "output" / sqrt(2L) only with tied
         embeddings (ArchScale's `_init_weights` applies the GPT-2 scaling whenever it does not zero lm_head).
    """
    residual = 1.0 / math.sqrt(2 * config.n_layer)
    for name, p, role in named_roles(model):
        if role.init == "zero":
            p.zero_()
        elif role.init in ("scheme", "output"):
            if config.init_scheme == "sp":
                p.normal_(0.0, config.init_std)
            if config.w_init_mult != 1.0:
                p.mul_(config.w_init_mult)
            if role.init == "output" and (config.init_scheme == "sp" or config.tie_embeddings):
                p.mul_(residual)


def init_stds(model: nn.Module) -> dict[str, float]:
    """Std each Linear weight role starts with (what `GPT.reset_parameters` draws, in closed form), keyed
    "<mixer>.<parameter>", plus wte and lm_head. Under mup a weight keeps its module's init: U(+-1/sqrt(fan_in))
    for a Linear (std 1/sqrt(3 fan_in)), or the mixer's own (`MixerSpec.mup_init_std`). Works on the meta device."""
    cfg = model.config
    residual = 1.0 / math.sqrt(2 * cfg.n_layer)
    out: dict[str, float] = {}
    for name, p, role in named_roles(model):
        spec, rel = owner(cfg, name)
        if spec is None or role.init not in ("scheme", "output"):
            continue
        if cfg.init_scheme == "sp":
            std = cfg.init_std
        else:
            own = spec.mup_init_std(cfg, rel)
            std = own if own is not None else 1.0 / math.sqrt(3 * p.shape[1])
        std *= cfg.w_init_mult
        if role.init == "output" and (cfg.init_scheme == "sp" or cfg.tie_embeddings):
            std *= residual
        out.setdefault(f"{spec.name}.{rel}", std)
    wte = cfg.init_std if cfg.tie_embeddings else cfg.embed_init_std
    head = wte if cfg.tie_embeddings else (0.0 if cfg.init_scheme == "mup" else cfg.init_std * cfg.w_init_mult)
    return {"wte": wte, "lm_head": head, **out}


def flops_breakdown(model: nn.Module, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token by term: "matmul" = 2 x every matmul weight a token uses (scheme/output roles,
    lm_head included, a mixture of experts' k of E experts; the embedding is a lookup), plus each layer's mixer
    terms (attention scores, scans, convs; a mixture of experts' router)."""
    cfg = model.config
    matmul = cfg.padded_vocab_size * cfg.n_embd
    for name, p, role in named_roles(model):
        if role.init in ("scheme", "output"):
            matmul += p.numel() * active_fraction(cfg, name)
    terms = {"matmul": 2.0 * matmul}
    for i in range(cfg.n_layer):
        layer = cfg.layer_config(i)  # the layer's own options (its window, differential attention, ...)
        for slot, kind in (("mixer", cfg.layer_kinds[i]), ("ffn", cfg.ffn_kinds[i])):
            for term, value in spec_for(kind, slot).flops(layer, kind, seq_len).items():
                terms[term] = terms.get(term, 0.0) + value
    return terms


def active_fraction(config: ModelConfig, name: str) -> float:
    """The fraction of parameter `name` one token uses (`MixerSpec.active`; 1 outside mixers)."""
    spec, rel = owner(config, name)
    return 1.0 if spec is None else spec.active(config, rel)


def num_params(model: nn.Module, non_embedding: bool = True, active: bool = False) -> int:
    """Parameters; non_embedding excludes the token embedding and lm_head (tied or not); `active` counts only
    what one token uses (a mixture of experts: its k of E routed experts)."""
    total = 0.0
    for name, p in model.named_parameters():  # tied weights are listed once
        if non_embedding and clean_name(name) in ("wte.weight", "lm_head.weight"):
            continue
        total += p.numel() * (active_fraction(model.config, name) if active else 1.0)
    return round(total)
