"""Where each ZeRO stage's memory goes, on CPU: DDP, FSDP2 and DeepSpeed ZeRO 0/1/2/3 on 2 and 4 processes.

For each (strategy, world size) this launches `torchrun --nproc_per_node=N` on this same file in worker mode. A
worker goes through the trainer's own code path: the strategy classes' `build_model()` and `build_optimizer()` (so DeepSpeed gets
`deepspeed_engine.ds_config`), bf16-mixed autocast, AdamW, then `--steps` optimizer steps of
`strategy.backward` / `strategy.clip_and_step` on synthetic tokens (`data/synthetic.py`). It samples its memory:

* baseline: the resident set (RSS) once torch, DeepSpeed and the process group are up and warmed up (one bf16
  forward/backward of a tiny model and one collective), before the model is built; every number below is
  relative to it. Workers run with MALLOC_MMAP_THRESHOLD_=65536, so a freed tensor leaves the resident set;
* build: the peak RSS while the model is built and wrapped (VmHWM), and what stays resident after it;
* steady state: the peak RSS over the optimizer steps after the first (VmHWM, reset through
  /proc/self/clear_refs after the first step), i.e. parameters, gradients, optimizer states, communication
  buckets and the (small: micro-batch 1 x 64 tokens) activations;
* step time: the median over the steps after the first;
* a census of the live tensors after the last backward, by holder (module parameters and gradients, the
  optimizer's master partitions, their gradients, Adam states, everything else): the model states themselves,
  without allocator slack or transients.

Expected model states per parameter, for the precision used (bf16-mixed: the ZeRO paper's mixed-precision Adam,
Rajbhandari et al. 2020 section 5.1, K = 12 bytes of fp32 master weights + Adam moments, 2 B bf16 params,
2 B bf16 grads): ZeRO-1 2+2+12/N, ZeRO-2 2+(2+12)/N, ZeRO-3 (2+2+12)/N. DDP and FSDP2 keep fp32 weights and cast
under autocast, so theirs is 4+4+8 = 16 (DDP) and 16/N (FSDP2); ZeRO-0 in DeepSpeed's bf16 is its bf16 optimizer
(bf16 weights and grads + fp32 master, moments and fp32 gradient accumulator: 2+2+4+8+4 = 20). Beside the paper,
DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`,
no offload; they add a 4 B/param fp32 gradient partition and, for ZeRO-3, the largest layer gathered in fp32).

    python benchmarks/zero_stages.py                       # 2 and 4 ranks; JSON + Markdown + PNG in benchmarks/results
    python benchmarks/zero_stages.py --nproc 2 --only ddp,zero3 --depth 2 --steps 2   # a quick look

Offload rows are left out: on a CPU-only machine host memory IS the device memory, so moving optimizer states
"to the CPU" cannot lower the peak (`--only zero2+offload` still runs the code path).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's archscale, in the launcher and (via PYTHONPATH) the workers
# name -> (strategy, zero_stage, offload, expected bytes/param in bf16-mixed as a function of N)
STRATEGIES = {
    "ddp": ("ddp", None, "none", lambda n: 16.0),
    "fsdp2": ("fsdp", None, "none", lambda n: 16.0 / n),
    "zero0": ("deepspeed", 0, "none", lambda n: 20.0),
    "zero1": ("deepspeed", 1, "none", lambda n: 4.0 + 12.0 / n),
    "zero2": ("deepspeed", 2, "none", lambda n: 2.0 + 14.0 / n),
    "zero3": ("deepspeed", 3, "none", lambda n: 16.0 / n),
    "zero2+offload": ("deepspeed", 2, "optimizer", lambda n: 2.0 + 2.0 / n),  # on the device; see the docstring
}
DEFAULT = "ddp,fsdp2,zero0,zero1,zero2,zero3"
MIB = 2 ** 20


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def hwm_mib() -> float:
    """The peak resident set since the process started or since `reset_hwm()` (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def deepspeed_estimates(name: str, n_params: int, largest_layer: int, nproc: int) -> float | None:
    """DeepSpeed's own per-device model-state estimate (bytes), without offload; None where it has none."""
    stage = STRATEGIES[name][1]
    if stage in (1, 2):
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        return estimate_zero2_model_states_mem_needs(n_params, nproc, 1, cpu_offload=False)[1]
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        return estimate_zero3_model_states_mem_needs(n_params, largest_layer, nproc, 1, cpu_offload=False,
                                                     cpu_offload_params=False)[1]
    return None


def tensor_census(strategy) -> dict[str, float]:
    """MiB of the live tensors of this rank, by what holds them (each storage counted once, in the first
    category that reaches it): the module's parameters and gradients; the inner optimizer's parameters (for ZeRO
    the fp32 master partitions), their gradients (ZeRO's fp32 gradient partitions) and its states (Adam moments);
    every other live tensor (found by the garbage collector: buckets, gathered parameters, activations)."""
    import gc

    import torch

    seen: set[int] = set()

    def add(tensors) -> float:
        total = 0
        for t in tensors:
            t = getattr(t, "_local_tensor", t)  # an FSDP2 DTensor: this rank's shard
            if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            if st.data_ptr() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total / MIB
    module = getattr(strategy, "engine", None)
    module = module.module if module is not None else strategy.model
    params = list(module.parameters())
    opt = strategy.optimizer
    inner = getattr(opt, "optimizer", opt)  # ZeRO wraps the torch optimizer
    inner_params = [p for g in inner.param_groups for p in g["params"]]
    out = {"module params": add([getattr(p, "ds_tensor", None) for p in params] + [p.data for p in params]),
           "module grads": add([p.grad for p in params]),
           "optimizer params": add(inner_params), "optimizer grads": add([p.grad for p in inner_params]),
           "optimizer states": add([v for st in inner.state.values() for v in st.values()])}
    out["other DeepSpeed/FSDP buffers"] = add(o for o in gc.get_objects() if isinstance(o, torch.Tensor))
    return out


def warm_up_libraries(env) -> None:
    """One bf16 forward/backward of a tiny model and one collective before the baseline is taken, so that the
    baseline holds what does not grow with the model (oneDNN primitives, autocast, thread pools, gloo buffers)."""
    import torch

    from archscale.config import ModelConfig
    from archscale.models.model import GPT

    tiny = GPT(ModelConfig.from_arch("transformer", 1, ar=8, vocab_size=256, block_size=16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = tiny(torch.randint(0, 256, (1, 16)))
    logits.float().sum().backward()
    env.sum_(torch.ones(1024))
    del tiny, logits


def worker(a) -> None:
    import importlib

    import torch

    importlib.import_module("deepspeed")  # loaded by every strategy: the same baseline for all

    from archscale.config import ModelConfig
    from archscale.data.synthetic import SyntheticLoader
    from archscale.models.model import GPT
    from archscale.train.distributed import setup
    from archscale.train.optim import param_groups
    from archscale.scaling_rules import RoleRule
    from archscale.train.config import PretrainConfig
    from archscale.train.parallel_layout import make_layout
    from archscale.train.strategy import OptimizerSpec, strategy_for

    strategy_name, stage, offload, _ = STRATEGIES[a.worker]
    env = setup(strategy_name)
    warm_up_libraries(env)
    torch.manual_seed(0)
    env.barrier()
    base = rss_mib()
    reset_hwm()
    cfg = ModelConfig.from_arch("transformer", a.depth, ar=a.ar, vocab_size=a.vocab, block_size=a.ctx)
    run = PretrainConfig(strategy=strategy_name, precision="bf16-mixed", zero_stage=stage or 0, offload=offload)
    strategy = strategy_for(make_layout(run, env.strategy, env.world_size, env.rank, env.device), run,
                            log=lambda msg: None)
    model = strategy.build_model(lambda: GPT(cfg))
    groups = param_groups(model.module if hasattr(model, "module") else model, RoleRule(1.0, 0.1),
                          RoleRule(1.0, 0.0))
    strategy.build_optimizer(groups, OptimizerSpec(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, accum=1,
                                                   micro_bsz=a.micro_bsz))
    env.barrier()
    build_peak, build_end = hwm_mib() - base, rss_mib() - base
    loader = SyntheticLoader("uniform", vocab_size=a.vocab, block_size=a.ctx + 1, micro_bsz=a.micro_bsz,
                             seed=0, rank=env.rank, world_size=env.world_size)
    times, step_peaks = [], []
    for i in range(a.steps):
        batch = next(loader)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = strategy.model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        strategy.backward(loss, 0)
        if i == a.steps - 1:
            census = tensor_census(strategy)  # after backward: gradients and the previous steps' Adam states
        outcome = strategy.clip_and_step()
        env.barrier()
        times.append(time.perf_counter() - t0)
        step_peaks.append(hwm_mib() - base)
        assert outcome.applied, f"{a.worker}: step {i + 1} was not applied"
        reset_hwm()
    row = {"rank": env.rank, "build_peak_mib": build_peak, "build_end_mib": build_end,
           "first_step_peak_mib": step_peaks[0], "steady_peak_mib": max(step_peaks[1:] or step_peaks),
           "end_mib": rss_mib() - base, "step_s": statistics.median(times[1:] or times), "loss": float(loss),
           "census_mib": census}
    Path(a.out).with_suffix(f".rank{env.rank}.json").write_text(json.dumps(row))
    env.barrier()
    env.close()


def model_sizes(a) -> tuple[int, int]:
    """(parameters, parameters of the largest module's own tensors) of the benchmarked model, built on meta."""
    import torch

    from archscale.config import ModelConfig
    from archscale.models.model import GPT

    with torch.device("meta"):
        model = GPT(ModelConfig.from_arch("transformer", a.depth, ar=a.ar, vocab_size=a.vocab, block_size=a.ctx))
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(a, name: str, nproc: int, tmp: Path, env: dict) -> list[dict] | None:
    out = tmp / f"{name}.n{nproc}"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", __file__, "--worker", name, "--out", str(out),
           "--depth", str(a.depth), "--ar", str(a.ar), "--vocab", str(a.vocab), "--ctx", str(a.ctx),
           "--micro_bsz", str(a.micro_bsz), "--steps", str(a.steps)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        print(f"{name} x{nproc}: FAILED\n{proc.stdout.decode(errors='replace')[-3000:]}", file=sys.stderr)
        return None
    return [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(nproc)]


def summarize(name: str, nproc: int, ranks: list[dict], n_params: int, largest: int) -> dict:
    expected = STRATEGIES[name][3](nproc)
    ds = deepspeed_estimates(name, n_params, largest, nproc)
    steady = max(r["steady_peak_mib"] for r in ranks)
    return {"strategy": name, "nproc": nproc, "params": n_params, "expected_bytes_per_param": expected,
            "expected_mib": expected * n_params / MIB, "deepspeed_estimate_mib": ds / MIB if ds else None,
            "steady_peak_mib": steady, "steady_bytes_per_param": steady * MIB / n_params,
            "ratio_to_expected": steady / (expected * n_params / MIB),
            "build_peak_mib": max(r["build_peak_mib"] for r in ranks),
            "first_step_peak_mib": max(r["first_step_peak_mib"] for r in ranks),
            "end_mib": max(r["end_mib"] for r in ranks), "step_s": max(r["step_s"] for r in ranks),
            "loss": ranks[0]["loss"], "census_mib": ranks[0]["census_mib"], "per_rank": ranks}


def table(results: list[dict]) -> str:
    head = ("| N | strategy | expected B/param | expected MiB/rank | DeepSpeed estimate MiB | measured steady peak "
            "MiB/rank | measured B/param | measured / expected | build peak MiB | step s |\n"
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in results:
        ds = f"{r['deepspeed_estimate_mib']:.0f}" if r["deepspeed_estimate_mib"] else "-"
        lines.append(f"| {r['nproc']} | {r['strategy']} | {r['expected_bytes_per_param']:.1f} | "
                     f"{r['expected_mib']:.0f} | {ds} | {r['steady_peak_mib']:.0f} | "
                     f"{r['steady_bytes_per_param']:.1f} | {r['ratio_to_expected']:.2f} | "
                     f"{r['build_peak_mib']:.0f} | {r['step_s']:.2f} |")
    return "\n".join(lines)


def census_table(results: list[dict]) -> str:
    """Where rank 0's live tensor bytes are, after the last backward (MiB), beside its steady-state peak RSS."""
    keys = list(results[0]["census_mib"])
    lines = ["| N | strategy | " + " | ".join(keys) + " | all live tensors | steady peak RSS |",
             "|---:|---|" + "---:|" * (len(keys) + 2)]
    for r in results:
        c = r["census_mib"]
        lines.append(f"| {r['nproc']} | {r['strategy']} | " + " | ".join(f"{c[k]:.0f}" for k in keys)
                     + f" | {sum(c.values()):.0f} | {r['per_rank'][0]['steady_peak_mib']:.0f} |")
    return "\n".join(lines)


def plot(results: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(12, 4.2))
    nprocs = sorted({r["nproc"] for r in results})
    names = list(dict.fromkeys(r["strategy"] for r in results))
    width = 0.8 / len(nprocs)
    for k, n in enumerate(nprocs):
        rows = {r["strategy"]: r for r in results if r["nproc"] == n}
        xs = [i + (k - (len(nprocs) - 1) / 2) * width for i in range(len(names))]
        mem = [rows[s]["steady_peak_mib"] if s in rows else 0 for s in names]
        exp = [rows[s]["expected_mib"] if s in rows else 0 for s in names]
        ax_m.bar(xs, mem, width * 0.9, label=f"measured, {n} ranks")
        ax_m.scatter(xs, exp, marker="_", s=400, color="black", zorder=3, label="expected" if k == 0 else None)
        ax_t.bar(xs, [rows[s]["step_s"] if s in rows else 0 for s in names], width * 0.9, label=f"{n} ranks")
    for ax, title in ((ax_m, "steady-state peak RSS per rank minus baseline (MiB)"), (ax_t, "step time (s)")):
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    params = results[0]["params"] / 1e6
    fig.suptitle(f"Transformer++ {params:.0f}M parameters, bf16-mixed AdamW, CPU (gloo)", fontsize=11)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--only", default=DEFAULT, help="comma-separated subset of " + ",".join(STRATEGIES))
    p.add_argument("--nproc", default="2,4", help="world sizes, comma-separated")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--ar", type=int, default=128, help="width = ar * depth (default 1024)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--micro_bsz", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (the first is not timed)")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args()
    if a.worker:
        return worker(a)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
               # every allocation above 64 KiB is its own mmap, returned to the OS when freed: without it glibc
               # raises its mmap threshold after the first frees and keeps freed tensors in its heap, and the
               # resident set then counts memory that no tensor holds any more
               MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    results_dir = Path(a.results)
    tmp = results_dir / "zero_stages.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    n_params, largest = model_sizes(a)
    print(f"model: {n_params:,} parameters (largest module {largest:,}); steps {a.steps}", flush=True)
    results = []
    for nproc in (int(x) for x in a.nproc.split(",")):
        for name in a.only.split(","):
            ranks = run_one(a, name, nproc, tmp, env)
            if ranks is None:
                continue
            results.append(summarize(name, nproc, ranks, n_params, largest))
            r = results[-1]
            print(f"N={nproc} {name:14s} steady peak/rank {r['steady_peak_mib']:7.0f} MiB  expected "
                  f"{r['expected_mib']:7.0f} MiB  ({r['ratio_to_expected']:.2f}x)  build peak "
                  f"{r['build_peak_mib']:7.0f} MiB  step {r['step_s']:.2f} s", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    config = {k: getattr(a, k) for k in ("depth", "ar", "vocab", "ctx", "micro_bsz", "steps", "nproc")}
    (results_dir / "zero_stages.json").write_text(json.dumps({"config": config, "results": results}, indent=1))
    plot(results, results_dir / "zero_stages.png")
    print("\n" + table(results))
    print("\nlive tensors of rank 0 after the last backward (MiB):\n" + census_table(results))
    print(f"\nwrote {results_dir / 'zero_stages.json'} and {results_dir / 'zero_stages.png'}")


if __name__ == "__main__":
    main()
