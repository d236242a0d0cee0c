"""The trainer's own optimizer step (`Trainer.train_step`: micro-batches, forward/backward, non-finite guard, clip,
AdamW) timed on synthetic tokens, one process. Prints one JSON line: the median step time over `--steps` steps
after `--warmup`, and the host reads of tensors per step (train/host_sync.py; on CUDA only reads of CUDA tensors
count: those are the host syncs).

Before/after a change, run the same command with each source tree first on PYTHONPATH, alternating, and compare
the medians (docs/BENCHMARKS.md quotes the ratio):

    PYTHONPATH=src .venv/bin/python benchmarks/step_time.py --steps 30
    PYTHONPATH=/tmp/old/src .venv/bin/python benchmarks/step_time.py --steps 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time


def step_times(depth: int, ctx: int, micro_bsz: int, accum: int, steps: int, warmup: int,
               extra: tuple = ()) -> dict:
    """Median seconds per `Trainer.train_step` and host reads per step (None where not countable)."""
    import torch

    from archscale.cli import parse_pretrain
    from archscale.train.distributed import DistEnv
    from archscale.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        args = ["--train_data_dir", "synthetic", "--vocab_size", "512", "--train_model", "transformer", "--depth",
                str(depth), "--ctx_len", str(ctx), "--micro_bsz", str(micro_bsz), "--base_hps.b0",
                str(micro_bsz * ctx * accum), "--max_tokens", str(micro_bsz * ctx * accum * (steps + warmup + 1)),
                "--eval_iters", "0", "--progress", "false", "--precision", "fp32", "--out_dir", f"{tmp}/run",
                "--resume", "none", "--logger", "csv", *extra]
        cfg, explicit = parse_pretrain(args)
        env = DistEnv(device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        trainer = Trainer(cfg, explicit, env, log=lambda msg: None)
        try:
            for _ in range(warmup):
                trainer.train_step(trainer.state, trainer.loader)
            times, reads = [], None
            try:
                from archscale.train.host_sync import count_host_reads
            except ImportError:  # an older source tree
                count_host_reads = None
            for _ in range(steps):
                sync()
                t0 = time.perf_counter()
                trainer.train_step(trainer.state, trainer.loader)
                sync()
                times.append(time.perf_counter() - t0)
            if count_host_reads is not None:
                with count_host_reads("cuda" if env.device.type == "cuda" else None) as counted:
                    trainer.train_step(trainer.state, trainer.loader)
                reads = counted.count
        finally:
            trainer.close()
    return {"median_step_s": statistics.median(times), "min_step_s": min(times), "steps": steps,
            "host_reads_per_step": reads, "tokens_per_step": micro_bsz * ctx * accum}


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--micro_bsz", type=int, default=2)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args(argv)
    print(json.dumps(step_times(a.depth, a.ctx, a.micro_bsz, a.accum, a.steps, a.warmup)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
