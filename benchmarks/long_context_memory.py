"""Peak memory of one training step vs context length, with and without activation checkpointing.

Each measurement runs in a fresh subprocess: build the model, take one warm-up step at a short context (so the
AdamW state exists), then one `--varlen` training step (forward, backward, AdamW) at context T on a packed row of
documents (`--doc_len` tokens each, EOS-separated), and report the process's peak resident memory (ru_maxrss)
above the memory it had before that step. Memory per token = that increase / T. The default model is the demo's
(Transformer++ d2, width 256, vocab 4096, bf16 autocast).

    python benchmarks/long_context_memory.py                            # 8K..64K, with and without --act_ckpt
    python benchmarks/long_context_memory.py --arch sambay --depth 4 --ar 64 --contexts 8192,32768
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def child(a: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from archscale import GPT, ModelConfig
    from archscale.models.varlen import document_ids
    from archscale.train.optim import GroupRule, build_adamw, param_groups
    from archscale.train.parallelize import apply_act_ckpt

    torch.manual_seed(0)
    cfg = ModelConfig.from_arch(a.arch, a.depth, ar=a.ar, vocab_size=a.vocab, block_size=a.ctx)
    model = GPT(cfg)
    if a.act_ckpt:
        apply_act_ckpt(model)
    opt = build_adamw(param_groups(model, GroupRule(), GroupRule()), 1e-3, (0.9, 0.95), 1e-8)
    dtype = torch.bfloat16 if a.dtype == "bf16" else None

    def step(T: int) -> None:
        x = torch.randint(1, a.vocab, (1, T + 1))
        x[0, a.doc_len::a.doc_len] = 0  # EOS every doc_len tokens
        inp = x[:, :-1]
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            logits = model(inp, doc_ids=document_ids(inp, 0))
        F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(256)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    step(a.ctx)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mib": peak / 1024, "step_mib": (peak - before) / 1024, "seconds": seconds,
                      "params": model.num_params(non_embedding=False)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="transformer")
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--ar", type=int, default=None)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--contexts", default="8192,16384,32768,65536")
    p.add_argument("--doc_len", type=int, default=4096)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ctx", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--act_ckpt", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
        return
    print(f"{a.arch} d{a.depth}{f' ar {a.ar}' if a.ar else ''}, vocab {a.vocab}, {a.dtype}, batch 1, documents of "
          f"{a.doc_len} tokens, one varlen fwd+bwd+AdamW step; peak RSS of a fresh process\n")
    print("| context | act_ckpt | peak RSS MiB | step increase MiB | KiB / token | step s |")
    print("|---:|---|---:|---:|---:|---:|")
    for T in [int(x) for x in a.contexts.split(",")]:
        for ckpt in (False, True):
            cmd = [sys.executable, __file__, "--child", "--ctx", str(T), "--arch", a.arch, "--depth", str(a.depth),
                   "--vocab", str(a.vocab), "--doc_len", str(a.doc_len), "--dtype", a.dtype]
            cmd += (["--ar", str(a.ar)] if a.ar else []) + (["--act_ckpt"] if ckpt else [])
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                last = (r.stderr.strip().splitlines() or ["?"])[-1]
                print(f"| {T} | {ckpt} | failed: {last[:80]} | | | |", flush=True)
                continue
            m = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"| {T} | {'yes' if ckpt else 'no'} | {m['peak_mib']:,.0f} | {m['step_mib']:,.0f} | "
                  f"{m['step_mib'] * 1024 / T:.1f} | {m['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
