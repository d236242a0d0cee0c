"""Layouts as data: the spec of an architecture (which mixer and feed-forward every layer has, with what options)
and its expansion at a given depth. Pure parsing: this module imports no model code (the mixer registry checks
the kinds and options later, `models/layout_rules.py`).

A spec is a YAML/JSON mapping (a file, one of the specs shipped in `archscale/layouts/`, or a one-line string):

    name: sambay                              # the run name's architecture part
    ar: 124                                   # aspect ratio: width = ar * depth
    layers: "[mamba, swa] * L/2, mamba_mem, kv, [gmu, cross] * rest"
    sliding_window: 128                       # defaults for the layers' options (ModelConfig fields)
    nope: true
    yoco: true                                # layers after the single KV layer form YOCO's cross-decoder
    law: [14.5, 144]                          # ArchScale's hand-entered N(d) = (a ar^2 + b ar) d^3, if any
    depth_multiple: 4

`layers` is a comma-separated list of segments. A segment is an ENTRY (one layer) or `[ENTRY, ...] * COUNT`
(the pattern repeated cyclically over COUNT layers; `ENTRY * COUNT` repeats one entry). COUNT is an integer, `L`
(the depth), `L/k`, `aL/k`, or `rest` (the layers the other segments leave; at most one segment). An ENTRY is
`MIXER[(option=value, ...)][:FFN]`, e.g. `swa(window=512)`, `attn(da)`, `kv:mlp_mem`, `mamba:moe`; FFN defaults
to the layout's `ffn` (default "mlp"). The one-line string form is the `layers` expression, optionally followed by
`; key=value` pairs for the other keys: `"[mamba2, mamba2, mamba2, swa] * L; sliding_window=512; ar=128"`.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import yaml

from archscale.errors import UserError

_ENTRY = re.compile(r"(?P<mixer>[a-z][a-z0-9_]*)\s*(\((?P<opts>[^()]*)\))?\s*(:\s*(?P<ffn>[a-z][a-z0-9_]*))?")
_COUNT = re.compile(r"(?P<a>\d+)?\s*L\s*(/\s*(?P<k>\d+))?")
SHIPPED = Path(__file__).parent / "layouts"


@dataclass(frozen=True)
class LayerEntry:
    """One layer as the spec wrote it: its mixer kind, feed-forward kind and explicitly given options."""

    mixer: str
    ffn: str
    options: tuple = ()  # ((name, value), ...) as written (aliases such as `window` resolved by the registry)


@dataclass(frozen=True)
class LayoutSpec:
    """An architecture as data (see the module docstring for the grammar)."""

    name: str
    layers: str
    ar: int = 128
    description: str = ""
    sliding_window: int = 0  # default window of sliding-window layers; 0: the spec has none
    nope: bool = False  # default: no positional encoding in attention layers
    use_da: bool = False  # default: differential attention in attention layers
    yoco: bool = False
    depth_multiple: int = 1
    law: Optional[tuple] = None  # (a, b): ArchScale's N(d) = (a ar^2 + b ar) d^3; None: counted from the model
    ffn: str = "mlp"
    preset: dict = field(default_factory=dict)  # fixed ModelConfig values (e.g. Phi4-mini-Flash's sizes)
    mixer_options: dict = field(default_factory=dict)  # {mixer name: {field: value}}
    source: str = ""  # where it was read from (a shipped file's name, a path, "string")

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]*", self.name):
            raise UserError(f"layout name {self.name!r} must be lower-case letters and digits (it names runs: "
                            f"'<name>_d<depth>')")
        if self.law is not None and (len(self.law) != 2 or not all(isinstance(v, (int, float)) for v in self.law)):
            raise UserError(f"layout {self.name}: law must be two numbers [a, b] (got {self.law!r})")
        if self.depth_multiple < 1 or self.ar < 2:
            raise UserError(f"layout {self.name}: depth_multiple must be >= 1 and ar >= 2")
        parse_layers(self.layers, self.name)  # a syntax error is found when the spec is read

    # ------------------------------------------------------------------ compatibility with the old ArchSpec
    def layout(self, n_layer: int) -> list[str]:
        return [e.mixer for e in self.expand(n_layer)]

    def ffn_layout(self, n_layer: int) -> list[str]:
        return [e.ffn for e in self.expand(n_layer)]

    def n_mult(self, ar: float) -> float:
        if self.law is None:
            raise UserError(f"layout {self.name} has no hand-entered parameter law (its parameters are counted)")
        a, b = self.law
        return a * ar**2 + b * ar

    def expand(self, n_layer: int) -> list[LayerEntry]:
        """The entry of every layer at depth `n_layer` (one-line errors naming the segment and the rule)."""
        if n_layer % self.depth_multiple:
            raise UserError(f"{self.name} needs a depth divisible by {self.depth_multiple} (got {n_layer})")
        return expand_layers(self.layers, n_layer, self.ffn, self.name)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["law"] = list(self.law) if self.law is not None else None
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "LayoutSpec":
        if not isinstance(d, dict):
            raise UserError(f"layout {where}: expected a mapping of keys (name, layers, ...), got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"layout {where}: unknown key(s) {unknown}; known: {sorted(known)}")
        missing = [k for k in ("name", "layers") if k not in d]
        if missing:
            raise UserError(f"layout {where}: missing key(s) {missing}")
        d = dict(d)
        for key, typ in (("ar", int), ("sliding_window", int), ("depth_multiple", int), ("nope", bool),
                         ("use_da", bool), ("yoco", bool), ("name", str), ("layers", str), ("ffn", str),
                         ("description", str), ("preset", dict), ("mixer_options", dict), ("source", str)):
            if key in d and (not isinstance(d[key], typ) or (typ is int and isinstance(d[key], bool))):
                raise UserError(f"layout {where}: {key} must be {typ.__name__} (got {d[key]!r})")
        if d.get("law") is not None:
            d["law"] = tuple(d["law"]) if isinstance(d["law"], (list, tuple)) else d["law"]
        return cls(**d)


# ------------------------------------------------------------------------------------------------ grammar
def _split_top(text: str, sep: str) -> list[str]:
    """Split on `sep` outside brackets and parentheses."""
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += ch in "[("
        depth -= ch in "])"
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _value(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        raise UserError(f"layout {where}: cannot read option value {text!r}") from None


def parse_entry(text: str, default_ffn: str, where: str) -> LayerEntry:
    m = _ENTRY.fullmatch(text.strip())
    if not m:
        raise UserError(f"layout {where}: {text.strip()!r} is not a layer (MIXER[(option=value, ...)][:FFN], "
                        "e.g. swa(window=512):mlp)")
    opts = []
    for item in filter(None, (s.strip() for s in (m["opts"] or "").split(","))):
        key, _, raw = item.partition("=")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", key.strip()):
            raise UserError(f"layout {where}: {item!r} in {text.strip()!r} is not an option (name=value)")
        opts.append((key.strip(), _value(raw, where) if raw.strip() else True))
    return LayerEntry(m["mixer"], m["ffn"] or default_ffn, tuple(opts))


def parse_layers(expr: str, where: str, default_ffn: str = "mlp") -> list[tuple[list[LayerEntry], str]]:
    """[(pattern, count expression), ...]; count "" means one layer per entry (no `* COUNT`)."""
    segments = []
    for seg in _split_top(expr, ","):
        if not seg:
            raise UserError(f"layout {where}: empty segment in {expr!r}")
        pieces = _split_top(seg, "*")
        if len(pieces) > 2:
            raise UserError(f"layout {where}: {seg!r} has more than one '*'")
        body, count = (pieces[0], pieces[1]) if len(pieces) == 2 else (seg, "")
        body = body.strip()
        if body.startswith("["):
            if not body.endswith("]"):
                raise UserError(f"layout {where}: unbalanced brackets in {seg!r}")
            entries = [parse_entry(e, default_ffn, where) for e in _split_top(body[1:-1], ",")]
        else:
            entries = [parse_entry(body, default_ffn, where)]
        count = count.strip()
        if count and count != "rest" and not count.isdigit() and not _COUNT.fullmatch(count):
            raise UserError(f"layout {where}: {count!r} in {seg!r} is not a layer count (an integer, L, L/k, aL/k "
                            "or rest)")
        segments.append((entries, count))
    return segments


def _count(count: str, n_layer: int, seg: str, where: str) -> int:
    if count.isdigit():
        return int(count)
    m = _COUNT.fullmatch(count)
    a, k = int(m["a"] or 1), int(m["k"] or 1)
    if (a * n_layer) % k:
        raise UserError(f"layout {where}: {count} in '{seg}' is not a whole number of layers at depth {n_layer}")
    return a * n_layer // k


def expand_layers(expr: str, n_layer: int, default_ffn: str, where: str) -> list[LayerEntry]:
    segments = parse_layers(expr, where, default_ffn)
    if sum(c == "rest" for _, c in segments) > 1:
        raise UserError(f"layout {where}: only one segment may use 'rest'")
    sizes = []
    for entries, count in segments:
        label = f"[{', '.join(e.mixer for e in entries)}] * {count}"
        sizes.append(len(entries) if not count else None if count == "rest"
                     else _count(count, n_layer, label, where))
    fixed = sum(s for s in sizes if s is not None)
    if fixed > n_layer or (None not in sizes and fixed != n_layer):
        raise UserError(f"layout {where}: the segments make {fixed} layers but the depth is {n_layer} (use L-relative "
                        "counts or 'rest')")
    out: list[LayerEntry] = []
    for (entries, _), size in zip(segments, sizes):
        size = n_layer - fixed if size is None else size
        out += [entries[i % len(entries)] for i in range(size)]
    return out


def layer_label(layer: dict) -> str:
    """A layer record as one compact string: `swa(sliding_window=128, nope=True):mlp`."""
    opts = ", ".join(f"{k}={v}" for k, v in layer.items() if k not in ("mixer", "ffn"))
    return f"{layer['mixer']}({opts}):{layer['ffn']}" if opts else f"{layer['mixer']}:{layer['ffn']}"


# ------------------------------------------------------------------------------------------------ loading
def shipped_specs() -> dict[str, LayoutSpec]:
    """Every spec shipped with the package: `architectures.yaml` (ArchScale's) and one file per other hybrid."""
    specs: dict[str, LayoutSpec] = {}
    for path in sorted(SHIPPED.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        items = doc if isinstance(doc, list) else [doc]
        for d in items:
            spec = LayoutSpec.from_dict({**d, "source": path.name}, f"{path.name}:{d.get('name', '?')}")
            if spec.name in specs:
                raise ValueError(f"layout {spec.name!r} shipped twice")
            specs[spec.name] = spec
    return specs


def read_layout(ref: str, named: dict[str, LayoutSpec]) -> LayoutSpec:
    """A spec from a shipped name, a YAML/JSON file, or the one-line string form."""
    ref = ref.strip()
    if ref in named:
        return named[ref]
    path = Path(ref)
    if path.suffix.lower() in (".yaml", ".yml", ".json") or path.is_file():
        if not path.is_file():
            raise UserError(f"--layout {ref}: no such file")
        try:
            text = path.read_text(encoding="utf-8")
            doc = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
        except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as e:
            raise UserError(f"--layout {ref}: cannot read it ({type(e).__name__}: {str(e).splitlines()[0][:120]})") \
                from None
        return LayoutSpec.from_dict({**doc, "source": str(path)} if isinstance(doc, dict) else doc, ref)
    return LayoutSpec.from_dict({**_one_line(ref, named), "source": "string"}, repr(ref))


def _one_line(ref: str, named: dict[str, LayoutSpec]) -> dict[str, Any]:
    parts = _split_top(ref, ";")
    d: dict[str, Any] = {"name": "custom", "layers": parts[0]}
    for part in parts[1:]:
        key, eq, raw = part.partition("=")
        if not eq:
            raise UserError(f"--layout {ref!r}: {part!r} is not key=value")
        d[key.strip()] = _value(raw, repr(ref))
    if len(parts) == 1 and re.fullmatch(r"[a-z][a-z0-9_]*", parts[0]):  # a bare word: a mistyped name, surely
        raise UserError(f"--layout {ref!r}: not a shipped layout name ({', '.join(sorted(named))}), a spec file, or "
                        "a layers expression such as 'attn * L'")
    return d
