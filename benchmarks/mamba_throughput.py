"""Mamba-1 training throughput on CPU: our mixer vs `mambapy` vs `transformers.MambaForCausalLM` (no CUDA kernels).

All three are the same pure-Mamba language model, embedding -> n x [RMSNorm -> Mamba, residual] -> RMSNorm ->
lm_head (untied for ours and mambapy, as in `mambapy.lm.LM`; HF ties the head to the embedding by default, so it
has one V x d matrix fewer). One training step = forward + cross-entropy + backward + AdamW step (+ zero_grad).

The models live in one process and are timed in alternating rounds (order reversed every round, so drift hits
all alike): each round runs `--steps` steps of ours and of mambapy and, in the first `--hf_rounds` rounds only,
`--hf_steps` steps of HF (whose reference path is ~100x slower). Reported: median tok/s over the rounds, the
ratio of the medians and the median of the per-round paired ratios, and how many cores other processes used
during each round (from /proc; the machine is shared, so only same-run ratios mean anything).

    .venv/bin/python benchmarks/mamba_throughput.py                      # fp32, all three
    .venv/bin/python benchmarks/mamba_throughput.py --dtype bf16 --skip_hf
    .venv/bin/python benchmarks/mamba_throughput.py --scan_impl ref       # our mixer with the reference scan

Needs `pip install -c constraints-cpu.txt mambapy` (not a dependency of archscale); without it that column is
skipped.
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

from archscale.kernels import selective_scan as scan_module
from archscale.models.mixers.mamba import Mamba
from archscale.models.norm import RMSNorm
from machine_load import CpuMeter

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class MambaLM(nn.Module):
    """Pure-Mamba LM from our mixer, laid out like `mambapy.lm.LM` so parameter counts match."""

    def __init__(self, vocab: int, d: int, n_layer: int, scan_impl: str):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList(RMSNorm(d) for _ in range(n_layer))
        self.mixers = nn.ModuleList(Mamba(d, scan_impl=scan_impl) for _ in range(n_layer))
        self.norm_f = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx).float()
        for norm, mixer in zip(self.norms, self.mixers):
            x = x + mixer(norm(x))[0]
        return self.lm_head(self.norm_f(x))


class MambapyLM(nn.Module):
    """`mambapy.lm.LM` rebuilt here: that module imports `mambapy.mamba2`, which needs mamba-ssm (CUDA only)."""

    def __init__(self, backbone: nn.Module, norm_f: nn.Module, vocab: int, d: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.mamba, self.norm_f = backbone, norm_f
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm_f(self.mamba(self.embedding(idx))))


def build_models(args) -> dict[str, tuple[nn.Module, callable]]:
    models = {}
    ours = MambaLM(args.vocab, args.width, args.layers, args.scan_impl)
    models["ours"] = (ours, ours)
    if not args.skip_mambapy:
        try:
            from mambapy.mamba import Mamba as PyMamba, MambaConfig as PyConfig, RMSNorm as PyRMSNorm
        except ImportError:
            print("mambapy not installed: skipping it (pip install -c constraints-cpu.txt mambapy)", file=sys.stderr)
        else:
            mp = MambapyLM(PyMamba(PyConfig(d_model=args.width, n_layers=args.layers, pscan=True)),
                           PyRMSNorm(args.width), args.vocab, args.width)
            models["mambapy"] = (mp, mp)
    if not args.skip_hf:
        import transformers

        cfg = transformers.MambaConfig(vocab_size=args.vocab, hidden_size=args.width, num_hidden_layers=args.layers,
                                       state_size=16, expand=2, conv_kernel=4, use_mambapy=False)
        hf = transformers.MambaForCausalLM(cfg)
        models["hf"] = (hf, lambda idx: hf(input_ids=idx, use_cache=False).logits)
    return models


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


class Runner:
    def __init__(self, name, model, forward, x, y, vocab):
        self.name, self.model, self.forward = name, model.train(), forward
        params = list({id(p): p for p in model.parameters()}.values())
        self.opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
        self.x, self.y, self.vocab = x, y, vocab

    def step(self, dtype) -> float:
        ctx = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
        with ctx:
            logits = self.forward(self.x)
        loss = F.cross_entropy(logits[..., : self.vocab].flatten(0, 1).float(), self.y.flatten())
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="bf16 = CPU autocast")
    p.add_argument("--steps", type=int, default=2, help="timed steps per model per round (ours, mambapy)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per model first")
    p.add_argument("--hf_steps", type=int, default=1, help="timed HF steps per HF round")
    p.add_argument("--hf_rounds", type=int, default=2, help="rounds that include HF (it is very slow)")
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument("--skip_mambapy", action="store_true")
    p.add_argument("--scan_impl", default="chunked", help="our selective_scan impl (chunked, cpu, ref, auto)")
    p.add_argument("--chunk", type=int, default=0, help="override the chunked scan's chunk length")
    p.add_argument("--block", type=int, default=0, help="override the chunked scan's block length")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.chunk:
        scan_module.CHUNK = args.chunk
    if args.block:
        scan_module.BLOCK = args.block
    dtype = DTYPES[args.dtype]

    torch.manual_seed(args.seed)
    models = build_models(args)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    runners = [Runner(name, m, fwd, x, y, args.vocab) for name, (m, fwd) in models.items()]
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, mambapy {_version('mambapy')}, "
          f"{torch.get_num_threads()} threads, {platform.machine()}; L={args.layers} d={args.width} V={args.vocab} "
          f"B={args.batch} T={args.seq} {args.dtype}; scan {args.scan_impl} chunk {scan_module.CHUNK} block {scan_module.BLOCK}; "
          f"{args.warmup} warmup, {args.rounds} rounds x {args.steps} steps (HF: {args.hf_rounds} x "
          f"{args.hf_steps}); load avg {_loadavg()}")
    for r in runners:
        print(f"  {r.name:8s} {n_params(r.model) / 1e6:6.2f}M params", flush=True)

    tokens = args.batch * args.seq
    for r in runners:
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            r.step(dtype)
        print(f"  warmup {r.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    rows = []
    for k in range(args.rounds):
        order = runners if k % 2 == 0 else runners[::-1]
        row, noise = {}, 0.0
        for r in order:
            steps = args.hf_steps if r.name == "hf" else args.steps
            if r.name == "hf" and k >= args.hf_rounds:
                continue
            seconds, others = timed(r, dtype, steps)
            row[r.name] = steps * tokens / seconds
            noise = max(noise, others or 0.0)
        row["noise"] = noise
        rows.append(row)
        print(f"  round {k + 1}: " + "  ".join(f"{n} {row[n]:,.1f}" for n in row if n != "noise")
              + f" tok/s; other processes {noise:.2f} cores", flush=True)

    med = {r.name: statistics.median(row[r.name] for row in rows if r.name in row) for r in runners}
    print("| model   | tok/s (median) | rounds |")
    print("|---------|----------------|--------|")
    for r in runners:
        print(f"| {r.name:<7} | {med[r.name]:>14,.1f} | {sum(r.name in row for row in rows):>6} |")
    for other in ("mambapy", "hf"):
        if other in med:
            paired = statistics.median(row["ours"] / row[other] for row in rows if other in row)
            print(f"ours/{other}: {med['ours'] / med[other]:.2f}x (ratio of medians), "
                  f"{paired:.2f}x (median of per-round ratios)")
    print(f"other processes per round (cores): " + " ".join(f"{row['noise']:.2f}" for row in rows)
          + f"; load avg at end {_loadavg()}")


def _version(pkg: str) -> str:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:
        return "n/a"


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "n/a"


if __name__ == "__main__":
    main()
