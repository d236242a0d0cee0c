"""Meta-device initialisation for FSDP2: build the model on `meta`, shard it, then initialise shard by shard with
exactly the values (bitwise) and the RNG stream of today's eager init, `torch.manual_seed(seed); GPT(config)` on the
CPU.

Why: the eager build holds the whole fp32 model on every rank before `fully_shard` splits it, so a model larger
than one device cannot be built. Here no rank ever holds more than its shards plus ONE full tensor, and that full
tensor lives in host memory: on a GPU the device holds only the shards.

How the values stay bitwise equal without a second copy of the init code: the very same code runs, GPT's
constructor and then `GPT.reset_parameters` (every module's own init, children first, then the parametrization's
`accounting.apply_init`, then the embedding / head), under `ReplayInit`, a dispatch mode that

- for every RNG op (any aten op tagged `nondeterministic_seeded`: uniform_, normal_, rand, ...) draws from the
  global CPU generator into a FULL-size CPU tensor, exactly as the eager CPU init draws, and keeps only this rank's
  slice of it (a sharded DTensor parameter), all of it (a plain parameter on a GPU) or nothing (a meta tensor: the
  constructor's draws only advance the generator, `reset_parameters` overwrites every value they gave);
- writes a plain tensor copied into a DTensor parameter (`A_log.copy_(log A)`) as this rank's slice of it;
- creates every new plain tensor (the scratch of a mixer's own init: Mamba's dt, A) on the CPU whatever device
  was asked for, so its arithmetic (exp, log, expm1) is the CPU's, as in the eager init.

Everything else (fill_, zero_, mul_ by a scalar) runs on the shards through DTensor, elementwise and exact. So the
peak of the build per rank is: this rank's shards of every parameter (fp32) + the largest single parameter in full
(host memory; the token embedding or lm_head, or a mixture of experts' stacked expert weight) + the mixers'
scratch vectors (d_inner-sized). Measured in docs/BENCHMARKS.md ("Meta-device init").

Every parameter and buffer is filled with NaN before the init runs and checked afterwards, and no tensor attribute
may stay on `meta`: a parameter or buffer that no `reset_parameters` initialises is an error here, not a silent
wrong value. (GPT registers no buffers today; its RoPE cos/sin cache is built on first use, on the input's device.)
The global CPU generator ends in the same state as after the eager build (every draw is replayed).

The trainer uses it for FSDP2 without `--pp` / `--ep` (`applies`): `build_on_meta` replaces `GPT(config)`, and
`materialize` runs right after `parallelize()` shards the model.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from archscale.config import ModelConfig
from archscale.models.model import GPT

aten = torch.ops.aten
CPU = torch.device("cpu")


def applies(strategy: str, pp: int, ep: int) -> bool:
    """Whether the trainer builds on meta: FSDP2, without a pipeline (its stages are cut from an eager model) or
    expert parallelism (which distributes the experts itself before FSDP2 sees them)."""
    return strategy == "fsdp" and pp <= 1 and ep <= 1


def build_on_meta(config: ModelConfig) -> nn.Module:
    """GPT(config) on the meta device, with the CPU generator advanced exactly as the eager constructor advances it
    (call `torch.manual_seed(seed)` first, as for the eager build). Parameters hold no memory until `materialize`."""
    with torch.device("meta"), ReplayInit():
        return GPT(config)


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate `model`'s (sharded) parameters on `device` and initialise them as `GPT.reset_parameters` does on
    the full CPU model, continuing the CPU generator from `build_on_meta`. `model` may be FSDP2-sharded (its
    parameters DTensors) or not. Returns the model."""
    gpt = _gpt_inside(model)
    _to_empty_in_place(model, device)
    with torch.no_grad():
        for t in _tensors(gpt):
            _local(t).fill_(math.nan)  # what no init writes stays NaN: found by `_check_initialised`
        with ReplayInit():
            gpt.reset_parameters()
    _check_initialised(gpt)
    return model


def _to_empty_in_place(model: nn.Module, device) -> None:
    """`model.to_empty(device)` keeping every Parameter object (swapped in place, not replaced), so a weight two
    modules share (tied embeddings) stays one tensor; FSDP2 re-binds its sharded storage (FSDPModule._apply)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


class ReplayInit(TorchDispatchMode):
    """Runs init code on meta tensors and sharded DTensor parameters with the values and the CPU-generator stream
    the same code gives on full CPU tensors (see the module docstring). `largest` is the most bytes one full CPU
    draw took (the scratch on top of the shards)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            return self._seeded(func, args, kwargs)
        if func is aten.copy_.default and isinstance(args[0], DTensor) and not isinstance(args[1], DTensor):
            _write_shard(args[0], args[1].expand(args[0].shape))
            return args[0]
        return func(*args, **_on_cpu(kwargs))

    def _seeded(self, func, args, kwargs):
        if func._schema.name.endswith("_"):  # in place: uniform_, normal_, ... on args[0]
            target = args[0]
            _refuse_tensor_args(func, args[1:], kwargs)
            if not isinstance(target, DTensor) and target.device == CPU:
                return func(*args, **kwargs)
            full = torch.empty(target.shape, dtype=target.dtype, device=CPU)  # a DTensor's shape is the global one
            self.largest = max(self.largest, full.nbytes)
            func(full, *args[1:], **kwargs)
            if isinstance(target, DTensor):
                _write_shard(target, full)
            elif not target.is_meta:
                target.copy_(full)
            return target
        # a factory (rand, randn, ...) or a *_like: drawn on the CPU; a meta result keeps only the shape
        like = func._schema.name.endswith("_like")
        meta = _asks_meta(args, kwargs)
        args = tuple(torch.empty(a.shape, dtype=a.dtype, device=CPU) if like and isinstance(a, torch.Tensor)
                     and a.is_meta else a for a in args)
        _refuse_tensor_args(func, args, kwargs)
        out = func(*args, **({**kwargs, "device": CPU} if "device" in kwargs else kwargs))
        self.largest = max(self.largest, out.nbytes)
        return out.to("meta") if meta else out


def _on_cpu(kwargs: dict) -> dict:
    """A factory's kwargs with any device but meta replaced by the CPU (init scratch computes as on the CPU)."""
    device = kwargs.get("device")
    if device is None or torch.device(device).type in ("cpu", "meta"):
        return kwargs
    return {**kwargs, "device": CPU}


def _asks_meta(args, kwargs) -> bool:
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device).type == "meta"
    return any(isinstance(a, torch.Tensor) and a.is_meta for a in args)


def _refuse_tensor_args(func, args, kwargs) -> None:
    """An RNG op whose other tensor arguments are not plain CPU tensors (bernoulli_ with a meta / sharded p) would
    need their values: refused by name, so a new init that needs it fails loudly instead of drawing differently."""
    for a in tree_leaves((args, kwargs)):
        if isinstance(a, torch.Tensor) and (isinstance(a, DTensor) or a.device != CPU):
            raise NotImplementedError(f"meta-device init cannot replay {func} with a {a.device} tensor argument")


def _write_shard(target: DTensor, full: torch.Tensor) -> None:
    """This rank's part of the full tensor `full` into the DTensor `target` (its placements on its mesh)."""
    shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
    local = target._local_tensor
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard {tuple(local.shape)} != its slice {tuple(shape)} of {tuple(full.shape)}")
    local.copy_(full[tuple(slice(o, o + s) for o, s in zip(offset, shape))])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _tensors(model: nn.Module):
    """Every distinct floating-point parameter and buffer (a tied weight once)."""
    seen = set()
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in seen and t.is_floating_point():
            seen.add(id(t))
            yield t


def _gpt_inside(model: nn.Module) -> nn.Module:
    while not hasattr(model, "reset_parameters") and hasattr(model, "module"):
        model = model.module
    return model


def _check_initialised(model: nn.Module) -> None:
    """No parameter / buffer left NaN (nothing initialised it), no tensor attribute left on meta."""
    names = {id(t): n for n, t in (*model.named_parameters(), *model.named_buffers())}
    for t in _tensors(model):
        if torch.isnan(_local(t)).any():
            raise RuntimeError(f"meta-device init: nothing initialises {names[id(t)]!r} (its module needs a "
                               "reset_parameters that sets it)")
    for mod_name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise RuntimeError(f"meta-device init: tensor attribute {mod_name}.{attr} is still on meta")
