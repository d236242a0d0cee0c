"""The gated RMSNorm of Mamba-2 and Gated DeltaNet, forward + backward: the C++ kernel (`kernels/gated_norm.py`,
impl "cpu") against the same maths through autograd (impl "torch", the reference), at the shapes of a d4 layer
(B4 x T512; GDNY's 1024 value channels, Mamba-2's d_inner 1024 of a width-512 model), fp32, both in one process
in alternating rounds. The inputs are non-leaf tensors, as in the mixers, so no gradient accumulation is timed.

    .venv/bin/python benchmarks/gated_norm.py
    .venv/bin/python benchmarks/gated_norm.py --width 2048 --rounds 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from archscale.host_alloc import describe as describe_host_alloc
from archscale.kernels.gated_norm import gated_rms_norm


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--width", type=int, default=1024, help="channels normalised together (one group)")
    p.add_argument("--rounds", type=int, default=20, help="alternating rounds, one forward + backward each")
    a = p.parse_args(argv)
    host_alloc = describe_host_alloc()
    gen = torch.Generator().manual_seed(0)
    x0, z0, g = (torch.randn(a.batch, a.seq, a.width, generator=gen) for _ in range(3))
    x0.requires_grad_(), z0.requires_grad_()
    weight = torch.ones(a.width, requires_grad=True)

    def step(impl: str) -> float:
        x, z = x0 * 1.0, z0 * 1.0  # non-leaf, as the mixers' inputs (made before the clock starts)
        t0 = time.perf_counter()
        out = gated_rms_norm(x, z, weight, impl=impl)
        torch.autograd.grad(out, (x, z, weight), g)
        return time.perf_counter() - t0

    impls = ("cpu", "torch")
    times = {i: [] for i in impls}
    for _ in range(3):
        for i in impls:
            step(i)
    for r in range(a.rounds):
        for i in (impls if r % 2 == 0 else impls[::-1]):
            times[i].append(step(i))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} logical CPUs; "
          f"(B, T, d) = ({a.batch}, {a.seq}, {a.width}) fp32, {a.rounds} rounds; load avg {os.getloadavg()[0]:.2f}\n"
          f"{host_alloc}")
    for i in impls:
        print(f"  {i:5s} forward + backward: median {statistics.median(times[i]) * 1e3:.2f} ms "
              f"(range {min(times[i]) * 1e3:.2f}-{max(times[i]) * 1e3:.2f})")
    paired = [t / c for c, t in zip(times["cpu"], times["torch"])]
    print(f"torch / cpu: {statistics.median(times['torch']) / statistics.median(times['cpu']):.2f}x (ratio of "
          f"medians), {statistics.median(paired):.2f}x (median of per-round ratios)")


if __name__ == "__main__":
    main()
