"""Decode throughput vs context: Transformer++ and SambaY at the same depth, generating after long prompts.

Both models decode with their caches (`GPT.generate` machinery): the Transformer++ reads a full KV cache in
every layer; SambaY reads one shared KV cache (its KV layer and its cross-attention layers), SWA windows and
Mamba states, and its GMU layers cost O(d). Timed separately: the prefill (one forward over the prompt that
fills the cache) and `--new` single-token decode steps. Rounds alternate between the models; the median of
`--rounds` is reported. Weights are random (throughput does not depend on them).

    python benchmarks/decode_throughput.py                       # d8, ar 32, prompts 1K/4K/16K, 128 new tokens
    python benchmarks/decode_throughput.py --prompts 1024 --new 32 --rounds 1    # quick look
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from archscale import GPT, ModelConfig
from archscale.models.cache import InferenceCache


@torch.no_grad()
def time_decode(model: GPT, prompt: torch.Tensor, new: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) for greedy decoding of `new` tokens after `prompt`."""
    cache = InferenceCache(capacity=prompt.shape[1] + new)
    t0 = time.perf_counter()
    logits = model(prompt, cache=cache, last_only=True)[:, -1]
    t1 = time.perf_counter()
    for _ in range(new):
        nxt = logits.argmax(-1, keepdim=True)
        logits = model(nxt, cache=cache)[:, -1]
    t2 = time.perf_counter()
    return t1 - t0, new * prompt.shape[0] / (t2 - t1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--ar", type=int, default=32, help="width = ar x depth (head_size = ar)")
    p.add_argument("--prompts", default="1024,4096,16384")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    models = {}
    for arch in ("transformer", "sambay"):
        cfg = ModelConfig.from_arch(arch, a.depth, ar=a.ar, vocab_size=a.vocab, block_size=4096)
        models[arch] = GPT(cfg).eval()
        kinds = cfg.layer_kinds
        print(f"{arch}_d{a.depth} ar {a.ar}: width {cfg.n_embd}, {models[arch].num_params() / 1e6:.2f}M "
              f"non-embedding params, layers {kinds}, SWA window {cfg.sliding_window or '-'}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {a.batch}, {a.new} new tokens, "
          f"fp32, median of {a.rounds} alternating rounds\n")
    print("| prompt | T++ prefill s | SambaY prefill s | prefill speedup | T++ decode tok/s | SambaY decode tok/s "
          "| decode speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in [int(x) for x in a.prompts.split(",")]:
        prompt = torch.randint(0, a.vocab, (a.batch, n))
        res = {k: [] for k in models}
        time_decode(models["transformer"], prompt[:, :64], 4)  # warm up kernels
        time_decode(models["sambay"], prompt[:, :64], 4)
        for _ in range(a.rounds):
            for name, model in models.items():
                res[name].append(time_decode(model, prompt, a.new))
        pre = {k: statistics.median(r[0] for r in v) for k, v in res.items()}
        dec = {k: statistics.median(r[1] for r in v) for k, v in res.items()}
        print(f"| {n} | {pre['transformer']:.2f} | {pre['sambay']:.2f} | {pre['transformer'] / pre['sambay']:.2f}x "
              f"| {dec['transformer']:.1f} | {dec['sambay']:.1f} | {dec['sambay'] / dec['transformer']:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
