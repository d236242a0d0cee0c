"""Peak CPU memory of the LM loss, forward + backward: plain (logits -> F.cross_entropy) vs chunked linear
cross-entropy (`archscale.kernels.cross_entropy`), fp32, at Phi4-mini-Flash's head: vocab 200,064 (padded to 200,064),
width 2560.

Each (path, tokens) runs in a fresh subprocess that reports its peak resident set size (getrusage ru_maxrss), the
RSS just before the loss (inputs: head weight, hidden states, targets) and the difference, the memory the loss
itself needs. A plain run whose estimated need (3 x tokens x vocab x 4 bytes + weight and its gradient) exceeds
the memory available now is skipped with a message, not started.

    python benchmarks/cross_entropy_memory.py                      # tokens 2048 and 8192
    python benchmarks/cross_entropy_memory.py --tokens 4096 --paths chunked

When plain runs were measured at two or more sizes but skipped at a bigger one, the plain path's loss memory there
is extrapolated by a least-squares line through the measured (tokens, loss GiB) points (the plain path's buffers
are tokens x vocab, so the line is the model) and printed as such, with the chunked/plain ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(path: str, tokens: int, vocab: int, width: int) -> dict:
    import torch
    import torch.nn.functional as F

    from archscale.kernels.cross_entropy import chunked_linear_cross_entropy

    torch.manual_seed(0)
    w = (torch.randn(vocab, width) * 0.02).requires_grad_()
    h = torch.randn(tokens, width).requires_grad_()
    t = torch.randint(0, vocab, (tokens,))
    before = rss_bytes()
    if path == "plain":
        loss = F.cross_entropy((h @ w.T).float(), t)
    else:
        loss = chunked_linear_cross_entropy(h, w, t, vocab)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(path=path, tokens=tokens, loss=float(loss), before_gib=before / 2**30, peak_gib=peak / 2**30,
                loss_gib=(peak - before) / 2**30)


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="2048,8192")
    p.add_argument("--vocab", type=int, default=200064)
    p.add_argument("--width", type=int, default=2560)
    p.add_argument("--paths", default="plain,chunked")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        path, tokens = a.child.split(":")
        print("RESULT " + json.dumps(child(path, int(tokens), a.vocab, a.width)))
        return
    import torch

    print(f"torch {torch.__version__}, vocab {a.vocab}, width {a.width}, fp32, forward + backward")
    print(f"{'path':8} {'tokens':>7} {'loss':>9} {'inputs GiB':>11} {'peak GiB':>9} {'loss GiB':>9}")
    measured: dict[tuple[str, int], float] = {}
    for tokens in (int(x) for x in a.tokens.split(",")):
        for path in a.paths.split(","):
            need = 3 * tokens * a.vocab * 4 + 3 * a.vocab * a.width * 4 if path == "plain" else 0
            if need and need * 1.1 > available_bytes():
                print(f"{path:8} {tokens:7d}  skipped: needs ~{need / 2**30:.1f} GiB, "
                      f"{available_bytes() / 2**30:.1f} GiB available now")
                continue
            done = subprocess.run([sys.executable, __file__, "--child", f"{path}:{tokens}", "--vocab", str(a.vocab),
                                   "--width", str(a.width)], capture_output=True, text=True, env=os.environ.copy())
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                print(f"{path:8} {tokens:7d}  failed (exit {done.returncode}): {done.stderr.strip()[-200:]}")
                continue
            r = json.loads(lines[-1][7:])
            measured[(path, tokens)] = r["loss_gib"]
            print(f"{path:8} {tokens:7d} {r['loss']:9.4f} {r['before_gib']:11.2f} {r['peak_gib']:9.2f} "
                  f"{r['loss_gib']:9.2f}", flush=True)
    compare(measured)


def compare(measured: dict[tuple[str, int], float]) -> None:
    """chunked / plain loss memory at every size with a chunked run: measured plain, else extrapolated."""
    plain = sorted((t, g) for (p, t), g in measured.items() if p == "plain")
    for (path, tokens), chunked in sorted(measured.items(), key=lambda kv: kv[0][1]):
        if path != "chunked":
            continue
        if ("plain", tokens) in measured:
            ref, how = measured[("plain", tokens)], "measured"
        elif len(plain) >= 2:
            n = len(plain)
            mt, mg = sum(t for t, _ in plain) / n, sum(g for _, g in plain) / n
            slope = sum((t - mt) * (g - mg) for t, g in plain) / sum((t - mt) ** 2 for t, _ in plain)
            ref = mg + slope * (tokens - mt)
            how = f"extrapolated from plain at {', '.join(str(t) for t, _ in plain)} tokens"
        else:
            continue
        print(f"tokens {tokens}: chunked {chunked:.2f} GiB / plain {ref:.2f} GiB ({how}) = {chunked / ref:.3f}")


if __name__ == "__main__":
    main()
