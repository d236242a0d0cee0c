"""Metric loggers behind one object, and a system-monitor thread.

`Loggers(out_dir, "csv,tensorboard,wandb", ...)` has the same `write(**row)` / `close()` shape as `MetricsCSV`
(which is its `csv` backend: `metrics.csv` keeps exactly its columns). TensorBoard and W&B receive every numeric
field of the row under readable names (`train/loss`, `train/ppl`, `val/loss`, `val/ppl`, `train/lr`,
`train/lr_<group>`, `train/grad_norm`, `perf/tokens_per_sec`, `perf/mfu`, `memory/*`). W&B runs offline when
there is no `WANDB_API_KEY` (sync later with `wandb sync RUN_DIR/wandb/offline-run-*`).

`SystemMonitor(loggers, interval)` is a daemon thread that samples CPU %, RAM, this process's RSS (psutil) and, per
GPU, utilisation / memory / temperature (NVML via `nvidia-ml-py` when installed; memory from torch.cuda otherwise)
plus PyTorch's allocated / reserved / max-allocated memory, and hands each sample to `loggers.log_system(...)`:
every sample to `system.csv` (csv backend); at most one point per training step to TensorBoard (`system/*`);
to W&B only PyTorch's allocator numbers (W&B records CPU, RAM and GPU use itself). The console stays quiet
unless asked (`--monitor_console`).
"""

from __future__ import annotations

import csv
import hashlib
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from archscale.errors import UserError

BACKENDS = ("csv", "tensorboard", "wandb")
# row key -> logged name (TensorBoard tag / W&B key); other numeric keys go to train/<key>
NAMES = {"train_loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
         "tokens": "train/tokens", "tokens_per_sec": "perf/tokens_per_sec", "mfu": "perf/mfu",
         "loss_scale": "train/loss_scale"}
GB = 1024 ** 3


def parse_logger_names(names: str | Iterable[str]) -> list[str]:
    items = [n.strip().lower() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    bad = [n for n in items if n not in BACKENDS]
    if bad:
        raise UserError(f"--logger {','.join(items)}: unknown logger(s) {bad}; choose from {', '.join(BACKENDS)}")
    return list(dict.fromkeys(items)) or ["csv"]


def named_scalars(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row as {tag: float}: known keys renamed, perplexities added, non-numbers and None dropped."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if k == "step" or v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out[NAMES.get(k, k if "/" in k else f"train/{k}")] = float(v)
    for src, dst in (("train_loss", "train/ppl"), ("val_loss", "val/ppl")):
        if row.get(src) is not None:
            out[dst] = math.exp(min(float(row[src]), 80.0))
    return out


def memory_stats() -> dict[str, float]:
    """Process RSS and, on CUDA, PyTorch's allocated / reserved / peak memory of the current device (GB)."""
    import psutil

    out = {"memory/rss_gb": psutil.Process().memory_info().rss / GB}
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["memory/cuda_allocated_gb"] = torch.cuda.memory_allocated() / GB
            out["memory/cuda_reserved_gb"] = torch.cuda.memory_reserved() / GB
            out["memory/cuda_max_allocated_gb"] = torch.cuda.max_memory_allocated() / GB
    except Exception:  # noqa: BLE001 - memory stats must never stop training
        pass
    return out


class _TensorBoard:
    def __init__(self, log_dir: Path, resume_step: Optional[int]):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("--logger tensorboard needs the tensorboard package: "
                            "pip install 'archscale[tensorboard]'") from None
        # purge_step drops events past the resumed step, so a resumed run has no duplicated points
        self.w = SummaryWriter(log_dir=str(log_dir), purge_step=None if resume_step is None else resume_step + 1)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.w.add_scalar(k, v, global_step=step)
        self.w.flush()

    def system(self, step: int, scalars: dict[str, float]) -> None:
        self.write(step, scalars)

    def close(self) -> None:
        self.w.close()


class _WandB:
    def __init__(self, out_dir: Path, project: str, run_name: Optional[str], config: Optional[dict],
                 tags: Optional[list[str]], mode: Optional[str]):
        try:
            import wandb
        except ImportError:
            raise UserError("--logger wandb needs the wandb package: pip install 'archscale[wandb]'") from None
        if mode is None:
            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.mode = mode
        # a stable id per run dir: a resumed run continues the same W&B run
        run_id = hashlib.sha1(str(Path(out_dir).resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(project=project, name=run_name, config=config or {}, tags=tags or None,
                              dir=str(out_dir), mode=mode, id=run_id, resume="allow",
                              settings=wandb.Settings(silent=True, console="off"))
        self.run_dir = Path(self.run.dir).parent if getattr(self.run, "dir", None) else None
        self.last_step = -1

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if step < self.last_step:  # W&B ignores steps that go backwards (a resumed run): keep them as fields
            scalars = {**scalars, "train/step": step}
            self.run.log(scalars)
            return
        self.last_step = step
        self.run.log(scalars, step=step)

    def system(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, commit=False)  # joins the next training row

    def close(self) -> None:
        self.run.finish()


class _SystemCSV:
    """system.csv: one row per monitor sample; the columns are fixed by the first sample."""

    def __init__(self, path: Path):
        self.path, self.columns = path, None

    def system(self, step: int, scalars: dict[str, float]) -> None:
        row = {"time": round(time.time(), 3), "step": step, **{k: f"{v:.6g}" for k, v in scalars.items()}}
        header = False
        if self.columns is None:
            if self.path.is_file() and self.path.stat().st_size:  # a resumed run: keep the file's columns
                with open(self.path, newline="") as f:
                    self.columns = next(csv.reader(f))
            else:
                self.columns, header = list(row), True
        with open(self.path, "w" if header else "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            if header:
                w.writeheader()
            w.writerow(row)


class Loggers:
    """Fan-out of metric rows to csv (`metrics.csv`), TensorBoard (`OUT/tb`) and W&B (`OUT/wandb`).

    `write(**row)` takes MetricsCSV's keys (step, tokens, train_loss, val_loss, lr, grad_norm, tokens_per_sec,
    mfu, ...) plus any other numbers (e.g. `lr_matrix=..., lr_vector=...` for per-group LRs): metrics.csv keeps
    its columns, the other backends log everything, with perplexities and memory added."""

    def __init__(self, out_dir: str | Path, loggers: str | Iterable[str] = "csv", *, resume_step: Optional[int] = None,
                 extra: tuple[str, ...] = (), config: Optional[dict] = None, run_name: Optional[str] = None,
                 project: str = "archscale", tags: Optional[list[str]] = None, wandb_mode: Optional[str] = None,
                 memory: bool = True):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.names = parse_logger_names(loggers)
        self.memory = memory
        self.last_step = 0 if resume_step is None else resume_step
        self._lock = threading.Lock()
        self._system_step: Optional[int] = None
        self.csv = self.tb = self.wandb = self.system_csv = None
        if "csv" in self.names:
            from archscale.train.metrics import MetricsCSV
            self.csv = MetricsCSV(self.out_dir / "metrics.csv", resume_step=resume_step, extra=extra)
            self.system_csv = _SystemCSV(self.out_dir / "system.csv")
        if "tensorboard" in self.names:
            self.tb = _TensorBoard(self.out_dir / "tb", resume_step)
        if "wandb" in self.names:
            self.wandb = _WandB(self.out_dir, project, run_name, config, tags, wandb_mode)

    def write(self, **row) -> None:
        step = int(row.get("step", self.last_step))
        with self._lock:
            self.last_step = step
            if self.csv is not None:
                self.csv.write(**{k: v for k, v in row.items() if k in self.csv.columns})
            if self.tb is None and self.wandb is None:
                return
            scalars = named_scalars(row)
            if self.memory:
                scalars.update(memory_stats())
            for b in (self.tb, self.wandb):
                if b is not None:
                    b.write(step, scalars)

    def log_system(self, metrics: dict[str, float]) -> None:
        """A system-monitor sample (keys like `system/cpu_percent`), at the last training step written."""
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        with self._lock:
            if self.system_csv is not None:  # every sample, with its time
                self.system_csv.system(self.last_step, scalars)
            if self._system_step == self.last_step:  # TensorBoard/W&B: one point per training step at most
                return
            self._system_step = self.last_step
            if self.tb is not None:
                self.tb.system(self.last_step, scalars)
            if self.wandb is not None:  # W&B samples CPU, RAM and GPUs itself; add only PyTorch's allocator
                own = {k: v for k, v in scalars.items() if "_torch_" in k}
                if own:
                    self.wandb.system(self.last_step, own)

    def close(self) -> None:
        with self._lock:
            for b in (self.tb, self.wandb):
                if b is not None:
                    b.close()
            self.tb = self.wandb = None


def seed_wandb_config(cfg: Any) -> tuple[dict, list[str]]:
    """ArchScale's W&B config fields and tags from a PretrainConfig-like object (plus every field of it)."""
    hps = getattr(cfg, "base_hps", None)
    train_name = str(getattr(cfg, "train_name", ""))
    param = str(getattr(cfg, "parametrization", "sp"))
    config = {
        "model_architecture": getattr(cfg, "train_model", None), "depth": getattr(cfg, "depth", None),
        "context_length": getattr(cfg, "ctx_len", None), "max_tokens": getattr(cfg, "max_tokens", None),
        "learning_rate": getattr(hps, "eta0", None), "batch_size": getattr(hps, "b0", None),
        "scaling_method": "muP++" if (param == "mup++" or ("mup" in train_name and "ori_mup" not in train_name))
        else "muP" if param == "mup" else "standard",
    }
    try:
        import dataclasses
        if dataclasses.is_dataclass(cfg):
            config["pretrain"] = dataclasses.asdict(cfg)
    except TypeError:
        pass
    tags = [str(t) for t in (getattr(cfg, "train_model", None), f"depth_{getattr(cfg, 'depth', '?')}", train_name)
            if t]
    return config, tags


# ---------------------------------------------------------------- system monitor

class SystemMonitor:
    """Samples the machine every `interval` seconds in a daemon thread; `sink(metrics)` receives each sample
    (a `Loggers` is accepted: its `log_system`). CPU and RAM come from psutil, GPUs from NVML (`nvidia-ml-py`,
    only when CUDA is available; memory from torch.cuda without it). Nothing goes to the console unless
    `console` is given (`--monitor_console`): a sample is a row of system.csv / a point in the loggers."""

    def __init__(self, sink: Any, interval: float = 60.0, console: Optional[Callable[[str], None]] = None):
        if interval <= 0:
            raise UserError(f"--monitor_interval {interval}: must be > 0 seconds (0 turns the monitor off)")
        import psutil

        self.sink = sink.log_system if hasattr(sink, "log_system") else sink
        self.interval, self.console = float(interval), console
        self.psutil, self.process = psutil, psutil.Process()
        psutil.cpu_percent(None)  # primes the counter: the next call measures since now
        self.nvml = self._init_nvml()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.samples = 0

    @staticmethod
    def _init_nvml():
        try:
            import torch
            if not torch.cuda.is_available():
                return None
            import pynvml
            pynvml.nvmlInit()
            return pynvml
        except Exception:  # noqa: BLE001 - no nvidia-ml-py / no driver: torch.cuda gives memory only
            return None

    def collect(self) -> dict[str, float]:
        vm = self.psutil.virtual_memory()
        m = {"system/cpu_percent": float(self.psutil.cpu_percent(None)), "system/ram_percent": float(vm.percent),
             "system/ram_used_gb": (vm.total - vm.available) / GB, "system/ram_total_gb": vm.total / GB,
             "system/process_rss_gb": self.process.memory_info().rss / GB}
        m.update(self._gpu())
        return m

    def _gpu(self) -> dict[str, float]:
        m: dict[str, float] = {}
        try:
            import torch
            if not torch.cuda.is_available():
                return m
            n = torch.cuda.device_count()
        except Exception:  # noqa: BLE001
            return m
        for i in range(n):
            p = f"system/gpu{i}"
            if self.nvml is not None:
                try:
                    h = self.nvml.nvmlDeviceGetHandleByIndex(i)
                    m[f"{p}_util_percent"] = float(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu)
                    mem = self.nvml.nvmlDeviceGetMemoryInfo(h)
                    m[f"{p}_mem_used_gb"], m[f"{p}_mem_total_gb"] = mem.used / GB, mem.total / GB
                    m[f"{p}_temp_c"] = float(self.nvml.nvmlDeviceGetTemperature(h, self.nvml.NVML_TEMPERATURE_GPU))
                except Exception:  # noqa: BLE001
                    pass
            if f"{p}_mem_used_gb" not in m:
                try:
                    free, total = torch.cuda.mem_get_info(i)
                    m[f"{p}_mem_used_gb"], m[f"{p}_mem_total_gb"] = (total - free) / GB, total / GB
                except Exception:  # noqa: BLE001
                    pass
            if torch.cuda.is_initialized():
                m[f"{p}_torch_allocated_gb"] = torch.cuda.memory_allocated(i) / GB
                m[f"{p}_torch_reserved_gb"] = torch.cuda.memory_reserved(i) / GB
                m[f"{p}_torch_max_allocated_gb"] = torch.cuda.max_memory_allocated(i) / GB
        return m

    def sample(self) -> dict[str, float]:
        m = self.collect()
        self.sink(m)
        self.samples += 1
        if self.console is not None:
            gpus = sorted({k.split("_")[0] for k in m if k.startswith("system/gpu")})
            self.console(f"[system] CPU {m.get('system/cpu_percent', float('nan')):.0f}% RAM "
                         f"{m.get('system/ram_percent', float('nan')):.0f}% RSS "
                         f"{m.get('system/process_rss_gb', float('nan')):.2f}GB"
                         + "".join(f" | {g.split('/')[1]} {m.get(g + '_util_percent', float('nan')):.0f}% "
                                   f"{m.get(g + '_mem_used_gb', float('nan')):.1f}/"
                                   f"{m.get(g + '_mem_total_gb', float('nan')):.1f}GB "
                                   f"{m.get(g + '_temp_c', float('nan')):.0f}C" for g in gpus))
        return m

    def _loop(self) -> None:
        warned = False
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 - the monitor never takes training down
                if not warned:  # once, not every interval
                    print(f"warning: system monitor: {e}", file=sys.stderr)
                    warned = True

    def start(self) -> "SystemMonitor":
        self._thread = threading.Thread(target=self._loop, name="archscale-system-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
