"""The sequence-length curriculum on the demo corpus: one Transformer++ run without and one with
`--curriculum seqlen:start=S,steps=N`, the demo's recipe otherwise (data order, seed, token budget, mu-P++), and
the validation loss (always at the full --ctx_len) of both at the same token counts.

    python benchmarks/curriculum_demo.py --work runs/curriculum_demo    # builds the demo data there if needed

One run each: the difference is one sample of the seed, not a measured distribution.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
from pathlib import Path


def val_curve(run: Path) -> dict[int, float]:
    with open(run / "metrics.csv", newline="") as f:
        return {int(r["tokens"]): float(r["val_loss"]) for r in csv.DictReader(f) if r["val_loss"]}


def main() -> None:
    from archscale.demo import DemoSettings, build_demo_data, pretrain_config
    from archscale.train.trainer import pretrain

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="runs/curriculum_demo")
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--curriculum", default=None, help="default seqlen:start=32,steps=<steps/2>,schedule=linear")
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "archscale"))
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    _, data = build_demo_data(work, Path(a.cache))
    s = DemoSettings(steps=a.steps, precision="fp32")
    spec = a.curriculum or f"seqlen:start=32,steps={a.steps // 2},schedule=linear"
    curves = {}
    for label, curriculum in (("baseline", "none"), ("curriculum", spec)):
        cfg = dataclasses.replace(pretrain_config(s, "transformer", 64, data, work / label, progress=False),
                                  curriculum=curriculum, log_interval=1)
        pretrain(cfg, {"ar", "depth"})
        curves[label] = val_curve(work / label)
    tokens = sorted(set(curves["baseline"]) & set(curves["curriculum"]))
    print(f"\nTransformer++ d{s.depth}, ctx {s.ctx_len}, {s.max_tokens:,} tokens, curriculum {spec}; one run each")
    print("| tokens | val loss, no curriculum | val loss, curriculum | difference |\n|---:|---:|---:|---:|")
    for t in tokens:
        b, c = curves["baseline"][t], curves["curriculum"][t]
        print(f"| {t:,} | {b:.4f} | {c:.4f} | {c - b:+.4f} |")
    (work / "curriculum_demo.json").write_text(json.dumps({"curriculum": spec, "curves": curves}, indent=1))


if __name__ == "__main__":
    main()
