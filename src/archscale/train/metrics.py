"""metrics.csv, peak-FLOPs for MFU, and the console progress line."""

from __future__ import annotations

import csv
import sys
import time
from pathlib import Path

import torch

COLUMNS = ["step", "tokens", "train_loss", "val_loss", "lr", "grad_norm", "tokens_per_sec", "mfu"]

# Dense bf16 tensor-core peaks (FLOP/s), keyed by a substring of torch.cuda.get_device_name().
GPU_PEAK_BF16 = {
    "H200": 989e12, "H100 SXM": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12,
    "B200": 2.25e15, "GB200": 2.5e15, "A100": 312e12, "A10G": 70e12, "L40S": 362e12, "L4": 121e12,
    "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12,
}


class MetricsCSV:
    """Append rows to `metrics.csv`; on resume, drop rows past the resumed step so nothing is duplicated."""

    def __init__(self, path: Path, resume_step: int | None = None, extra: tuple[str, ...] = ()):
        self.path = Path(path)
        self.columns = COLUMNS + [c for c in extra if c not in COLUMNS]  # e.g. loss_scale under fp16
        rows = []
        if resume_step is not None and self.path.is_file():
            with open(self.path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if r.get("step") and int(r["step"]) <= resume_step]
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)

    def write(self, **row) -> None:
        unknown = set(row) - set(self.columns)
        assert not unknown, unknown
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow({k: _fmt(row.get(k)) for k in self.columns})


def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.6e}"
    return v


def read_metrics(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(FLOP/s, where it came from): a table for known GPUs, else a short matmul measurement (CPU)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_BF16.items():
            if key in name:
                return (peak if dtype != torch.float32 else peak / 2), f"table ({name})"
    return measure_matmul_flops(device, dtype), "measured"


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 1024, seconds: float = 0.3) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * iters / (time.perf_counter() - start)


class Progress:
    """One console line per update: a bar, step, loss, tokens/s and ETA. Rewrites in place on a TTY."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True):
        self.total, self.enabled = total_steps, enabled
        self.tty = sys.stderr.isatty()
        self.t0, self.s0 = time.perf_counter(), start_step

    def update(self, step: int, loss: float, tok_s: float, val_loss: float | None = None, force: bool = False):
        if not self.enabled or not (self.tty or force):
            return
        done = step / max(1, self.total)
        rate = (step - self.s0) / max(1e-9, time.perf_counter() - self.t0)
        eta = (self.total - step) / rate if rate > 0 else float("nan")
        bar = "#" * int(24 * done) + "-" * (24 - int(24 * done))
        line = (f"[{bar}] step {step}/{self.total} loss {loss:.4f}"
                + (f" val {val_loss:.4f}" if val_loss is not None else "")
                + f" {tok_s:,.0f} tok/s ETA {_hms(eta)}")
        if self.tty:
            sys.stderr.write("\r" + line.ljust(100) + ("\n" if step >= self.total else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _hms(seconds: float) -> str:
    if seconds != seconds:
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
