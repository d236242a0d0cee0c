"""`archscale layout SPEC --depth D [--ctx N] [--check]`: what a layout builds, before anything trains.

Prints one row per layer (mixer, feed-forward, options, the state it keeps when decoding, parameters, forward
FLOPs per token at --ctx), the totals, the mu-P++ role of every parameter kind, and with --check the contract
verdicts at a tiny width (`archscale/layout_check.py`). Exit 1 when a check fails, 2 for a spec that is not valid.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import torch

from archscale.config import LAYOUTS, ModelConfig, resolve_layout
from archscale.errors import UserError
from archscale.layout import LayoutSpec


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="archscale layout", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", nargs="?", help="a shipped layout name, a YAML/JSON spec file, or a one-line spec such as "
                                           "\"[mamba2, mamba2, mamba2, swa] * L; sliding_window=512\"")
    p.add_argument("--depth", type=int, default=8, help="number of layers (width = ar x depth); default 8")
    p.add_argument("--ar", type=int, default=None, help="aspect ratio override (default: the layout's)")
    p.add_argument("--ctx", type=int, default=4096, help="context length for the FLOPs column (default 4096)")
    p.add_argument("--check", action="store_true", help="run the contract checks at a tiny width (about a minute)")
    p.add_argument("--list", action="store_true", help="list the shipped layouts and exit")
    p.add_argument("--json", action="store_true", help="print the table (and verdicts) as JSON")
    a = p.parse_args(argv)
    if not a.list and not a.spec:
        raise UserError("archscale layout: give a SPEC (a name, a file or a one-line spec), or --list")
    for flag in ("depth", "ctx"):
        if getattr(a, flag) < 1:
            raise UserError(f"--{flag} must be >= 1 (got {getattr(a, flag)})")
    return a


def decode_state(config: ModelConfig, i: int) -> str:
    """What layer i keeps between decoded tokens, from its mixer's declared state type."""
    from archscale.models.mixers import spec_for

    layer = config.layers[i]
    spec = spec_for(layer["mixer"])
    if config.cross_decoder and i >= config.cross_decoder or not spec.keeps_state(layer["mixer"]):
        return "none"
    if layer.get("sliding_window"):
        return f"last {layer['sliding_window'] - 1} K/V"
    return spec.state.__name__ if spec.state is not None else "none"


def short_label(layer: dict) -> str:
    """`swa(window=128, nope):mlp`: options by their short names (the registry's first alias), true flags by name,
    false ones left out."""
    from archscale.models.mixers import REGISTRY

    alias = {o.field: (o.aliases or (o.field,))[0] for s in REGISTRY.values() for o in s.layer_options}
    opts = [alias.get(k, k) if v is True else f"{alias.get(k, k)}={v}"
            for k, v in layer.items() if k not in ("mixer", "ffn") and v is not False]
    return f"{layer['mixer']}({', '.join(opts)}):{layer['ffn']}" if opts else f"{layer['mixer']}:{layer['ffn']}"


def layer_rows(model, ctx: int) -> list[dict]:
    from archscale.models import accounting
    from archscale.models.mixers import spec_for

    cfg = model.config
    rows = []
    for i, block in enumerate(model.blocks):
        params = sum(p.numel() for p in block.parameters())
        matmul = sum(p.numel() * accounting.active_fraction(cfg, f"blocks.{i}.{n}")
                     for n, p in block.named_parameters()
                     if accounting.role_of(cfg, f"blocks.{i}.{n}").init in ("scheme", "output"))
        view = cfg.layer_config(i)
        extra = sum(sum(spec_for(k, slot).flops(view, k, ctx).values())
                    for slot, k in (("mixer", cfg.layers[i]["mixer"]), ("ffn", cfg.layers[i]["ffn"])))
        rows.append({"layer": i, "spec": short_label(cfg.layers[i]), "record": cfg.layers[i], "decode_state": decode_state(cfg, i),
                     "params": params, "flops_per_token": 2 * matmul + extra})
    return rows


def role_table(model) -> dict[str, list[str]]:
    """The mu-P++ treatment of every parameter kind: matrix-like (width-scaled LR, decayed) or vector-like."""
    from archscale.models import accounting

    groups: dict[str, set] = defaultdict(set)
    for name, _, role in accounting.named_roles(model):
        spec, rel = accounting.owner(model.config, name)
        label = f"{spec.name}.{rel}" if spec is not None else accounting.clean_name(name).split(".")[0]
        if label.startswith("blocks"):
            label = "norms"
        groups[f"{role.group} (init: {role.init})"].add(label)
    return {k: sorted(v) for k, v in sorted(groups.items())}


def describe(spec: LayoutSpec, depth: int, ar: int | None, ctx: int) -> dict:
    """The layout at `depth` on the meta device (no memory): rows, totals, roles."""
    from archscale.models.model import GPT

    with torch.device("meta"):
        model = GPT(ModelConfig.from_layout(spec, depth, ar=ar))
    cfg = model.config
    return {"layout": spec.name, "source": spec.source, "description": spec.description, "depth": depth,
            "width": cfg.n_embd, "heads": f"{cfg.n_head} (KV {cfg.n_query_groups}) x {cfg.head_size}",
            "cross_decoder_start": cfg.cross_decoder_start, "ctx": ctx, "layers": layer_rows(model, ctx),
            "params": model.num_params(non_embedding=False), "params_non_embedding": model.num_params(),
            "params_active_non_embedding": model.num_params(active=True),
            "flops_per_token_forward": model.flops_per_token(ctx, training=False),
            "params_law": (f"ArchScale's law {spec.law[0]:g} ar^2 + {spec.law[1]:g} ar per depth^3"
                           if spec.law else "counted from the model"),
            "roles": role_table(model)}


def print_table(info: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 120)
    title = (f"{info['layout']} at depth {info['depth']}: width {info['width']}, heads {info['heads']}"
             + (f", cross-decoder from layer {info['cross_decoder_start']}" if info["cross_decoder_start"] else ""))
    table = Table(title=title)
    for col in ("layer", "mixer(options):ffn", "decode state", "params", f"FLOPs/token @ {info['ctx']}"):
        table.add_column(col, justify="right" if col in ("layer", "params") or col.startswith("FLOPs") else "left")
    for r in info["layers"]:
        table.add_row(str(r["layer"]), r["spec"], r["decode_state"], f"{r['params']:,}", f"{r['flops_per_token']:.3g}")
    console.print(table)
    console.print(f"parameters: {info['params']:,} total, {info['params_non_embedding']:,} non-embedding "
                  f"({info['params_active_non_embedding']:,} active); token budget's N(d): {info['params_law']}")
    console.print(f"forward FLOPs/token at ctx {info['ctx']}: {info['flops_per_token_forward']:.4g} (training 3x)")
    console.print("mu-P++ roles (matrix: LR and init scaled with width, decayed; vector: neither):")
    for role, names in info["roles"].items():
        console.print(f"  {role}: {', '.join(names)}")


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if a.list:
        for name, spec in sorted(LAYOUTS.items()):
            print(f"{name:15s} {spec.source:20s} {spec.layers}")
        return 0
    spec = resolve_layout(a.spec)
    info = describe(spec, a.depth, a.ar, a.ctx)
    verdicts = []
    if a.check:
        from archscale.layout_check import check_layout
        verdicts = check_layout(spec, a.depth)
    if a.json:
        print(json.dumps({**info, "checks": [v.__dict__ for v in verdicts]}, indent=2))
    else:
        print_table(info)
        for v in verdicts:
            print(f"{'PASS' if v.ok else 'FAIL'}  {v.check}: {v.detail}")
    if verdicts and not all(v.ok for v in verdicts):
        print(f"{sum(not v.ok for v in verdicts)} of {len(verdicts)} contract checks failed", file=sys.stderr)
        return 1
    return 0
