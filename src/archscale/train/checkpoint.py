"""Atomic, resumable checkpoints.

Layout of `<run>/checkpoints/`:
    step-00000040/   .metadata + *.distcp   model and optimizer via torch.distributed.checkpoint (DCP)
                     train_state_rank{R}.safetensors  step, tokens, loader state, RNG states (one per rank;
                                            tensors + JSON, see safe_io.py: nothing in it can run code)
                     config.yaml            the resolved run config
                     COMPLETE               JSON {step, finite, files: {name: {bytes, sha256}}}, written last
    latest           text: the name of the newest complete checkpoint

A checkpoint is written into `.step-XXXXXXXX.tmp` and renamed into place only when complete, so a crash never
leaves a half-written directory that looks finished. The sha256 of every DCP file and train state is computed
while it is written (DCP's streams are wrapped, see safe_io.HashingFileSystem); DeepSpeed's files, which
DeepSpeed writes itself, are hashed right after writing. Loading verifies every size and sha256 first, then
reads nothing that could execute code. `find_latest` skips (with a one-line warning) any checkpoint that fails
those checks or whose metadata / train state cannot be read, and raises a UserError when checkpoints exist but
none is usable (never silently start over). `prune` never deletes the checkpoint `latest` names nor the newest
one marked finite.

Distributed runs: every rank writes its DCP shard (single/DDP/FSDP2) or DeepSpeed writes its own files into
`step-XXXXXXXX/deepspeed/` (`--strategy deepspeed`); barriers order "clean tmp -> all ranks write -> rank 0
seals (COMPLETE, rename, latest)". The file system must be shared by all ranks (multi-node: a network FS).
DCP checkpoints are resharded on load, so a run may resume with another world size or strategy (DDP <-> FSDP2
<-> single); the loader state is global (see `GlobalOrderLoader`), so every rank takes rank 0's when the world
size changed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import random
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from archscale.errors import UserError
from archscale.train import safe_io

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


def train_state_name(rank: int) -> str:
    return f"train_state_rank{rank}.safetensors"


def save_checkpoint(root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    train_state: dict[str, Any], config_yaml: str, keep_last: int = 0, rank: int = 0,
                    barrier: Callable[[], None] = _noop, engine: Any = None, flat_optim: bool = False) -> Path:
    """Write the checkpoint of `step` atomically. Collective: every rank calls it (with its own rank and the
    process group's barrier); `engine` is the DeepSpeed engine under --strategy deepspeed. `flat_optim` keys the
    optimizer state by parameter name (pipeline stages hold different parameters; see `_optim_options`). A finite
    `train_state["loss"]` (or none) marks the checkpoint finite in COMPLETE."""
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".{step_dir_name(step)}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    barrier()
    digests: dict[str, str | None] = {}
    if engine is not None:
        engine.save_checkpoint(str(tmp), tag=DS_TAG, save_latest=False)  # hashed from disk by rank 0 below
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [],
                                            options=StateDictOptions(flatten_optimizer_state_dict=flat_optim))
        state = {"model": model_sd} if optimizer is None else {"model": model_sd, "optim": optim_sd}
        writer = dcp.FileSystemWriter(str(tmp), sync_files=True)
        writer.fs = fs = safe_io.HashingFileSystem()
        _quiet_dcp(dcp.save, state, storage_writer=writer)
        digests.update({str(Path(k).relative_to(tmp)): v for k, v in fs.digests.items()})
    data = safe_io.encode_train_state(train_state)
    _write_bytes(tmp / train_state_name(rank), data)
    digests[train_state_name(rank)] = hashlib.sha256(data).hexdigest()
    _write_bytes(tmp / f".sha256-rank{rank}.json", json.dumps(digests).encode())
    barrier()
    if rank == 0:
        _seal(tmp, final, root, step, config_yaml, _is_finite(train_state.get("loss")))
        if keep_last > 0:
            prune(root, keep_last)
    barrier()
    return final


def _is_finite(loss: Any) -> bool:
    if loss is None:
        return True
    return bool(math.isfinite(float(loss)))


def _seal(tmp: Path, final: Path, root: Path, step: int, config_yaml: str, finite: bool) -> None:
    """Rank 0: config.yaml, COMPLETE (sizes + sha256 of every file), rename into place, update `latest`."""
    _write_bytes(tmp / "config.yaml", config_yaml.encode())
    digests: dict[str, str | None] = {"config.yaml": hashlib.sha256(config_yaml.encode()).hexdigest()}
    for part in sorted(tmp.glob(".sha256-rank*.json")):
        digests.update(json.loads(part.read_text()))
        part.unlink()
    files = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            name = str(p.relative_to(tmp))
            sha = digests.get(name) or safe_io.sha256_file(p)  # DeepSpeed's files: read back while hot
            files[name] = {"bytes": p.stat().st_size, "sha256": sha}
    _write_atomic(tmp / "COMPLETE", json.dumps({"step": step, "finite": finite, "files": files}, indent=1))
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(root / "latest", final.name + "\n")
    _fsync_dir(root)


def _complete_info(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "COMPLETE").read_text())
    except (OSError, ValueError):
        return {}


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints, except that the one `latest` names and the
    newest one COMPLETE marks finite are never deleted. Returns what was deleted."""
    root = Path(root)
    complete = complete_checkpoints(root)
    keep = set(complete[-keep_last:]) if keep_last > 0 else set(complete)
    finite = [p for p in complete if _complete_info(p).get("finite", True) is not False]
    if finite:
        keep.add(finite[-1])
    try:
        keep.add(root / (root / "latest").read_text().strip())
    except OSError:
        pass
    deleted = [p for p in complete if p not in keep]
    for old in deleted:
        shutil.rmtree(old, ignore_errors=True)
    return deleted


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


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


def _expected_files(info: dict) -> dict[str, tuple[int, str | None]]:
    """name -> (bytes, sha256 or None); COMPLETE of older versions recorded sizes only."""
    out = {}
    for name, v in (info.get("files") or {}).items():
        out[name] = (v["bytes"], v.get("sha256")) if isinstance(v, dict) else (int(v), None)
    return out


def check_complete(path: Path) -> str | None:
    """None when `path` has a COMPLETE marker and every file it lists with its size, else the reason (cheap:
    no file is read)."""
    marker = path / "COMPLETE"
    if not marker.is_file():
        return "no COMPLETE marker (the save was interrupted)"
    info = _complete_info(path)
    if not isinstance(info.get("files"), dict):
        return "unreadable COMPLETE marker"
    try:
        expected = _expected_files(info)
    except (KeyError, TypeError, ValueError):
        return "unreadable COMPLETE marker"
    for name, (size, _) in expected.items():
        f = path / name
        if not f.is_file():
            return f"missing file {name}"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, expected {size}"
    return None


_VERIFIED: dict[str, tuple] = {}  # resolved path -> file signature at its last successful verification


def _signature(path: Path, names) -> tuple:
    return tuple((n, (path / n).stat().st_size, (path / n).stat().st_mtime_ns) for n in sorted(names))


def verify_checkpoint(path: Path) -> str | None:
    """None when every file matches COMPLETE's size and sha256 and the metadata and train state parse (without
    executing anything), else the reason. A checkpoint verified earlier in this process and unchanged since
    (sizes, mtimes) is not hashed again."""
    path = Path(path)
    reason = check_complete(path) if path.is_dir() else "not a directory"
    if reason is not None:
        return reason
    expected = _expected_files(_complete_info(path))
    key = str(path.resolve())
    if _VERIFIED.get(key) == _signature(path, expected):
        return None
    if not any(sha for _, sha in expected.values()):
        return "COMPLETE records no checksums (written by an older archscale, whose train state was a pickle)"
    for name, (_, sha) in expected.items():
        if sha is None:
            return f"COMPLETE records no checksum for {name}"
        if safe_io.sha256_file(path / name) != sha:
            return f"{name} does not match its sha256 in COMPLETE (the file was modified or damaged)"
    try:
        if not is_deepspeed_checkpoint(path):
            safe_io.load_dcp_metadata(path / ".metadata")
        read_train_state(path, 0)
    except Exception as e:  # noqa: BLE001 - untrusted bytes: any failure to parse means unreadable
        return f"unreadable: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"
    _VERIFIED[key] = _signature(path, expected)
    return None


def step_dirs(root: Path) -> list[Path]:
    """The checkpoints/step-* dirs under root, oldest first."""
    if not Path(root).is_dir():
        return []
    return sorted(p for p in Path(root).iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root (COMPLETE present, sizes match), oldest first."""
    return [p for p in step_dirs(root) if check_complete(p) is None]


def find_latest(root: Path, warn: Callable[[str], None] = print) -> Path | None:
    """The newest usable checkpoint (verified: sizes, sha256, readable metadata and train state), skipping any
    other with a one-line warning. None when there are no checkpoints; a UserError when there are some but none
    is usable (starting over would silently discard the run)."""
    dirs = step_dirs(root)
    newest_reason = None
    for p in reversed(dirs):
        reason = verify_checkpoint(p)
        if reason is None:
            return p
        newest_reason = newest_reason or f"{p.name}: {reason}"
        warn(f"warning: skipping checkpoint {p}: {reason}")
    if dirs:
        raise UserError(f"{root}: none of the {len(dirs)} checkpoints is usable (newest {newest_reason}); move them "
                        "away to start over, or use a good copy")
    return None


def read_train_state(path: Path, rank: int = 0, warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """This rank's train state from a checkpoint dir; ranks without a file of their own (the world size grew)
    take rank 0's."""
    path = Path(path)
    ts_path = path / train_state_name(rank)
    if not ts_path.is_file():
        ts_path = path / train_state_name(0)
        if not ts_path.is_file():
            raise UserError(f"{path}: no {train_state_name(0)}; the checkpoint is incomplete or was written by an "
                            "older archscale")
        if warn is not None and rank == 1:
            warn(f"note: {path} was saved by fewer processes; ranks without a train state of their own use rank "
                 "0's (the data position is global; RNG streams are rank 0's)")
    return safe_io.decode_train_state(ts_path.read_bytes(), str(ts_path))


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    rank: int = 0, engine: Any = None, warn: Callable[[str], None] = print,
                    ds_universal: Path | None = None, layers: list | None = None) -> dict[str, Any]:
    """Verify, then load model (+ optimizer) state in place; return this rank's train_state dict. `layers`: the
    layer record the caller built the model from, checked against the one saved with the weights.

    `optimizer=None` loads the weights only, from either format, into a plain (unsharded) model. Under DeepSpeed
    pass the `engine` (it loads its own checkpoints). When the world size changed, ranks without a file of their
    own take rank 0's train state (its loader state is global; RNG states are then rank 0's)."""
    path = Path(path)
    reason = verify_checkpoint(path)
    if reason is not None:
        raise UserError(f"{path}: not a usable checkpoint ({reason}); pass a checkpoints/step-* dir")
    if layers is not None:
        check_layers_record(path, layers, read_train_state(path, 0, warn))
    try:
        _load_states(path, model, optimizer, engine, ds_universal)
    except BaseException as e:  # noqa: BLE001 - DCP wraps a rank's error in CheckpointException (a BaseException)
        refused = _unpickling_error(e)
        if refused is None:
            raise
        raise UserError(f"{path}: not a usable checkpoint (refused to unpickle it: {refused})") from None
    return read_train_state(path, rank, warn)


LAYERS_KEY = "model_layers"  # the train state's copy of the layer record the weights were trained with


def layers_record(layers: list) -> str:
    return json.dumps(layers, sort_keys=True)


def check_layers_record(path: Path, layers: list, train_state: dict) -> None:
    """Kinds with the same tensors (attention and sliding-window attention, GMU and nGMU at equal widths) load
    into each other without error: the record saved beside the weights must equal the config's. Checkpoints
    written before the record existed have none (nothing to check)."""
    saved = train_state.get(LAYERS_KEY)
    if saved is None or saved == layers_record(layers):
        return
    from archscale.layout import layer_label

    trained = json.loads(saved)
    for i, (was, now) in enumerate(zip(trained, layers)):
        if was != now:
            raise UserError(f"{path}: its config's layer record disagrees with the layers the weights were trained "
                            f"as: layer {i} is {layer_label(now)} in config.yaml but was trained as "
                            f"{layer_label(was)}; restore the run's own config.yaml")
    raise UserError(f"{path}: its config records {len(layers)} layers but the weights were trained with "
                    f"{len(trained)}")


def _unpickling_error(e: BaseException) -> str | None:
    """The reason line when `e` is (or wraps) a refused unpickling: a class outside the allowlists."""
    inner = e
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) else first
    if not isinstance(inner, pickle.UnpicklingError):
        return None
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    told = [line for line in lines if "Unsupported global" in line or "refusing" in line]
    return (told or lines or [type(inner).__name__])[0][:200]


def _load_states(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, engine: Any,
                 ds_universal: Path | None) -> None:
    if is_deepspeed_checkpoint(path):
        if engine is not None:  # ds_universal: the same checkpoint converted for another world size
            with safe_io.deepspeed_weights_only():
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
            options = _optim_options(path)
            model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            model_sd = get_state_dict(model, [])[0]
            state = {"model": model_sd}
        _quiet_dcp(dcp.load, state, storage_reader=safe_io.SafeDCPReader(str(path)),
                   planner=safe_io.SafeLoadPlanner())
        set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}),
                       options=options if optimizer is not None else None)


def _optim_options(path: Path) -> StateDictOptions:
    """How the checkpoint's optimizer state is keyed. By group index (`optim.param_groups.0.params` lists the
    names) unless it was saved by pipeline stages: those hold different parameters, so their group lists
    would collide; they key every group setting by parameter name instead (`flatten_optimizer_state_dict`),
    which loads into any cut of the model, --pp 1 included. A model of pipeline stages needs that form."""
    return StateDictOptions(flatten_optimizer_state_dict=optim_keyed_by_name(path))


def optim_keyed_by_name(path: Path) -> bool:
    """Whether the DCP checkpoint at `path` keys its optimizer groups by parameter name (see `_optim_options`)."""
    keys = safe_io.load_dcp_metadata(Path(path) / ".metadata").state_dict_metadata
    return not any(k.startswith("optim.param_groups.") and k.endswith(".params") for k in keys)


def deepspeed_weights(path: Path) -> dict[str, torch.Tensor]:
    """Consolidated fp32 model weights of a DeepSpeed checkpoint (any ZeRO stage, any world size)."""
    path = Path(path)
    if (path / DS_TAG / "mp_rank_00_model_states.pt").is_file() and not any((path / DS_TAG).glob("*optim_states.pt")):
        with safe_io.deepspeed_weights_only():
            sd = torch.load(path / DS_TAG / "mp_rank_00_model_states.pt", map_location="cpu")
        return {k: v.float() for k, v in sd["module"].items()}
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        raise UserError(f"{path} is a DeepSpeed checkpoint; reading it needs DeepSpeed "
                        "(pip install 'archscale[deepspeed]')") from None
    with warnings.catch_warnings(), safe_io.deepspeed_weights_only():
        warnings.simplefilter("ignore")
        sd = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DS_TAG)
    return {k: v.float() for k, v in sd.items()}
