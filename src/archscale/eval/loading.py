"""Load a checkpoint for evaluation: model, run config, tokenizer (all through `archscale.runs.load_run`, the
loader `generate` and `export` use too) and the run's validation data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from archscale.errors import UserError
from archscale.runs import find_run_path, load_run, step_number


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
    # model, inputs -> logits as the run's training validation calls it: with --varlen, documents (from EOS)
    # mask attention and reset recurrent states (the trainer's own `make_forward`)
    forward: Callable = field(default=lambda model, x: model(x))
    masking: str = "none"  # "none" or "documents (eos_id N)"

    def autocast(self):
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return torch.autocast(device_type=self.device.type, enabled=False)

    @property
    def step(self) -> int | None:
        return step_number(self.step_dir)


def load_eval_model(checkpoint: str | Path, device: str | torch.device | None = None, tokenizer: str | None = None,
                    precision: str = "fp32", need_tokenizer: bool = True) -> EvalModel:
    """Resolve a run dir / checkpoints dir / step dir and load everything evaluation needs (`runs.load_run`).
    With `need_tokenizer=False` a run that records no tokenizer gets `tokenizer=None` instead of an error."""
    if precision not in ("fp32", "bf16"):
        raise UserError(f"--precision must be fp32 or bf16, got {precision!r}")
    try:
        run = load_run(checkpoint, device=device, tokenizer=True, tokenizer_path=tokenizer)
    except UserError as e:
        if need_tokenizer or tokenizer or "tokenizer" not in str(e):
            raise
        run = load_run(checkpoint, device=device, tokenizer=False)
    forward, masking = validation_forward(run.run_config, run.run_dir)
    return EvalModel(model=run.model, tokenizer=run.tokenizer, train_len=run.model_config.block_size,
                     step_dir=run.step_dir, run_dir=run.run_dir, run_cfg=run.run_config, device=run.device,
                     precision=precision, forward=forward, masking=masking)


def validation_forward(run_cfg: dict, run_dir: Path | None) -> tuple[Callable, str]:
    """The forward the trainer validated this run with (`train.trainer.make_forward` on the saved settings):
    document-masked for a --varlen run (EOS id from the training data's manifest, else --eos_id), plain
    otherwise. Returns (forward, a description for the results)."""
    from archscale.data.loader import read_manifest
    from archscale.train.trainer import make_forward

    pre = run_cfg.get("pretrain") or {}
    if not pre.get("varlen"):
        return (lambda model, x: model(x)), "none"
    data = find_run_path(run_dir, pre["train_data_dir"]) if pre.get("train_data_dir") else None
    eos_id = (read_manifest(data) or {}).get("eos_id") if data is not None and data.is_dir() else None
    eos_id = eos_id if eos_id is not None else pre.get("eos_id")
    if eos_id is None:
        raise UserError("this --varlen run's documents end at an EOS id that neither its training data's "
                        "manifest.json (not found here) nor its config records; cannot mask documents as it "
                        "was validated")
    settings = SimpleNamespace(varlen=True, reset_position_ids=bool(pre.get("reset_position_ids")))
    return make_forward(settings, int(eos_id)), f"documents (eos_id {int(eos_id)})"


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
