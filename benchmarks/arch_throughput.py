"""Training throughput of our architectures against each other at equal size: `<arch>_d<depth>` models with
ArchScale's aspect ratio (so about equal non-embedding parameters), vocab 8192, one training step = forward +
cross-entropy + backward + fused AdamW, fp32.

All models live in one process and are timed in alternating rounds (order reversed every round). Reported per
model: the median and the best tok/s over the rounds in wall time, the median in CPU time of this process (which a
busy neighbour distorts less, but which with several threads also counts threads waiting for work), and the
ratios to the first architecture. Only same-run ratios mean anything on a shared machine.

    .venv/bin/python benchmarks/arch_throughput.py                                   # transformer vs mamba, d4
    .venv/bin/python benchmarks/arch_throughput.py --archs transformer,mamba,samba,sambay --rounds 6
    ARCHSCALE_SCAN_IMPL=chunked .venv/bin/python benchmarks/arch_throughput.py       # Mamba on the PyTorch scan
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from archscale.config import ModelConfig
from archscale.models import GPT


def build(arch: str, depth: int, vocab: int, seed: int):
    torch.manual_seed(seed)
    model = GPT(ModelConfig.from_name(f"{arch}_d{depth}", vocab_size=vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    body = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("wte", "lm_head")))
    return model, opt, body


def step(model, opt, x) -> None:
    logits = model(x[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", default="transformer,mamba", help="comma list; ratios are to the first")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rounds", type=int, default=4, help="timed rounds (one step per model each)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    archs = a.archs.split(",")
    models = {name: build(name, a.depth, a.vocab, seed=i) for i, name in enumerate(archs)}
    x = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(0))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, B{a.batch} x T{a.seq}, vocab {a.vocab}, "
          f"fp32, scan impl {os.environ.get('ARCHSCALE_SCAN_IMPL', 'auto')}; load avg {os.getloadavg()[0]:.2f}")
    for name, (model, opt, body) in models.items():
        print(f"  {name}_d{a.depth}: {body / 1e6:.2f}M non-embedding parameters")
        step(model, opt, x)  # warm-up (and the C++ scan's first-use build)
    wall = {name: [] for name in archs}
    cpu = {name: [] for name in archs}
    for r in range(a.rounds):
        for name in (archs if r % 2 == 0 else archs[::-1]):
            model, opt, _ = models[name]
            t0, c0 = time.perf_counter(), time.process_time()
            step(model, opt, x)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    tokens = a.batch * a.seq
    base, base_cpu = statistics.median(wall[archs[0]]), statistics.median(cpu[archs[0]])
    print(f"| model | tok/s (median) | tok/s (best) | ratio to {archs[0]} | ratio in CPU time |")
    print("|---|---|---|---|---|")
    for name in archs:
        med, med_cpu = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"| {name}_d{a.depth} | {tokens / med:,.0f} | {tokens / min(wall[name]):,.0f} | {base / med:.2f} | "
              f"{base_cpu / med_cpu:.2f} |")
    print(f"load avg at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
