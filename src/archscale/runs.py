"""Load a trained run: the one loader behind `generate`, `export` and `eval`.

`load_run(path)` takes a run dir (its newest complete checkpoint), a checkpoints/ dir, or one checkpoints/step-*
dir, and rebuilds the model from the checkpoint's own `config.yaml` (never from the path's name). The tokenizer,
when asked for, is the one recorded in the training data's `manifest.json` (written by `archscale prepare`)
unless a path overrides it. Every problem is a one-line `UserError` naming the flag (`--checkpoint`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from archscale.config import ModelConfig
from archscale.errors import UserError


@dataclass
class LoadedRun:
    model: torch.nn.Module  # GPT in eval mode, on the requested device
    model_config: ModelConfig
    run_config: dict  # the checkpoint's resolved config.yaml: {"pretrain": ..., "plan": ..., "model": ...}
    step_dir: Path
    run_dir: Path
    tokenizer: Optional[Any] = None  # archscale.data.tokenizer.Tokenizer, when asked for
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def step(self) -> Optional[int]:
        return step_number(self.step_dir)


def step_number(step_dir: Optional[Path]) -> Optional[int]:
    """The step of a checkpoints/step-XXXXXXXX dir (None for another name)."""
    if step_dir is None:
        return None
    try:
        return int(Path(step_dir).name.split("-")[-1])
    except ValueError:
        return None


def first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def _cause_line(e: BaseException) -> str:
    """The most telling line of a (possibly multi-rank, traceback-carrying) exception message."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errs = [line for line in lines if "Error:" in line]
    return (errs[-1] if errs else (lines[0] if lines else type(e).__name__))[:300]


def resolve_checkpoint(path: str | Path, flag: str = "--checkpoint") -> Path:
    """A run dir (newest complete checkpoint), a checkpoints/ dir, or one checkpoints/step-* dir."""
    from archscale.train import checkpoint as ckpt

    path = Path(path)
    if not path.exists():
        raise UserError(f"{flag} {path}: no such file or directory")
    if (path / "COMPLETE").exists():
        return path
    for root in (path / "checkpoints", path):
        found = ckpt.find_latest(root, warn=lambda m: None)
        if found is not None:
            return found
    raise UserError(f"{flag} {path}: no complete checkpoint found (expected checkpoints/step-*)")


def run_dir_of(step_dir: Path) -> Path:
    return step_dir.parent.parent if step_dir.parent.name == "checkpoints" else step_dir.parent


def read_run_config(step_dir: Path, flag: str = "--checkpoint") -> dict:
    """The checkpoint's saved config.yaml (it must have a 'model' section)."""
    cfg_path = Path(step_dir) / "config.yaml"
    if not cfg_path.is_file():
        raise UserError(f"{flag} {step_dir}: {cfg_path} is missing; the checkpoint cannot be rebuilt without its "
                        "saved config")
    try:
        run_cfg = yaml.safe_load(cfg_path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"{flag} {step_dir}: cannot read {cfg_path} ({first_line(e)})") from None
    if not isinstance(run_cfg, dict) or not isinstance(run_cfg.get("model"), dict):
        raise UserError(f"{flag} {step_dir}: {cfg_path} has no 'model' section")
    return run_cfg


def model_config_of(run_cfg: dict, flag: str, where: Path) -> ModelConfig:
    if "layers" not in run_cfg["model"] and run_cfg["model"].get("arch"):
        print(f"note: {where} was saved before runs recorded their layers; rebuilding it from the named layout "
              f"{run_cfg['model']['arch']!r} of this version", file=sys.stderr)
    try:
        return ModelConfig.from_dict(run_cfg["model"])
    except (TypeError, UserError) as e:
        raise UserError(f"{flag} {where}: the saved model config does not fit this version of archscale "
                        f"({first_line(e)})") from None


def load_run(path: str | Path, *, device: str | torch.device | None = "cpu", tokenizer: bool = False,
             tokenizer_path: Optional[str] = None, flag: str = "--checkpoint") -> LoadedRun:
    """Rebuild a run's model (weights from either checkpoint format, no optimizer) in eval mode. `path` may also
    be an exported HF folder, a quantized folder or an exported safetensors file (`archscale.export.load`).

    `device=None` picks CUDA when available. With `tokenizer=True` (or a `tokenizer_path`) the tokenizer is
    loaded too and checked against the model's vocabulary."""
    from archscale.export.load import exported_kind
    from archscale.models.model import GPT
    from archscale.train import checkpoint as ckpt

    if exported_kind(path):
        return _load_exported_run(path, device, tokenizer or bool(tokenizer_path), tokenizer_path, flag)
    step_dir = resolve_checkpoint(path, flag)
    run_cfg = read_run_config(step_dir, flag)
    model_cfg = model_config_of(run_cfg, flag, Path(path))
    model = GPT(model_cfg)
    try:
        ckpt.load_checkpoint(step_dir, model, None, layers=model.config.layers)
    except (UserError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # size mismatch, missing keys, unreadable shards (dcp's CheckpointException)
        raise UserError(f"{flag} {path}: the weights in {step_dir} do not match its saved config "
                        f"({_cause_line(e)})") from None
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run = LoadedRun(model=model.to(dev).eval(), model_config=model_cfg, run_config=run_cfg, step_dir=step_dir,
                    run_dir=run_dir_of(step_dir), device=dev)
    if tokenizer or tokenizer_path:
        _attach_tokenizer(run, resolve_tokenizer(run.run_dir, run_cfg, tokenizer_path))
    return run


def _attach_tokenizer(run: LoadedRun, tok: Any) -> None:
    if tok.vocab_size > run.model_config.padded_vocab_size:
        raise UserError(f"tokenizer {tok.path} has {tok.vocab_size} tokens but the model embeds only "
                        f"{run.model_config.vocab_size}; pass the tokenizer the run was trained with")
    run.tokenizer = tok


def _load_exported_run(path: str | Path, device, tokenizer: bool, tokenizer_path: Optional[str],
                       flag: str) -> LoadedRun:
    """An exported HF folder / quantized folder / safetensors file: its own tokenizer unless overridden."""
    from archscale.data.tokenizer import Tokenizer
    from archscale.export.load import load_exported

    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ex = load_exported(path, dev)
    path = Path(path)
    run = LoadedRun(model=ex.model.eval(), model_config=ex.model.config, run_config=ex.run_cfg, step_dir=path,
                    run_dir=path if path.is_dir() else path.parent, device=dev)
    if tokenizer:
        if tokenizer_path is None and ex.tokenizer_path is None:
            raise UserError(f"{flag} {path}: holds no tokenizer.json; pass --tokenizer PATH")
        _attach_tokenizer(run, Tokenizer(tokenizer_path or ex.tokenizer_path))
    return run


def find_run_path(run_dir: Path | None, value: str | None) -> Path | None:
    """A path recorded in config.yaml: as written (absolute or relative to the cwd), else relative to the run
    dir or one of its ancestors (training may have been launched from another directory)."""
    if not value:
        return None
    p = Path(value).expanduser()
    if p.exists() or p.is_absolute():
        return p if p.exists() else None
    if run_dir is not None:
        for base in [run_dir, *run_dir.resolve().parents]:
            if (base / p).exists():
                return base / p
    return None


def resolve_tokenizer(run_dir: Path | None, run_cfg: dict, override: str | None):
    """`override` (warning when it is not the one the data was made with), else the data manifest's."""
    from archscale.data.loader import read_manifest
    from archscale.data.prepare import file_sha256
    from archscale.data.tokenizer import Tokenizer

    pre = run_cfg.get("pretrain") or {}
    manifest = None
    for key in ("train_data_dir", "val_data_dir"):
        d = find_run_path(run_dir, pre.get(key))
        if d is not None and d.is_dir():
            manifest = read_manifest(d)
            if manifest and manifest.get("tokenizer"):
                break
    if override:
        tok = Tokenizer(override)
        want = (manifest or {}).get("tokenizer_sha256")
        if want and file_sha256(tok.path) != want:
            print(f"warning: --tokenizer {override} differs from the one the training data was made with "
                  f"({manifest.get('tokenizer')})", file=sys.stderr)
        return tok
    recorded = (manifest or {}).get("tokenizer")
    if not recorded:
        raise UserError("the run records no tokenizer (its training data has no manifest.json with a 'tokenizer' "
                        "entry); pass --tokenizer PATH")
    path = find_run_path(run_dir, recorded)
    if path is None:
        raise UserError(f"the run's tokenizer {recorded} (from its data manifest) does not exist; pass --tokenizer PATH")
    return Tokenizer(path)
