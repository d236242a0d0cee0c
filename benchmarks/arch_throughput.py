"""Training throughput of our architectures against each other at equal size: `<arch>_d<depth>` models with
ArchScale's aspect ratio (so about equal non-embedding parameters), vocab 8192, one training step = forward +
cross-entropy + backward + fused AdamW, fp32; the loss is the trainer's (`select_loss`: on CPU the C++ cross-entropy
of kernels/cross_entropy.py, ``--ab ARCHSCALE_LOSS_IMPL=torch`` for F.cross_entropy).

All models live in one process and are timed in alternating rounds (order reversed every round). A round is not
counted when other processes kept more than `--max-noise` cores busy (read from /proc, `machine_load.py`), or when
the fp32 matmul peak measured just before or just after it fell below `--min-peak` x the best one of the run (on
this VM the host's other work slows every core down without showing in /proc: the peak then drops by up to half);
rounds go on until `--rounds` counted ones are in, and every round run is printed with both. Reported per model:
the median tok/s over the rounds in wall time and its spread (slowest-fastest round); the ratio to the first
architecture, as the ratio of the medians and as the median (and range) of each round's own ratio (the models of a
round run seconds apart, so a slow drift of the machine cancels in it); the ratio in CPU time of this process
(which a busy neighbour distorts less, but which with several threads also counts threads waiting for work); the
training FLOPs per token from the model's own count; the ratio those FLOPs allow at equal MFU (the first
architecture's FLOPs per token over the model's: what the tok/s ratio would be if both ran their FLOPs at the same
rate, so a ratio target above it asks the model to outrun the first architecture's MFU); and the MFU: those FLOPs
at the median tok/s over the fp32 matmul peak (a 1024^3 matmul, measured at the start of every round in this
process, so "near the limit" is a number per architecture). Under the table, 95% bootstrap intervals of both ratios
(whole rounds resampled, `machine_load.ratio_intervals`): whether the run resolves a target such as 0.85. Only
same-run ratios mean anything on a shared machine; the CPU model and its vector flags are printed first.

    .venv/bin/python benchmarks/arch_throughput.py                                   # transformer vs mamba, d4
    .venv/bin/python benchmarks/arch_throughput.py --archs transformer,mamba,samba,sambay --rounds 6
    ARCHSCALE_SCAN_IMPL=chunked .venv/bin/python benchmarks/arch_throughput.py       # Mamba on the PyTorch scan
    ARCHSCALE_HOST_ALLOC=system .venv/bin/python benchmarks/arch_throughput.py       # glibc's default malloc
    .venv/bin/python benchmarks/arch_throughput.py --archs transformer,gdny --breakdown  # products vs the rest
    .venv/bin/python benchmarks/arch_throughput.py --archs gdny --ab ARCHSCALE_NORM_IMPL=torch  # a kernel A/B

With ``--breakdown`` each model then runs three more steps with every op timed (`step_breakdown.py`, models in
turn, medians): how much of its step is matrix products (and at what rate), how much is other ops, and what
``--target`` (a ratio to the first architecture) leaves for the rest once the products are paid for.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from archscale.config import ModelConfig
from archscale.host_alloc import describe as describe_host_alloc
from archscale.kernels.cross_entropy import select_loss
from archscale.models import GPT, accounting
from archscale.train.metrics import measure_matmul_flops
from machine_load import CpuMeter, counted_rounds, ratio_intervals
from step_breakdown import describe, describe_bound, interleaved


def build(arch: str, depth: int, vocab: int, seed: int):
    torch.manual_seed(seed)
    model = GPT(ModelConfig.from_name(f"{arch}_d{depth}", vocab_size=vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    body = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("wte", "lm_head")))
    return model, opt, body


def step(model, opt, x, env: dict | None = None) -> None:
    """One training step, with `env` set in os.environ meanwhile (an A/B variant's setting, e.g. a kernel's
    ARCHSCALE_*_IMPL, which the kernels read at call time)."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        logits = model(x[:, :-1])
        select_loss("auto", logits.shape[-1])(logits, x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cpu_description() -> str:
    """The CPU model and its vector-unit flags (from /proc/cpuinfo): the matmul peak depends on them."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown CPU"
    field = lambda key: next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith(key)), "")  # noqa: E731
    wanted = [fl for fl in field("flags").split() if fl.startswith(("avx", "amx", "fma"))]
    return f"{field('model name') or 'unknown CPU'}, {os.cpu_count()} logical CPUs, flags {' '.join(wanted)}"


def matmul_flops_per_token(model, seq: int) -> float:
    """Training FLOPs per token from the model's own count (`flops_breakdown`: 3 x forward), the terms a matmul
    peak applies to: every term but the "*elementwise" ones (gates, decays, norms: memory-bound, not matmuls)."""
    terms = accounting.flops_breakdown(model, seq)
    return 3.0 * sum(v for k, v in terms.items() if "elementwise" not in k)


def timed_rounds(models: dict, archs: list[str], x, rounds: int, max_noise: float = 0.15,
                 min_peak: float = 0.85) -> tuple[dict, dict, list[float], dict]:
    """Alternating rounds (order reversed every round), one step per model each, until `rounds` count
    (`machine_load.counted_rounds`: not when other processes were busy, nor when the fp32 matmul peak measured
    just before or after the round dropped). Returns (wall seconds, CPU seconds, peaks FLOP/s) over the counted
    rounds, and {"quiet": count, "run": count, "others": cores per round run}."""
    tokens = x.shape[0] * (x.shape[1] - 1)

    def play(r: int):
        times = {}
        with CpuMeter() as meter:
            for name in (archs if r % 2 == 0 else archs[::-1]):
                model, opt, _, env = models[name]
                t0, c0 = time.perf_counter(), time.process_time()
                step(model, opt, x, env)
                times[name] = (time.perf_counter() - t0, time.process_time() - c0)
        text = "  ".join(f"{n} {tokens / times[n][0]:,.1f}" for n in archs) + " tok/s"
        return times, text, meter.other_cores

    peak = lambda: measure_matmul_flops(torch.device("cpu"), torch.float32)  # noqa: E731
    used, noise = counted_rounds(play, rounds, peak, max_noise, min_peak)
    wall = {name: [times[name][0] for times, _ in used] for name in archs}
    cpu = {name: [times[name][1] for times, _ in used] for name in archs}
    return wall, cpu, [p for _, p in used], noise


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", default="transformer,mamba", help="comma list; ratios are to the first")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rounds", type=int, default=4, help="timed rounds (one step per model each)")
    p.add_argument("--max-noise", type=float, default=0.15,
                   help="a round in which other processes kept more than this many cores busy is not counted "
                        "(rounds go on until --rounds quiet ones are in, at most 3x as many run)")
    p.add_argument("--min-peak", type=float, default=0.85,
                   help="a round is not counted when the matmul peak measured before or after it fell below this "
                        "fraction of the best one measured in the run (the host slowing this VM down)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--breakdown", action="store_true",
                   help="after the rounds, time every op of three more steps per model: products vs the rest")
    p.add_argument("--target", type=float, default=0.85,
                   help="with --breakdown: the tok/s ratio to the first architecture to size the rest against")
    p.add_argument("--ab", default="",
                   help="VAR=VALUE: also time every architecture with this environment setting (same init), "
                        "e.g. ARCHSCALE_NORM_IMPL=torch for a kernel's effect on the whole step, paired per round")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps per model first: the C++ scan's build, and the heap settling (a model's "
                        "first steps fault in memory that later steps reuse; GDNY's took ~5 steps)")
    a = p.parse_args(argv)
    host_alloc = describe_host_alloc()  # before the models: their buffers come from the allocator it sets up
    if a.threads:
        torch.set_num_threads(a.threads)
    archs = a.archs.split(",")
    var, eq, value = a.ab.partition("=")
    if a.ab and not (var and eq):
        p.error(f"--ab takes VAR=VALUE (got {a.ab!r})")
    models = {}
    for i, arch in enumerate(archs):  # with --ab each architecture twice, the same init, the second with the setting
        models[arch] = (*build(arch, a.depth, a.vocab, seed=i), {})
        if a.ab:
            models[f"{arch}[{value}]"] = (*build(arch, a.depth, a.vocab, seed=i), {var: value})
    archs = list(models)
    x = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(0))
    print(f"{cpu_description()}\ntorch {torch.__version__}, {torch.get_num_threads()} threads, B{a.batch} x "
          f"T{a.seq}, vocab {a.vocab}, fp32, scan impl {os.environ.get('ARCHSCALE_SCAN_IMPL', 'auto')}; "
          f"{a.warmup} warm-up steps per model; load avg {os.getloadavg()[0]:.2f}\n{host_alloc}")
    for name, (model, opt, body, env) in models.items():
        print(f"  {name}_d{a.depth}: {body / 1e6:.2f}M non-embedding parameters"
              + "".join(f"; {k}={v}" for k, v in env.items()))
        for _ in range(a.warmup):
            step(model, opt, x, env)
    wall, cpu, peaks, noise = timed_rounds(models, archs, x, a.rounds, a.max_noise, a.min_peak)
    report(models, archs, a, wall, cpu, peaks, noise)
    if a.breakdown:
        report_breakdown(models, archs, x, a.target)


def report(models, archs, a, wall, cpu, peaks, noise) -> None:
    """The table: tok/s (median, spread over rounds), ratios to the first architecture, the ratio its FLOPs allow
    at equal MFU, and the MFU at the median peak."""
    tokens, peak = a.batch * a.seq, statistics.median(peaks)
    base, base_cpu = statistics.median(wall[archs[0]]), statistics.median(cpu[archs[0]])
    base_flops = matmul_flops_per_token(models[archs[0]][0], a.seq)
    counted = len(peaks)
    print(f"rounds counted: {counted} ({noise['quiet']} of {noise['run']} run were quiet and at full speed"
          + ("" if counted == noise["quiet"] else f"; fewer than {a.rounds}: ALL counted, noisy") + "); "
          "other processes per round (cores): " + " ".join("n/a" if c is None else f"{c:.2f}" for c in noise["others"]))
    print(f"fp32 matmul peak (1024^3, per round): median {peak / 1e9:.1f} GFLOP/s, "
          f"range {min(peaks) / 1e9:.1f}-{max(peaks) / 1e9:.1f}")
    print(f"| model | tok/s (median) | tok/s (min-max over rounds) | ratio to {archs[0]} | per-round ratio (median, "
          "min-max) | ratio in CPU time | GFLOP/token (train) | ratio at equal MFU | MFU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in archs:
        med, med_cpu = statistics.median(wall[name]), statistics.median(cpu[name])
        per_token = matmul_flops_per_token(models[name][0], a.seq)
        paired = [b / w for b, w in zip(wall[archs[0]], wall[name])]  # each round's own ratio: drift cancels
        print(f"| {name}_d{a.depth} | {tokens / med:,.0f} | {tokens / max(wall[name]):,.0f}-"
              f"{tokens / min(wall[name]):,.0f} | {base / med:.2f} | {statistics.median(paired):.2f} "
              f"({min(paired):.2f}-{max(paired):.2f}) | {base_cpu / med_cpu:.2f} | "
              f"{per_token / 1e9:.3f} | {base_flops / per_token:.3f} | {per_token * tokens / med / peak:.1%} |")
    print(f"load avg at the end {os.getloadavg()[0]:.2f}; 'ratio at equal MFU' = {archs[0]}'s FLOPs per token over "
          "the model's: the tok/s ratio if both ran their FLOPs at the same rate")
    if counted > 1 and len(archs) > 1:
        print(f"95% bootstrap intervals of the ratios to {archs[0]} over the {counted} rounds used (2,000 resamples "
              "of whole rounds, seed 0): " + "; ".join(interval_text(name, wall[archs[0]], wall[name])
                                                      for name in archs[1:]))


def interval_text(name: str, base: list[float], walls: list[float]) -> str:
    iv = ratio_intervals(base, walls)
    return (f"{name} ratio of medians {iv['medians'][0]:.3f}-{iv['medians'][1]:.3f}, per-round "
            f"{iv['per_round'][0]:.3f}-{iv['per_round'][1]:.3f}")


def report_breakdown(models, archs, x, target: float, rounds: int = 3) -> None:
    """Products vs other ops per model (medians of `rounds` instrumented steps, models in turn), and what `target`
    leaves each model."""
    print(f"per-op wall clock, medians of {rounds} instrumented steps per model, models in turn (the timing adds a "
          "few us per op):")
    steps = {name: (lambda m=models[name]: step(m[0], m[1], x, m[3])) for name in archs}
    parts = interleaved(steps, rounds)
    for name in archs:
        print(describe(name, parts[name]))
    for name in archs[1:]:
        print(describe_bound(name, parts[name], archs[0], parts[archs[0]], target))


if __name__ == "__main__":
    main()
