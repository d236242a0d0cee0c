"""The mixer contract: what one token-mixer file declares, and the registry shared code loops over.

A mixer module builds `nn.Module`s that map `(x, ctx) -> y` (x, y: (B, T, n_embd)) and registers one `MixerSpec`:

- `kinds`: the layer kinds it serves (the strings an architecture's layout uses, e.g. "mamba", "mamba_mem");
- `build(config, layer_idx, kind)`: the module for one layer;
- `options`: a dataclass of its own config fields (`ModelConfig.mixer_options[name]` overrides the defaults);
- `roles`: the role of every parameter it owns, as (fnmatch pattern relative to the module, Role) pairs. Roles
  drive init (`GPT.reset_parameters`, `init_stds`), the optimizer groups and weight decay. A parameter without a
  role is an error at model build time;
- `flops(config, kind, seq_len)`: forward FLOPs per token that are not parameter matmuls (attention scores,
  scans, convolutions), as a dict of named terms;
- `state`: the decode-state type it keeps in `InferenceCache` (None if stateless);
- `varlen`: how it honours document masks (`ctx.doc_ids`);
- `memory_width(config, kind)`: for kinds that export GMU memory, the memory's width (else 0);
- `saved(config, kind, env)`: bytes per token the layer keeps for backward (a `SaveEnv` gives the sequence length,
  the activation element size, activation checkpointing and the device), as named terms; "per_layer" is a term in
  bytes per layer whatever the token count. Autocast's weight copies are not in it (shared code counts them).
  Under `env.act_ckpt` (per-block checkpointing) it is what outlives the block: exported GMU memory, YOCO's K/V.
  The memory model (`train/memory_model.py`) sums it over the layers;
- `kernels`: optional fast kernels, each with its pure-PyTorch reference and the test that compares them;
- `active(config, rel)`: the fraction of a parameter one token uses (a mixture of experts: top_k / n_experts);
- `tests`: the reference tests ("tests/file.py::test_name") that check it against a naive implementation;
- `layer_options`: the per-layer options a layout may give its kinds (`swa(window=512)`, `attn(da)`): each sets a
  ModelConfig field for that layer only (`ModelConfig.layer_config`);
- `provides` / `needs`: what a kind hands to later layers in the same forward ("shared_kv") or reads from an
  earlier one ("shared_kv", "memory"; exporting GMU memory is declared by `memory_width`), checked per layout;
- `stateless_kinds`: kinds that keep no decode state although the mixer has a `state` type (YOCO's cross-decoder
  may hold only stateless layers).

The feed-forward of a block is a component of the same kind (slot "ffn"); a mixer has slot "mixer".
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from archscale.config import ModelConfig
from archscale.errors import UserError


@dataclass(frozen=True)
class Role:
    """How a parameter is treated. group: "matrix" | "vector" (optimizer group: LR multiplier, weight decay).
    init: "scheme" (the parametrization's Linear init), "output" (as scheme, but writes into the residual stream:
    GPT-2's 1/sqrt(2L) under SP and under mu-P with tied embeddings), "own" (the module's reset_parameters draws
    it: norms, SSM parameters, convolutions), "zero" (biases)."""

    group: str
    init: str
    # Under mu-P, "scheme" and "output" weights keep the module's construction-time init (PyTorch's default for a
    # plain Linear, Mamba's own for its dt_proj) times w_init0, as ArchScale does; under SP they are N(0, init_std).

    def __post_init__(self):
        if self.group not in ("matrix", "vector") or self.init not in ("scheme", "output", "own", "zero"):
            raise ValueError(f"bad role {self}")


MATRIX = Role("matrix", "scheme")
OUTPUT = Role("matrix", "output")
VECTOR = Role("vector", "own")
BIAS = Role("vector", "zero")


@dataclass(frozen=True)
class KernelRef:
    """An optional fast kernel: `available()` says whether it can run here; `reference` names the pure-PyTorch
    function it must equal; `test` is the test comparing them (CUDA-marked when it needs a GPU)."""

    name: str
    available: Callable[[], bool]
    reference: str
    test: str
    install: str = ""  # how to get it where it is missing (`archscale doctor` prints it)


@dataclass(frozen=True)
class LayerOption:
    """A per-layer option: sets ModelConfig `field` for the layers of `kinds` that give it (under its field name
    or an alias); `check(value, config)` returns what is wrong with a value, or None."""

    field: str
    kinds: tuple[str, ...]
    aliases: tuple[str, ...] = ()
    check: Callable[[Any, ModelConfig], Optional[str]] = lambda value, config: None


def no_flops(config: ModelConfig, kind: str, seq_len: int) -> dict[str, float]:
    return {}


def no_memory(config: ModelConfig, kind: str) -> int:
    return 0


@dataclass(frozen=True)
class SaveEnv:
    """What a mixer's `saved` declaration depends on besides the model config."""

    seq_len: int
    act_bytes: int = 2  # bytes of an activation element: 2 under bf16/fp16-mixed autocast, 4 in fp32
    act_ckpt: bool = False  # per-block activation checkpointing: only what outlives the block stays
    device: str = "cuda"  # "cpu" | "cuda": which attention / scan kernels run, hence what they keep


def no_saved(config: ModelConfig, kind: str, env: SaveEnv) -> dict[str, float]:
    return {}


@dataclass(frozen=True)
class MixerSpec:
    name: str
    kinds: tuple[str, ...]
    build: Callable[[ModelConfig, int, str], nn.Module]
    roles: tuple[tuple[str, Role], ...]
    flops: Callable[[ModelConfig, str, int], dict[str, float]]
    description: str
    tests: tuple[str, ...]
    options: Optional[type] = None
    state: Optional[type] = None
    varlen: str = ""
    memory_width: Callable[[ModelConfig, str], int] = no_memory
    saved: Callable[[ModelConfig, str, SaveEnv], dict[str, float]] = no_saved
    kernels: tuple[KernelRef, ...] = ()
    slot: str = "mixer"
    # std of a "scheme" weight under mu-P when its module's own init is not PyTorch's Linear default (else None)
    mup_init_std: Callable[[ModelConfig, str], Optional[float]] = lambda config, rel: None
    # fraction of a parameter (by relative name) that one token uses: 1 for dense layers, top_k / n_experts for a
    # mixture of experts' expert weights; FLOPs per token and the dry run's active parameters read it
    active: Callable[[ModelConfig, str], float] = lambda config, rel: 1.0
    layer_options: tuple[LayerOption, ...] = ()
    provides: tuple[tuple[str, tuple[str, ...]], ...] = ()  # ((kind, (resource, ...)), ...)
    needs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    stateless_kinds: tuple[str, ...] = ()

    def keeps_state(self, kind: str) -> bool:
        return self.state is not None and kind not in self.stateless_kinds

    def resources(self, table: tuple, kind: str) -> tuple[str, ...]:
        return dict(table).get(kind, ())

    def role_of(self, rel_name: str) -> Optional[Role]:
        for pattern, role in self.roles:
            if fnmatch.fnmatchcase(rel_name, pattern):
                return role
        return None


REGISTRY: dict[str, MixerSpec] = {}
_BY_KIND: dict[tuple[str, str], MixerSpec] = {}


def register(spec: MixerSpec) -> MixerSpec:
    """Add a spec (called once at the bottom of each mixer module). Kinds are unique within a slot."""
    if spec.name in REGISTRY:
        raise ValueError(f"mixer {spec.name!r} registered twice")
    for kind in spec.kinds:
        if (spec.slot, kind) in _BY_KIND:
            raise ValueError(f"layer kind {kind!r} already served by {_BY_KIND[spec.slot, kind].name!r}")
    if not spec.tests:
        raise ValueError(f"mixer {spec.name!r} declares no reference test")
    REGISTRY[spec.name] = spec
    for kind in spec.kinds:
        _BY_KIND[spec.slot, kind] = spec
    return spec


def spec_for(kind: str, slot: str = "mixer") -> MixerSpec:
    if (slot, kind) not in _BY_KIND:
        known = sorted(k for s, k in _BY_KIND if s == slot)
        raise UserError(f"no {slot} registered for layer kind {kind!r}; known: {', '.join(known)}")
    return _BY_KIND[slot, kind]


def options_of(config: ModelConfig, spec: MixerSpec) -> Any:
    """The MixerSpec's options dataclass with `config.mixer_options[spec.name]` applied (unknown keys: one line)."""
    given = dict((config.mixer_options or {}).get(spec.name, {}))
    if spec.options is None:
        if given:
            raise UserError(f"mixer {spec.name!r} takes no options (got {sorted(given)})")
        return None
    names = {f.name for f in dataclasses.fields(spec.options)}
    unknown = sorted(set(given) - names)
    if unknown:
        raise UserError(f"mixer_options.{spec.name}: unknown field(s) {unknown}; known: {sorted(names)}")
    return spec.options(**given)


def memory_source(config: ModelConfig, layer_idx: int) -> tuple[int, int]:
    """(layer, width) of the last layer before `layer_idx` whose mixer or feed-forward exports GMU memory."""
    found = None
    for i in range(layer_idx):
        for slot, kind in (("mixer", config.layer_kinds[i]), ("ffn", config.ffn_kinds[i])):
            width = spec_for(kind, slot).memory_width(config, kind)
            if width:
                found = (i, width)
    if found is None:
        raise UserError(f"{config.name}: layer {layer_idx} reads GMU memory but no earlier layer exports any")
    return found


@dataclass
class ForwardContext:
    """What layers share within one forward pass."""

    pos: int  # absolute position of the first input token (0 in training; the cache length when decoding)
    cos: Optional[torch.Tensor]  # RoPE tables broadcastable to (B, T, heads, hd/2): (T, 1, hd/2) or (B, T, 1, hd/2)
    sin: Optional[torch.Tensor]  # (per-document positions); None for NoPE models
    doc_ids: Optional[torch.Tensor] = None  # (B, T) document index of every token (varlen): mixers stay inside
    cache: Any = None  # InferenceCache when decoding
    memory: Optional[torch.Tensor] = None  # GMU memory (set by the layer that exports it)
    shared_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # YOCO K/V (B, G, T_kv, hd), key 0 = position 0
    # Rows decoding at different positions (continuous batching, serve/batching.py): row_pos (B,) is each row's
    # position, and the cache's `row_kv(layer_idx)` appends K/V per row and returns the keys with a per-row mask,
    # which the YOCO KV layer shares as shared_kv_mask (B, 1, 1, T_kv)
    row_pos: Optional[torch.Tensor] = None
    shared_kv_mask: Optional[torch.Tensor] = None
    # training losses that components add to the LM loss, already weighted (MoE load balancing, router z-loss);
    # GPT.forward sums them into `GPT.aux_loss`
    aux_losses: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # per-forward values a mixer family shares (e.g. cached doc resets)

    def state(self, layer_idx: int, make: Callable[[], Any]) -> Any:
        """This layer's decode state (created by `make` on first use), or None outside decoding."""
        return None if self.cache is None else self.cache.layer(layer_idx, make)
