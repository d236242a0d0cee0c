"""Mamba-2 training throughput on CPU: our mixer vs `transformers.Mamba2ForCausalLM`'s torch path (no CUDA kernels).

Both are the same pure-Mamba-2 language model, HF's layout: embedding -> n x [RMSNorm -> Mamba-2, residual] ->
RMSNorm -> lm_head (untied in both), every Mamba-2 with d_inner = 2 d, headdim 64 (d_inner / 64 heads), d_state
128, ngroups 1, d_conv 4, chunk_size 256, gated RMSNorm (norm after the gate). No MLP in either (HF's Mamba-2
blocks have none), so the two have exactly the same parameters (checked below). One training step = forward +
cross-entropy + backward + AdamW step (+ zero_grad). Each side's loss is its framework's own: ours the trainer's
(`select_loss`: on CPU the C++ cross-entropy of kernels/cross_entropy.py, ``ARCHSCALE_LOSS_IMPL=torch`` for
`F.cross_entropy`), transformers' `F.cross_entropy`, which is what its ``labels=`` loss computes.

The models live in one process and are timed in alternating rounds (order reversed every round, so drift hits
both alike). Reported: median tok/s over the rounds, the ratio of the medians and the median of the per-round
ratios, each with a 95% bootstrap interval (whole rounds resampled, `machine_load.ratio_intervals`). A round is
not counted when other processes kept more than `--max-noise` cores busy (from /proc) or when the fp32 matmul
peak measured just before or after it fell below `--min-peak` x the run's best (the host slowing this VM down,
which /proc does not show); rounds go on until `--rounds` counted ones are in, and every round run is printed.
The machine is shared, so only same-run ratios mean anything.

    .venv/bin/python benchmarks/mamba2_throughput.py                 # fp32, B4 x T512, width 512 x 4 layers
    .venv/bin/python benchmarks/mamba2_throughput.py --torch_chunk 256 # our scan at ArchScale's chunk length
    .venv/bin/python benchmarks/mamba2_throughput.py --scan_impl ref   # our mixer with the sequential reference
    .venv/bin/python benchmarks/mamba2_throughput.py --breakdown       # then: products vs the rest, per model

``--breakdown`` times every op of three more steps per model (`step_breakdown.py`; models in turn, medians) and
says what a ``--target`` ratio of ours to transformers' leaves for our ops other than the matrix products.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from archscale.host_alloc import describe as describe_host_alloc
from archscale.kernels.cross_entropy import select_loss
from archscale.kernels import ssd as ssd_module
from archscale.models.mixers.mamba2 import Mamba2
from archscale.models.norm import RMSNorm
from archscale.train.metrics import measure_matmul_flops
from machine_load import CpuMeter, counted_rounds, ratio_intervals
from step_breakdown import describe, describe_bound, interleaved

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Mamba2LM(nn.Module):
    """Pure-Mamba-2 LM from our mixer, laid out like HF's `Mamba2ForCausalLM` (untied head)."""

    def __init__(self, vocab: int, d: int, n_layer: int, chunk_size: int, scan_impl: str):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList(RMSNorm(d) for _ in range(n_layer))
        self.mixers = nn.ModuleList(Mamba2(d, 2 * d, chunk_size=chunk_size, scan_impl=scan_impl)
                                    for _ in range(n_layer))
        self.norm_f = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx).float()
        for norm, mixer in zip(self.norms, self.mixers):
            x = x + mixer(norm(x))[0]
        return self.lm_head(self.norm_f(x))


def build_models(args) -> dict[str, tuple[nn.Module, callable]]:
    import transformers

    ours = Mamba2LM(args.vocab, args.width, args.layers, args.chunk_size, args.scan_impl)
    models = {"ours": (ours, ours, select_loss("auto", args.vocab))}
    if not args.skip_hf:
        cfg = transformers.Mamba2Config(vocab_size=args.vocab, hidden_size=args.width, num_hidden_layers=args.layers,
                                        state_size=128, expand=2, head_dim=64, num_heads=2 * args.width // 64,
                                        n_groups=1, conv_kernel=4, chunk_size=args.chunk_size, use_conv_bias=True,
                                        use_bias=False, layer_norm_epsilon=1e-5, tie_word_embeddings=False)
        hf = transformers.Mamba2ForCausalLM(cfg)
        models["hf"] = (hf, lambda idx: hf(input_ids=idx, use_cache=False).logits, hf_loss)
    return models


def hf_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss on already shifted targets (`ForCausalLMLoss`: fp32 logits, F.cross_entropy)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


class Runner:
    def __init__(self, name, model, forward, loss, x, y, vocab):
        self.name, self.model, self.forward, self.loss = name, model.train(), forward, loss
        params = list({id(p): p for p in model.parameters()}.values())
        self.opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
        self.x, self.y, self.vocab = x, y, vocab

    def step(self, dtype) -> float:
        ctx = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
        with ctx:
            logits = self.forward(self.x)
        loss = self.loss(logits[..., : self.vocab], self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


def timed(runner: Runner, dtype, steps: int) -> tuple[float, float | None]:
    """Seconds for `steps` training steps, and the cores other processes kept busy meanwhile."""
    with CpuMeter() as meter:
        for _ in range(steps):
            runner.step(dtype)
    return meter.seconds, meter.other_cores


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "n/a"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="bf16 = CPU autocast")
    p.add_argument("--steps", type=int, default=1, help="timed steps per model per round")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds to count")
    p.add_argument("--max-noise", type=float, default=0.15,
                   help="a round in which other processes kept more than this many cores busy is not counted")
    p.add_argument("--min-peak", type=float, default=0.85,
                   help="a round is not counted when the matmul peak measured before or after it fell below this "
                        "fraction of the run's best (the host slowing this VM down)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per model first")
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument("--scan_impl", default="auto", help="our ssd_scan impl: auto (the C++ kernel on CPU when it builds), cpu, chunked (the torch path), ref")
    p.add_argument("--chunk_size", type=int, default=256, help="the model's chunk_size (both models)")
    p.add_argument("--torch_chunk", type=int, default=0, help="override our chunked path's longest chunk")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--breakdown", action="store_true",
                   help="after the rounds, time every op of three more steps per model: products vs the rest")
    p.add_argument("--target", type=float, default=2.0,
                   help="with --breakdown: the ours/hf tok/s ratio to size our other ops against")
    return p.parse_args(argv)


def main(argv=None) -> None:
    import transformers

    args = parse(argv)
    host_alloc = describe_host_alloc()  # before any tensor (both models run under it)
    if args.torch_chunk:
        ssd_module.TORCH_CHUNK = args.torch_chunk
    dtype = DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    models = build_models(args)
    counts = {name: n_params(m) for name, (m, *_) in models.items()}
    if len(set(counts.values())) != 1:
        raise SystemExit(f"the models differ in size: {counts}")
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    runners = [Runner(name, m, fwd, loss, x, y, args.vocab) for name, (m, fwd, loss) in models.items()]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.machine()}; L={args.layers} d={args.width} V={args.vocab} B={args.batch} T={args.seq} "
          f"{args.dtype}; chunk_size {args.chunk_size}, our torch chunk {ssd_module.TORCH_CHUNK}, scan "
          f"{args.scan_impl}; {args.warmup} warmup, {args.rounds} rounds x {args.steps} steps; "
          f"load avg {_loadavg()}\n{host_alloc}")
    for r in runners:
        print(f"  {r.name:5s} {counts[r.name] / 1e6:6.2f}M params", flush=True)
    for r in runners:
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            r.step(dtype)
        print(f"  warmup {r.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    rows = timed_rounds(runners, dtype, args)
    med = {r.name: statistics.median(row[r.name] for row in rows) for r in runners}
    print("| model | tok/s (median) |")
    print("|-------|----------------|")
    for r in runners:
        print(f"| {r.name:<5} | {med[r.name]:>14,.1f} |")
    if "hf" in med:
        paired = statistics.median(row["ours"] / row["hf"] for row in rows)
        print(f"ours/hf: {med['ours'] / med['hf']:.2f}x (ratio of medians), {paired:.2f}x (median of per-round "
              f"ratios)")
        if len(rows) > 1:
            iv = ratio_intervals([row["ours"] for row in rows], [row["hf"] for row in rows])
            print(f"95% bootstrap intervals over the {len(rows)} rounds used (2,000 resamples of whole rounds, "
                  f"seed 0): ratio of medians {iv['medians'][0]:.3f}-{iv['medians'][1]:.3f}x, per-round "
                  f"{iv['per_round'][0]:.3f}-{iv['per_round'][1]:.3f}x")
    print(f"rounds counted: {len(rows)}; load avg at end {_loadavg()}")
    if args.breakdown:
        report_breakdown(runners, dtype, args.target)


def timed_rounds(runners: list[Runner], dtype, args) -> list[dict]:
    """Alternating rounds until `args.rounds` count (`machine_load.counted_rounds`: not when other processes
    were busy, nor when the fp32 matmul peak measured just before or after the round dropped). Returns the
    counted rounds, each {model name: tok/s}."""
    tokens = args.batch * args.seq

    def play(k: int):
        row, noise = {}, 0.0
        for r in runners if k % 2 == 0 else runners[::-1]:
            seconds, others = timed(r, dtype, args.steps)
            row[r.name] = args.steps * tokens / seconds
            noise = max(noise, others or 0.0)
        return row, "  ".join(f"{n} {v:,.1f}" for n, v in row.items()) + " tok/s", noise

    peak = lambda: measure_matmul_flops(torch.device("cpu"), torch.float32)  # noqa: E731
    used, _ = counted_rounds(play, args.rounds, peak, args.max_noise, args.min_peak)
    return [row for row, _ in used]


def report_breakdown(runners: list[Runner], dtype, target: float, rounds: int = 3) -> None:
    """Products vs other ops per model (medians of `rounds` instrumented steps, models in turn), and what
    `target` leaves ours."""
    print(f"per-op wall clock, medians of {rounds} instrumented steps per model, models in turn (the timing adds a "
          "few us per op):")
    parts = interleaved({r.name: (lambda r=r: r.step(dtype)) for r in runners}, rounds)
    for name, p in parts.items():
        print(describe(name, p))
    if "hf" in parts:
        print(describe_bound("ours", parts["ours"], "hf", parts["hf"], target))


if __name__ == "__main__":
    main()
