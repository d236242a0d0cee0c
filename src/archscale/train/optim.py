"""AdamW with two parameter groups: matrix-like and vector-like weights.

The group of every parameter is its role, declared by the mixer that owns it (`archscale.models.accounting`):
embeddings, lm_head, norms, biases and SSM vectors are vector-like, hidden Linear weights matrix-like (the same
partition as ArchScale's name rule). Each group carries an `lr_mult` and its own weight decay from the
parametrization's `RoleRule`s (`archscale.scaling_rules`): under SP both get lr_mult 1 and weight_decay0; mu-P++
gives vectors wd 0 and matrices lr_mult d0/d.
"""

from __future__ import annotations

import torch
from torch import nn

from archscale.models.accounting import named_roles
from archscale.scaling_rules import RoleRule


def param_groups(model: nn.Module, matrix: RoleRule, vector: RoleRule) -> list[dict]:
    groups: dict[str, list] = {"matrix": [], "vector": []}
    seen = set()
    for _, p, role in named_roles(model):
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        groups[role.group].append(p)
    out = []
    for key, rule in (("matrix", matrix), ("vector", vector)):
        if groups[key]:
            out.append({"name": key, "params": groups[key], "lr_mult": rule.lr_mult,
                        "weight_decay": rule.weight_decay})
    return out


def build_adamw(groups: list[dict], lr: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    device_types = {p.device.type for g in groups for p in g["params"]}
    # The fused kernel is the fastest path on CUDA and on CPU alike (torch >= 2.4).
    fused = device_types <= {"cuda", "cpu"}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_mult", 1.0)
