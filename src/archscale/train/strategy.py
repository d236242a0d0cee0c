"""What differs between single process, DDP, FSDP2 and DeepSpeed in one optimizer step, behind one object.

The trainer's step is the same for every strategy:

    loss_sum = strategy.run_micro_batches(batches, ...)   # by default:
    for micro in range(accum):
        with strategy.no_sync(micro):
            loss = loss_of(strategy.model, batch)
            strategy.backward(loss, micro)
    outcome = strategy.clip_and_step(apply=...)   # global-norm clip at 1.0, then the update (or not)

`apply=False` (a non-finite loss) makes the torch strategies drop the step's gradients without an update. Every
strategy reports whether the update happened: DeepSpeed's engine decides that itself (ZeRO and its bf16/fp16
optimizers skip a step whose gradient norm is not finite; `deepspeed_engine.build_engine` gives ZeRO-0 in fp32 the
same skip). `state_dict_target()` is what checkpoints save and load.
"""

from __future__ import annotations

import math
import shutil
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from archscale.train.distributed import DistEnv
from archscale.train.parallelize import unwrap

CLIP_NORM = 1.0  # global gradient-norm clipping threshold (ArchScale's `grad_clip`)


@dataclass
class StepOutcome:
    grad_norm: float  # global gradient norm before clipping (inf/nan when the gradients were not finite)
    applied: bool  # the optimizer update happened
    overflow: bool = False  # an fp16 loss scaler skipped the update (normal: it lowers the scale and goes on)


class Strategy:
    """One process, or any torch strategy whose gradients are complete after backward (FSDP2 shards them; the
    clipping norm is then a DTensor made whole by `full_tensor`)."""

    name = "single"
    experts = None  # expert parallelism (train/expert_parallel.ExpertParallel), set by the trainer with --ep
    comm = None  # DDP: the counting (and --grad_compression) hook, train/grad_compression.CountingHook

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, accum: int,
                 scaler: Optional[torch.amp.GradScaler] = None):
        self.model = model  # what the forward pass calls
        self.optimizer = optimizer  # whose param groups' "lr" the trainer sets
        self.accum = accum
        self.scaler = scaler

    def no_sync(self, micro: int):
        return nullcontext()

    def run_micro_batches(self, batches, forward: Callable, loss_fn: Callable, label_smoothing: float,
                          autocast: Callable) -> torch.Tensor:
        """Forward and backward of each (inputs, targets) of one step, the loop above; returns the sum of the
        micro-batches' language-model losses (detached). A pipeline runs them all in one schedule instead."""
        total = None
        for micro, (inputs, targets) in enumerate(batches):
            with self.no_sync(micro):
                with autocast():
                    out = forward(self.model, inputs)
                loss = loss_fn(out, targets, label_smoothing)
                aux = unwrap(self.model).aux_loss  # a mixture of experts' balancing losses (None without)
                self.backward(loss if aux is None else loss + aux, micro)
            total = loss.detach() if total is None else total + loss.detach()  # no .item(): no GPU sync here
        return total

    def backward(self, loss: torch.Tensor, micro: int) -> None:
        """Accumulate the gradient of one micro-batch's mean loss (the step averages over micro-batches)."""
        loss = loss / self.accum
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def clip_and_step(self, apply: bool = True) -> StepOutcome:
        opt, scaler = self.optimizer, self.scaler
        if scaler is not None:
            scaler.unscale_(opt)
        if self.experts is not None:  # --ep: finishes the expert gradients, clips by the global norm
            norm = self.experts.clip(self.model, CLIP_NORM)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP_NORM)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        finite = math.isfinite(grad_norm)
        if scaler is not None:
            if apply:
                scaler.step(opt)  # skips the update itself when the unscaled gradients hold inf/nan
            scaler.update()  # lowers the scale after an overflow; must follow every unscale_
        elif apply and finite:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return StepOutcome(grad_norm, applied=apply and finite, overflow=scaler is not None and apply and not finite)

    def loss_scale(self) -> Optional[float]:
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    def state_dict_target(self) -> tuple[torch.nn.Module, Optional[torch.optim.Optimizer], Any]:
        """(module, optimizer, DeepSpeed engine) as `checkpoint.save_checkpoint`/`load_checkpoint` take them."""
        return self.model, self.optimizer, None

    def describe(self) -> str:
        return self.name

    def after_load(self, env: DistEnv) -> None:
        """Clean-up once a checkpoint was loaded into every rank."""


class FSDPStrategy(Strategy):
    name = "fsdp"


class DDPStrategy(Strategy):
    """DDP all-reduces gradients in backward; only the last micro-batch of a step needs to."""

    name = "ddp"

    def no_sync(self, micro: int):
        return self.model.no_sync() if micro < self.accum - 1 else nullcontext()

    def clip_and_step(self, apply: bool = True) -> StepOutcome:
        outcome = super().clip_and_step(apply)
        if self.comm is not None:
            if not outcome.applied:
                self.comm.drop_nonfinite()
            self.comm.end_step()
        return outcome

    def state_dict_target(self):
        return unwrap(self.model), self.optimizer, None  # DCP keys without DDP's "module." prefix

    def describe(self) -> str:
        method = self.comm.spec.describe() if self.comm is not None else "none"
        return self.name + (f" + {method} gradient compression" if method != "none" else "")


class DeepSpeedStrategy(Strategy):
    """The engine does backward, accumulation (it divides the loss by the accumulation steps), clipping and the
    update; its optimizer is ours (same groups), so the trainer still sets the LR."""

    name = "deepspeed"

    def __init__(self, engine, accum: int, zero_stage: int, offload: str = "none",
                 universal: Optional[Path] = None, plain_fp32: bool = False):
        super().__init__(engine, engine.optimizer, accum)
        self.engine = engine
        self.zero_stage, self.offload = zero_stage, offload
        self.universal = universal  # a resumed checkpoint converted for this world size (removed after loading)
        # ZeRO-0 in fp32 steps our optimizer directly and reports no gradient norm: measure it here, on the
        # all-reduced gradients, before the engine clips them
        self.plain_fp32 = plain_fp32

    def backward(self, loss: torch.Tensor, micro: int) -> None:
        self.engine.backward(loss)
        if micro < self.accum - 1:
            self.engine.step()  # inside the accumulation window: counts the micro-batch, updates nothing

    def clip_and_step(self, apply: bool = True) -> StepOutcome:
        # The boundary step. A non-finite loss has non-finite gradients, which the engine's overflow check
        # refuses; the trainer stops if an update was applied anyway (`applied` with a non-finite norm).
        own_norm = None
        if self.plain_fp32:
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            own_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        self.engine.step()
        reported = self.engine.get_global_grad_norm()
        grad_norm = float(reported if reported is not None else own_norm or 0.0)
        applied = bool(self.engine.was_step_applied())
        return StepOutcome(grad_norm, applied=applied, overflow=not applied and self.engine.fp16_enabled())

    def loss_scale(self) -> Optional[float]:
        from archscale.train.deepspeed_engine import loss_scale

        return loss_scale(self.engine)

    def state_dict_target(self):
        return self.engine, None, self.engine

    def describe(self) -> str:
        return f"deepspeed ZeRO-{self.zero_stage}" + (f" offload {self.offload}" if self.offload != "none" else "")

    def after_load(self, env: DistEnv) -> None:
        if self.universal is not None:
            env.barrier()
            if env.is_main:
                shutil.rmtree(self.universal, ignore_errors=True)
            self.universal = None


def build_strategy(env: DistEnv, model: torch.nn.Module, groups: list[dict], *, lr: float,
                   betas: tuple[float, float], eps: float, accum: int, micro_bsz: int, precision: str,
                   zero_stage: int = 2, offload: str = "none", universal_from: Optional[Callable[[], Path]] = None,
                   fp16_scale_window: int = 1000, grad_compression: str = "none") -> tuple[Strategy, Optional[dict]]:
    """The strategy for `env.strategy` around the parallelized `model`, with its optimizer over `groups`.
    Returns (strategy, DeepSpeed config or None). `universal_from()` converts the checkpoint to resume (when it
    was saved by DeepSpeed with another world size) and returns where the converted copy is. fp16-mixed: both
    scalers start at 2**16, halve on an overflow (skipping that step) and double after `fp16_scale_window`
    overflow-free steps. DDP gets the `grad_compression` hook (none: a plain all-reduce, counted)."""
    if env.strategy != "deepspeed":
        from archscale.train.optim import build_adamw

        optimizer = build_adamw(groups, lr, betas, eps)
        scaler = (torch.amp.GradScaler(env.device.type, init_scale=2.0 ** 16, backoff_factor=0.5, growth_factor=2.0,
                                       growth_interval=fp16_scale_window) if precision == "fp16-mixed" else None)
        cls = {"ddp": DDPStrategy, "fsdp": FSDPStrategy}.get(env.strategy, Strategy)
        strategy = cls(model, optimizer, accum, scaler)
        if env.strategy == "ddp":
            from archscale.train.grad_compression import install, parse_grad_compression

            strategy.comm = install(model, parse_grad_compression(grad_compression))
        return strategy, None
    from archscale.train.deepspeed_engine import build_engine, ds_config

    config = ds_config(micro_bsz=micro_bsz, grad_accum=accum, world_size=env.world_size, zero_stage=zero_stage,
                       precision=precision, offload=offload, cuda=env.device.type == "cuda",
                       fp16_scale_window=fp16_scale_window)
    universal = universal_from() if universal_from is not None else None
    if universal is not None:
        config["checkpoint"] = {"load_universal": True}
    engine = build_engine(model, groups, lr, betas, eps, config)
    config.pop("checkpoint", None)
    plain_fp32 = zero_stage == 0 and precision == "fp32"
    return DeepSpeedStrategy(engine, accum, zero_stage, offload, universal, plain_fp32), config
