"""Read exported models back into archscale's `GPT`, so eval / generate / serve take them as `--checkpoint`.

    DIR/config.json (model_type "archscale")   an `archscale export --format hf` folder of any architecture
    DIR/config.json (model_type "llama")       a Transformer++ exported as Llama (needs the "archscale" key)
    DIR/archscale_quantized.json               an `archscale quantize` folder (`archscale.quantize`)
    FILE.safetensors                           `archscale export --format safetensors` (config in its metadata)

Nothing here runs code from the folder: the config is JSON and the weights are safetensors (`transformers` is
not needed). Weights are loaded strictly: a missing or unexpected tensor is a one-line error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from archscale.config import ModelConfig
from archscale.errors import UserError
from archscale.export.common import Exported, _read_json, load_state_strict  # noqa: F401 (re-exported)

QUANT_FILE = "archscale_quantized.json"


def exported_kind(path: str | Path) -> str | None:
    """"hf-archscale" | "hf-llama" | "quantized" | "safetensors", or None for anything else (run dirs...)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        return "safetensors"
    if not p.is_dir() or (p / "COMPLETE").exists() or (p / "checkpoints").is_dir():
        return None
    if (p / QUANT_FILE).is_file():
        return "quantized"
    if (p / "config.json").is_file():
        cfg = _read_json(p / "config.json", f"--checkpoint {path}")
        if cfg.get("model_type") == "archscale":
            return "hf-archscale"
        if cfg.get("model_type") == "llama":
            return "hf-llama"
        raise UserError(f"--checkpoint {path}: a Hugging Face folder of model type {cfg.get('model_type')!r}; "
                        "archscale reads back only the folders it exported (llama / archscale)")
    return None


def read_safetensors_folder(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of model.safetensors or of the shards its index lists, plus the first file's metadata."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_read_json(index, f"--checkpoint {folder}").get("weight_map", {}).values()))
    else:
        files = ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}
    for name in files:
        path = folder / name
        if not path.is_file() or path.parent.resolve() != folder.resolve():
            raise UserError(f"--checkpoint {folder}: weight file {name} is missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = meta or dict(f.metadata() or {})
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
        except (OSError, ValueError, RuntimeError) as e:  # safetensors' SafetensorError is a ValueError
            raise UserError(f"--checkpoint {folder}: cannot read {name} ({str(e).splitlines()[0]})") from None
    return tensors, meta


def _model_config(d: dict, where: str) -> ModelConfig:
    if not isinstance(d, dict) or not d:
        raise UserError(f"--checkpoint {where}: no archscale model config recorded (was it exported by archscale?)")
    try:
        return ModelConfig(**d)
    except TypeError as e:
        raise UserError(f"--checkpoint {where}: the recorded model config does not fit this version of archscale "
                        f"({str(e).splitlines()[0]})") from None


def _load_hf_folder(folder: Path, kind: str) -> Exported:
    from archscale.models.model import GPT

    cfg_json = _read_json(folder / "config.json", f"--checkpoint {folder}")
    cfg = _model_config(cfg_json.get("archscale"), str(folder))
    tensors, _ = read_safetensors_folder(folder)
    model = GPT(cfg)
    if kind == "hf-llama":
        from archscale.export.hf import from_llama_state_dict
        try:
            sd = from_llama_state_dict(tensors, cfg)
        except (KeyError, ValueError) as e:
            raise UserError(f"--checkpoint {folder}: not a Llama export of this config ({e})") from None
    else:
        bad = [k for k in tensors if not k.startswith("model.")]
        if bad:
            raise UserError(f"--checkpoint {folder}: unexpected tensor {bad[0]} (archscale folders hold model.*)")
        sd = {k[len("model."):]: v for k, v in tensors.items()}
    load_state_strict(model, sd, str(folder))
    run_cfg = {}
    if (folder / "archscale_run.json").is_file():
        run_cfg = _read_json(folder / "archscale_run.json", f"--checkpoint {folder}")
    run_cfg["model"] = cfg.to_dict()
    tok = folder / "tokenizer.json"
    return Exported(model.eval(), run_cfg, tok if tok.is_file() else None, kind,
                    {"folded": cfg_json.get("archscale_folded")})


def _load_safetensors_file(path: Path) -> Exported:
    from archscale.models.model import GPT

    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"--checkpoint {path}: cannot read it as safetensors ({str(e).splitlines()[0]})") from None
    try:
        cfg_dict = json.loads(meta.get("archscale_model_config", "{}"))
    except json.JSONDecodeError:
        cfg_dict = None
    cfg = _model_config(cfg_dict, str(path))
    model = GPT(cfg)
    load_state_strict(model, tensors, str(path))
    return Exported(model.eval(), {"model": cfg.to_dict()}, None, "safetensors", {"step": meta.get("step")})


def load_exported(path: str | Path, device: str | torch.device = "cpu") -> Exported:
    """Load any exported form (see the module docstring) as an fp32 `GPT` in eval mode on `device`."""
    p = Path(path)
    kind = exported_kind(p)
    if kind is None:
        raise UserError(f"--checkpoint {path}: not an exported archscale model")
    if kind == "quantized":
        from archscale.quantize import load_quantized
        ex = load_quantized(p)
    elif kind == "safetensors":
        ex = _load_safetensors_file(p)
    else:
        ex = _load_hf_folder(p, kind)
    ex.model = ex.model.to(device)
    return ex
