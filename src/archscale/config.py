"""Model configuration: one dataclass, and the architectures that turn "{arch}_d{depth}" into sizes.

Sizes follow ArchScale (github.com/microsoft/ArchScale, `lit_gpt/config.py`): n_layer = depth, n_embd = ar * depth,
n_head = depth, n_query_groups = max(1, depth // 4), head_size = 128, SwiGLU hidden = 4 * n_embd. An architecture
is a layout of layer kinds, an aspect ratio and a parameter-count law; the kinds are served by the mixers in
`archscale.models.mixers` (this module imports no model code).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable

from archscale.errors import UserError


def _all(kind: str) -> Callable[[int], list[str]]:
    return lambda L: [kind] * L


def _transformerls(L: int) -> list[str]:
    return ["attn" if i % 4 == 3 else "swa" for i in range(L)]


def _samba(rnn: str) -> Callable[[int], list[str]]:
    return lambda L: [rnn if i % 2 == 0 else "swa" for i in range(L)]


def _yoco(rnn: str, rnn_every: int = 2, gmu: str | None = "gmu", gmu_every: int = 2,
          memory: str = "rnn") -> Callable[[int], list[str]]:
    """ArchScale's YOCO wiring (its `Block` with `yoco`, `rnn_per_layer`, `gmu_per_layer`): a self-decoder of
    layers 0..L/2-1 (RNN on every `rnn_every`-th layer, SWA between), layer L/2 an RNN, layer L/2+1 the one full
    attention layer whose K/V the cross-decoder reuses, then layers >= L/2+2: GMU on every `gmu_every`-th index,
    cross-attention elsewhere. `memory` says which layer's output the GMUs gate: "rnn" (layer L/2 exports its
    pre-gate SSM output: kind rnn + "_mem"), "attn" (layer L/2+1's attention output before its projection) or "mlp"
    (layer L/2+1's MLP input half, see `_ffn_mem_after_half`)."""
    def layout(L: int) -> list[str]:
        half = L // 2
        kinds = [rnn if i % rnn_every == 0 else "swa" for i in range(half)]
        kinds.append(rnn + "_mem" if gmu and memory == "rnn" else rnn)
        kinds.append("kv_mem" if gmu and memory == "attn" else "kv")
        kinds += [gmu if gmu and i % gmu_every == 0 else "cross" for i in range(half + 2, L)]
        return kinds
    return layout


def _ffn_mem_after_half(L: int) -> list[str]:
    return ["mlp_mem" if i == L // 2 + 1 else "mlp" for i in range(L)]


def _law(a: float, b: float = 0.0) -> Callable[[float], float]:
    """ArchScale's parameter-count law N(d) = (a ar^2 + b ar) d^3 (its `pretrain.py`; used for token budgets)."""
    return lambda ar: a * ar**2 + b * ar


@dataclass(frozen=True)
class ArchSpec:
    """An architecture: a layout (layer index -> mixer kind), its aspect ratio and its parameter-count law."""

    ar: int  # aspect ratio: n_embd = ar * depth
    description: str
    layout: Callable[[int], list[str]]  # n_layer -> the mixer kind of every layer (kinds: models/mixers/)
    n_mult: Callable[[float], float]  # ar -> non-embedding parameters per depth^3 (the token-budget law)
    ffn_layout: Callable[[int], list[str]] = _all("mlp")  # n_layer -> the feed-forward kind of every layer
    sliding_window: int = 0  # SWA window W (each query sees itself and W-1 earlier tokens); 0: no SWA layers
    nope: bool = False  # no positional encoding anywhere (SambaY family)
    use_da: bool = False  # differential attention in every attention layer
    yoco: bool = False  # needs depth % 4 == 0; layers >= depth/2 + 2 (the cross-decoder) keep no state of their
    # own, so at prefill they see only the last prompt position
    preset: tuple = ()  # fixed ModelConfig overrides ((field, value), ...), e.g. Phi4-mini-Flash's sizes


_YOCO = dict(sliding_window=128, nope=True, yoco=True)
ARCHITECTURES: dict[str, ArchSpec] = {
    "transformer": ArchSpec(128, "Transformer++: pre-norm RMSNorm, RoPE, GQA, SwiGLU, no biases", _all("attn"),
                            _law(14.5)),
    "transformerls": ArchSpec(128, "Transformer++ with SWA-128 in 3 of 4 layers (idx % 4 == 3 full attention)",
                              _transformerls, _law(14.5), sliding_window=128),
    "mamba": ArchSpec(114, "every layer Mamba-1 + SwiGLU (ar 114: parameters within 3% of transformer)",
                      _all("mamba"), _law(18.25)),  # the law is ours: Mamba-1 6.25 ar^2 + SwiGLU 12 ar^2
    "samba": ArchSpec(122, "Samba: Mamba on even layers, SWA-2048 (RoPE) on odd layers, SwiGLU everywhere",
                      _samba("mamba"), _law(15, 160), sliding_window=2048),
    "sambay": ArchSpec(124, "SambaY: Samba self-decoder, then one full-attention KV layer and a cross-decoder "
                            "alternating GMU and cross-attention; NoPE", _yoco("mamba"), _law(14.5, 144), **_YOCO),
    "sambayda": ArchSpec(124, "SambaY with differential attention in every attention layer", _yoco("mamba"),
                         _law(14.5, 144), use_da=True, **_YOCO),
    "sambayoco": ArchSpec(126, "Samba+YOCO: SambaY with cross-attention in every cross-decoder layer (no GMU)",
                          _yoco("mamba", gmu=None), _law(13.5, 208), **_YOCO),
    "mambay": ArchSpec(120, "MambaY: an all-Mamba-1 self-decoder (no SWA), SambaY's GMU cross-decoder",
                       _yoco("mamba", rnn_every=1), _law(16, 64), **_YOCO),
    "sambay2": ArchSpec(124, "SambaY with Mamba-2 RNN layers and nGMU", _yoco("mamba2", gmu="ngmu"),
                        _law(14.5, 144), **_YOCO),
    "mambay2": ArchSpec(120, "MambaY with Mamba-2 and nGMU", _yoco("mamba2", rnn_every=1, gmu="ngmu"),
                        _law(16, 64), **_YOCO),
    "gdny": ArchSpec(120, "GDNY: an all-Gated-DeltaNet self-decoder, nGMU cross-decoder",
                     _yoco("gdn", rnn_every=1, gmu="ngmu"), _law(16, 64), **_YOCO),
    "sgdny": ArchSpec(126, "SGDNY: Samba-style (Gated DeltaNet + SWA) self-decoder, nGMU cross-decoder",
                      _yoco("gdn", gmu="ngmu"), _law(16, 64), **_YOCO),
    "sambayattn": ArchSpec(126, "SambaY-A: the GMUs gate the KV layer's attention output (before its projection)",
                           _yoco("mamba", memory="attn"), _law(13.5, 208), **_YOCO),
    "sambayattnall": ArchSpec(126, "SambaY-AA: SambaY-A with a GMU in every cross-decoder layer",
                              _yoco("mamba", memory="attn", gmu_every=1), _law(13.5, 208), **_YOCO),
    "sambaymlp": ArchSpec(120, "SambaY-MLP: the GMUs gate the input half of the KV layer's SwiGLU",
                          _yoco("mamba", memory="mlp"), _law(15.5, 144), ffn_layout=_ffn_mem_after_half, **_YOCO),
    "phi4miniflash": ArchSpec(80, "Phi4-mini-Flash: SambaY + DA, LayerNorm, q/k/v/o biases, tied embeddings",
                              _yoco("mamba"), _law(14.5, 144), sliding_window=512, nope=True, use_da=True,
                              yoco=True,
                              preset=(("n_head", 40), ("n_query_groups", 20), ("head_size", 64),
                                      ("vocab_size", 200064), ("norm_class", "layernorm"), ("attn_bias", True),
                                      ("tie_embeddings", True), ("block_size", 8192))),
}


def arch_preset(arch: str) -> dict[str, Any]:
    """The architecture's fixed ModelConfig values (empty for the depth-scaled families)."""
    return dict(ARCHITECTURES[arch].preset) if arch in ARCHITECTURES else {}


def layer_kinds(arch: str, n_layer: int) -> list[str]:
    """The mixer kind of every layer of `arch` (see `ArchSpec.layout`; the kinds are served by models/mixers/)."""
    if arch not in ARCHITECTURES:
        raise UserError(f"unknown architecture {arch!r}")
    return ARCHITECTURES[arch].layout(n_layer)


def n_mult(arch: str, ar: float | None = None) -> float:
    """Non-embedding parameters per depth^3 by the architecture's law; `ar` overrides its aspect ratio."""
    if arch not in ARCHITECTURES:
        raise UserError(f"no parameter-count law for unknown architecture {arch!r}")
    spec = ARCHITECTURES[arch]
    return spec.n_mult(spec.ar if ar is None else ar)


# ModelConfig fields of round 1 that now live in a mixer's options (read from old run configs).
MIXER_LEGACY_DEFAULTS = {"d_state": 16, "d_conv": 4, "mamba_expand": 2}
LEGACY_MIXER_FIELDS = {"d_state": ("mamba", "d_state"), "d_conv": ("mamba", "d_conv"),
                       "mamba_expand": ("mamba", "expand")}


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
    rotary_dim: int = 0  # RoPE on the first rotary_dim dims of each head (partial RoPE); 0: all head_size dims
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    bias: bool = False  # biases in every Linear of attention and MLP (ArchScale's `_bias`)
    attn_bias: bool = False  # q, v and output-projection biases only (Phi4-mini-Flash)
    norm_class: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    # Mixer options (defaults filled from the architecture's ArchSpec; see `layer_kinds`).
    sliding_window: int = 0
    nope: bool = False
    use_da: bool = False
    # Feed-forward kind replacing the layout's plain "mlp" layers in every architecture, e.g. "moe" (a mixture of
    # experts, options in mixer_options["moe"]); "" keeps the layout's. GMU-memory layers ("mlp_mem") stay dense.
    ffn_kind: str = ""
    # Per-mixer fields, {mixer name: {field: value}} over the defaults each mixer declares (models/mixers/),
    # e.g. {"mamba": {"d_state": 16}}.
    mixer_options: dict = field(default_factory=dict)
    # Parametrization multipliers (1.0 under SP; the mu-P++ rules set them).
    residual_scale: float = 1.0  # each block's branch output is multiplied by this (mu-P++: 1/sqrt(2L))
    logit_scale: float = 1.0  # final hidden state is multiplied by this before lm_head (mu-P: d0/L)
    attn_scale_mult: float = 1.0  # softmax scale = attn_scale_mult / sqrt(head_size)
    # Init (SP defaults from ArchScale: N(0, 0.02) linears, GPT-2 1/sqrt(2L) on output projections).
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
        if self.rotary_dim < 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_size:
            problems.append(f"rotary_dim={self.rotary_dim} must be even and in 0..head_size={self.head_size}")
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
        """Sizes from depth (ArchScale's `pretrain.py`). `ar` overrides the architecture's aspect ratio: width = ar * depth with
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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """A config saved by `to_dict` (a run's config.yaml), including runs saved before mixers had options."""
        d = dict(d)
        opts = {k: dict(v) for k, v in (d.pop("mixer_options", None) or {}).items()}
        for old, (mixer, name) in LEGACY_MIXER_FIELDS.items():
            if old in d:
                value = d.pop(old)
                if value != MIXER_LEGACY_DEFAULTS[old]:
                    opts.setdefault(mixer, {})[name] = value
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise UserError(f"saved model config has unknown field(s): {', '.join(sorted(unknown))}")
        return cls(**d, mixer_options=opts)

    @property
    def layer_kinds(self) -> list[str]:
        return layer_kinds(self.arch, self.n_layer)

    @property
    def cross_decoder_start(self) -> int | None:
        """First layer of a YOCO cross-decoder (layers there keep no decode state), None without one."""
        return self.n_layer // 2 + 2 if ARCHITECTURES[self.arch].yoco and self.n_layer >= 4 else None

    @property
    def ffn_kinds(self) -> list[str]:
        kinds = ARCHITECTURES[self.arch].ffn_layout(self.n_layer)
        return [self.ffn_kind if self.ffn_kind and k == "mlp" else k for k in kinds]

    def replace(self, **changes: Any) -> "ModelConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
