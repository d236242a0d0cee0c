"""What differs between single process, DDP, FSDP2, DeepSpeed and a pipeline, behind one object.

A strategy is a class built from the run's parallel layout (train/parallel_layout.py) and its config, looked up
by `layout.kind` in `STRATEGIES` (a class registers itself with `@register`). The trainer then calls, for any:

    model = strategy.build_model(factory)      # build (the place for meta-device init), memory savers, shard
    strategy.build_optimizer(groups, spec)     # its optimizer (or DeepSpeed engine) over the trainer's groups

The trainer's step is the same for every strategy:

    loss_sum = strategy.run_micro_batches(batches, ...)   # by default:
    for micro in range(accum):
        with strategy.no_sync(micro):
            loss = loss_of(strategy.model, batch)
            strategy.backward(loss, micro)
    outcome = strategy.clip_and_step(loss=mean_loss)   # global-norm clip at 1.0, then the update (or not)

The step's mean loss (a device tensor) and the gradient norm are read together, in ONE host sync per optimizer
step (`read_together`); a non-finite loss or norm makes the torch strategies drop the step's gradients without an
update (the non-finite guard). Every
strategy reports whether the update happened: DeepSpeed's engine decides that itself (ZeRO and its bf16/fp16
optimizers skip a step whose gradient norm is not finite; `deepspeed_engine.build_engine` gives ZeRO-0 in fp32 the
same skip). `state_dict_target()` is what checkpoints save and load.
"""

from __future__ import annotations

import json
import math
import shutil
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import torch.nn.functional as F
from torch import nn

from archscale.train.distributed import DistEnv
from archscale.train.parallel_layout import ParallelLayout
from archscale.train.parallelize import apply_act_ckpt, apply_compile, apply_fsdp, unwrap

CLIP_NORM = 1.0  # global gradient-norm clipping threshold (ArchScale's `grad_clip`)


@dataclass
class StepOutcome:
    grad_norm: float  # global gradient norm before clipping (inf/nan when the gradients were not finite)
    applied: bool  # the optimizer update happened
    overflow: bool = False  # an fp16 loss scaler skipped the update (normal: it lowers the scale and goes on)
    train_loss: float = math.nan  # the step's mean loss as given to clip_and_step (nan when none was)


def read_together(norm: torch.Tensor, loss: Optional[torch.Tensor]) -> tuple[float, float]:
    """(gradient norm, loss) on the host in one read: the step's only host sync. `loss` None reads as 0.0."""
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    parts = [norm.detach().double().reshape(())]
    if loss is not None:
        parts.append(loss.detach().double().reshape(()).to(parts[0].device))
    values = torch.stack(parts).tolist()
    return values[0], (values[1] if loss is not None else 0.0)



@dataclass
class OptimizerSpec:
    """What every strategy's optimizer is built from: the plan's numbers (the groups come separately)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    accum: int
    micro_bsz: int
    universal_from: Optional[Callable[[], Optional[Path]]] = None  # DeepSpeed resume at another world size


STRATEGIES: dict[str, type["Strategy"]] = {}


def register(cls: type["Strategy"]) -> type["Strategy"]:
    """Make `cls` the strategy of layouts whose `kind` is `cls.name`."""
    STRATEGIES[cls.name] = cls
    return cls


def strategy_for(layout: ParallelLayout, cfg, log: Callable[[str], None] = print) -> "Strategy":
    """The strategy object that runs `layout` (not built yet: build_model, then build_optimizer). A strategy
    defined outside this file registers on import (train/pipeline.py's, which the trainer imports)."""
    if layout.kind not in STRATEGIES:
        raise RuntimeError(f"no strategy class registered for {layout.kind!r} (import its module first)")
    return STRATEGIES[layout.kind](layout, cfg, log)


def evaluate(model: nn.Module, batches: list[torch.Tensor], device: torch.device, autocast,
             env: Optional[DistEnv] = None, pad: int = 0, pad_batch: Optional[torch.Tensor] = None,
             forward: Callable = lambda model, x: model(x)) -> float:
    """Mean token loss over all ranks' `batches`. `pad` extra forwards (results discarded) keep every rank at
    the same number of forwards, which sharded models (FSDP2, ZeRO-3) need: their forward is collective."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, token count)
    with torch.no_grad(), autocast():
        for i, batch in enumerate(batches + [pad_batch] * pad):
            batch = batch.to(device)
            logits = forward(model, batch[:, :-1])
            if i >= len(batches):
                continue
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            total[0] += loss.item()
            total[1] += batch[:, 1:].numel()
    if env is not None:
        env.sum_(total)
    model.train()
    return float(total[0] / total[1].clamp_min(1))


@register
class Strategy:
    """One process, or any torch strategy whose gradients are complete after backward (FSDP2 shards them; the
    clipping norm is then a DTensor made whole by `full_tensor`)."""

    name = "single"
    flat_optimizer_state = False  # optimizer state keyed by parameter name (a pipeline's stages differ)
    head_only_in_forward = False  # the head weight is whole only inside lm_head's forward (ZeRO-3): no chunked loss

    def __init__(self, layout: ParallelLayout, cfg, log: Callable[[str], None] = print):
        self.layout, self.cfg, self.log = layout, cfg, log
        self.model: Optional[nn.Module] = None  # what the forward pass calls (set by build_model)
        self.optimizer: Optional[torch.optim.Optimizer] = None  # whose param groups' "lr" the trainer sets
        self.accum = 1
        self.scaler: Optional[torch.amp.GradScaler] = None
        self.experts = None  # expert parallelism (train/expert_parallel.ExpertParallel) with --ep
        self.comm = None  # DDP: the counting (and --grad_compression) hook, train/grad_compression.CountingHook
        self.run_files: dict[str, str] = {}  # files the run dir gets beside config.yaml (name -> text)

    # ---- the model: built, memory savers, sharded
    def build_model(self, factory: Callable[[], nn.Module]) -> nn.Module:
        """`factory()` makes the full model (the same init on every rank: the caller seeds); this puts it on the
        device and parallelizes it. Meta-device initialisation replaces this build for sharded strategies."""
        model = factory().to(self.layout.device)
        self.model = self.parallelize(model)
        return self.model

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Memory savers (activation checkpointing, then compile: torchtitan's order), expert parallelism, then
        the strategy's own wrapping (`wrap`); returns the module to call."""
        cfg = self.cfg
        if cfg.act_ckpt or cfg.fsdp_save_mem:
            apply_act_ckpt(model)
        if cfg.compile and not cfg.fsdp_save_mem:
            apply_compile(model)
        if cfg.fsdp_save_mem and cfg.compile:
            self.log("note: --fsdp_save_mem turns --compile off (as ArchScale does)")
        if self.layout.ep > 1:  # split the experts before wrapping; DDP / FSDP2 then leave them alone
            from archscale.train.expert_parallel import ExpertParallel

            self.experts = ExpertParallel(self.layout.ep, self.layout.device, layout=self.layout)
            self.experts.shard(model)
        return self.wrap(model, frozenset(self.experts.params) if self.experts else frozenset())

    def wrap(self, model: nn.Module, ignored: frozenset) -> nn.Module:
        return model

    # ---- the optimizer
    def build_optimizer(self, groups: list[dict], spec: OptimizerSpec) -> None:
        from archscale.train.optim import build_adamw

        self.accum = spec.accum
        self.optimizer = build_adamw(groups, spec.lr, spec.betas, spec.eps)
        if self.cfg.precision == "fp16-mixed":  # starts at 2**16, halves on an overflow, doubles after a window
            self.scaler = torch.amp.GradScaler(self.layout.device.type, init_scale=2.0 ** 16, backoff_factor=0.5,
                                               growth_factor=2.0, growth_interval=self.cfg.fp16_scale_window)

    # ---- one step
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

    def clip_and_step(self, apply: bool = True, loss: Optional[torch.Tensor] = None) -> StepOutcome:
        """Clip to the global norm, then update unless `apply` is False or the loss or the norm is not finite."""
        opt, scaler = self.optimizer, self.scaler
        if scaler is not None:
            scaler.unscale_(opt)
        if self.experts is not None:  # --ep: finishes the expert gradients, clips by the global norm
            norm = self.experts.clip(self.model, CLIP_NORM)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP_NORM)
        grad_norm, loss_value = read_together(norm, loss)  # clipping itself needs no host value
        apply = apply and math.isfinite(loss_value)
        finite = math.isfinite(grad_norm)
        if scaler is not None:
            if apply:
                scaler.step(opt)  # skips the update itself when the unscaled gradients hold inf/nan
            scaler.update()  # lowers the scale after an overflow; must follow every unscale_
        elif apply and finite:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return StepOutcome(grad_norm, applied=apply and finite, overflow=scaler is not None and apply and not finite,
                           train_loss=loss_value if loss is not None else math.nan)

    def loss_scale(self) -> Optional[float]:
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    def state_dict_target(self) -> tuple[torch.nn.Module, Optional[torch.optim.Optimizer], Any]:
        """(module, optimizer, DeepSpeed engine) as `checkpoint.save_checkpoint`/`load_checkpoint` take them."""
        return self.model, self.optimizer, None

    def describe(self) -> str:
        return self.name

    def after_load(self, env: DistEnv) -> None:
        """Clean-up once a checkpoint was loaded into every rank."""

    def evaluate(self, batches: list[torch.Tensor], device: torch.device, autocast, env: DistEnv, pad: int = 0,
                 pad_batch: Optional[torch.Tensor] = None, forward: Callable = lambda model, x: model(x)) -> float:
        """The mean validation token loss over every rank's `batches` (see `evaluate`)."""
        return evaluate(self.model, batches, device, autocast, env, pad, pad_batch, forward=forward)


@register
class FSDPStrategy(Strategy):
    """FSDP2 over the layout's dp_shard ranks: every block its own unit, then the root."""

    name = "fsdp"

    def build_model(self, factory: Callable[..., nn.Module]) -> nn.Module:
        """Built on meta, sharded, then initialised shard by shard with the eager init's values (meta_init);
        with --ep the experts are distributed from a full model first, so that build stays eager."""
        from archscale.train import meta_init

        if not meta_init.applies(self.name, self.cfg.pp, self.cfg.ep):
            return super().build_model(factory)
        self.model = self.parallelize(factory(on_meta=True))
        meta_init.materialize(self.model, torch.device("cpu") if self._cpu_offload() else self.layout.device)
        self.log("meta-device init: built on meta, sharded, initialised shard by shard")
        return self.model

    def _cpu_offload(self) -> bool:
        # FSDP2's CPUOffloadPolicy needs an accelerator to offload from; on a CPU machine the shards already live
        # in host memory, so --fsdp_save_mem is activation checkpointing only there.
        return self.cfg.fsdp_save_mem and self.layout.device.type == "cuda"

    def wrap(self, model: nn.Module, ignored: frozenset) -> nn.Module:
        layout, cfg = self.layout, self.cfg
        cpu_offload = self._cpu_offload()
        if cfg.fsdp_save_mem and not cpu_offload:
            self.log("note: --fsdp_save_mem on CPU = activation checkpointing (FSDP2 CPU offload needs a GPU to "
                     "offload from)")
        apply_fsdp(model, bf16=cfg.precision == "bf16-mixed", cpu_offload=cpu_offload, ignored=ignored,
                   mesh=layout.submesh("dp_shard") if layout.ep == 1 else None)
        return model


@register
class DDPStrategy(Strategy):
    """DDP all-reduces gradients in backward; only the last micro-batch of a step needs to."""

    name = "ddp"

    def wrap(self, model: nn.Module, ignored: frozenset) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if ignored:
            ids = {id(p) for p in ignored}
            DDP._set_params_and_buffers_to_ignore_for_model(model, [n for n, p in model.named_parameters()
                                                                    if id(p) in ids])
        device = self.layout.device
        # gradients as views into DDP's all-reduce buckets: without it DDP keeps a second copy of every gradient
        # (4 B/param in fp32; measured in benchmarks/zero_stages.py)
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)

    def build_optimizer(self, groups: list[dict], spec: OptimizerSpec) -> None:
        from archscale.train.grad_compression import install, parse_grad_compression

        super().build_optimizer(groups, spec)
        self.comm = install(self.model, parse_grad_compression(self.cfg.grad_compression))

    def no_sync(self, micro: int):
        return self.model.no_sync() if micro < self.accum - 1 else nullcontext()

    def clip_and_step(self, apply: bool = True, loss: Optional[torch.Tensor] = None) -> StepOutcome:
        outcome = super().clip_and_step(apply, loss)
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


@register
class DeepSpeedStrategy(Strategy):
    """The engine does backward, accumulation (it divides the loss by the accumulation steps), clipping and the
    update; its optimizer is ours (same groups), so the trainer still sets the LR. Its config is written to the
    run dir as deepspeed_config.json."""

    name = "deepspeed"

    def __init__(self, layout: ParallelLayout, cfg, log: Callable[[str], None] = print):
        super().__init__(layout, cfg, log)
        self.engine = None
        self.zero_stage, self.offload = cfg.zero_stage, cfg.offload
        self.universal: Optional[Path] = None  # a resumed checkpoint converted for this world size (removed after)
        # ZeRO-0 in fp32 steps our optimizer directly and reports no gradient norm: measure it here, on the
        # all-reduced gradients, before the engine clips them
        self.plain_fp32 = cfg.zero_stage == 0 and cfg.precision == "fp32"
        self.head_only_in_forward = cfg.zero_stage == 3

    def wrap(self, model: nn.Module, ignored: frozenset) -> nn.Module:
        return model  # the engine wraps it in build_optimizer

    def build_optimizer(self, groups: list[dict], spec: OptimizerSpec) -> None:
        from archscale.train.deepspeed_engine import build_engine, ds_config

        cfg, layout = self.cfg, self.layout
        config = ds_config(micro_bsz=spec.micro_bsz, grad_accum=spec.accum, world_size=layout.world_size,
                           zero_stage=cfg.zero_stage, precision=cfg.precision, offload=cfg.offload,
                           cuda=layout.device.type == "cuda", fp16_scale_window=cfg.fp16_scale_window)
        self.universal = spec.universal_from() if spec.universal_from is not None else None
        if self.universal is not None:
            config["checkpoint"] = {"load_universal": True}
        self.engine = build_engine(self.model, groups, spec.lr, spec.betas, spec.eps, config)
        config.pop("checkpoint", None)
        self.model, self.optimizer, self.accum = self.engine, self.engine.optimizer, spec.accum
        self.run_files["deepspeed_config.json"] = json.dumps(config, indent=1)

    def backward(self, loss: torch.Tensor, micro: int) -> None:
        self.engine.backward(loss)
        if micro < self.accum - 1:
            self.engine.step()  # inside the accumulation window: counts the micro-batch, updates nothing

    def clip_and_step(self, apply: bool = True, loss: Optional[torch.Tensor] = None) -> StepOutcome:
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
        return StepOutcome(grad_norm, applied=applied, overflow=not applied and self.engine.fp16_enabled(),
                           train_loss=float(loss) if loss is not None else math.nan)

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
