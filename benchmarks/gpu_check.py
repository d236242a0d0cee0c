"""The prepared GPU check behind `benchmarks/gpu_check.sh` (read docs/GPU.md): the CUDA-marked tests, then one
table of measurements, written as JSON and a log under $OUT when it is set.

Rows (bf16 autocast, AdamW, fp32 master weights; random tokens; weights random):
- train MFU: transformer d16 and sambay d16 at ctx 4096, eager and with `--compile`'s regional compilation;
  MFU = GPT.flops_per_token(ctx) x tokens/s over 989 TFLOP/s (H100/H200 bf16 dense peak), and over the matmul
  rate measured on this machine (a bf16 8192^3 matmul);
- varlen: transformer d16 training at 32K positions, documents (lengths 64..8K) vs plain causal;
- decode: tokens/s of SambaY d16 vs Transformer++ d16 after 16K and 32K prompts (prefill timed apart);
- step: the trainer's own optimizer step (`Trainer.train_step`, bf16-mixed, batches prefetched into pinned memory
  on a background thread) of transformer d16 at ctx 4096: seconds per step, tokens/s and the host syncs per step
  (reads of CUDA tensors, train/host_sync.py: the step path is meant to need one); benchmarks/step_time.py;
- peak memory (torch.cuda.max_memory_allocated) of each row, and for training rows the memory model's prediction
  for it (`archscale.train.memory_model`, the dry run's "memory" section, at allocator factor 1: allocated, not
  reserved) with predicted / measured (the compiled rows fuse activations the eager prediction counts).
Each row runs in its own subprocess with a time limit (a hung compile or an OOM costs one row, not the run), and
the whole table stays inside a budget (default 320 s; the tests get 120 s before it: under 8 minutes in all).

`--dry`: the same logic on CPU at tiny sizes, every row in this process (seconds); `tests/test_gpu_check.py`.
Needs only torch (and numpy) from the repository, run with PYTHONPATH=src; pytest is optional (a small built-in
runner executes the CUDA-marked tests without it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

PEAK_BF16 = 989e12  # H100 / H200 SXM bf16 dense
CUDA_TEST_FILES = ("tests/test_gpu.py",)
ROOT = Path(__file__).resolve().parents[1]

SIZES = {  # name -> (depth, ar, ctx, micro_bsz, steps, varlen ctx, decode prompts, new tokens)
    "gpu": dict(depth=16, ar=None, ctx=4096, bsz=2, steps=8, varlen_ctx=32768, prompts=(16384, 32768), new=64,
                vocab=32000),
    "dry": dict(depth=4, ar=8, ctx=64, bsz=2, steps=1, varlen_ctx=256, prompts=(64, 128), new=4, vocab=256),
}


# ------------------------------------------------------------------------------------------------ measurements
def _device_and_sync():
    import torch

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    return torch, dev, sync


def _model(arch, size, ctx):
    from archscale import GPT, ModelConfig

    torch, dev, _ = _device_and_sync()
    torch.manual_seed(0)
    cfg = ModelConfig.from_arch(arch, size["depth"], ar=size["ar"], vocab_size=size["vocab"], block_size=ctx)
    return GPT(cfg).to(dev)


def _peak_mem(torch, dev):
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None


def predicted_peak_gib(arch, size, ctx, bsz, act_ckpt, device):
    """The memory model's per-rank peak for this row's training loop (single process, bf16-mixed, plain loss)."""
    from archscale.config import ModelConfig
    from archscale.train.memory_model import GIB, RunShape, predict_memory

    cfg = ModelConfig.from_arch(arch, size["depth"], ar=size["ar"], vocab_size=size["vocab"], block_size=ctx)
    shape = RunShape(micro_bsz=bsz, ctx_len=ctx, act_ckpt=act_ckpt, device=device)
    return predict_memory(cfg, shape, alloc_factor=1.0)["peak_bytes"] / GIB


def measure_train(arch, size, compiled, varlen=False, dry=False):
    """Tokens/s, MFU and peak memory of training steps (first steps are warm-up: compile, autotuning)."""
    from archscale.models.varlen import document_ids
    from archscale.train.parallelize import apply_act_ckpt, apply_compile

    torch, dev, sync = _device_and_sync()
    long = varlen in ("causal", "docs")  # the 32K rows: one sequence, documents or plain causal
    ctx, bsz = (size["varlen_ctx"], 1) if long else (size["ctx"], size["bsz"])
    model = _model(arch, size, ctx)
    if long:
        apply_act_ckpt(model)  # 32K positions: keep only block inputs (the comparison is between masks)
    if compiled:
        apply_compile(model, backend="eager" if dry else "inductor")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(1, size["vocab"], (bsz, ctx + 1), generator=gen)
    docs = None
    if varlen == "docs":  # EOS (id 0) at random document ends, lengths 64 .. ctx/4
        pos = 0
        while True:
            pos += int(torch.randint(64 if not dry else 8, max(65, ctx // 4), (1,), generator=gen))
            if pos >= ctx:
                break
            x[:, pos] = 0
    x = x.to(dev)
    if varlen == "docs":
        docs = document_ids(x[:, :-1], 0)
    dtype = torch.bfloat16
    warm, steps = (1, size["steps"]) if not compiled else (2, size["steps"])
    times = []
    for i in range(warm + steps):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=dtype):
            logits = model(x[:, :-1], doc_ids=docs)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= warm:
            times.append(time.perf_counter() - t0)
    tok_s = bsz * ctx / (sum(times) / len(times))
    flops = model.flops_per_token(ctx)
    peak, predicted = _peak_mem(torch, dev), predicted_peak_gib(arch, size, ctx, bsz, long, dev.type)
    return dict(tokens_per_s=tok_s, flops_per_token=flops, achieved_tflops=flops * tok_s / 1e12,
                mfu_peak=flops * tok_s / PEAK_BF16, loss=float(loss), peak_gib=peak, predicted_gib=predicted,
                predicted_over_measured=predicted / peak if peak else None,
                docs=int(docs.max()) + 1 if docs is not None else None)


def measure_decode(arch, size, prompt_len):
    from archscale.models.cache import InferenceCache

    torch, dev, sync = _device_and_sync()
    model = _model(arch, size, 4096).eval()
    new = size["new"]
    prompt = torch.randint(1, size["vocab"], (1, prompt_len), device=dev)
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
        for attempt in range(2):  # the first pass compiles FlexAttention / warms the kernels
            cache = InferenceCache(capacity=prompt_len + new)
            sync()
            t0 = time.perf_counter()
            logits = model(prompt, cache=cache, last_only=True)[:, -1]
            sync()
            t1 = time.perf_counter()
            for _ in range(new):
                logits = model(logits.argmax(-1, keepdim=True), cache=cache)[:, -1]
            sync()
            t2 = time.perf_counter()
    return dict(prefill_s=t1 - t0, decode_tokens_per_s=new / (t2 - t1), peak_gib=_peak_mem(torch, dev))


def measure_matmul(dry):
    torch, dev, sync = _device_and_sync()
    n = 256 if dry else 8192
    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    sync()
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < (0.2 if dry else 2.0):
        a @ b
        iters += 1
        if dev.type == "cuda" and iters % 10 == 0:
            sync()
    sync()
    return dict(tflops=2 * n**3 * iters / (time.perf_counter() - t0) / 1e12)


def measure_step(size, dry):
    """The trainer's step (benchmarks/step_time.py) at this size: seconds, tokens/s, host syncs per step."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from step_time import step_times

    r = step_times(size["depth"], size["ctx"], size["bsz"], accum=2, steps=size["steps"], warmup=2,
                   extra=("--precision", "bf16-mixed") if not dry else ())
    return dict(step_s=r["median_step_s"], tokens_per_s=r["tokens_per_step"] / r["median_step_s"],
                host_syncs_per_step=r["host_reads_per_step"])


def rows_for(size):
    rows = [("matmul", "measure_matmul", {})]
    # sambay compiled goes last: compiling its PyTorch Mamba scan is the row most likely to run out of time
    for arch, compiled in (("transformer", False), ("transformer", True), ("sambay", False)):
        rows.append((f"train {arch} d{size['depth']} ctx{size['ctx']} {'compiled' if compiled else 'eager'}",
                     "measure_train", dict(arch=arch, compiled=compiled)))
    for mode in ("causal", "docs"):
        rows.append((f"train transformer d{size['depth']} ctx{size['varlen_ctx']} {mode}", "measure_train",
                     dict(arch="transformer", compiled=False, varlen=mode)))
    for n in size["prompts"]:
        for arch in ("transformer", "sambay"):
            rows.append((f"decode {arch} d{size['depth']} prompt {n}", "measure_decode", dict(arch=arch, prompt_len=n)))
    rows.append((f"step transformer d{size['depth']} ctx{size['ctx']} trainer", "measure_step", {}))
    rows.append((f"train sambay d{size['depth']} ctx{size['ctx']} compiled", "measure_train",
                 dict(arch="sambay", compiled=True)))
    return rows


def run_row(func, kwargs, size_name):
    size = SIZES[size_name]
    if func == "measure_matmul":
        return measure_matmul(size_name == "dry")
    if func == "measure_train":
        return measure_train(size=size, dry=size_name == "dry", **kwargs)
    if func == "measure_step":
        return measure_step(size, dry=size_name == "dry")
    return measure_decode(size=size, **kwargs)


def run_isolated(func, kwargs, size_name, timeout):
    """One row in a fresh process (own CUDA context and peak-memory counter); {'error': ...} on failure."""
    cmd = [sys.executable, __file__, "--row", json.dumps([func, kwargs, size_name])]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1, timeout), env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("ROW "):
            return json.loads(line[4:])
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"exit {done.returncode}: {tail[0][:160]}"}


# ---------------------------------------------------------------------------------------------------- tests
def run_cuda_tests(dry, timeout):
    """pytest -m cuda when pytest imports; else the built-in runner. Returns a summary dict."""
    files = [f for f in CUDA_TEST_FILES if (ROOT / f).exists()]
    try:
        import pytest  # noqa: F401
        have_pytest = True
    except ImportError:
        have_pytest = False
    if dry:  # CPU: the cuda tests would all skip; check only that the runner collects them
        return builtin_runner(files, collect_only=True)
    if have_pytest:
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *files]
        try:
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"runner": "pytest", "error": f"timeout after {timeout} s"}
        print(done.stdout[-4000:])
        return {"runner": "pytest", "returncode": done.returncode, "summary": done.stdout.strip().splitlines()[-1:]}
    return builtin_runner(files)


def _pytest_shim() -> types.ModuleType:
    """Just enough of pytest for the CUDA test files: marks (parametrize recorded), skip, raises."""
    shim = types.ModuleType("pytest")

    class Skipped(Exception):
        pass

    class Mark:
        def __getattr__(self, name):
            def factory(*args, **kw):
                if name not in ("parametrize", "skipif") and len(args) == 1 and callable(args[0]) and not kw:
                    args[0].__dict__.setdefault("_marks", set()).add(name)  # bare @pytest.mark.cuda
                    return args[0]

                def deco(f):
                    f.__dict__.setdefault("_marks", set()).add(name)
                    if name == "parametrize":
                        f.__dict__.setdefault("_params", []).append(args)
                    return f
                return deco
            return factory

    def skip(reason=""):
        raise Skipped(reason)

    shim.mark, shim.skip, shim.Skipped = Mark(), skip, Skipped
    shim.fixture = lambda *a, **kw: (a[0] if a and callable(a[0]) else (lambda f: f))
    return shim


def _cases(fn):
    """Every parameter combination of a function's (stacked) parametrize marks, as kwargs."""
    axes = []
    for names, values in fn.__dict__.get("_params", []):
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        axes.append([dict(zip(names, v if len(names) > 1 else (v,))) for v in values])
    for combo in itertools.product(*axes):
        yield {k: v for d in combo for k, v in d.items()}


def builtin_runner(files, collect_only=False):
    import importlib.util
    import inspect

    real_pytest = sys.modules.get("pytest")
    shim = sys.modules["pytest"] = _pytest_shim()  # the shim's marks record what the runner needs
    try:
        return _run_files(files, collect_only, shim.Skipped, inspect, importlib.util)
    finally:
        if real_pytest is not None:
            sys.modules["pytest"] = real_pytest
        else:
            sys.modules.pop("pytest", None)


def _run_files(files, collect_only, Skipped, inspect, importlib_util):
    passed, failed, skipped, collected = 0, [], 0, 0
    for f in files:
        spec = importlib_util.spec_from_file_location(f"_gpu_check_{Path(f).stem}", ROOT / f)
        mod = importlib_util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for name, fn in vars(mod).items():
            if not (name.startswith("test_") and callable(fn) and "cuda" in fn.__dict__.get("_marks", ())):
                continue
            for kwargs in _cases(fn):
                collected += 1
                needs = set(inspect.signature(fn).parameters) - set(kwargs)
                if collect_only or needs:
                    skipped += 1
                    continue
                try:
                    fn(**kwargs)
                    passed += 1
                except Exception as e:  # noqa: BLE001 - report every failure, run the rest
                    if isinstance(e, Skipped):
                        skipped += 1
                    else:
                        failed.append(f"{f}::{name}{kwargs}: {type(e).__name__}: {str(e)[:200]}")
    for line in failed:
        print("FAILED", line)
    return {"runner": "builtin", "collected": collected, "passed": passed, "failed": len(failed),
            "skipped": skipped, "collect_only": collect_only}


# ----------------------------------------------------------------------------------------------------- table
def format_table(results, matmul_tflops):
    head = (f"{'measurement':46} {'tokens/s':>12} {'MFU(989T)':>10} {'MFU(mm)':>8} {'peak GiB':>9} {'pred GiB':>9}"
            f" {'pred/meas':>9}  note")
    lines = [head, "-" * len(head)]
    for name, r in results:
        if name == "matmul":
            continue
        if "error" in r:
            lines.append(f"{name:46} {'-':>12} {'-':>10} {'-':>8} {'-':>9} {'-':>9} {'-':>9}  {r['error']}")
            continue
        tok = r.get("tokens_per_s", r.get("decode_tokens_per_s"))
        mfu = f"{100 * r['mfu_peak']:.1f}%" if "mfu_peak" in r else "-"
        mfu_mm = f"{100 * r['achieved_tflops'] / matmul_tflops:.1f}%" if "achieved_tflops" in r and matmul_tflops \
            else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        note = f"prefill {r['prefill_s']:.2f} s" if "prefill_s" in r else (f"{r['docs']} docs" if r.get("docs") else "")
        if "step_s" in r:
            note = f"{r['step_s'] * 1e3:.1f} ms/step, {r['host_syncs_per_step']} host sync(s)/step"
        pred = f"{r['predicted_gib']:.2f}" if r.get("predicted_gib") is not None else "-"
        ratio = f"{r['predicted_over_measured']:.2f}" if r.get("predicted_over_measured") else "-"
        lines.append(f"{name:46} {tok:12.1f} {mfu:>10} {mfu_mm:>8} {peak:>9} {pred:>9} {ratio:>9}  {note}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="CPU, tiny sizes, every row in this process (seconds)")
    p.add_argument("--budget", type=float, default=320.0, help="seconds for the measurement table")
    p.add_argument("--test_timeout", type=float, default=120.0, help="seconds for the CUDA-marked tests")
    p.add_argument("--skip_tests", action="store_true")
    p.add_argument("--row", help=argparse.SUPPRESS)  # internal: one isolated row
    a = p.parse_args(argv)
    if a.row:
        func, kwargs, size_name = json.loads(a.row)
        print("ROW " + json.dumps(run_row(func, kwargs, size_name)), flush=True)
        return 0
    import torch

    if not a.dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry for the CPU rehearsal)")
        return 2
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    size_name = "dry" if a.dry else "gpu"
    t_start = time.perf_counter()
    env = dict(torch=torch.__version__, cuda=torch.version.cuda,
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", size=size_name)
    print(f"gpu_check: {env}")
    tests = {"skipped": "--skip_tests"} if a.skip_tests else run_cuda_tests(a.dry, a.test_timeout)
    print(f"cuda tests: {tests}")
    results, deadline = [], time.perf_counter() + a.budget
    for name, func, kwargs in rows_for(SIZES[size_name]):
        left = deadline - time.perf_counter()
        if left < 5:
            results.append((name, {"error": "skipped: time budget spent"}))
            continue
        t0 = time.perf_counter()
        if a.dry:
            try:
                r = run_row(func, kwargs, size_name)
            except Exception as e:  # noqa: BLE001 - a row's failure is reported in the table
                traceback.print_exc()
                r = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
        else:
            r = run_isolated(func, kwargs, size_name, timeout=min(left, 150.0))
        r["wall_s"] = time.perf_counter() - t0
        results.append((name, r))
        print(f"  {name}: {json.dumps(r)}", flush=True)
    matmul = dict(results).get("matmul", {}).get("tflops")
    table = format_table(results, matmul)
    print(f"\nmeasured bf16 matmul: {matmul:.1f} TFLOP/s; MFU(989T) = analytic FLOPs / 989 TFLOP/s, "
          f"MFU(mm) = analytic FLOPs / the measured matmul rate\n" if matmul else "\nmatmul rate not measured\n")
    print(table)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(json.dumps(dict(env=env, tests=tests, matmul_tflops=matmul,
                                                            rows=[dict(name=n, **r) for n, r in results]), indent=1))
        (out / "gpu_check_table.txt").write_text(table + "\n")
    failed = bool(tests.get("failed")) or bool(tests.get("returncode")) or bool(tests.get("error"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
