"""Load a checkpoint for evaluation: model, run config, tokenizer and validation data, all from the run itself.

The architecture and every flag come from the checkpoint's saved `config.yaml` (never from the path name). The
tokenizer is the one recorded in the training data's `manifest.json` (written by `archscale prepare`), unless
`--tokenizer` overrides it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from archscale.config import ModelConfig
from archscale.data.prepare import file_sha256
from archscale.errors import UserError


@dataclass
class EvalModel:
    model: torch.nn.Module
    tokenizer: object  # archscale.data.tokenizer.Tokenizer (or a stand-in with encode/decode/eos_id in tests)
    train_len: int  # the training context length (config.block_size)
    step_dir: Path | None = None
    run_dir: Path | None = None
    run_cfg: dict = field(default_factory=dict)
    device: torch.device = torch.device("cpu")
    precision: str = "fp32"

    def autocast(self):
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return torch.autocast(device_type=self.device.type, enabled=False)

    @property
    def step(self) -> int | None:
        if self.step_dir is None:
            return None
        try:
            return int(self.step_dir.name.split("-")[-1])
        except ValueError:
            return None


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def _cause_line(e: BaseException) -> str:
    """The most telling line of a (possibly multi-rank, traceback-carrying) exception message."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errs = [line for line in lines if "Error:" in line]
    return (errs[-1] if errs else (lines[0] if lines else type(e).__name__))[:300]


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
    from archscale.data.loader import read_manifest
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


def _load_exported_eval_model(checkpoint: str | Path, device, tokenizer: str | None, precision: str) -> EvalModel:
    """An exported HF folder / quantized folder / safetensors file: its own tokenizer unless overridden."""
    from archscale.data.tokenizer import Tokenizer
    from archscale.export.load import load_exported

    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ex = load_exported(checkpoint, dev)
    path = Path(checkpoint)
    if tokenizer is None and ex.tokenizer_path is None:
        raise UserError(f"--checkpoint {checkpoint}: holds no tokenizer.json; pass --tokenizer PATH")
    tok = Tokenizer(tokenizer or ex.tokenizer_path)
    cfg = ex.model.config
    if tok.vocab_size > cfg.padded_vocab_size:
        raise UserError(f"tokenizer {tok.path} has {tok.vocab_size} tokens but the model only {cfg.vocab_size}")
    return EvalModel(model=ex.model.eval(), tokenizer=tok, train_len=cfg.block_size, step_dir=path,
                     run_dir=path if path.is_dir() else path.parent, run_cfg=ex.run_cfg, device=dev,
                     precision=precision)


def load_eval_model(checkpoint: str | Path, device: str | torch.device | None = None, tokenizer: str | None = None,
                    precision: str = "fp32") -> EvalModel:
    """Resolve a run dir / checkpoints dir / step dir (or an exported folder / file) and load everything
    evaluation needs."""
    from archscale.eval.generate import resolve_checkpoint
    from archscale.export.load import exported_kind
    from archscale.models.model import GPT
    from archscale.train import checkpoint as ckpt

    if precision not in ("fp32", "bf16"):
        raise UserError(f"--precision must be fp32 or bf16, got {precision!r}")
    if exported_kind(checkpoint):
        return _load_exported_eval_model(checkpoint, device, tokenizer, precision)
    step_dir = resolve_checkpoint(checkpoint)
    cfg_path = step_dir / "config.yaml"
    if not cfg_path.is_file():
        raise UserError(f"--checkpoint {checkpoint}: {cfg_path} is missing; the checkpoint cannot be rebuilt "
                        "without its saved config")
    try:
        run_cfg = yaml.safe_load(cfg_path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"--checkpoint {checkpoint}: cannot read {cfg_path} ({_first_line(e)})") from None
    if not isinstance(run_cfg, dict) or not isinstance(run_cfg.get("model"), dict):
        raise UserError(f"--checkpoint {checkpoint}: {cfg_path} has no 'model' section")
    try:
        model_cfg = ModelConfig(**run_cfg["model"])
    except TypeError as e:
        raise UserError(f"--checkpoint {checkpoint}: the saved model config does not fit this version of "
                        f"archscale ({_first_line(e)})") from None
    model = GPT(model_cfg)
    try:
        ckpt.load_checkpoint(step_dir, model, None)
    except UserError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # size mismatch, missing keys, unreadable shards (dcp's CheckpointException)
        raise UserError(f"--checkpoint {checkpoint}: the weights in {step_dir} do not match its saved config "
                        f"({_cause_line(e)})") from None
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(dev).eval()
    run_dir = step_dir.parent.parent if step_dir.parent.name == "checkpoints" else step_dir.parent
    tok = resolve_tokenizer(run_dir, run_cfg, tokenizer)
    if tok.vocab_size > model_cfg.padded_vocab_size:
        raise UserError(f"tokenizer {tok.path} has {tok.vocab_size} tokens but the model only {model_cfg.vocab_size}; "
                        "pass the tokenizer the run was trained with")
    return EvalModel(model=model, tokenizer=tok, train_len=model_cfg.block_size, step_dir=step_dir, run_dir=run_dir,
                     run_cfg=run_cfg, device=dev, precision=precision)


def validation_dir(em: EvalModel, override: str | None = None) -> Path:
    if override:
        p = Path(override)
        if not p.is_dir():
            raise UserError(f"--val_data_dir {override}: no such folder")
        return p
    pre = em.run_cfg.get("pretrain") or {}
    recorded = pre.get("val_data_dir") or pre.get("train_data_dir")  # as the trainer chooses
    if not recorded:
        raise UserError("the run config names no validation data; pass --val_data_dir DIR")
    p = find_run_path(em.run_dir, recorded)
    if p is None or not p.is_dir():
        raise UserError(f"the run's validation data dir {recorded} does not exist here; pass --val_data_dir DIR")
    return p


def read_user_text(path: str | Path, flag: str) -> str:
    """The UTF-8 text of a file the user named with `flag`, or a one-line UserError saying what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{flag} {path}: no such file")
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag} {path}: cannot read it as UTF-8 text ({e})") from None
