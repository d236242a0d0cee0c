"""Training throughput: our Transformer++ vs `transformers.LlamaForCausalLM` with identical shapes and weights.

One training step = forward + cross-entropy + backward + AdamW step (+ zero_grad). Both models live in one
process and are timed in alternating rounds (A B, then B A, ...) so machine drift hits both alike; each round
times `--steps` consecutive steps per model. A round in which other processes kept more than `--max-noise`
cores busy (read from /proc) is not counted, and rounds continue until `--rounds` quiet ones are in; tok/s is
the median over those. Only the ratio ours/HF is meaningful on a shared machine; absolute tok/s drift.

MFU = model.flops_per_token(seq) * tok/s / peak, with peak the best square-matmul measurement in the same
dtype (bf16 for the autocast runs) taken in this process before and after the rounds.

    .venv/bin/python benchmarks/train_throughput.py                       # fp32 and bf16, default sizes
    .venv/bin/python benchmarks/train_throughput.py --precision bf16 --steps 2 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from archscale.config import ModelConfig
from archscale.export import to_llama_model
from archscale.models import GPT
from archscale.train.metrics import measure_matmul_flops
from machine_load import CpuMeter

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", default="fp32,bf16", help="comma list of fp32, bf16 (bf16 = CPU autocast)")
    p.add_argument("--steps", type=int, default=2, help="timed training steps per model per round")
    p.add_argument("--rounds", type=int, default=8,
                   help="quiet alternating A/B rounds wanted; tok/s is the median over them")
    p.add_argument("--max-noise", type=float, default=0.15,
                   help="a round counts only if other processes used at most this many cores meanwhile")
    p.add_argument("--max-round-factor", type=int, default=3,
                   help="give up after rounds x this many attempts (then report what there is, flagged)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model before the rounds")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048, help="SwiGLU hidden size")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--optimizer", choices=["fused", "foreach", "for-loop"], default="fused",
                   help="AdamW implementation, the same for both models (the trainer uses fused)")
    p.add_argument("--hf-attn", default="sdpa", help="attn_implementation for LlamaForCausalLM")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def make_optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    params = list({id(p): p for p in model.parameters()}.values())  # tied weights once
    flags = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}[kind]
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **flags)


class Runner:
    """One model + optimizer + fixed batch; `step()` does one full training step."""

    def __init__(self, name: str, model: torch.nn.Module, forward, optimizer_kind: str, x, y, vocab: int):
        self.name, self.model, self.forward = name, model.train(), forward
        self.opt = make_optimizer(model, optimizer_kind)
        self.x, self.y, self.vocab = x, y, vocab

    def step(self, dtype: torch.dtype) -> float:
        autocast = (torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext())
        with autocast:
            logits = self.forward(self.x)
            loss = F.cross_entropy(logits[..., : self.vocab].flatten(0, 1).float(), self.y.flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def timed(self, dtype: torch.dtype, steps: int) -> tuple[float, float | None]:
        """(seconds for `steps` steps, CPU cores other processes used meanwhile)."""
        with CpuMeter() as meter:
            for _ in range(steps):
                self.step(dtype)
        return meter.seconds, meter.other_cores


def measure_peak(dtype: torch.dtype, tries: int = 3) -> float:
    """Best of a few short square-matmul measurements (contention only ever lowers them)."""
    return max(measure_matmul_flops(torch.device("cpu"), dtype) for _ in range(tries))


def bench_precision(label: str, dtype: torch.dtype, runners: list[Runner], args, flops_per_token: float) -> dict:
    tokens_per_step = args.batch * args.seq
    for r in runners:
        for _ in range(args.warmup):
            r.step(dtype)
    peak = measure_peak(dtype)
    rounds: list[dict] = []  # {name: tok/s, ..., "noise": max other cores, "clean": bool}
    max_rounds = args.rounds * args.max_round_factor
    while sum(r["clean"] for r in rounds) < args.rounds and len(rounds) < max_rounds:
        order = runners if len(rounds) % 2 == 0 else runners[::-1]  # ABBA: cancels linear drift
        row, noise = {}, 0.0
        for r in order:
            seconds, others = r.timed(dtype, args.steps)
            row[r.name] = args.steps * tokens_per_step / seconds
            noise = max(noise, others or 0.0)
        row["noise"], row["clean"] = noise, noise <= args.max_noise
        rounds.append(row)
        print(f"  [{label}] round {len(rounds)}: ours {row['ours']:,.0f} tok/s  hf {row['hf']:,.0f} tok/s  "
              f"other processes {noise:.2f} cores{'' if row['clean'] else '  (noisy: not counted)'}",
              file=sys.stderr, flush=True)
    peak = max(peak, measure_peak(dtype))
    clean = [r for r in rounds if r["clean"]]
    used = clean if len(clean) >= 3 else rounds  # too few quiet rounds: report everything, flagged
    ours, hf = (statistics.median(r[n] for r in used) for n in ("ours", "hf"))
    paired = [r["ours"] / r["hf"] for r in used]
    return {
        "precision": label, "ours_tok_s": ours, "hf_tok_s": hf, "ratio": ours / hf,
        "paired_ratio": statistics.median(paired), "ratio_per_round": paired,
        "ours_mfu": flops_per_token * ours / peak, "hf_mfu": flops_per_token * hf / peak, "peak_flops": peak,
        "clean_rounds": len(clean), "rounds_run": len(rounds), "noisy": used is rounds and len(clean) < 3,
        "rounds": rounds,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    precisions = [s.strip() for s in args.precision.split(",") if s.strip()]
    unknown = set(precisions) - set(DTYPES)
    if unknown:
        raise SystemExit(f"--precision: unknown {sorted(unknown)}; choose from {sorted(DTYPES)}")

    cfg = ModelConfig(name="bench", n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                      n_query_groups=args.kv_heads, head_size=args.head_dim, intermediate_size=args.hidden,
                      vocab_size=args.vocab, block_size=args.seq)
    torch.manual_seed(args.seed)
    ours = GPT(cfg)
    hf = to_llama_model(ours, attn_implementation=args.hf_attn)  # same weights, independent copies
    g = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    runners = [
        Runner("ours", ours, ours, args.optimizer, x, y, cfg.vocab_size),
        Runner("hf", hf, lambda idx: hf(input_ids=idx, use_cache=False).logits, args.optimizer, x, y,
               cfg.vocab_size),
    ]
    fpt = ours.flops_per_token(args.seq)

    setup = (f"torch {torch.__version__}, transformers {_transformers_version()}, "
             f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; "
             f"L={cfg.n_layer} d={cfg.n_embd} H={cfg.n_head} G={cfg.n_query_groups} hd={cfg.head_size} "
             f"ffn={cfg.intermediate_size} V={cfg.vocab_size} B={args.batch} T={args.seq}; "
             f"AdamW {args.optimizer}; HF attn {args.hf_attn}; {args.warmup} warmup + "
             f"{args.rounds} rounds x {args.steps} steps; {fpt / 1e6:.1f} MFLOP/token")
    print(setup, file=sys.stderr, flush=True)
    load_before = _loadavg()
    rows = [bench_precision(p, DTYPES[p], runners, args, fpt) for p in precisions]

    print(setup)
    header = (f"| {'precision':<9} | {'ours tok/s':>10} | {'HF tok/s':>10} | {'ours/HF':>7} | {'paired':>6} "
              f"| {'ours MFU':>8} | {'HF MFU':>7} | {'peak GFLOP/s':>12} | {'quiet rounds':>12} |")
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        quiet = f"{r['clean_rounds']}/{r['rounds_run']}" + (" !" if r["noisy"] else "")
        print(f"| {r['precision']:<9} | {r['ours_tok_s']:>10,.0f} | {r['hf_tok_s']:>10,.0f} | {r['ratio']:>7.3f} "
              f"| {r['paired_ratio']:>6.3f} | {100 * r['ours_mfu']:>7.1f}% | {100 * r['hf_mfu']:>6.1f}% "
              f"| {r['peak_flops'] / 1e9:>12,.1f} | {quiet:>12} |")
    for r in rows:
        print(f"{r['precision']} ours/HF per counted round: " + " ".join(f"{x:.3f}" for x in r["ratio_per_round"]))
    print("ours/HF = median ours tok/s / median HF tok/s; paired = median of per-round ratios; "
          "'!' = fewer than 3 quiet rounds, all rounds used")
    print(f"load average before/after: {load_before} / {_loadavg()}")

    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "setup": setup,
              "loadavg_before_after": [load_before, _loadavg()],
              "args": vars(args), "flops_per_token": fpt, "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _loadavg() -> str:
    """1-minute load average (Linux); on a 2-core machine anything near or above 2 means a noisy neighbour."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "n/a"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
