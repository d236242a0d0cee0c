"""The memory model (`archscale.train.memory_model`) against measurement, on this CPU.

For every architecture family (transformer, mamba, Mamba-2 (mambay2), a Gated DeltaNet layout (gdny), samba,
sambay, sambayda, an MoE transformer) at ctx 512 / 2048 / 8192, with and without --act_ckpt, in one process; then
DDP / FSDP2 / DeepSpeed ZeRO-2 / ZeRO-3 at 2 ranks (torchrun, gloo): the predicted peak per rank (the dry run's
`memory.per_rank_peak_gib`, CPU kernels, allocator factor 1) beside the measured one. Measured = the peak of the
bytes held by live tensors over one steady-state optimizer step of the trainer's own setup
(`memory_measure.LivePeak`: the census of live tensors `benchmarks/zero_stages.py` takes, after every op; the CPU
analogue of torch.cuda.max_memory_allocated). bf16-mixed, micro-batch 1, vocab 2048, tiny widths so the whole
table runs in minutes on 2 cores.

    python benchmarks/memory_model.py                 # everything; JSON in benchmarks/results/memory_model.json
    python benchmarks/memory_model.py --only transformer,mamba --ctx 512 --no_dist
    python benchmarks/memory_model.py --measured a.json,b.json   # re-predict saved measurements (the model changed)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# family -> PretrainConfig fields (tiny: width 128)
FAMILIES = {
    "transformer": dict(train_model="transformer", depth=4, ar=32),
    "mamba": dict(train_model="mamba", depth=4, ar=32),
    "mamba2": dict(train_model="mambay2", depth=4, ar=32),
    "gdny": dict(train_model="gdny", depth=4, ar=32),
    "samba": dict(train_model="samba", depth=4, ar=32),
    "sambay": dict(train_model="sambay", depth=4, ar=32),
    "sambayda": dict(train_model="sambayda", depth=8, ar=16),  # differential attention pairs heads: depth 8
    "moe": dict(train_model="transformer", depth=4, ar=32, moe="4:2"),
}
STRATEGIES = {"ddp": dict(strategy="ddp"), "fsdp2": dict(strategy="fsdp"),
              "zero2": dict(strategy="deepspeed", zero_stage=2), "zero3": dict(strategy="deepspeed", zero_stage=3)}
MIB = 2 ** 20


def fields_for(family: str, ctx: int, act_ckpt: bool, world: int = 1, width: int = 128, **extra) -> dict:
    fam = dict(FAMILIES[family])
    fam["ar"] = width // fam["depth"]  # the same width for every family (default 128)
    return {"train_data_dir": "synthetic", "vocab_size": 2048, "ctx_len": ctx, "micro_bsz": 1, "max_tokens": 1e7,
            "act_ckpt": act_ckpt, "strategy": "single", "base_hps": {"b0": ctx * world},
            **fam, **extra}


def predicted_bytes(fields: dict, world: int) -> float:
    from archscale.scaling_rules import BaseHyperparameters
    from archscale.train.config import PretrainConfig
    from archscale.train.memory_model import predict_memory, shape_of
    from archscale.train.trainer import make_plan

    cfg = PretrainConfig(**{**fields, "base_hps": BaseHyperparameters(**fields["base_hps"])})
    _, model_cfg = make_plan(dataclasses.replace(cfg), set(), world_size=world, warn=lambda s: None)
    return predict_memory(model_cfg, shape_of(cfg, world, device="cpu"))["peak_bytes"]


def measured_bytes(fields: dict, world: int) -> float:
    from archscale.scaling_rules import BaseHyperparameters
    from archscale.train.config import PretrainConfig
    from archscale.train.memory_measure import measure_distributed, measure_training_peak

    if world > 1:
        return max(r["peak_bytes"] for r in measure_distributed(fields, world))
    cfg = PretrainConfig(**{**fields, "base_hps": BaseHyperparameters(**fields["base_hps"])})
    return measure_training_peak(cfg)["peak_bytes"]


def row(label: str, family: str, ctx: int, ckpt: bool, world: int, fields: dict, max_mib: float) -> dict:
    pred = predicted_bytes(fields, world)
    out = {"family": family, "ctx": ctx, "act_ckpt": ckpt, "strategy": label, "ranks": world,
           "width": fields["ar"] * fields["depth"],
           "predicted_mib": pred / MIB}
    if pred / MIB > max_mib:
        out.update(measured_mib=None, error=None, note=f"skipped: predicted above --max_mib {max_mib:.0f}")
        return out
    t0 = time.perf_counter()
    meas = measured_bytes(fields, world)
    out.update(measured_mib=meas / MIB, error=pred / meas - 1, seconds=time.perf_counter() - t0)
    return out


def table(rows: list[dict]) -> str:
    lines = ["| family | width | ctx | act_ckpt | strategy | ranks | predicted MiB/rank | measured MiB/rank | error |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        meas = f"{r['measured_mib']:.1f}" if r["measured_mib"] is not None else "-"
        err = f"{100 * r['error']:+.1f}%" if r["error"] is not None else r.get("note", "-")
        lines.append(f"| {r['family']} | {r.get('width', 128)} | {r['ctx']} | {'yes' if r['act_ckpt'] else 'no'} | "
                     f"{r['strategy']} | "
                     f"{r['ranks']} | {r['predicted_mib']:.1f} | {meas} | {err} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(FAMILIES), help="families, comma-separated")
    p.add_argument("--ctx", default="512,2048,8192")
    p.add_argument("--no_dist", action="store_true", help="leave out the 2-rank strategies")
    p.add_argument("--width", type=int, default=128, help="n_embd of every family (depth 4; sambayda 8)")
    p.add_argument("--max_mib", type=float, default=3072.0, help="skip a row predicted above this (MiB)")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "memory_model.json"))
    p.add_argument("--measured", default=None, help="JSON files of earlier runs: predict their rows again, print")
    a = p.parse_args()
    if a.measured:
        return summarize([repredict(r) for f in a.measured.split(",") for r in json.loads(Path(f).read_text())])
    rows, out = [], Path(a.results)
    out.parent.mkdir(parents=True, exist_ok=True)

    def add(r: dict) -> None:  # printed and saved as it comes: a long run interrupted keeps its rows
        rows.append(r)
        print(table([r]).splitlines()[-1], flush=True)
        out.write_text(json.dumps(rows, indent=1))

    ctxs = [int(c) for c in a.ctx.split(",")]
    for ctx in ctxs:
        for family in a.only.split(","):
            for ckpt in (False, True):
                add(row("single", family, ctx, ckpt, 1, fields_for(family, ctx, ckpt, width=a.width), a.max_mib))
        if not a.no_dist and ctx == min(ctxs):
            for label, extra in STRATEGIES.items():
                fields = fields_for("transformer", ctx, False, world=2, width=a.width, **extra)
                add(row(label, "transformer", ctx, False, 2, fields, a.max_mib))
    summarize(rows)


def repredict(r: dict) -> dict:
    """A saved row with the current memory model's prediction (the measurement is kept as it was)."""
    family, ctx, ckpt, world = r["family"], r["ctx"], r["act_ckpt"], r["ranks"]
    extra = STRATEGIES[r["strategy"]] if world > 1 else {}
    fields = fields_for(family, ctx, ckpt, world=world, width=r.get("width", 128), **extra)
    if world > 1 and "width" not in r:  # rows of the first run: transformer depth 8 at width 256 (ar 32)
        fields.update(depth=8, ar=32)
    pred = predicted_bytes(fields, world) / MIB
    meas = r["measured_mib"]
    return {**r, "width": fields["ar"] * fields["depth"], "predicted_mib": pred,
            "error": pred / meas - 1 if meas else None}


def summarize(rows: list[dict]) -> None:
    done = [r for r in rows if r["error"] is not None]
    worst = max(done, key=lambda r: abs(r["error"])) if done else None
    print("\n" + table(rows))
    if worst:
        within = sum(abs(r["error"]) <= 0.15 for r in done)
        print(f"\n{within}/{len(done)} measured rows within 15%; worst {100 * worst['error']:+.1f}% "
              f"({worst['family']} ctx {worst['ctx']} {worst['strategy']})")


if __name__ == "__main__":
    main()
