"""Our server under load: `archscale serve` + `archscale bench-serve` at several concurrencies, per architecture.

For each architecture: a 2-step `archscale pretrain` run at depth D (ctx 512) on the packaged Areopagitica essay
with its own BPE tokenizer (serving speed does not depend on how well the weights are trained; `ignore_eos` makes
every request decode exactly --max_tokens), then `archscale serve --checkpoint RUN` in its own process and
`archscale bench-serve` against it at each concurrency. Prints each bench-serve output as it came and a summary;
writes all JSON to --out.

    python benchmarks/serve_throughput.py                                    # transformer + sambay d4, c = 1/4/16
    python benchmarks/serve_throughput.py --archs sambay --concurrency 1,8 --duration 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
ESSAY = ROOT / "src" / "archscale" / "eval" / "data" / "areopagitica.txt"
CLI = [sys.executable, "-m", "archscale.cli"]


def make_data(work: Path) -> Path:
    from archscale.data.prepare import prepare
    from archscale.data.tokenizer import train_bpe

    paras = [p for p in ESSAY.read_text().split("\n\n") if p.strip()]
    (work / "c.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paras))
    train_bpe([str(work / "c.jsonl")], 2048, str(work / "tok.json"))
    prepare([str(work / "c.jsonl")], str(work / "data"), str(work / "tok.json"), val_fraction=0.1, chunk_size=1 << 16,
            progress=False, num_workers=1)
    return work / "data"


def make_run(work: Path, data: Path, arch: str, depth: int) -> Path:
    out = work / f"{arch}_d{depth}"
    subprocess.run([*CLI, "pretrain", "--train_data_dir", str(data), "--train_model", arch, "--depth", str(depth),
                    "--ctx_len", "512", "--micro_bsz", "2", "--base_hps.b0", "1024", "--max_tokens", "2048",
                    "--base_hps.warmup_tokens0", "1024", "--eval_iters", "1", "--eval_interval", "1000",
                    "--out_dir", str(out), "--progress", "false", "--precision", "fp32", "--resume", "none"],
                   check=True, env=ENV, stdout=subprocess.DEVNULL)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise SystemExit("the server did not come up")


def bench_arch(run: Path, args, work: Path) -> list[dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [*CLI, "serve", "--checkpoint", str(run), "--port", str(port), "--max_batch", str(args.max_batch)]
    print("$ " + " ".join(["archscale", *serve[3:]]), flush=True)
    proc = subprocess.Popen(serve, env=ENV)
    docs = []
    try:
        wait_healthy(url, proc)
        for c in args.concurrency:
            out = work / f"{run.name}_c{c}.json"
            cmd = [*CLI, "bench-serve", "--url", url, "--concurrency", str(c), "--duration", str(args.duration),
                   "--max_tokens", str(args.max_tokens), "--output", str(out)]
            print("$ " + " ".join(["archscale", *cmd[3:]]), flush=True)
            subprocess.run(cmd, check=True, env=ENV)
            doc = json.loads(out.read_text())
            doc["arch"] = run.name
            docs.append(doc)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return docs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default="transformer,sambay")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--max_batch", type=int, default=16)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_throughput.json"))
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    import torch
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (other processes share these cores)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = make_data(work)
        docs = []
        for arch in args.archs.split(","):
            docs += bench_arch(make_run(work, data, arch, args.depth), args, work)
    print("\n| model | concurrency | requests/s | output tokens/s | latency mean / p50 / p95 / p99 (ms) | "
          "TTFT mean / p99 (ms) | ITL mean / p99 (ms) |")
    print("|---|---:|---:|---:|---|---|---|")
    for d in docs:
        lat, ttft, itl = d["latency_ms"], d["ttft_ms"], d["itl_ms"]
        print(f"| {d['arch']} | {d['concurrency']} | {d['requests_per_s']:.2f} | {d['output_tokens_per_s']:.1f} | "
              f"{lat['mean']:.0f} / {lat['median']:.0f} / {lat['p95']:.0f} / {lat['p99']:.0f} | "
              f"{ttft['mean']:.0f} / {ttft['p99']:.0f} | {itl['mean']:.1f} / {itl['p99']:.1f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(docs, indent=2) + "\n")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"wrote {args.out}")


ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}

if __name__ == "__main__":
    main()
