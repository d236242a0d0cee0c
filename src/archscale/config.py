"""Model configuration: one dataclass, and the registry that turns "{arch}_d{depth}" into sizes.

Sizes follow ArchScale (spec §3): n_layer = depth, n_embd = ar * depth, n_head = depth, n_query_groups =
max(1, depth // 4), head_size = 128, SwiGLU hidden = 4 * n_embd. Only the Transformer++ is registered here so
far; the architecture-zoo work adds the hybrids to `ARCHITECTURES`.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from archscale.errors import UserError


@dataclass(frozen=True)
class ArchSpec:
    """What differs between architectures at the same depth."""

    ar: int  # aspect ratio: n_embd = ar * depth
    description: str


ARCHITECTURES: dict[str, ArchSpec] = {
    "transformer": ArchSpec(ar=128, description="Transformer++: pre-norm RMSNorm, RoPE, GQA, SwiGLU, no biases"),
}


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - n % k


@dataclass
class ModelConfig:
    name: str = "transformer_d8"
    arch: str = "transformer"
    n_layer: int = 8
    n_embd: int = 1024
    n_head: int = 8
    n_query_groups: int = 2
    head_size: int = 128
    intermediate_size: int = 4096
    vocab_size: int = 32000
    padding_multiple: int = 64
    padded_vocab_size: int = 0  # 0: vocab_size rounded up to padding_multiple
    block_size: int = 4096  # training context length (RoPE cache is built lazily beyond it)
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    bias: bool = False
    # Parametrization multipliers (1.0 under SP; the mu-P++ rules set them).
    residual_scale: float = 1.0  # each block's branch output is multiplied by this (mu-P++: 1/sqrt(2L))
    logit_scale: float = 1.0  # final hidden state is multiplied by this before lm_head (mu-P: d0/L)
    attn_scale_mult: float = 1.0  # softmax scale = attn_scale_mult / sqrt(head_size)
    # Init (SP defaults from the seed: N(0, 0.02) linears, GPT-2 1/sqrt(2L) on output projections).
    init_std: float = 0.02
    embed_init_std: float = 1e-4
    init_scheme: str = "sp"  # "sp" | "mup" (kaiming-uniform linears, zero lm_head); set by the scaling rules
    w_init_mult: float = 1.0  # mup scheme: Linear weights are PyTorch's default init times this (w_init0)

    def __post_init__(self) -> None:
        if self.padded_vocab_size <= 0:
            self.padded_vocab_size = find_multiple(self.vocab_size, self.padding_multiple)
        self.validate()

    def validate(self) -> None:
        problems = []
        for name in ("n_layer", "n_embd", "n_head", "n_query_groups", "head_size", "intermediate_size",
                     "vocab_size", "block_size"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive (got {getattr(self, name)})")
        if self.n_query_groups > 0 and self.n_head % max(self.n_query_groups, 1) != 0:
            problems.append(f"n_head={self.n_head} must be a multiple of n_query_groups={self.n_query_groups}")
        if self.head_size % 2:
            problems.append(f"head_size={self.head_size} must be even for RoPE")
        if self.padded_vocab_size < self.vocab_size:
            problems.append("padded_vocab_size must be >= vocab_size")
        if self.init_scheme not in ("sp", "mup"):
            problems.append(f"init_scheme must be 'sp' or 'mup' (got {self.init_scheme!r})")
        if self.arch not in ARCHITECTURES:
            problems.append(f"unknown architecture {self.arch!r}; choose one of {sorted(ARCHITECTURES)}")
        if problems:
            raise UserError(f"model config {self.name}: " + "; ".join(problems))

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "ModelConfig":
        """`ModelConfig.from_name("transformer_d8", vocab_size=8192)`."""
        m = re.fullmatch(r"(?P<arch>[a-z0-9]+)_d(?P<depth>\d+)", name)
        if not m:
            raise UserError(f"model name {name!r} must look like '<arch>_d<depth>', e.g. 'transformer_d8'")
        return cls.from_arch(m["arch"], int(m["depth"]), **overrides)

    @classmethod
    def from_arch(cls, arch: str, depth: int, ar: int | None = None, **overrides: Any) -> "ModelConfig":
        """Sizes from depth (spec §3). `ar` overrides the architecture's aspect ratio: width = ar * depth with
        n_head = depth heads, so head_size = ar (128 at the registry's ar for the Transformer)."""
        if arch not in ARCHITECTURES:
            raise UserError(f"unknown --train_model {arch!r}; choose one of: {', '.join(sorted(ARCHITECTURES))}")
        if depth < 1:
            raise UserError(f"--depth must be >= 1 (got {depth})")
        spec = ARCHITECTURES[arch]
        head_size = 128
        if ar is None:
            ar = spec.ar
        else:
            if ar < 2 or ar % 2:
                raise UserError(f"--ar must be an even number >= 2 (got {ar}): head_size = ar must be even for RoPE")
            head_size = ar
        base = dict(
            name=f"{arch}_d{depth}", arch=arch, n_layer=depth, n_embd=ar * depth, n_head=depth,
            n_query_groups=max(1, depth // 4), head_size=head_size, intermediate_size=4 * ar * depth,
        )
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise UserError(f"unknown ModelConfig field(s): {', '.join(sorted(unknown))}")
        base.update(overrides)
        if "intermediate_size" not in overrides and "n_embd" in overrides:
            base["intermediate_size"] = 4 * base["n_embd"]
        return cls(**base)

    def replace(self, **changes: Any) -> "ModelConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def init_stds(self) -> dict[str, float]:
        """Standard deviation each weight role starts with under `init_scheme` (closed form; what
        `GPT.reset_parameters` draws). Norm weights start at 1 and are not listed.

        mup linears are U(+-w/sqrt(fan_in)) (PyTorch's kaiming-uniform, a=sqrt(5)), so std = w/sqrt(3 fan_in).
        """
        d, hd, L = self.n_embd, self.head_size, self.n_layer
        if self.init_scheme == "mup":
            def lin(fan_in: int) -> float:
                return self.w_init_mult / math.sqrt(3 * fan_in)
            out = {"attn.qkv": lin(d), "attn.proj": lin(self.n_head * hd), "mlp.w1": lin(d),
                   "mlp.w3": lin(self.intermediate_size)}
            head = 0.0
        else:
            gpt2 = self.init_std / math.sqrt(2 * L)
            out = {"attn.qkv": self.init_std, "attn.proj": gpt2, "mlp.w1": self.init_std, "mlp.w3": gpt2}
            head = self.init_std
        wte = self.init_std if self.tie_embeddings else self.embed_init_std
        return {"wte": wte, "lm_head": wte if self.tie_embeddings else head, **out}

    def non_embedding_params(self) -> int:
        """Closed-form count (norms included, token embedding and lm_head excluded)."""
        d, hd = self.n_embd, self.head_size
        qkv = d * (self.n_head + 2 * self.n_query_groups) * hd
        proj = self.n_head * hd * d
        mlp = d * 2 * self.intermediate_size + self.intermediate_size * d
        norms = 2 * d
        biases = 0
        if self.bias:
            biases = (self.n_head + 2 * self.n_query_groups) * hd + d + 2 * self.intermediate_size + d
        return self.n_layer * (qkv + proj + mlp + norms + biases) + d
