"""AdamW with two parameter groups: matrix-like and vector-like weights.

The split follows the seed: a parameter is vector-like when its name lacks "weight" or contains one of
conv1d, wte, lm_head, norm, ln, layernorm (embeddings, head, norms, biases, SSM vectors). Each group carries an
`lr_mult` and its own weight decay; under SP both groups get lr_mult 1 and wd = weight_decay0 (the mu-P++ rules
give vectors wd 0 and matrices lr_mult d0/d).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

VECTOR_NAME_PARTS = ("conv1d", "wte", "lm_head", "norm", "ln", "layernorm")


def is_vector_like(name: str) -> bool:
    return "weight" not in name or any(part in name for part in VECTOR_NAME_PARTS)


@dataclass
class GroupRule:
    lr_mult: float = 1.0
    weight_decay: float = 0.1


def param_groups(model: nn.Module, matrix: GroupRule, vector: GroupRule) -> list[dict]:
    groups = {"matrix": [], "vector": []}
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        groups["vector" if is_vector_like(name) else "matrix"].append(p)
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
