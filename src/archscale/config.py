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
    """What differs between architectures at the same depth (spec §2.2)."""

    ar: int  # aspect ratio: n_embd = ar * depth
    description: str
    layout: str = "transformer"  # which `layer_kinds` rule builds the layer stack
    sliding_window: int = 0  # SWA window W (each query sees itself and W-1 earlier tokens); 0: no SWA layers
    nope: bool = False  # no positional encoding anywhere (SambaY family)
    use_da: bool = False  # differential attention in every attention layer
    yoco: bool = False  # needs depth % 4 == 0 (self-decoder / cross-decoder split)
    preset: tuple = ()  # fixed ModelConfig overrides ((field, value), ...), e.g. Phi4-mini-Flash's sizes


ARCHITECTURES: dict[str, ArchSpec] = {
    "transformer": ArchSpec(128, "Transformer++: pre-norm RMSNorm, RoPE, GQA, SwiGLU, no biases"),
    "transformerls": ArchSpec(128, "Transformer++ with SWA-128 in 3 of 4 layers (idx % 4 == 3 full attention)",
                              layout="transformerls", sliding_window=128),
    "mamba": ArchSpec(114, "every layer Mamba-1 + SwiGLU (ar 114: parameters within 3% of transformer)",
                      layout="mamba"),
    "samba": ArchSpec(122, "Samba: Mamba on even layers, SWA-2048 (RoPE) on odd layers, SwiGLU everywhere",
                      layout="samba", sliding_window=2048),
    "sambay": ArchSpec(124, "SambaY: Samba self-decoder, then one full-attention KV layer and a cross-decoder "
                            "alternating GMU and cross-attention; NoPE", layout="sambay", sliding_window=128,
                       nope=True, yoco=True),
    "sambayda": ArchSpec(124, "SambaY with differential attention in every attention layer", layout="sambay",
                         sliding_window=128, nope=True, use_da=True, yoco=True),
    "sambayoco": ArchSpec(126, "Samba+YOCO: SambaY with cross-attention in every cross-decoder layer (no GMU)",
                          layout="sambayoco", sliding_window=128, nope=True, yoco=True),
    "phi4miniflash": ArchSpec(80, "Phi4-mini-Flash: SambaY + DA, LayerNorm, q/v/o biases, tied embeddings",
                              layout="sambay", sliding_window=512, nope=True, use_da=True, yoco=True,
                              preset=(("n_head", 40), ("n_query_groups", 20), ("head_size", 64),
                                      ("vocab_size", 200064), ("norm_class", "layernorm"), ("attn_bias", True),
                                      ("tie_embeddings", True), ("block_size", 8192))),
}

def arch_preset(arch: str) -> dict[str, Any]:
    """The architecture's fixed ModelConfig values (empty for the depth-scaled families)."""
    return dict(ARCHITECTURES[arch].preset) if arch in ARCHITECTURES else {}


LAYER_KINDS = ("attn", "swa", "mamba", "mamba_mem", "kv", "cross", "gmu")


def layer_kinds(layout: str, n_layer: int) -> list[str]:
    """The mixer of every layer (spec §2.2). attn: full attention; swa: sliding-window attention; mamba_mem: a
    Mamba layer that also exports its pre-gate SSM output as GMU memory; kv: the full-attention layer whose K/V
    every cross layer reuses (YOCO); cross: cross-attention (own queries only) to that K/V; gmu: gated memory."""
    L = n_layer
    if layout == "transformer":
        return ["attn"] * L
    if layout == "transformerls":
        return ["attn" if i % 4 == 3 else "swa" for i in range(L)]
    if layout == "mamba":
        return ["mamba"] * L
    if layout == "samba":
        return ["mamba" if i % 2 == 0 else "swa" for i in range(L)]
    if layout in ("sambay", "sambayoco"):
        half = L // 2
        kinds = ["mamba" if i % 2 == 0 else "swa" for i in range(half)]
        kinds += ["mamba_mem" if layout == "sambay" else "mamba", "kv"]
        for i in range(half + 2, L):
            kinds.append("gmu" if layout == "sambay" and i % 2 == 0 else "cross")
        return kinds
    raise UserError(f"unknown layout {layout!r}")


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
    rope_scaling: float = 1.0  # linear position interpolation factor (positions are divided by it)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    bias: bool = False  # biases in every Linear of attention and MLP (seed's `_bias`)
    attn_bias: bool = False  # q, v and output-projection biases only (Phi4-mini-Flash)
    norm_class: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    # Mixer options (defaults filled from the architecture's ArchSpec; see `layer_kinds`).
    sliding_window: int = 0
    nope: bool = False
    use_da: bool = False
    d_state: int = 16  # Mamba-1
    d_conv: int = 4
    mamba_expand: int = 2
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
        else:
            spec = ARCHITECTURES[self.arch]
            if spec.yoco and self.n_layer % 4:
                problems.append(f"{self.arch} needs a depth divisible by 4 (got {self.n_layer})")
            if spec.sliding_window and self.sliding_window < 1:
                problems.append(f"sliding_window must be >= 1 for {self.arch} (got {self.sliding_window})")
        if self.use_da and (self.n_head % 2 or self.n_query_groups % 2):
            problems.append(f"differential attention pairs heads: n_head={self.n_head} and "
                            f"n_query_groups={self.n_query_groups} must both be even (a depth that is a multiple of 8)")
        if self.rope_scaling < 1.0:
            problems.append(f"rope_scaling must be >= 1 (got {self.rope_scaling})")
        if self.norm_class not in ("rmsnorm", "layernorm"):
            problems.append(f"norm_class must be 'rmsnorm' or 'layernorm' (got {self.norm_class!r})")
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
            sliding_window=spec.sliding_window, nope=spec.nope, use_da=spec.use_da,
        )
        base.update(dict(spec.preset))
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise UserError(f"unknown ModelConfig field(s): {', '.join(sorted(unknown))}")
        base.update(overrides)
        if "intermediate_size" not in overrides and "n_embd" in overrides:
            base["intermediate_size"] = 4 * base["n_embd"]
        return cls(**base)

    @property
    def layer_kinds(self) -> list[str]:
        return layer_kinds(ARCHITECTURES[self.arch].layout, self.n_layer)

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
        kinds = set(self.layer_kinds)
        d_inner = self.mamba_expand * d
        # (role, fan_in, writes into the residual stream) for every Linear role this architecture has
        roles = [("attn.qkv", d, False), ("attn.proj", self.n_head * hd, True), ("mlp.w1", d, False),
                 ("mlp.w3", self.intermediate_size, True)]
        if "cross" in kinds:
            roles.append(("attn.q_proj", d, False))
        if kinds & {"mamba", "mamba_mem"}:
            roles += [("mamba.in_proj", d, False), ("mamba.x_proj", d_inner, False),
                      ("mamba.out_proj", d_inner, True)]
        if "gmu" in kinds:
            roles += [("gmu.in_proj", d, False), ("gmu.out_proj", d_inner, True)]
        if self.init_scheme == "mup":
            out = {r: self.w_init_mult / math.sqrt(3 * fan_in) for r, fan_in, _ in roles}
            head = 0.0
        else:
            gpt2 = self.init_std / math.sqrt(2 * L)
            out = {r: gpt2 if residual else self.init_std for r, _, residual in roles}
            head = self.init_std
        if kinds & {"mamba", "mamba_mem"}:  # Mamba's dt_proj keeps its own init: U(+-dt_rank^-0.5)
            out["mamba.dt_proj"] = 1.0 / math.sqrt(3 * math.ceil(d / 16))
        wte = self.init_std if self.tie_embeddings else self.embed_init_std
        return {"wte": wte, "lm_head": wte if self.tie_embeddings else head, **out}

    def non_embedding_params(self) -> int:
        """Norms included, token embedding and lm_head excluded. Closed form for the Transformer++ (checked
        against the module in tests); other architectures are counted on a meta-device model (no memory)."""
        if self.layer_kinds != ["attn"] * self.n_layer or self.attn_bias or self.norm_class != "rmsnorm":
            import torch

            from archscale.models.model import GPT

            with torch.device("meta"):
                return GPT(self).num_params(non_embedding=True)
        d, hd = self.n_embd, self.head_size
        qkv = d * (self.n_head + 2 * self.n_query_groups) * hd
        proj = self.n_head * hd * d
        mlp = d * 2 * self.intermediate_size + self.intermediate_size * d
        norms = 2 * d
        biases = 0
        if self.bias:
            biases = (self.n_head + 2 * self.n_query_groups) * hd + d + 2 * self.intermediate_size + d
        return self.n_layer * (qkv + proj + mlp + norms + biases) + d
