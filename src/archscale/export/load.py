"""Read exported models back into archscale's `GPT`, so eval / generate / serve take them as `--checkpoint`.

    DIR/config.json (model_type "archscale")   an `archscale export --format hf` folder of any architecture
    DIR/config.json (model_type "llama")       a Transformer++ exported as Llama (needs the "archscale" key)
    DIR/archscale_quantized.json               an `archscale quantize` folder (`archscale.quantize`)
    FILE.safetensors                           `archscale export --format safetensors` (config in its metadata)

Nothing here runs code from the folder: the config is JSON and the weights are safetensors (`transformers` is
not needed). A folder is first checked against its `archscale_manifest.json` (every file's size and sha256:
`export/manifest.py`); the recorded config is checked field by field (types) and against the tensors' shapes
(vocabulary, depth, widths) before a model is built; weights are loaded strictly. Any mismatch is a one-line error
naming the file or field.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from archscale.config import ModelConfig
from archscale.errors import UserError
from archscale.export.common import (Exported, _read_json, check_config_fits, load_state_strict,  # noqa: F401
                                     model_config_from, tensor_shapes)

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


def weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards its index lists (each inside the folder)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, f"--checkpoint {folder}").get("weight_map", {})
        files = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []
        if not files or not all(isinstance(n, str) for n in files):
            raise UserError(f"--checkpoint {folder}: model.safetensors.index.json lists no weight files")
    else:
        files = ["model.safetensors"]
    for name in files:
        path = folder / name
        if not path.is_file() or path.parent.resolve() != folder.resolve():
            raise UserError(f"--checkpoint {folder}: weight file {name} is missing")
    return [folder / n for n in files]


def read_safetensors_folder(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of model.safetensors or of the shards its index lists, plus the first file's metadata."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}
    for path in weight_files(folder):
        name = path.name
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = meta or dict(f.metadata() or {})
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
        except (OSError, ValueError, RuntimeError) as e:  # safetensors' SafetensorError is a ValueError
            raise UserError(f"--checkpoint {folder}: cannot read {name} ({str(e).splitlines()[0]})") from None
    return tensors, meta


_HF_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "n_embd", "num_hidden_layers": "n_layer",
              "num_attention_heads": "n_head"}


def _check_hf_fields(cfg_json: dict, cfg: ModelConfig, folder: Path) -> None:
    """The fields transformers reads and the "archscale" config we read must describe the same model."""
    for hf_name, ours in _HF_FIELDS.items():
        if hf_name in cfg_json and cfg_json[hf_name] != getattr(cfg, ours):
            raise UserError(f"--checkpoint {folder}: config.json: {hf_name} = {cfg_json[hf_name]!r} but the "
                            f"archscale config's {ours} = {getattr(cfg, ours)!r}; they must agree")


def _load_hf_folder(folder: Path, kind: str) -> Exported:
    from archscale.models.model import GPT

    cfg_json = _read_json(folder / "config.json", f"--checkpoint {folder}")
    cfg = model_config_from(cfg_json.get("archscale"), str(folder), "config.json")
    _check_hf_fields(cfg_json, cfg, folder)
    check_config_fits(cfg, tensor_shapes(weight_files(folder)), "llama" if kind == "hf-llama" else "hf",
                      str(folder), "config.json")
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
    cfg = model_config_from(cfg_dict, str(path), "its archscale_model_config metadata")
    check_config_fits(cfg, {k: tuple(v.shape) for k, v in tensors.items()}, "plain", str(path),
                      "its archscale_model_config metadata")
    model = GPT(cfg)
    load_state_strict(model, tensors, str(path))
    return Exported(model.eval(), {"model": cfg.to_dict()}, None, "safetensors", {"step": meta.get("step")})


def load_exported(path: str | Path, device: str | torch.device = "cpu") -> Exported:
    """Load any exported form (see the module docstring) as an fp32 `GPT` in eval mode on `device`."""
    p = Path(path)
    kind = exported_kind(p)
    if kind is None:
        raise UserError(f"--checkpoint {path}: not an exported archscale model")
    if kind != "safetensors":  # a folder: every file exactly as exported before any is read
        from archscale.export.manifest import verify_manifest
        verify_manifest(p)
    if kind == "quantized":
        from archscale.quantize import load_quantized
        ex = load_quantized(p)
    elif kind == "safetensors":
        ex = _load_safetensors_file(p)
    else:
        ex = _load_hf_folder(p, kind)
    ex.model = ex.model.to(device)
    return ex
