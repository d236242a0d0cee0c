"""What every reader of exported folders shares (`export/load.py`, `quantize.py`): the loaded result, strict JSON
and state-dict reading. Its own module so that those readers do not import each other."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from archscale.errors import UserError


@dataclass
class Exported:
    model: torch.nn.Module
    run_cfg: dict  # {"model": ModelConfig dict, ...the training config when the folder has it}
    tokenizer_path: Path | None
    kind: str
    info: dict = field(default_factory=dict)


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{what}: cannot read {path} ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{what}: {path} is not a JSON object")
    return data


def load_state_strict(model: torch.nn.Module, sd: dict[str, torch.Tensor], where: str,
                      skip: set[str] = frozenset()) -> None:
    """Load `sd` (any float dtype) into `model`; a tied lm_head may be absent; names in `skip` (already set,
    e.g. quantised weights) are left alone. One-line error on any mismatch."""
    own = {k: v for k, v in model.state_dict().items() if k not in skip}
    if model.config.tie_embeddings:
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
        own.pop("lm_head.weight", None)
    missing, unexpected = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
    wrong = [k for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or wrong:
        parts = [f"{n} {what}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
                 for what, keys in (("missing", missing), ("unexpected", unexpected), ("of the wrong shape", wrong))
                 for n in [len(keys)] if keys]
        raise UserError(f"--checkpoint {where}: the weights do not match the recorded config ({'; '.join(parts)})")
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(sd[k].to(t.dtype))
