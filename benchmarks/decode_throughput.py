"""Decode throughput vs context: Transformer++ and SambaY at the same depth, generating after long prompts.

Both models decode with their caches (`GPT.generate` machinery): the Transformer++ reads a full KV cache in
every layer; SambaY reads one shared KV cache (its KV layer and its cross-attention layers), SWA windows and
Mamba states, and its GMU layers cost O(d). Timed separately: the prefill (one forward over the prompt that
fills the cache) and `--new` single-token decode steps. Rounds alternate between the models; the median of
`--rounds` is reported. Weights are random (throughput does not depend on them).

    python benchmarks/decode_throughput.py                       # d8, ar 32, prompts 1K/4K/16K, 128 new tokens
    python benchmarks/decode_throughput.py --prompts 1024 --new 32 --rounds 1    # quick look

`--bound` instead puts each decode step against the memory-bandwidth bound: for the Transformer++, SambaY and
GDN-Y (`--bound_archs`) at batch 1 / 8 / 32 and context 2K / 8K / 16K, the bytes one step must read (every weight
but the embedding table, whose B rows are counted; plus each layer's cache as the model's own `InferenceCache`
holds it: a full layer's K/V up to the context, a window's kept K/V, a recurrent state, and the one YOCO K/V once
per layer that attends to it), a read-bandwidth probe (`torch.sum` over 512 MiB, timed in the same process right
before each measurement), the measured step (median of `--steps` greedy single-token steps) with PyTorch's plain
linears and with the weights pre-packed for oneDNN as `archscale serve` runs them (`kernels/packed_linear.py`;
both on the same cache, the order alternating), and the bound's share of the packed step (bytes / bandwidth /
step time). The caches are filled to the context without a prefill (timing does not
depend on the values: the prompt's first 64 positions' K/V are tiled), so 16K x 32 costs no 16K prefill.

    python benchmarks/decode_throughput.py --bound --threads 1
    python benchmarks/decode_throughput.py --threads 1 --window_before OLD/models/cache.py   # the window ring
    PYTHONPATH=OLD_SRC python benchmarks/decode_throughput.py --threads 1 --sampling         # serving's sampling
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from archscale import GPT, ModelConfig
from archscale.host_alloc import describe as describe_host_alloc
from archscale.kernels.packed_linear import pack_linears
from archscale.models.cache import InferenceCache, KVCache, WindowKVCache


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


def filled_cache(model: GPT, batch: int, ctx: int, new: int) -> InferenceCache:
    """A cache at position `ctx` for `batch` rows: a 64-token prefill, its K/V tiled up to `ctx` (full layers) or
    to the window (SWA layers); recurrent states as they are (their size does not grow with the context)."""
    cache = InferenceCache(capacity=ctx + new)
    model(torch.randint(0, model.config.vocab_size, (batch, 64)), cache=cache, last_only=True)
    def tile(t: torch.Tensor, n: int) -> torch.Tensor:
        return t[:, :, :64].repeat(1, 1, -(-n // 64), 1)[:, :, :n].contiguous()

    for state in cache.layers.values():
        if isinstance(state, KVCache):
            state.k, state.v, state.length = tile(state.k, ctx + new), tile(state.v, ctx + new), ctx
        elif isinstance(state, WindowKVCache):
            state.k, state.v = tile(state.k, state.keep), tile(state.v, state.keep)
    cache.pos = ctx
    return cache


def step_bytes(model: GPT, cache: InferenceCache, batch: int) -> dict[str, int]:
    """Bytes one decode step reads: weights (the embedding table: only `batch` rows) and each layer's cache."""
    emb = model.wte.weight
    tied = model.lm_head.weight is emb
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)
    weights += (emb.numel() if tied else batch * emb.shape[1]) * emb.element_size()
    kinds = model.config.layer_kinds
    readers = 1 + kinds.count("cross")  # the YOCO KV layer's cache is read by it and by every cross layer
    kv = window = recurrent = 0
    for idx, state in cache.layers.items():
        if isinstance(state, KVCache):
            kv += 2 * state.k[:, :, :state.length].numel() * state.k.element_size() * \
                (readers if kinds[idx] in ("kv", "kv_mem") else 1)
        elif isinstance(state, WindowKVCache):
            window += 2 * state.k.numel() * state.k.element_size()
        else:
            recurrent += sum(t.numel() * t.element_size() for t in vars(state).values() if torch.is_tensor(t))
    return {"weights": weights, "kv": kv, "window": window, "recurrent": recurrent}


def read_bandwidth(buf: torch.Tensor, reps: int = 5) -> float:
    """Bytes/s of reading `buf` once (torch.sum, the same threads as the model), the median of `reps`."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * buf.element_size() / statistics.median(times)


@torch.no_grad()
def time_steps(model: GPT, cache: InferenceCache, steps: int) -> float:
    """Median seconds of one greedy single-token decode step."""
    nxt = torch.zeros(cache_batch(cache), 1, dtype=torch.long)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        nxt = model(nxt, cache=cache)[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cache_batch(cache: InferenceCache) -> int:
    state = next(iter(cache.layers.values()))
    return next(t for t in vars(state).values() if torch.is_tensor(t)).shape[0]


@torch.no_grad()
def bound_row(models: dict[str, GPT], packed: dict[str, GPT], batch: int, ctx: int, a,
              buf: torch.Tensor) -> dict[str, dict]:
    """One (batch, context) point for every model: bytes, bandwidth, step time with plain and with packed linears
    on the same cache (medians over rounds that alternate the models and the two variants)."""
    res = {name: {"step": [], "dense": [], "bw": []} for name in models}
    for r in range(a.rounds):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            cache = filled_cache(models[name], batch, ctx, 2 * a.steps + 1)
            res[name]["bytes"] = step_bytes(models[name], cache, batch)
            res[name]["bw"].append(read_bandwidth(buf))
            for key, m in (("dense", models[name]), ("step", packed[name]))[::1 if r % 2 == 0 else -1]:
                res[name][key].append(time_steps(m, cache, a.steps))
            del cache
    for v in res.values():
        v["step"], v["dense"], v["bw"] = (statistics.median(v[k]) for k in ("step", "dense", "bw"))
        v["total"] = sum(v["bytes"].values())
        v["frac"] = v["total"] / v["bw"] / v["step"]
    return res


def print_bound(a) -> None:
    torch.manual_seed(0)
    models = {arch: GPT(ModelConfig.from_arch(arch, a.depth, ar=a.ar, vocab_size=a.vocab, block_size=4096)).eval()
              for arch in a.bound_archs.split(",")}
    for arch, m in models.items():
        print(f"{arch}_d{a.depth} ar {a.ar}: {m.num_params() / 1e6:.2f}M non-embedding params, layers "
              f"{m.config.layer_kinds}, SWA window {m.config.sliding_window or '-'}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, vocab {a.vocab}, median of {a.steps} "
          f"steps, median of {a.rounds} alternating rounds, load average {_load()}\n")
    packed = {name: copy.deepcopy(m) for name, m in models.items()}
    swapped = {name: pack_linears(m) for name, m in packed.items()}
    print(f"packed linears per model: {swapped}")
    buf = torch.ones(128 << 20)  # 512 MiB: far past any cache level
    ref = list(models)[0]
    others = list(models)[1:]
    head = " | ".join(f"{o} / {ref} measured | bytes" for o in others)
    print(f"| batch | context | model | MB read / step (weights + KV + window + state) | probe GB/s | step ms plain "
          f"| step ms packed | bound ms | % of bound (packed) | {head} |")
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|" + "---:|---:|" * len(others))
    for batch in [int(x) for x in a.batches.split(",")]:
        for ctx in [int(x) for x in a.contexts.split(",")]:
            res = bound_row(models, packed, batch, ctx, a, buf)
            for name, v in res.items():
                b = v["bytes"]
                mb = " + ".join(f"{b[k] / 1e6:.1f}" for k in ("weights", "kv", "window", "recurrent"))
                ratios = " | ".join(
                    f"{res[ref]['step'] / res[o]['step']:.2f}x | {res[ref]['total'] / res[o]['total']:.2f}x"
                    if name == o else " | " for o in others)
                print(f"| {batch} | {ctx} | {name} | {v['total'] / 1e6:.1f} ({mb}) | {v['bw'] / 1e9:.1f} | "
                      f"{v['dense'] * 1e3:.1f} | {v['step'] * 1e3:.1f} | {v['total'] / v['bw'] * 1e3:.1f} | "
                      f"{100 * v['frac']:.0f}% | {ratios} |",
                      flush=True)
    print(f"load average at the end: {_load()}")


def window_before_after(old_cache_py: str, batch: int = 32, groups: int = 2, hd: int = 32, window: int = 128) -> None:
    """`WindowKVCache.append` of `old_cache_py` (e.g. an older commit's models/cache.py) against today's, in this
    process, CPU time (thread time: far less disturbed by other processes than wall time), alternating rounds."""
    import importlib.util

    from archscale.models import cache as new

    spec = importlib.util.spec_from_file_location("old_cache", old_cache_py)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    res = {"before": [], "after": []}
    for r in range(6):
        for name, mod in (("before", old), ("after", new))[::1 if r % 2 == 0 else -1]:
            c = mod.WindowKVCache(window)
            c.append(torch.randn(batch, groups, 200, hd), torch.randn(batch, groups, 200, hd))
            k = torch.randn(batch, groups, 1, hd)
            t0 = time.thread_time()
            for _ in range(300):
                c.append(k, k)
            res[name].append((time.thread_time() - t0) / 300 * 1e6)
    for name, v in res.items():
        print(f"WindowKVCache.append, batch {batch}, {groups} KV heads x {hd}, window {window}: {name}: median "
              f"{statistics.median(v):.0f} us CPU per step (6 alternating rounds of 300)")


def sampling_cost(rows: int = 16, vocab: int = 32000, steps: int = 200) -> None:
    """CPU time of the serving engine's per-step work after the decode step (sampling, finiteness, bookkeeping) for
    `rows` greedy rows: the step's logits are fixed, so only that work is timed. Run it with PYTHONPATH on an older
    src/ and on today's in turn for a before / after."""
    from archscale.serve import engine as eng_mod
    from archscale.serve.batching import decode_step

    class Tok:
        eos_id = 0

        def decode(self, ids):
            return "x" * len(ids)

    torch.manual_seed(0)
    model = GPT(ModelConfig.from_arch("transformer", 4, vocab_size=vocab, block_size=512)).eval()
    eng = eng_mod.Engine(model, Tok(), max_batch=rows)
    times = []
    with torch.inference_mode():
        for i in range(rows):
            eng._admit(eng_mod.Sequence(list(range(1, 20 + i)), eng_mod.SamplingParams(
                max_tokens=10 ** 6, temperature=0, ignore_eos=True), lambda e: None))
        logits = decode_step(eng.batch, torch.tensor([s.out_ids[-1] for s in eng.rows]))
        eng_mod.decode_step = lambda batch, tokens: logits
        for _ in range(steps):
            t0 = time.thread_time()
            eng._step()
            times.append(time.thread_time() - t0)
    ms = statistics.median(times) * 1e3
    print(f"engine step after the model, {rows} greedy rows, vocab {vocab}: median {ms:.2f} ms CPU (thread time) per step")


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


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
    p.add_argument("--bound", action="store_true", help="the memory-bandwidth bound table instead (see above)")
    p.add_argument("--bound_archs", default="transformer,sambay,gdny")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--contexts", default="2048,8192,16384")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--window_before", default=None, metavar="CACHE_PY",
                   help="time an older models/cache.py's sliding-window append against today's, and exit")
    p.add_argument("--sampling", action="store_true", help="time the serving engine's per-step sampling, and exit")
    a = p.parse_args()
    print(describe_host_alloc())  # before any tensor (every model runs under it)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.sampling:
        sampling_cost()
        return
    if a.window_before:
        window_before_after(a.window_before)
        return
    if a.bound:
        print_bound(a)
        return
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
