"""The build peak per rank of an FSDP2 model: eager init (every rank builds the full fp32 model, then shards it)
against meta-device init (train/meta_init.py: built on meta, sharded, initialised shard by shard).

For each mode this launches `torchrun --nproc_per_node=N` on this file in worker mode. A worker seeds, builds the
model the way the trainer does for FSDP2 (eager: `GPT(config)` then `parallelize.apply_fsdp`; meta:
`meta_init.build_on_meta`, `apply_fsdp`, `meta_init.materialize`), and measures the build:

* live tensors: the peak of the bytes held by live CPU tensor storages during the build
  (`memory_measure.LivePeak`: every op's outputs, each storage once), and what is left after it;
* resident set: the peak RSS during the build (VmHWM, reset just before it) minus the RSS just before it, with
  MALLOC_MMAP_THRESHOLD_=65536 so freed tensors leave the resident set (as benchmarks/zero_stages.py).

Expected: eager ~ the full model (4 B/param) plus the shards being copied out of it; meta ~ this rank's shards
(4/N B/param) plus the largest single parameter in full (the scratch its draw is made in) plus, during the
draws, mixers' small scratch vectors.

    python benchmarks/meta_init_memory.py    # Transformer++ d8, width 1024, vocab 32000 (187M), 2 ranks;
                                             # ~2 min on 2 cores; benchmarks/results/meta_init_memory.json
    python benchmarks/meta_init_memory.py --depth 2 --ar 128 --vocab 4096   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
MIB = 2 ** 20


def model_config(args):
    from archscale import ModelConfig

    return ModelConfig.from_arch(args.arch, args.depth, ar=args.ar, vocab_size=args.vocab, block_size=64)


def build(mode: str, cfg, seed: int = 0):
    import torch

    from archscale.models.model import GPT
    from archscale.train import meta_init
    from archscale.train.parallelize import apply_fsdp

    torch.manual_seed(seed)
    model = meta_init.build_on_meta(cfg) if mode == "meta" else GPT(cfg)
    apply_fsdp(model, bf16=False, cpu_offload=False)
    if mode == "meta":
        meta_init.materialize(model, "cpu")
    return model


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from archscale.train.memory_measure import LivePeak
    from zero_stages import hwm_mib, reset_hwm, rss_mib

    dist.init_process_group("gloo")
    cfg = model_config(args)
    # warm-up: a tiny model built the same way loads every module and allocates the process group's and torch's
    # one-off buffers before the baseline, so the numbers below grow with the model only
    build(args.mode, model_config(argparse.Namespace(arch=args.arch, depth=1, ar=64, vocab=256)))
    dist.barrier()
    before = rss_mib()
    reset_hwm()
    start = time.perf_counter()
    with LivePeak() as census:
        base = census.current
        model = build(args.mode, cfg)
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    out = dict(mode=args.mode, nproc=dist.get_world_size(), rank=dist.get_rank(), params=params,
               largest_param=largest, live_peak_mib=(census.peak - base) / MIB,
               live_after_mib=(census.current - base) / MIB, rss_peak_mib=hwm_mib() - before,
               seconds=seconds)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{args.mode}-rank{out['rank']}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def launch(args, mode: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", __file__, "--worker", mode,
           "--out", args.out, "--arch", args.arch, "--depth", str(args.depth), "--ar", str(args.ar),
           "--vocab", str(args.vocab)]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return [json.loads((Path(args.out) / f"{mode}-rank{r}.json").read_text()) for r in range(args.nproc)]


def table(rows: list[dict]) -> str:
    lines = ["| N | init | params | model MiB (fp32) | expected MiB/rank | live-tensor peak MiB/rank | "
             "left after build MiB/rank | RSS peak MiB/rank | build s |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        model = 4 * r["params"] / MIB
        expected = model if r["mode"] == "eager" else model / r["nproc"] + 4 * r["largest_param"] / MIB
        lines.append(f"| {r['nproc']} | {r['mode']} (rank {r['rank']}) | {r['params']:,} | {model:.0f} | "
                     f"{expected:.0f} | {r['live_peak_mib']:.0f} | {r['live_after_mib']:.0f} | "
                     f"{r['rss_peak_mib']:.0f} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=("eager", "meta"))
    p.add_argument("--out", help="where the workers write their rows (default: a temporary folder)")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "meta_init_memory.json"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--arch", default="transformer")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--ar", type=int, default=128, help="aspect ratio: width = ar x depth")
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()
    if args.worker:
        args.mode = args.worker
        return worker(args)
    args.out = args.out or tempfile.mkdtemp(prefix="meta_init_memory-")
    rows = [row for mode in ("eager", "meta") for row in launch(args, mode)]
    print(table(rows))
    Path(args.results).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
