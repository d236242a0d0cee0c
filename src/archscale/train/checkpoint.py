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

Distributed runs: every rank writes its DCP shard (single/DDP/FSDP2) or DeepSpeed writes its own files into
`step-XXXXXXXX/deepspeed/` (`--strategy deepspeed`); barriers order "clean tmp -> all ranks write -> rank 0
seals (COMPLETE, rename, latest)". The file system must be shared by all ranks (multi-node: a network FS).
DCP checkpoints are resharded on load, so a run may resume with another world size or strategy (DDP <-> FSDP2
<-> single); the loader state is global (see `GlobalOrderLoader`), so every rank takes rank 0's when the world
size changed.
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
DS_TAG = "deepspeed"  # DeepSpeed's files live in step-XXXXXXXX/deepspeed/


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


def _noop() -> None:
    pass


def is_deepspeed_checkpoint(path: Path) -> bool:
    return (Path(path) / DS_TAG).is_dir()


def save_checkpoint(root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    train_state: dict[str, Any], config_yaml: str, keep_last: int = 0, rank: int = 0,
                    barrier: Callable[[], None] = _noop, engine: Any = None) -> Path:
    """Write the checkpoint of `step` atomically. Collective: every rank calls it (with its own rank and the
    process group's barrier); `engine` is the DeepSpeed engine under --strategy deepspeed."""
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".{step_dir_name(step)}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    barrier()
    if engine is not None:
        engine.save_checkpoint(str(tmp), tag=DS_TAG, save_latest=False)
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
        state = {"model": model_sd} if optimizer is None else {"model": model_sd, "optim": optim_sd}
        _quiet_dcp(dcp.save, state, checkpoint_id=str(tmp))
    torch.save(train_state, tmp / f"train_state_rank{rank}.pt")
    barrier()
    if rank == 0:
        (tmp / "config.yaml").write_text(config_yaml)
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
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
    barrier()
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
                    rank: int = 0, engine: Any = None, warn: Callable[[str], None] = print,
                    ds_universal: Path | None = None) -> dict[str, Any]:
    """Load model (+ optimizer) state in place; return this rank's train_state dict.

    `optimizer=None` loads the weights only, from either format, into a plain (unsharded) model. Under DeepSpeed
    pass the `engine` (it loads its own checkpoints). When the world size changed, ranks without a file of their
    own take rank 0's train state (its loader state is global; RNG states are then rank 0's)."""
    path = Path(path)
    reason = check_complete(path) if path.is_dir() else "not a directory"
    if reason is not None:
        raise UserError(f"--resume {path}: not a usable checkpoint ({reason}); pass a checkpoints/step-* dir")
    if is_deepspeed_checkpoint(path):
        if engine is not None:  # ds_universal: the same checkpoint converted for another world size
            engine.load_checkpoint(str(ds_universal or path), tag="universal" if ds_universal else DS_TAG,
                                   load_optimizer_states=True, load_lr_scheduler_states=False)
        elif optimizer is None:
            model.load_state_dict(deepspeed_weights(path), strict=True)
        else:
            raise UserError(f"{path} was written by DeepSpeed; resume it with --strategy deepspeed, or start a new "
                            "run from its weights (`archscale export` makes a safetensors file)")
    else:
        if engine is not None:
            raise UserError(f"{path} is a torch.distributed.checkpoint (single/ddp/fsdp run); resume it with one "
                            "of those strategies, not deepspeed")
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
        ts_path = path / "train_state_rank0.pt"
        if not ts_path.is_file():
            raise UserError(f"{path}: no train_state_rank0.pt; the checkpoint is incomplete")
        if rank == 1:
            warn(f"note: {path} was saved by fewer processes; ranks without a train state of their own use rank "
                 "0's (the data position is global; RNG streams are rank 0's)")
    return torch.load(ts_path, weights_only=False)


def deepspeed_weights(path: Path) -> dict[str, torch.Tensor]:
    """Consolidated fp32 model weights of a DeepSpeed checkpoint (any ZeRO stage, any world size)."""
    path = Path(path)
    if (path / DS_TAG / "mp_rank_00_model_states.pt").is_file() and not any((path / DS_TAG).glob("*optim_states.pt")):
        sd = torch.load(path / DS_TAG / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        return {k: v.float() for k, v in sd["module"].items()}
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        raise UserError(f"{path} is a DeepSpeed checkpoint; reading it needs DeepSpeed "
                        "(pip install 'archscale[deepspeed]')") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DS_TAG)
    return {k: v.float() for k, v in sd.items()}
