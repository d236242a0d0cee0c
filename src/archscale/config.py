"""Model configuration: one dataclass, and the shipped layouts that turn "{arch}_d{depth}" into sizes.

Sizes follow ArchScale (github.com/microsoft/ArchScale, `lit_gpt/config.py`): n_layer = depth, n_embd = ar * depth,
n_head = depth, n_query_groups = max(1, depth // 4), head_size = 128, SwiGLU hidden = 4 * n_embd. An architecture
is a layout spec (`archscale/layout.py`, shipped in `archscale/layouts/`): the kinds of every layer, their options,
an aspect ratio and optionally ArchScale's parameter-count law; the kinds are served by the mixers in
`archscale.models.mixers` (this module imports no model code). A config carries its spec (`layout`) and the record
of every layer (`layers`), from which it is rebuilt.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from archscale.errors import UserError
from archscale.layout import LayoutSpec, read_layout, shipped_specs


# Every shipped spec (ArchScale's in layouts/architectures.yaml, other published hybrids one file each), and
# ArchScale's own: the architectures the per-architecture tests walk.
LAYOUTS: dict[str, LayoutSpec] = shipped_specs()
ARCHITECTURES: dict[str, LayoutSpec] = {n: s for n, s in LAYOUTS.items() if s.source == "architectures.yaml"}
ArchSpec = LayoutSpec  # the name of round 2


def resolve_layout(ref: "str | LayoutSpec") -> LayoutSpec:
    """A spec from a shipped name, a YAML/JSON file or the one-line string form (`archscale/layout.py`)."""
    return ref if isinstance(ref, LayoutSpec) else read_layout(ref, LAYOUTS)


def arch_preset(arch: "str | LayoutSpec") -> dict[str, Any]:
    """The architecture's fixed ModelConfig values (empty for the depth-scaled families)."""
    if isinstance(arch, LayoutSpec):
        return dict(arch.preset)
    return dict(LAYOUTS[arch].preset) if arch in LAYOUTS else {}


def layer_kinds(arch: str, n_layer: int) -> list[str]:
    """The mixer kind of every layer of `arch` (its spec's expansion; the kinds are served by models/mixers/)."""
    if arch not in LAYOUTS:
        raise UserError(f"unknown architecture {arch!r}")
    return LAYOUTS[arch].layout(n_layer)


def n_mult(arch: str, ar: float | None = None) -> float:
    """Non-embedding parameters per depth^3 by the architecture's hand-entered law; `ar` overrides its aspect
    ratio. Specs without a law have their parameters counted instead (`has_law`)."""
    if arch not in LAYOUTS:
        raise UserError(f"no parameter-count law for unknown architecture {arch!r}")
    spec = LAYOUTS[arch]
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
    # Defaults of the layers' options (from the layout spec); each layer's own values are in `layers`.
    sliding_window: int = 0
    nope: bool = False
    use_da: bool = False
    # Feed-forward kind replacing the layout's plain "mlp" layers in every architecture, e.g. "moe" (a mixture of
    # experts, options in mixer_options["moe"]); "" keeps the layout's. GMU-memory layers ("mlp_mem") stay dense.
    ffn_kind: str = ""
    # The architecture as data: `layout` is the spec it was built from (`archscale/layout.py`, a dict), `layers`
    # the record of every layer as built ({"mixer": kind, "ffn": kind, option field: value, ...}: the registry
    # fills every option, `models/layout_rules.complete`), `cross_decoder` the first YOCO cross-decoder layer
    # (0: none). A saved config is rebuilt from `layers`, never from the name.
    layout: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)
    cross_decoder: int = 0
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
        if not self.layout and self.arch in LAYOUTS:
            self.layout = LAYOUTS[self.arch].to_dict()
        self.validate()
        if not self.layers:
            self.layers = self._expanded_layers()
        elif len(self.layers) != self.n_layer:
            raise UserError(f"model config {self.name}: {len(self.layers)} layer records for n_layer={self.n_layer}")

    def spec(self) -> LayoutSpec:
        return LayoutSpec.from_dict(self.layout, f"of {self.name}")

    def _expanded_layers(self) -> list[dict]:
        """Each layer's kinds and explicitly given options, from the spec (the registry fills the rest)."""
        out = []
        for e in self.spec().expand(self.n_layer):
            ffn = self.ffn_kind if self.ffn_kind and e.ffn == "mlp" else e.ffn
            out.append({"mixer": e.mixer, "ffn": ffn, **dict(e.options)})
        return out

    def layer_config(self, i: int) -> "ModelConfig":
        """This config as layer i sees it: its own options (window, NoPE, differential attention, ...) in place of
        the defaults, so a mixer reads `config.sliding_window` and gets its layer's value."""
        opts = {k: v for k, v in self.layers[i].items() if k not in ("mixer", "ffn")}
        return dataclasses.replace(self, **opts) if opts else self

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
        if not self.layout and not self.layers:
            problems.append(f"unknown architecture {self.arch!r}; choose one of {sorted(LAYOUTS)}")
        elif self.layout:
            if self.layout.get("depth_multiple", 1) > 1 and self.n_layer % self.layout["depth_multiple"]:
                problems.append(f"{self.arch} needs a depth divisible by {self.layout['depth_multiple']} "
                                f"(got {self.n_layer})")
            if self.layout.get("sliding_window") and self.sliding_window < 1:
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
    def from_arch(cls, arch: "str | LayoutSpec", depth: int, ar: int | None = None,
                  **overrides: Any) -> "ModelConfig":
        """Sizes from depth (ArchScale's `pretrain.py`): n_layer = depth, width = ar * depth, n_head = depth,
        n_query_groups = max(1, depth // 4), head_size 128, SwiGLU hidden 4 x width. `arch` is a shipped name or
        a `LayoutSpec`; `ar` overrides its aspect ratio (then head_size = ar, so width stays n_head * head_size)."""
        if isinstance(arch, str) and arch not in LAYOUTS:
            raise UserError(f"unknown --train_model {arch!r}; choose one of: {', '.join(sorted(LAYOUTS))} (or pass "
                            "a spec with --layout)")
        spec = resolve_layout(arch)
        if depth < 1:
            raise UserError(f"--depth must be >= 1 (got {depth})")
        head_size = 128
        if ar is None:
            ar = spec.ar
        else:
            if ar < 2 or ar % 2:
                raise UserError(f"--ar must be an even number >= 2 (got {ar}): head_size = ar must be even for RoPE")
            head_size = ar
        base = dict(
            name=f"{spec.name}_d{depth}", arch=spec.name, n_layer=depth, n_embd=ar * depth, n_head=depth,
            n_query_groups=max(1, depth // 4), head_size=head_size, intermediate_size=4 * ar * depth,
            sliding_window=spec.sliding_window, nope=spec.nope, use_da=spec.use_da, layout=spec.to_dict(),
            mixer_options={k: dict(v) for k, v in spec.mixer_options.items()},
        )
        base.update(dict(spec.preset))
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise UserError(f"unknown ModelConfig field(s): {', '.join(sorted(unknown))}")
        if "mixer_options" in overrides:  # per mixer: the caller's fields over the layout's
            given = overrides.pop("mixer_options") or {}
            base["mixer_options"] = {m: {**base["mixer_options"].get(m, {}), **dict(given.get(m, {}))}
                                     for m in {*base["mixer_options"], *given}}
        base.update(overrides)
        if "intermediate_size" not in overrides and "n_embd" in overrides:
            base["intermediate_size"] = 4 * base["n_embd"]
        return cls(**base)

    @classmethod
    def from_layout(cls, ref: "str | LayoutSpec", depth: int, **overrides: Any) -> "ModelConfig":
        """`ModelConfig.from_layout("my_hybrid.yaml", 8)`: a spec file, a shipped name or a one-line spec."""
        return cls.from_arch(resolve_layout(ref), depth, **overrides)

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
        return [layer["mixer"] for layer in self.layers]

    @property
    def ffn_kinds(self) -> list[str]:
        return [layer["ffn"] for layer in self.layers]

    @property
    def cross_decoder_start(self) -> int | None:
        """First layer of a YOCO cross-decoder (layers there keep no decode state), None without one."""
        return self.cross_decoder or None

    @property
    def uses_rope(self) -> bool:
        """Whether any layer rotates positions (every layer NoPE: no RoPE tables needed)."""
        return any(not layer.get("nope", self.nope) for layer in self.layers)

    # Fields the layer records are derived from: changing one re-expands the spec (unless `layers` is given too).
    _LAYOUT_INPUTS = frozenset({"n_layer", "arch", "layout", "ffn_kind", "sliding_window", "nope", "use_da"})

    def replace(self, **changes: Any) -> "ModelConfig":
        if "arch" in changes and "layout" not in changes:
            changes["layout"] = {}
        if self._LAYOUT_INPUTS & set(changes) and "layers" not in changes:
            changes.update(layers=[], cross_decoder=0)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
