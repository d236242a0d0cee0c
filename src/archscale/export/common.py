"""What every reader of exported folders shares (`export/load.py`, `quantize.py`): the loaded result, strict JSON
and state-dict reading, the recorded config checked by field type and against the tensors' shapes. Its own module so that those readers do not import each other."""

from __future__ import annotations

import json
import math
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


_WIDTHS = ("n_embd", "intermediate_size", "n_head", "n_query_groups", "head_size")


def _type_ok(hint, value) -> bool:
    """The JSON value fits the field's declared type (only the plain scalar / dict types are checked)."""
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint in (str, dict):
        return isinstance(value, hint)
    return True


def model_config_from(d, where: str, file: str):
    """The `ModelConfig` a folder or file records in `file`, its fields checked by type first: a string
    `rope_base`, a fractional `n_layer` or a NaN is a one-line error naming the field, not a traceback later."""
    import typing

    from archscale.config import ModelConfig

    if not isinstance(d, dict) or not d:
        raise UserError(f"--checkpoint {where}: {file} records no archscale model config (was it exported by "
                        "archscale?)")
    hints = typing.get_type_hints(ModelConfig)
    for key, value in d.items():
        if key not in hints:
            raise UserError(f"--checkpoint {where}: {file} records a model config field {key!r} this version of "
                            "archscale does not have")
        if not _type_ok(hints[key], value):
            raise UserError(f"--checkpoint {where}: {file}: model config field {key} = {value!r} is not "
                            f"{getattr(hints[key], '__name__', hints[key])}")
    try:
        return ModelConfig(**d)
    except (TypeError, ValueError, KeyError, UserError) as e:
        raise UserError(f"--checkpoint {where}: {file}: the model config does not fit this version of archscale "
                        f"({str(e).splitlines()[0]})") from None


def tensor_shapes(paths: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the safetensors headers alone (no data read)."""
    from safetensors import safe_open

    shapes = {}
    for path in paths:
        try:
            with safe_open(str(path), framework="pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        except (OSError, ValueError, RuntimeError) as e:  # safetensors' SafetensorError is a ValueError
            raise UserError(f"--checkpoint {path.parent}: cannot read {path.name} ({str(e).splitlines()[0]})") \
                from None
    return shapes


def check_config_fits(cfg, shapes: dict[str, tuple[int, ...]], layout: str, where: str, file: str) -> None:
    """Before a model is built: the recorded vocabulary, depth and widths against the tensors the file holds.
    `layout`: "llama" (transformers' Llama names), "hf" (archscale names under "model."), "plain" (our names);
    names absent from `shapes` (quantised weights, a tied lm_head) are left to the strict load."""
    embed, prefix = {"llama": ("model.embed_tokens.weight", "model.layers."), "hf": ("model.wte.weight",
                     "model.blocks."), "plain": ("wte.weight", "blocks.")}[layout]

    def bad(field: str, what: str) -> UserError:
        return UserError(f"--checkpoint {where}: {file}: {field} = {getattr(cfg, field)} does not match the weights "
                         f"({what})")
    if embed not in shapes:
        raise UserError(f"--checkpoint {where}: the weights hold no {embed}")
    rows, cols = shapes[embed]
    if rows != (cfg.vocab_size if layout == "llama" else cfg.padded_vocab_size):
        raise bad("vocab_size", f"{embed} has {rows} rows")
    if cols != cfg.n_embd:
        raise bad("n_embd", f"{embed} is {cols} wide")
    layers = {int(k[len(prefix):].split(".")[0]) for k in shapes if k.startswith(prefix)}
    if layers != set(range(cfg.n_layer)):
        raise bad("n_layer", f"they hold {len(layers)} layers")
    for name, want in _expected_shapes(cfg, layout, f"--checkpoint {where}: {file}").items():
        if name in shapes and shapes[name] != want:
            widths = ", ".join(f"{w}={getattr(cfg, w)}" for w in _WIDTHS)
            raise UserError(f"--checkpoint {where}: {file}: the recorded widths ({widths}) make {name} "
                            f"{tuple(want)}, the weights have {shapes[name]}")


def _expected_shapes(cfg, layout: str, where: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the model `cfg` describes, built on the meta device (nothing allocated)."""
    from archscale.models.model import GPT

    try:
        with torch.device("meta"):
            model = GPT(cfg)
            if layout == "llama":
                from archscale.export.hf import to_llama_state_dict
                sd = to_llama_state_dict(model)
            else:
                sd = {("model." if layout == "hf" else "") + k: v for k, v in model.state_dict().items()}
    except (ValueError, RuntimeError, TypeError, ZeroDivisionError, AssertionError, UserError) as e:
        raise UserError(f"{where}: the recorded model config builds no model ({str(e).splitlines()[0]})") from None
    return {k: tuple(v.shape) for k, v in sd.items()}
