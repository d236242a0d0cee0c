"""`archscale quantize`: post-training weight quantisation with torchao (no hand-written kernels).

Methods (every `nn.Linear` of every mixer and MLP, and an untied lm_head; embeddings, norms, convolutions and
SSM parameters stay fp32; a tied lm_head stays with its embedding):

    int8-dynamic  int8 weights (per output channel) and int8 activations quantised per token at run time
                  (torchao `Int8DynamicActivationInt8WeightConfig`)
    int8-weight   int8 weights, activations in float (torchao `Int8WeightOnlyConfig`)
    nf4           4-bit NormalFloat weights in blocks of 64 with double-quantised scales (QLoRA's format,
                  torchao `NF4Tensor`), dequantised to the activation dtype inside each matmul

All three run in pure PyTorch on CPU as well as CUDA. The output folder holds the *quantised* tensors (int8 /
packed 4-bit data and their scales) in `model.safetensors` plus a JSON recipe (`archscale_quantized.json`) and
the tokenizer; `archscale eval / generate` read it back by rebuilding the torchao tensors from those pieces
(torchao's allowlisted safetensors format for int8; the NF4Tensor's own fields for nf4). No pickle anywhere.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from archscale.errors import UserError

METHODS = ("int8-dynamic", "int8-weight", "nf4")
RECIPE_FILE = "archscale_quantized.json"
WEIGHTS_FILE = "model.safetensors"
NF4_META = "archscale_nf4"
NF4_BLOCK = 64


def _torchao():
    logging.getLogger("torchao").setLevel(logging.ERROR)  # it logs missing optional CUDA extensions on import
    try:
        import torchao
    except ImportError:
        raise UserError("archscale quantize needs torchao: pip install 'archscale[quantize]'") from None
    return torchao


def quantizable_linears(model: nn.Module) -> list[str]:
    """Names of the Linear modules to quantise: all of them except one sharing its weight with an embedding."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and id(m.weight) not in embeddings]


def _nf4_scaler_block(n_blocks: int) -> int:
    """The largest power of two <= 256 dividing n_blocks (QLoRA uses 256; small matrices need less)."""
    s = 256
    while n_blocks % s:
        s //= 2
    return s


def quantize_model(model: nn.Module, method: str) -> dict[str, list[str]]:
    """Quantise `model` in place; returns {"quantized": [module names], "skipped": [...]} ."""
    if method not in METHODS:
        raise UserError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    _torchao()
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_, to_nf4

    names = quantizable_linears(model)
    skipped = []
    if method == "nf4":
        for name in names:
            lin = model.get_submodule(name)
            if lin.weight.numel() % NF4_BLOCK:
                skipped.append(name)
                continue
            scaler = _nf4_scaler_block(lin.weight.numel() // NF4_BLOCK)
            lin.weight = nn.Parameter(to_nf4(lin.weight.detach(), NF4_BLOCK, scaler), requires_grad=False)
    else:
        config = Int8DynamicActivationInt8WeightConfig() if method == "int8-dynamic" else Int8WeightOnlyConfig()
        wanted = set(names)
        quantize_(model, config, filter_fn=lambda m, fqn: fqn in wanted)
    done = [n for n in names if n not in skipped]
    if not done:
        raise UserError(f"--method {method}: no linear layer of this model can be quantised")
    return {"quantized": done, "skipped": skipped}


def _split_state(model: nn.Module, quantized: list[str]) -> tuple[dict, dict, dict]:
    """(plain tensors, torchao int8 tensors, NF4 tensors) of the model's state, by state-dict name."""
    from torchao.quantization import NF4Tensor

    plain, int8, nf4 = {}, {}, {}
    qnames = {f"{n}.weight" for n in quantized}
    for k, t in model.state_dict().items():
        if k in qnames and isinstance(t, NF4Tensor):
            nf4[k] = t
        elif k in qnames:
            int8[k] = t
        else:
            plain[k] = t.detach().contiguous().clone()
    if model.config.tie_embeddings:
        plain.pop("lm_head.weight", None)  # the embedding, stored once
    return plain, int8, nf4


def save_quantized(model: nn.Module, info: dict, out: Path) -> None:
    """model.safetensors: plain tensors, torchao's flattened int8 tensors, NF4 fields (`<name>:<field>`)."""
    from safetensors.torch import save_file
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    plain, int8, nf4 = _split_state(model, info["quantized"])
    tensors, meta = dict(plain), {}
    if int8:
        flat, meta = flatten_tensor_state_dict(int8)
        tensors.update(flat)
    nf4_meta = {}
    for k, t in nf4.items():
        fields, ctx = t.__tensor_flatten__()
        tensors.update({f"{k}:{f}": getattr(t, f).contiguous() for f in fields})
        nf4_meta[k] = {"block_size": ctx["block_size"], "n_blocks": ctx["n_blocks"],
                       "scaler_block_size": ctx["scaler_block_size"], "shape": list(t.shape)}
    meta = {**meta, NF4_META: json.dumps(nf4_meta), "format": "pt"}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata=meta)


def _rebuild_nf4(tensors: dict, nf4_meta: dict) -> dict:
    from torchao.quantization import NF4Tensor
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import SubclassTensorArgs

    out = {}
    for k, m in nf4_meta.items():
        fields = {f: tensors.pop(f"{k}:{f}") for f in
                  ("quantized_data", "scaler_mean", "quantization_factor", "quantized_scalers", "nf4")}
        shape = torch.Size(m["shape"])
        stride = tuple(int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape)))
        args = SubclassTensorArgs(shape, stride, 0, torch.float32, fields["nf4"].device, False)
        out[k] = NF4Tensor.__tensor_unflatten__(fields, {"tensor_meta": args, "block_size": m["block_size"],
                                                         "n_blocks": m["n_blocks"],
                                                         "scaler_block_size": m["scaler_block_size"]}, shape, stride)
    return out


def load_quantized(folder: str | Path):
    """An `Exported` (see export/load.py) holding the quantised GPT read from `folder`. The recipe's config is
    checked by field type and against the tensors' shapes before the model is built; a tensor that does not
    rebuild into the quantised weight the config asks for is a one-line error naming the file."""
    from archscale.export.common import (Exported, _read_json, check_config_fits, load_state_strict, model_config_from,
                                         tensor_shapes)

    folder = Path(folder)
    recipe = _read_json(folder / RECIPE_FILE, f"--checkpoint {folder}")
    if recipe.get("method") not in METHODS or not isinstance(recipe.get("model"), dict):
        raise UserError(f"--checkpoint {folder}: {RECIPE_FILE} names no known method / model config")
    cfg = model_config_from(recipe["model"], str(folder), RECIPE_FILE)
    check_config_fits(cfg, tensor_shapes([folder / WEIGHTS_FILE]), "plain", str(folder), RECIPE_FILE)
    _torchao()
    try:
        model, quant, tensors = _assemble(folder, cfg)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
        raise UserError(f"--checkpoint {folder}: {WEIGHTS_FILE} does not rebuild into the {recipe['method']} model "
                        f"{RECIPE_FILE} describes ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    load_state_strict(model, tensors, str(folder), skip=set(quant))
    tok = folder / "tokenizer.json"
    run_cfg = _read_json(folder / "archscale_run.json", str(folder)) if (folder / "archscale_run.json").is_file() \
        else {}
    run_cfg["model"] = recipe["model"]
    return Exported(model.eval(), run_cfg, tok if tok.is_file() else None, "quantized",
                    {"method": recipe["method"], "quantized": recipe.get("quantized", [])})


def _assemble(folder: Path, cfg) -> tuple[nn.Module, dict, dict]:
    """(the GPT with its quantised weights set, those weights by name, the plain tensors left to load)."""
    from safetensors import safe_open
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    from archscale.models.model import GPT

    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    nf4 = _rebuild_nf4(tensors, json.loads(meta.pop(NF4_META, "{}")))
    quant = dict(nf4)
    if "tensor_names" in meta:
        meta.pop("format", None)
        int8, tensors = unflatten_tensor_state_dict(tensors, meta)
        quant.update({k: v for k, v in int8.items() if k not in tensors})
    model = GPT(cfg)
    for k, t in quant.items():
        module = model.get_submodule(k.rsplit(".", 1)[0])
        inner = getattr(t, "qdata", None)
        if tuple(t.shape) != tuple(module.weight.shape) or (inner is not None and inner.shape != t.shape):
            raise ValueError(f"{k} is {tuple(inner.shape if inner is not None else t.shape)}, the config makes "
                             f"{tuple(module.weight.shape)}")
        module.weight = nn.Parameter(t, requires_grad=False)
    return model, quant, tensors
