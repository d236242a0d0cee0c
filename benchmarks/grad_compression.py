"""Gradient compression on the demo corpus, 2 DDP ranks (gloo, CPU): bytes all-reduced and final losses of
`--grad_compression none | fp16 | bf16 | powersgd:rank=R` under the demo's recipe (Transformer++ d4, ctx 256,
mu-P++, fp32, the same seed, data order and global batch: 2 ranks x micro-batch 4 x 256 = 2,048 tokens).

    python benchmarks/grad_compression.py                      # builds the demo data in --work if needed
    python benchmarks/grad_compression.py --steps 40 --only none,fp16

Each setting is one `torchrun --nproc_per_node=2` launch of this file in worker mode, which calls the trainer's
`pretrain` (so DDP, the counting hook and the checkpoints are the real ones). Bytes are what the hook counted:
the tensors rank 0 handed to all-reduce per step (metrics.csv `comm_bytes`, logged every step). One run each:
a loss difference is one sample of the seed, not a measured distribution.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
SETTINGS = ("none", "fp16", "bf16", "powersgd:rank=4")


def worker(spec: dict) -> None:
    from archscale.demo import DemoSettings, pretrain_config
    from archscale.train.trainer import pretrain

    s = DemoSettings(steps=spec["steps"], precision="fp32")  # b0, token budget, warmup: the demo's (2,048/step)
    # micro-batch 4 on each of the 2 ranks makes the demo's 2,048-token batch (no accumulation, same LR)
    base = dataclasses.replace(pretrain_config(s, "transformer", 64, Path(spec["data"]), Path(spec["out"]),
                                               progress=False), micro_bsz=4, strategy="ddp",
                               grad_compression=spec["method"], log_interval=1)
    pretrain(base, {"ar", "depth"})


def read_run(run: Path) -> dict:
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [r for r in rows if r["train_loss"]]
    comm = [int(r["comm_bytes"]) for r in steps]
    return {"steps": len(steps), "bytes_per_step": sum(comm) / len(comm), "bytes_total": sum(comm),
            "bytes_first": comm[0], "bytes_last": comm[-1], "final_train_loss": float(steps[-1]["train_loss"]),
            "final_val_loss": float([r for r in rows if r["val_loss"]][-1]["val_loss"])}


def launch(method: str, data: Path, out: Path, steps: int) -> float:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    spec = json.dumps({"method": method, "data": str(data), "out": str(out), "steps": steps})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", __file__, "--worker", spec]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="runs/grad_compression")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--only", default=",".join(SETTINGS), help="comma-separated --grad_compression values")
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "archscale"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(json.loads(a.worker))
    from archscale.demo import build_demo_data

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    _, data = build_demo_data(work, Path(a.cache))
    results = {}
    for method in a.only.split(","):
        out = work / method.replace(":", "_").replace("=", "")
        if out.exists():
            import shutil

            shutil.rmtree(out)
        seconds = launch(method, data, out, a.steps)
        results[method] = {**read_run(out), "seconds": seconds}
    ref = results.get("none")
    print(f"\nTransformer++ d4 (demo recipe, fp32), 2 DDP ranks (gloo), {a.steps} steps x 2,048 tokens; one run each")
    print("| --grad_compression | bytes/step/rank (mean) | first -> last step | vs none | final train loss | "
          "final val loss | wall s |\n|---|---:|---:|---:|---:|---:|---:|")
    for method, r in results.items():
        ratio = f"{r['bytes_total'] / ref['bytes_total']:.3f}" if ref else "-"
        print(f"| {method} | {r['bytes_per_step']:,.0f} | {r['bytes_first']:,} -> {r['bytes_last']:,} | {ratio} | "
              f"{r['final_train_loss']:.4f} | {r['final_val_loss']:.4f} | {r['seconds']:.0f} |")
    (work / "grad_compression.json").write_text(json.dumps({"steps": a.steps, "results": results}, indent=1))


if __name__ == "__main__":
    main()
