"""DeepSpeed ZeRO 0-3 behind the same loop: a generated config, our optimizer, our LR schedule.

What must not change when the strategy does (so mu-P++ survives):
* the optimizer is OURS: AdamW over `param_groups(...)` (matrix / vector groups with their `lr_mult` and weight
  decay); with `--offload optimizer|params` it is DeepSpeed's CPU Adam over the very same groups (DeepSpeed needs
  its own kernel there). ZeRO keeps the client optimizer's `param_groups`, extra keys included;
* the LR is set by the trainer before every step, `group["lr"] = lr(step) * group["lr_mult"]`
  (`optim.set_lr` on `engine.optimizer`); the config has no "scheduler" and no "optimizer" section;
* gradient accumulation (`gradient_accumulation_steps` = the plan's, DeepSpeed divides the loss by it), global-norm
  clipping at 1.0, and the batch size (`train_batch_size` = micro x accum x world) come from the plan.

Precision: `bf16-mixed` -> DeepSpeed "bf16" (bf16 weights and gradients, fp32 master weights in the optimizer;
autocast stays on because the model keeps its residual stream in fp32); `fp16-mixed` -> "fp16" with dynamic loss
scaling (`loss_scale: 0`), whose current scale the trainer logs as `loss_scale` (DeepSpeed's CPU accelerator
has no fp16: GPU only); `fp32` -> neither.

Offload (`--offload`): `optimizer` moves optimizer states + the step to the CPU (ZeRO 1-3); `params` also offloads
parameters (ZeRO 3 only). The first use JIT-compiles the cpu_adam op (~60 s, cached in ~/.cache/torch_extensions).

Checkpoints are DeepSpeed's own (`engine.save_checkpoint`, tag "deepspeed" inside our step directory);
`archscale export` consolidates them with DeepSpeed's zero_to_fp32.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from archscale.errors import UserError
from archscale.train.checkpoint import DS_TAG

OFFLOADS = ("none", "optimizer", "params")
BUCKET_ELEMENTS = 20_000_000  # gradient-reduce / all-gather / ZeRO-3 prefetch bucket, in elements


def check_options(zero_stage: int, offload: str) -> None:
    """--zero_stage / --offload, checked alone and together."""
    if zero_stage not in (0, 1, 2, 3):
        raise UserError(f"--zero_stage must be 0, 1, 2 or 3 (got {zero_stage})")
    if offload not in OFFLOADS:
        raise UserError(f"--offload must be none, optimizer or params (got {offload!r})")
    if offload == "params" and zero_stage != 3:
        raise UserError("--offload params needs --zero_stage 3 (only ZeRO-3 partitions parameters)")
    if offload != "none" and zero_stage == 0:
        raise UserError("--offload needs --zero_stage 1, 2 or 3")


def ds_config(*, micro_bsz: int, grad_accum: int, world_size: int, zero_stage: int, precision: str,
              offload: str = "none", cuda: bool = False, clip: float = 1.0,
              fp16_scale_window: int = 1000) -> dict[str, Any]:
    """The DeepSpeed config dict for one run (written beside the checkpoints as deepspeed_config.json)."""
    check_options(zero_stage, offload)
    zero: dict[str, Any] = {"stage": zero_stage}
    # Bounded buffers (benchmarks/zero_stages.py measured them; docs/BENCHMARKS.md). DeepSpeed's defaults size the
    # gradient bucket at 5e8 elements (1 GB in bf16, more than a 150M model's gradients: ZeRO-2 then holds them
    # all at once) and, for ZeRO-3, let gathered parameters stay until their reuse (max_reuse_distance and
    # max_live_parameters 1e9 elements, more than the model). 2e7 elements is 40 MB in bf16.
    if zero_stage in (1, 2):
        zero.update(reduce_scatter=True, overlap_comm=cuda, contiguous_gradients=True,
                    reduce_bucket_size=BUCKET_ELEMENTS, allgather_bucket_size=BUCKET_ELEMENTS)
    if zero_stage == 3:
        zero.update(reduce_bucket_size=BUCKET_ELEMENTS, stage3_prefetch_bucket_size=BUCKET_ELEMENTS,
                    stage3_max_live_parameters=BUCKET_ELEMENTS, stage3_max_reuse_distance=0)
    if offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    if offload == "params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    return {
        "train_batch_size": micro_bsz * grad_accum * world_size,
        "train_micro_batch_size_per_gpu": micro_bsz,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16-mixed"},
        # hysteresis 1: halve at the first overflow, as torch's GradScaler does (DeepSpeed's default 2 waits for a
        # second one), so both scalers follow the same rule
        "fp16": {"enabled": precision == "fp16-mixed", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": fp16_scale_window, "hysteresis": 1, "min_loss_scale": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2 ** 31 - 1,  # we log; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
    }


def build_engine(model: torch.nn.Module, groups: list[dict], lr: float, betas: tuple[float, float], eps: float,
                 config: dict[str, Any]):
    """deepspeed.initialize with our optimizer over our groups; returns the engine (engine.optimizer holds
    the param groups whose "lr" the trainer sets)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError:
        raise UserError("--strategy deepspeed needs DeepSpeed: pip install 'archscale[deepspeed]'") from None
    if not torch.cuda.is_available() and os.environ.get("ARCHSCALE_DS_SHM", "0") != "1":
        # DeepSpeed's CPU backend JIT-builds a shared-memory all-reduce op (~2 min on first use, and it needs
        # AVX-512 for bf16); gloo does the same job here. ARCHSCALE_DS_SHM=1 opts back in.
        import importlib

        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    zero = config["zero_optimization"]
    if "offload_optimizer" in zero:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(groups, lr=lr, betas=betas, eps=eps, adamw_mode=True)
    else:
        # the single-process optimizer (fused AdamW); ZeRO hands it flat fp32 partitions of the same groups
        from archscale.train.optim import build_adamw

        optimizer = build_adamw(groups, lr, betas, eps)
        if zero["stage"] == 0 and not (config["bf16"]["enabled"] or config["fp16"]["enabled"]):
            _skip_nonfinite_steps(optimizer)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine


def _skip_nonfinite_steps(optimizer: torch.optim.Optimizer) -> None:
    """Without ZeRO and in fp32 DeepSpeed steps our optimizer directly and would apply NaN gradients (ZeRO and its
    bf16/fp16 optimizers skip such a step). Give it the same skip; the engine reads `optimizer.overflow` after
    the step and then reports the step as not applied. ZeRO-0 gradients are all-reduced, so every rank agrees."""
    step = optimizer.step
    optimizer.overflow = False

    def guarded(*args, **kwargs):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        optimizer.overflow = not all(bool(torch.isfinite(g).all()) for g in grads)
        return None if optimizer.overflow else step(*args, **kwargs)
    optimizer.step = guarded


def loss_scale(engine) -> float | None:
    """The current dynamic fp16 loss scale (None when not in fp16)."""
    if not engine.fp16_enabled():
        return None
    opt = engine.optimizer
    for name in ("cur_scale", "loss_scale"):
        v = getattr(opt, name, None)
        if v is not None:
            return float(v)
    return None


def to_universal(step_dir, out_root) -> None:
    """Convert the DeepSpeed checkpoint in `step_dir` (saved with another world size) into DeepSpeed's
    world-size-free "universal" format at `out_root/universal` (run on rank 0; load it with a config that has
    `checkpoint.load_universal`). DeepSpeed cannot re-partition ZeRO optimizer states any other way."""
    import argparse
    import contextlib
    import io
    from pathlib import Path

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = argparse.Namespace(input_folder=str(Path(step_dir) / DS_TAG), output_folder=str(Path(out_root) / "universal"),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)  # plain models carry no universal info
    from archscale.train.safe_io import deepspeed_weights_only

    # it prints every fragment; it reads with torch.load(weights_only=False), which the guard makes safe (its
    # worker processes are forked, so they inherit the guard)
    with contextlib.redirect_stdout(io.StringIO()), deepspeed_weights_only():
        ds_to_universal(args)
