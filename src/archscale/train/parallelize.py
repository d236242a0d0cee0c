"""The pieces a strategy parallelizes a model with (torchtitan's split): memory savers, compile, FSDP2.

Order, per torchtitan's `parallelize_llama`: activation checkpointing (per block) -> torch.compile (per block,
after checkpointing so the compiled graph is the checkpointed one) -> sharding (FSDP2 `fully_shard` per block,
then the root) or DDP; each strategy class (strategy.py) applies them in `Strategy.parallelize`. DeepSpeed wraps the
model itself (deepspeed_engine.py) after the first two steps.

All three edits keep parameter names (FQNs) unchanged: checkpointing swaps a block's `forward` on the instance,
compile uses `nn.Module.compile()` (in place), and FSDP2 swaps the class, not the module tree. So checkpoints
written under any strategy load under any other.

GPU notes (not exercised on CPU CI): NCCL is the backend (distributed.py); `--precision bf16-mixed` adds
FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` (bf16 all-gathers and compute, fp32
gradient reduction and fp32 sharded master weights) on top of autocast; flash-attn is picked by the model's
attention module when installed.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint



def apply_act_ckpt(model: nn.Module) -> None:
    """Recompute each block's activations in the backward pass (keeps only block inputs alive)."""
    for block in model.blocks:
        if getattr(block, "_act_ckpt", False):
            continue
        inner = block.forward  # the bound original forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward  # instance attribute: nn.Module.__call__ (and FSDP's hooks) wrap it
        block._act_ckpt = True


def apply_compile(model: nn.Module, backend: str = "inductor", fullgraph: bool = False) -> None:
    """Regional compilation: torch.compile each block in place (FQNs unchanged); embedding, final norm, head and
    loss stay eager. Blocks of one kind share a compiled graph (parameters are graph inputs); a block whose
    constants differ (its layer kind, differential attention's per-layer lambda_init) gets its own, so the
    recompile limit is raised to cover every block. A Transformer++ block traces as one graph (tested)."""
    dynamo = torch._dynamo.config
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"  # renamed in torch 2.6
    setattr(dynamo, name, max(getattr(dynamo, name), 2 * len(model.blocks) + 8))
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=fullgraph)


def apply_fsdp(model: nn.Module, bf16: bool, cpu_offload: bool, ignored: frozenset = frozenset(),
               mesh=None, root: bool = True) -> None:
    """FSDP2 over the 1-D `mesh` (default: every rank): every block is its own unit (all-gathered just before
    use, resharded after), then the root (embedding, final norm, head; `root=False` leaves the root alone, for a
    pipeline stage that shards its pieces itself). `ignored` parameters (expert-parallel experts) stay as they
    are."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    skip = dict(ignored_params=set(ignored)) if ignored else {}
    if mesh is not None:
        skip["mesh"] = mesh
    blocks = model.blocks.values() if isinstance(model.blocks, nn.ModuleDict) else model.blocks
    for block in blocks:
        fully_shard(block, mp_policy=mp, offload_policy=offload, **skip)
    if root:
        fully_shard(model, mp_policy=mp, offload_policy=offload, **skip)


def unwrap(model: nn.Module) -> nn.Module:
    """The GPT inside a DDP wrapper or a DeepSpeed engine (FSDP2 modules are the model itself)."""
    while hasattr(model, "module"):
        model = model.module
    return model
