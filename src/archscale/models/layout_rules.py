"""A layout checked against the mixer registry and completed into the record a run keeps.

`complete(config)` fills every layer's options from what its mixer declares (`MixerSpec.layer_options`: a value
the spec wrote, else the config's default), sets YOCO's cross-decoder start, and refuses a layout that cannot
work with one line naming the layer and the rule: an unknown kind, an option its kind does not take (a window on
full attention), a value the option refuses (differential attention with odd heads), a layer that reads what no
earlier layer produces (cross-attention before any KV layer, a GMU before any memory), a YOCO cross-decoder
holding a layer with decode state. Nothing here names a mixer: it reads the registry.
"""

from __future__ import annotations

import dataclasses

from archscale.config import ModelConfig
from archscale.errors import UserError
from archscale.models.mixers.base import REGISTRY, MixerSpec, spec_for

SLOTS = ("mixer", "ffn")


def _where(config: ModelConfig, i: int) -> str:
    layer = config.layers[i]
    return f"{config.name}: layer {i} ({layer['mixer']}:{layer['ffn']})"


def _spec(config: ModelConfig, i: int, slot: str) -> MixerSpec:
    try:
        return spec_for(config.layers[i][slot], slot)
    except UserError as e:
        raise UserError(f"{_where(config, i)}: {e}") from None


def _options_taking(name: str) -> str:
    kinds = sorted({k for s in REGISTRY.values() for o in s.layer_options if name in (o.field, *o.aliases)
                    for k in o.kinds})
    return f"{name!r} applies to: {', '.join(kinds)}" if kinds else f"no layer kind takes {name!r}"


def complete_layer(config: ModelConfig, i: int) -> dict:
    """Layer i's record with every declared option filled (given > the config's default)."""
    layer = config.layers[i]
    given = {k: v for k, v in layer.items() if k not in SLOTS}
    record = {"mixer": layer["mixer"], "ffn": layer["ffn"]}
    for slot in SLOTS:
        kind = layer[slot]
        for opt in _spec(config, i, slot).layer_options:
            if kind not in opt.kinds:
                continue
            names = [n for n in (opt.field, *opt.aliases) if n in given]
            value = given.pop(names[0]) if names else getattr(config, opt.field)
            for extra in names[1:]:
                given.pop(extra)
            problem = opt.check(value, config)
            if problem:
                raise UserError(f"{_where(config, i)}: option {names[0] if names else opt.field}: {problem}")
            record[opt.field] = value
    if given:
        name = sorted(given)[0]
        raise UserError(f"{_where(config, i)}: option {name!r} does not apply to this layer ({_options_taking(name)})")
    return record


def _check_resources(config: ModelConfig) -> None:
    """Every layer reads only what an earlier layer (or its own mixer, for its feed-forward) produced."""
    have: set[str] = set()
    for i in range(config.n_layer):
        view = config.layer_config(i)
        for slot in SLOTS:
            kind, spec = config.layers[i][slot], _spec(config, i, slot)
            for need in spec.resources(spec.needs, kind):
                if need not in have:
                    raise UserError(f"{_where(config, i)}: reads {need.replace('_', ' ')} but no earlier layer "
                                    f"produces it (kinds that do: {', '.join(producers(need, view))})")
            have.update(spec.resources(spec.provides, kind))
            if spec.memory_width(view, kind):
                have.add("memory")


def producers(resource: str, config: ModelConfig) -> list[str]:
    out = set()
    for spec in REGISTRY.values():
        out.update(k for k in spec.kinds if resource in spec.resources(spec.provides, k))
        if resource == "memory":
            out.update(k for k in spec.kinds if spec.memory_width(config, k))
    return sorted(out)


def _cross_decoder(config: ModelConfig) -> int:
    """YOCO: the layers after the one shared-KV layer form the cross-decoder and must keep no decode state."""
    if not config.layout.get("yoco"):
        return 0
    kv = [i for i in range(config.n_layer)
          if "shared_kv" in _spec(config, i, "mixer").resources(_spec(config, i, "mixer").provides,
                                                                config.layers[i]["mixer"])]
    if len(kv) != 1:
        raise UserError(f"{config.name}: a YOCO layout needs exactly one layer producing the shared KV (kinds: "
                        f"{', '.join(producers('shared_kv', config))}); it has {len(kv)}")
    start = kv[0] + 1
    for i in range(start, config.n_layer):
        for slot in SLOTS:
            if _spec(config, i, slot).keeps_state(config.layers[i][slot]):
                raise UserError(f"{_where(config, i)}: is in the YOCO cross-decoder (after the KV layer {kv[0]}) "
                                f"but keeps decode state; only stateless kinds may follow the KV layer "
                                f"({', '.join(stateless_kinds(slot))})")
    return start


def stateless_kinds(slot: str) -> list[str]:
    return sorted(k for s in REGISTRY.values() if s.slot == slot for k in s.kinds if not s.keeps_state(k))


def complete(config: ModelConfig) -> ModelConfig:
    """The config with every layer's record complete and the YOCO structure set (idempotent)."""
    records = [complete_layer(config, i) for i in range(config.n_layer)]
    done = dataclasses.replace(config, layers=records, cross_decoder=0)
    _check_resources(done)
    return dataclasses.replace(done, cross_decoder=_cross_decoder(done))
