"""Gated DeltaNet kernel speed on CPU: our chunked gated delta rule vs transformers' Qwen3-Next torch fallback
(`torch_chunk_gated_delta_rule`, what `transformers` runs when flash-linear-attention is absent).

One step = forward + backward of sum(o * w) (w fixed random) through the kernel, from the same inputs
(q, k (B, T, H, K), v (B, T, H, V), log-space gate g, beta in (0, 2), in-kernel qk l2norm, chunk 64 both). The two
are timed in alternating rounds (order reversed every round, so drift hits both alike); reported: median ms per
step over the rounds, the ratio of the medians, the median of the per-round ratios, wall and CPU (process) time,
and the load average (the machine may be shared: only same-run ratios mean anything). The outputs of the two are
compared first (max abs difference printed).

    .venv/bin/python benchmarks/gdn_throughput.py                     # B4 T512 H2 K256 V256, fp32
    .venv/bin/python benchmarks/gdn_throughput.py --v 512 --threads 1 # ArchScale's value width (expand_v 2)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from archscale.host_alloc import describe as describe_host_alloc
from archscale.kernels.gated_delta import gated_delta_rule


def inputs(B, T, H, K, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = {"q": torch.randn(B, T, H, K, generator=g), "k": torch.randn(B, T, H, K, generator=g),
         "v": torch.randn(B, T, H, V, generator=g),
         "g": -torch.rand(B, T, H, generator=g) * 0.5, "beta": 2 * torch.rand(B, T, H, generator=g)}
    return {n: t.requires_grad_(True) for n, t in x.items()}, torch.randn(B, T, H, V, generator=g)


def ours(x, chunk):
    return gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], impl="chunked", chunk_size=chunk)[0]


def theirs(x, chunk):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    return torch_chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=chunk,
                                        use_qk_l2norm_in_kernel=True)[0]


def step(fn, x, w, chunk):
    for t in x.values():
        t.grad = None
    (fn(x, chunk) * w).sum().backward()


def timed(fn, x, w, chunk, steps):
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step(fn, x, w, chunk)
    return (time.perf_counter() - t0) / steps * 1e3, (time.process_time() - c0) / steps * 1e3


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "n/a"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--k", type=int, default=256)
    p.add_argument("--v", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    print(describe_host_alloc())  # before any tensor (both kernels run under it)
    if a.threads:
        torch.set_num_threads(a.threads)
    x, w = inputs(a.batch, a.seq, a.heads, a.k, a.v)
    with torch.no_grad():
        diff = (ours(x, a.chunk) - theirs(x, a.chunk)).abs().max().item()
    print(f"B{a.batch} T{a.seq} H{a.heads} K{a.k} V{a.v} chunk {a.chunk}, fp32, {torch.get_num_threads()} threads; "
          f"max |ours - transformers| = {diff:.2e}")
    for fn in (ours, theirs):  # warm-up
        step(fn, x, w, a.chunk)
    rows = {"ours": [], "transformers": []}
    for r in range(a.rounds):
        order = [("ours", ours), ("transformers", theirs)]
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            rows[name].append(timed(fn, x, w, a.chunk, a.steps))
        o, t = rows["ours"][-1], rows["transformers"][-1]
        print(f"round {r}: ours {o[0]:7.1f} ms (cpu {o[1]:7.1f})  transformers {t[0]:7.1f} ms (cpu {t[1]:7.1f})  "
              f"ratio {t[0] / o[0]:.2f}x  load {loadavg()}")
    med = {n: statistics.median(v[0] for v in rows[n]) for n in rows}
    med_cpu = {n: statistics.median(v[1] for v in rows[n]) for n in rows}
    paired = statistics.median(t[0] / o[0] for o, t in zip(rows["ours"], rows["transformers"]))
    print(f"median fwd+bwd: ours {med['ours']:.1f} ms, transformers {med['transformers']:.1f} ms; "
          f"ratio of medians {med['transformers'] / med['ours']:.2f}x, median paired ratio {paired:.2f}x; "
          f"cpu-time ratio {med_cpu['transformers'] / med_cpu['ours']:.2f}x")


if __name__ == "__main__":
    main()
