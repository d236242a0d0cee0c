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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from archscale.config import ModelConfig
from archscale.errors import UserError

QUANT_FILE = "archscale_quantized.json"


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
