"""Atomic, resumable checkpoints.

Layout of `<run>/checkpoints/`:
    step-00000040/   .metadata + *.distcp   model and optimizer via torch.distributed.checkpoint (DCP)
                     train_state_rank{R}.pt step, tokens, loader state, RNG states (one per rank)
                     config.yaml            the resolved run config
                     COMPLETE               JSON {step, files: {name: bytes}}, written last
    latest           text: the name of the newest complete checkpoint

A checkpoint is written into `.step-XXXXXXXX.tmp` and renamed into place only when complete, so a crash never
leaves a half-written directory that looks finished; `find_latest` also re-checks COMPLETE's file sizes and
skips (with a warning) anything that fails.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from archscale.errors import UserError

PREFIX = "step-"


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _quiet_dcp(fn: Callable, *args, **kwargs):
    with warnings.catch_warnings():  # DCP warns that it runs without a process group; that is intended here
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return fn(*args, **kwargs)


def save_checkpoint(root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    train_state: dict[str, Any], config_yaml: str, keep_last: int = 0, rank: int = 0) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".{step_dir_name(step)}.tmp"
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    _quiet_dcp(dcp.save, {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(train_state, tmp / f"train_state_rank{rank}.pt")
    if rank == 0:
        (tmp / "config.yaml").write_text(config_yaml)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        _write_atomic(tmp / "COMPLETE", json.dumps({"step": step, "files": files}, indent=1))
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(root / "latest", final.name + "\n")
        _fsync_dir(root)
        if keep_last > 0:
            for old in complete_checkpoints(root)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    return final


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_complete(path: Path) -> str | None:
    """None when `path` is a complete checkpoint, else the reason it is not."""
    marker = path / "COMPLETE"
    if not marker.is_file():
        return "no COMPLETE marker (the save was interrupted)"
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return "unreadable COMPLETE marker"
    for name, size in info.get("files", {}).items():
        f = path / name
        if not f.is_file():
            return f"missing file {name}"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, expected {size}"
    return None


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    if not Path(root).is_dir():
        return []
    dirs = sorted(p for p in Path(root).iterdir() if p.is_dir() and p.name.startswith(PREFIX))
    return [p for p in dirs if check_complete(p) is None]


def find_latest(root: Path, warn: Callable[[str], None] = print) -> Path | None:
    """Newest complete checkpoint, skipping incomplete or corrupt ones with a warning."""
    root = Path(root)
    if not root.is_dir():
        return None
    for p in sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)), reverse=True):
        reason = check_complete(p)
        if reason is None:
            return p
        warn(f"warning: skipping checkpoint {p}: {reason}")
    return None


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    rank: int = 0) -> dict[str, Any]:
    """Load model (+ optimizer) state in place; return the rank's train_state dict."""
    path = Path(path)
    reason = check_complete(path) if path.is_dir() else "not a directory"
    if reason is not None:
        raise UserError(f"--resume {path}: not a usable checkpoint ({reason}); pass a checkpoints/step-* dir")
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        model_sd = get_state_dict(model, [])[0]
        state = {"model": model_sd}
    _quiet_dcp(dcp.load, state, checkpoint_id=str(path))
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}))
    ts_path = path / f"train_state_rank{rank}.pt"
    if not ts_path.is_file():
        raise UserError(f"{path}: no {ts_path.name}; was it saved with a different number of processes?")
    return torch.load(ts_path, weights_only=False)
