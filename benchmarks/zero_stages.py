"""ArchScale's ZeRO comparison on CPU: DDP, FSDP2 and DeepSpeed ZeRO 0/1/2/3 (+ optimizer offload), 2 processes.

For each strategy this launches `torchrun --nproc_per_node=2` on this same file in worker mode. A worker builds
the model, wraps it with archscale's own code (parallelize.py / deepspeed_engine.py, the trainer's path), runs
`--steps` fp32 AdamW steps on random tokens and reports, per rank:

* peak memory: the process's peak RSS (getrusage ru_maxrss) minus its RSS just before the model was built, so
  the Python/torch/DeepSpeed baseline is excluded and what remains is parameters, gradients, optimizer states,
  communication buffers and activations;
* resident memory after the steps (RSS minus the same baseline): what stays allocated, without transients;
* step time: the median over the timed steps (after one warm-up step).

Next to it, the ZeRO paper's model-state estimate (Rajbhandari et al. 2020, section 5) for fp32 training,
4 bytes params + 4 grads + 8 Adam (K=8, no separate master copy): DDP and ZeRO-0 16 B/param, ZeRO-1 4+4+8/N,
ZeRO-2 4+(4+8)/N, ZeRO-3 and FSDP2 16/N, with N = 2 ranks. "Offload optimizer" moves the Adam states (and the
step) to host memory; on a CPU machine host memory IS the device memory, so it saves nothing here (the column
shows what it would leave on an accelerator).

    python benchmarks/zero_stages.py                    # all strategies, writes benchmarks/results/zero_stages.json
    python benchmarks/zero_stages.py --only ddp,zero3   # a subset

The first offload run JIT-compiles DeepSpeed's cpu_adam (~1 min, cached in ~/.cache/torch_extensions).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = {  # name -> (strategy, zero_stage, offload, paper bytes/param as a function of N)
    "ddp": ("ddp", None, "none", lambda n: 16.0),
    "fsdp2": ("fsdp", None, "none", lambda n: 16.0 / n),
    "zero0": ("deepspeed", 0, "none", lambda n: 16.0),
    "zero1": ("deepspeed", 1, "none", lambda n: 8.0 + 8.0 / n),
    "zero2": ("deepspeed", 2, "none", lambda n: 4.0 + 12.0 / n),
    "zero3": ("deepspeed", 3, "none", lambda n: 16.0 / n),
    "zero1+offload": ("deepspeed", 1, "optimizer", lambda n: 8.0),  # on the device: params + grads
    "zero2+offload": ("deepspeed", 2, "optimizer", lambda n: 4.0 + 4.0 / n),
    "zero3+offload": ("deepspeed", 3, "optimizer", lambda n: 8.0 / n),
}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(a) -> None:
    import torch
    import torch.nn.functional as F

    from archscale.config import ModelConfig
    from archscale.models.model import GPT
    from archscale.train.distributed import setup
    from archscale.train.optim import GroupRule, build_adamw, param_groups
    from archscale.train.parallelize import parallelize

    strategy, stage, offload, _ = STRATEGIES[a.worker]
    env = setup(strategy)
    torch.manual_seed(0)
    base = rss_mib()
    model = GPT(ModelConfig.from_arch("transformer", a.depth, ar=a.ar, vocab_size=a.vocab, block_size=a.ctx))
    n_params = sum(p.numel() for p in model.parameters())
    model = parallelize(model, env)
    groups = param_groups(model, GroupRule(1.0, 0.1), GroupRule(1.0, 0.0))
    if strategy == "deepspeed":
        from archscale.train.deepspeed_engine import build_engine, ds_config

        cfg = ds_config(micro_bsz=a.micro_bsz, grad_accum=1, world_size=env.world_size, zero_stage=stage,
                        precision="fp32", offload=offload)
        engine = build_engine(model, groups, 1e-3, (0.9, 0.95), 1e-8, cfg)
    else:
        opt = build_adamw(groups, 1e-3, (0.9, 0.95), 1e-8)
    times = []
    g = torch.Generator().manual_seed(env.rank)
    for i in range(a.steps + 1):
        x = torch.randint(0, a.vocab, (a.micro_bsz, a.ctx + 1), generator=g)
        t0 = time.perf_counter()
        if strategy == "deepspeed":
            loss = F.cross_entropy(engine(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            engine.backward(loss)
            engine.step()
        else:
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        env.barrier()
        if i > 0:
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    row = {"rank": env.rank, "params": n_params, "peak_mib": peak - base, "end_mib": rss_mib() - base,
           "step_s": statistics.median(times), "loss": float(loss)}
    Path(a.out).with_suffix(f".rank{env.rank}.json").write_text(json.dumps(row))
    env.barrier()
    env.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--only", default=",".join(STRATEGIES), help="comma-separated subset of " + ",".join(STRATEGIES))
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--ar", type=int, default=128, help="width = ar * depth (default 768)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--micro_bsz", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "zero_stages.json"))
    a = p.parse_args()
    if a.worker:
        return worker(a)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    tmp = Path(a.json).parent / "zero_stages.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    results = []
    for name in a.only.split(","):
        out = tmp / name
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={a.nproc}", "--rdzv_backend=c10d",
               f"--rdzv_endpoint=127.0.0.1:{free_port()}", __file__, "--worker", name, "--out", str(out),
               "--depth", str(a.depth), "--ar", str(a.ar), "--vocab", str(a.vocab), "--ctx", str(a.ctx),
               "--micro_bsz", str(a.micro_bsz), "--steps", str(a.steps)]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            print(f"{name}: FAILED\n{proc.stdout.decode(errors='replace')[-3000:]}", file=sys.stderr)
            continue
        ranks = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(a.nproc)]
        n_params = ranks[0]["params"]
        est = STRATEGIES[name][3](a.nproc) * n_params / 2**20
        results.append({"strategy": name, "params": n_params, "paper_bytes_per_param": STRATEGIES[name][3](a.nproc),
                        "paper_model_states_mib": est, "peak_mib_per_rank": [r["peak_mib"] for r in ranks],
                        "end_mib_per_rank": [r["end_mib"] for r in ranks],
                        "step_s": max(r["step_s"] for r in ranks), "loss": ranks[0]["loss"]})
        r = results[-1]
        print(f"{name:14s} peak/rank {max(r['peak_mib_per_rank']):8.0f} MiB  paper {est:8.0f} MiB  "
              f"step {r['step_s']:.2f} s", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    Path(a.json).write_text(json.dumps({"config": {k: getattr(a, k) for k in
                                                   ("depth", "ar", "vocab", "ctx", "micro_bsz", "steps", "nproc")},
                                        "results": results}, indent=1))
    print("\n| strategy | paper B/param | paper model states MiB/rank | measured peak MiB/rank (r0, r1) | "
          "resident after the steps MiB/rank | step s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        peaks = ", ".join(f"{x:.0f}" for x in r["peak_mib_per_rank"])
        ends = ", ".join(f"{x:.0f}" for x in r["end_mib_per_rank"])
        print(f"| {r['strategy']} | {r['paper_bytes_per_param']:.0f} | {r['paper_model_states_mib']:.0f} | {peaks} | "
              f"{ends} | {r['step_s']:.2f} |")


if __name__ == "__main__":
    main()
