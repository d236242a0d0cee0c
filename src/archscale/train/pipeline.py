"""Pipeline parallelism (`--pp N`): the blocks cut into stages at block boundaries, one stage per rank of a
pipeline group (two with the interleaved schedule), run by a `torch.distributed.pipelining` schedule.

    world = D data-parallel replicas x N pipeline ranks; rank = replica * N + pipeline rank (a (dp, pp) mesh)
    stage s holds blocks [a_s, b_s) under their own names (`blocks.3....`); stage 0 also holds the embedding,
        the last stage the final norm and lm_head; checkpoints keep the model's FQNs, so they reshard to --pp 1
    one optimizer step = one schedule step over the step's micro-batches (the gradient-accumulation steps become
        the pipeline's micro-batches: the same samples, the same per-micro-batch mean loss, scaled by 1 / count)

What crosses a boundary is the residual stream plus what the blocks before it left in the `ForwardContext` for
later blocks: a hybrid's YOCO key/values (SambaY's cross-decoder reuses the KV layer's cache), its GMU memory (an
earlier layer's SSM output), a mixture of experts' auxiliary losses. Which fields those are is found once, without
naming any mixer: a probe forward of the full model (2 tokens) records every context field that is new or grown
at each boundary, and that list of tensors travels with the activations (autograd-aware, both directions).

Gradients: data-parallel replicas average theirs (one all-reduce over the dp group), and clipping uses the global
norm (squared norms summed over the pipeline group). The logged loss is the last stage's, broadcast to its group.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from archscale.config import ModelConfig
from archscale.errors import UserError
from archscale.models.mixers import ForwardContext
from archscale.models.model import GPT, output_head
from archscale.train.parallel_layout import ParallelLayout, stages_per_rank
from archscale.train.parallelize import apply_act_ckpt, apply_compile, apply_fsdp
from archscale.train.strategy import CLIP_NORM, OptimizerSpec, Strategy, StepOutcome, read_together, register



def stage_layers(n_layer: int, n_stages: int, spec: Optional[str] = None) -> list[range]:
    """The blocks of every stage: `spec` "6,2" gives per-stage block counts; default as even as possible (the
    earlier stages take the remainder)."""
    if spec:
        try:
            counts = [int(c) for c in str(spec).split(",")]
        except ValueError:
            counts = []
        if len(counts) != n_stages or min(counts, default=0) < 1 or sum(counts) != n_layer:
            raise UserError(f"--pp_layers {spec!r}: give {n_stages} block counts >= 1 that sum to the model's "
                            f"{n_layer} blocks, e.g. --pp_layers {','.join(map(str, _even(n_layer, n_stages)))}")
    else:
        counts = _even(n_layer, n_stages)
    starts = [sum(counts[:s]) for s in range(n_stages)]
    return [range(a, a + c) for a, c in zip(starts, counts)]


def _even(n: int, k: int) -> list[int]:
    return [n // k + (1 if s < n % k else 0) for s in range(k)]


def pipeline_section(cfg, n_layer: int, microbatches: int) -> dict:
    """The dry run's {"pipeline": ...} section ({} without --pp)."""
    return {"pipeline": pipeline_summary(cfg, n_layer, microbatches)} if cfg.pp > 1 else {}


def pipeline_summary(cfg, n_layer: int, microbatches: int) -> dict:
    """The dry run's view: which blocks on which stage, which stage on which pipeline rank, the schedule."""
    stages = cfg.pp * stages_per_rank(cfg.pp_schedule)
    cut = stage_layers(n_layer, stages, cfg.pp_layers)
    return {"pp": cfg.pp, "schedule": cfg.pp_schedule, "microbatches": microbatches,
            "stages": [{"stage": s, "pp_rank": s % cfg.pp, "blocks": list(r),
                        "also": (["wte"] if s == 0 else []) + (["ln_f", "lm_head"] if s == stages - 1 else [])}
                       for s, r in enumerate(cut)]}


# ------------------------------------------------------------------------------------- what crosses a boundary
def _tensors(value) -> Optional[tuple[str, int]]:
    """(kind, count) when `value` can travel between stages: a tensor, or a tuple/list of tensors."""
    if isinstance(value, torch.Tensor):
        return "tensor", 1
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return type(value).__name__, len(value)
    return None


@torch.no_grad()
def carried_layout(model: GPT, boundaries: Iterable[int]) -> dict[int, tuple]:
    """boundary b (the first block of a stage) -> ((field, kind, count), ...): the context fields that blocks
    before b set (or grew) and that therefore travel to b. Found by a 2-token forward of the full model."""
    boundaries = sorted(set(boundaries))
    entry: dict[str, tuple] = {}
    found: dict[int, tuple] = {}

    def on_entry(module, args):
        ctx = args[1]
        entry.update({f.name: (getattr(ctx, f.name), _size(getattr(ctx, f.name)))
                      for f in dataclasses.fields(ctx)})

    def on_exit(module, args, output):
        ctx, layout = args[1], []
        for f in dataclasses.fields(ctx):
            value = getattr(ctx, f.name)
            before, size = entry[f.name]
            if value is before and _size(value) == size:
                continue  # untouched since the first block: the stage rebuilds it from its own inputs
            kind = _tensors(value)
            if kind is None:
                if value is None or (isinstance(value, (dict, list)) and not value):
                    continue
                raise UserError(f"--pp: block {module.layer_idx} leaves {f.name!r} of type {type(value).__name__} in "
                                "the forward context for later blocks; only tensors can cross a pipeline stage")
            layout.append((f.name, *kind))
        found[module.layer_idx + 1] = tuple(layout)

    hooks = [model.blocks[0].register_forward_pre_hook(on_entry)]
    hooks += [model.blocks[b - 1].register_forward_hook(on_exit) for b in boundaries]
    device = next(model.parameters()).device
    try:
        model(torch.zeros(1, min(2, model.config.block_size), dtype=torch.long, device=device))
    finally:
        for h in hooks:
            h.remove()
        model.aux_loss = None
    return found


def _size(value) -> int:
    return len(value) if isinstance(value, (list, dict)) else -1


def pack(ctx: ForwardContext, layout: tuple) -> list[torch.Tensor]:
    out = []
    for name, kind, _ in layout:
        value = getattr(ctx, name)
        out.extend([value] if kind == "tensor" else value)
    return [t.contiguous() for t in out]  # sent as laid out; gloo receives into contiguous buffers only


def unpack(ctx: ForwardContext, layout: tuple, tensors: tuple) -> None:
    i = 0
    for name, kind, n in layout:
        part = tensors[i:i + n]
        setattr(ctx, name, part[0] if kind == "tensor" else (tuple(part) if kind == "tuple" else list(part)))
        i += n
    if i != len(tensors):
        raise RuntimeError(f"pipeline stage received {len(tensors)} context tensors, expected {i}")


# ------------------------------------------------------------------------------------------------ the stages
class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is made contiguous: a received tensor's gradient goes back to the previous stage,
    and gloo sends and receives contiguous buffers only (a key's gradient may come out transposed)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class StageModule(nn.Module):
    """Some of the model's modules under their model names (wte, blocks.<i>, ln_f, lm_head). As a stage it
    runs its blocks with GPT's own forward pieces (`GPT.embed`, `GPT.context`, `GPT.run_blocks`, `output_head`):
    ids -> (x, *context) on the first stage, (x, *context) -> (x, *context) in between, and -> (logits or scaled
    hidden state, [aux loss]) on the last. Every stage gets the documents (`doc_ids`, `position_ids`: --varlen)
    as keyword inputs of the schedule. As a rank's shard (all its stages' modules) it is what the optimizer and
    the checkpoints see."""

    # the model's own code, run on this stage's modules (each needs only the attributes the stage has)
    embed, context, rope, run_blocks = GPT.embed, GPT.context, GPT.rope, staticmethod(GPT.run_blocks)

    def __init__(self, config: ModelConfig, blocks: dict[int, nn.Module], wte=None, ln_f=None, lm_head=None,
                 carry_in: tuple = (), carry_out: tuple = (), return_hidden: bool = False):
        super().__init__()
        self.config = config
        if wte is not None:
            self.wte = wte
        self.blocks = nn.ModuleDict({str(i): b for i, b in sorted(blocks.items())})
        if lm_head is not None:
            self.ln_f, self.lm_head = ln_f, lm_head
        self.carry_in, self.carry_out = carry_in, carry_out
        self.return_hidden = return_hidden  # the last stage: hidden state for a chunked loss (else logits)
        self.autocast: Callable = nullcontext
        self._rope = None

    @property
    def is_first(self) -> bool:
        return hasattr(self, "wte")

    @property
    def is_last(self) -> bool:
        return hasattr(self, "lm_head")

    def forward(self, *inputs: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None):
        with self.autocast():
            if self.is_first:
                x, rest = self.embed(inputs[0]), ()
            else:
                x, *rest = (_ContiguousGrad.apply(t) if t.requires_grad else t for t in inputs)
            ctx = self.context(x.shape[1], x.device, doc_ids=doc_ids, position_ids=position_ids)
            unpack(ctx, self.carry_in, rest)
            x = self.run_blocks(x, ctx, ((int(i), b) for i, b in self.blocks.items()))
            if not self.is_last:
                return (x.contiguous(), *pack(ctx, self.carry_out))
            out = output_head(self.config, self.ln_f, self.lm_head, x, return_hidden=self.return_hidden)
            out = out[0] if self.return_hidden else out
            return (out, sum(ctx.aux_losses)) if ctx.aux_losses else (out,)


@dataclasses.dataclass
class Pipeline:
    """This rank's part of the pipeline: its stage modules, the shard holding them, the groups."""

    shard: StageModule  # every module of this rank's stages (the optimizer's and the checkpoints' view)
    stages: list[StageModule]
    stage_ids: list[int]
    n_stages: int
    pp: int
    dp: int  # replicas that average their gradients here (dp_replicate; FSDP2 reduces over dp_shard itself)
    pp_rank: int
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    cut: list[range]
    tie_group: Optional[dist.ProcessGroup] = None  # tied embeddings: this pipeline's first and last stage ranks

    @property
    def has_first(self) -> bool:
        return self.stage_ids[0] == 0

    @property
    def has_last(self) -> bool:
        return self.stage_ids[-1] == self.n_stages - 1


def build_pipeline(model: GPT, layout: ParallelLayout, pp_layers: Optional[str], return_hidden: bool) -> Pipeline:
    """Cut the full `model` (built identically on every rank) into stages and keep this rank's. The caller
    drops `model` afterwards, which frees the other stages' blocks."""
    pp, pp_rank = layout.pp, layout.coords["pp"]
    n_stages = pp * stages_per_rank(layout.pp_schedule)
    cut = stage_layers(model.config.n_layer, n_stages, pp_layers)
    ids = list(range(pp_rank, n_stages, pp))  # interleaved: stages r, r + pp (torch's looped assignment)
    stages, shard = make_stages(model, cut, ids, return_hidden)
    tie = _tie_group(layout, ids[0] == 0 or ids[-1] == n_stages - 1) if model.config.tie_embeddings else None
    return Pipeline(shard=shard, stages=stages, stage_ids=ids, n_stages=n_stages, pp=pp, dp=layout.dp_replicate,
                    pp_rank=pp_rank, pp_group=layout.group("pp"), dp_group=layout.group("dp_replicate"), cut=cut,
                    tie_group=tie)


def _tie_group(layout: ParallelLayout, holds_an_end: bool) -> Optional[dist.ProcessGroup]:
    """The group of this pipeline's first and last stage ranks (pipeline ranks 0 and pp-1; interleaved: the
    same two), which hold the one tied embedding / head weight: every rank creates every pipeline's group."""
    mine = None
    for pipeline in layout.build_mesh().mesh.reshape(-1, layout.pp).tolist():  # one row per pipeline
        group = dist.new_group([pipeline[0], pipeline[-1]])
        if layout.rank in pipeline and holds_an_end:
            mine = group
    return mine


def make_stages(model: GPT, cut: list[range], ids: list[int],
                return_hidden: bool = False) -> tuple[list[StageModule], StageModule]:
    """The stage modules `ids` of the cut `cut` of `model` (sharing its modules), and their shard."""
    n_stages = len(cut)
    layout = carried_layout(model, [r.start for r in cut[1:]])
    stages = []
    for s in ids:
        first, last = s == 0, s == n_stages - 1
        stages.append(StageModule(model.config, {i: model.blocks[i] for i in cut[s]},
                                  wte=model.wte if first else None, ln_f=model.ln_f if last else None,
                                  lm_head=model.lm_head if last else None,
                                  carry_in=() if first else layout[cut[s].start],
                                  carry_out=() if last else layout[cut[s].stop], return_hidden=return_hidden))
    has_first, has_last = ids[0] == 0, ids[-1] == n_stages - 1
    shard = StageModule(model.config, {i: model.blocks[i] for s in ids for i in cut[s]},
                        wte=model.wte if has_first else None, ln_f=model.ln_f if has_last else None,
                        lm_head=model.lm_head if has_last else None)
    return stages, shard


def make_schedule(pipe: Pipeline, name: str, n_microbatches: int, loss_fn: Callable, device: torch.device):
    """A fresh set of PipelineStage objects over the pipe's stage modules and the schedule `name` running them."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleLoopedBFS)

    stages = [PipelineStage(m, s, pipe.n_stages, device, group=pipe.pp_group)
              for m, s in zip(pipe.stages, pipe.stage_ids)]
    if len(stages) > 1:
        cls = ScheduleInterleaved1F1B if name == "interleaved1f1b" else ScheduleLoopedBFS
        return cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=True)
    cls = Schedule1F1B if name == "1f1b" else ScheduleGPipe
    return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=True)


def _as_tuple(output) -> tuple:
    """The last stage's output as it returned it: a schedule may hand a 1-tuple to the loss unwrapped."""
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)


@register
class PipelineStrategy(Strategy):
    """`--pp N`: this rank runs its stages under the schedule; the step's micro-batches are the pipeline's."""

    name = "pipeline"
    flat_optimizer_state = True  # optimizer state keyed by parameter name: stages hold different parameters

    def __init__(self, layout: ParallelLayout, cfg, log: Callable[[str], None] = print):
        super().__init__(layout, cfg, log)
        self.schedule_name, self.device = cfg.pp_schedule, layout.device
        self.pipe: Optional[Pipeline] = None
        self.sharded = layout.strategy == "fsdp"  # pp x dp_shard: FSDP2 shards every stage over dp_shard
        # the chunked loss reads the head weight outside its forward, where FSDP2 holds only a shard of it
        self.head_only_in_forward = self.sharded
        self._schedules: dict[tuple[bool, int], object] = {}
        self._lm: Callable = lambda out, target: None
        self._lm_of: dict[int, torch.Tensor] = {}

    def build_model(self, factory: Callable[[], nn.Module]) -> nn.Module:
        """Memory savers on the full model, then this rank's stages (FQNs unchanged)."""
        from archscale.kernels.cross_entropy import select_loss

        model = factory().to(self.layout.device)
        if self.cfg.act_ckpt:
            apply_act_ckpt(model)
        if self.cfg.compile:
            apply_compile(model)
        wants_hidden = select_loss(self.cfg.loss, model.config.vocab_size, zero3=self.head_only_in_forward).wants_hidden
        self.pipe = build_pipeline(model, self.layout, self.cfg.pp_layers, return_hidden=wants_hidden)
        if self.sharded:  # FSDP2 over dp_shard: each stage is a root (torch's PipelineStage drives its reduce)
            mesh = self.layout.submesh("dp_shard")
            for stage in self.pipe.stages:
                apply_fsdp(stage, bf16=self.cfg.precision == "bf16-mixed", cpu_offload=False, mesh=mesh)
        self.model = self.pipe.shard
        return self.model

    def schedule(self, train: bool, seq_len: int):
        """The training (or validation) schedule for sequences of `seq_len`: a pipeline fixes its activation
        shapes at its first step, so each length (--curriculum) gets schedules of its own."""
        key = (train, seq_len)
        if key not in self._schedules:
            self._schedules[key] = (make_schedule(self.pipe, self.schedule_name, self.accum, self._train_loss,
                                                  self.device) if train else
                                    make_schedule(self.pipe, "gpipe", 1, self._eval_loss, self.device))
        return self._schedules[key]

    # the last stage's loss functions; they record the language-model loss for logging
    def _train_loss(self, output: tuple, target: torch.Tensor) -> torch.Tensor:
        output = _as_tuple(output)
        out, aux = output[0], (output[1] if len(output) > 1 else None)
        lm = self._lm((out, self.pipe.shard.lm_head.weight) if self.pipe.stages[-1].return_hidden else out, target)
        loss = lm if aux is None else lm + aux
        self._lm_of[id(loss)] = lm.detach()
        return loss

    def _eval_loss(self, output: tuple, target: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(_as_tuple(output)[0].float().flatten(0, 1), target.flatten(), reduction="sum")
        self._lm_of[id(loss)] = loss
        return loss

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor, autocast, train: bool,
             forward: Optional[Callable] = None) -> torch.Tensor:
        """One schedule pass; the sum of the last stage's recorded losses on every rank of the pipeline group.
        Every stage gets the forward's keyword inputs (the documents of --varlen), split like the batch."""
        schedule = self.schedule(train, inputs.shape[1])
        kwargs = forward.model_kwargs(inputs) if hasattr(forward, "model_kwargs") else {}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        for stage in self.pipe.stages:
            stage.autocast = autocast
        # the schedule's own list of micro-batch losses (its first step also computes a loss to infer shapes)
        # -> the language-model part of each, recorded by the loss function
        self._lm_of, losses = {}, []
        args = (inputs,) if self.pipe.has_first else ()
        target = targets if self.pipe.has_last else None
        if train:
            schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        else:
            schedule.eval(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        lm = [self._lm_of[id(loss)] for loss in losses]
        self._lm_of = {}
        total = (torch.stack(lm).sum() if lm else torch.zeros(())).double().to(self.device)
        dist.broadcast(total, group=self.pipe.pp_group, group_src=self.pipe.pp - 1)
        return total

    def run_micro_batches(self, batches, forward, loss_fn, label_smoothing: float, autocast) -> torch.Tensor:
        inputs, targets = zip(*batches)
        self._lm = lambda out, target: loss_fn(out, target, label_smoothing)
        return self._run(torch.cat(inputs), torch.cat(targets), autocast, train=True, forward=forward)

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor], device: torch.device, autocast, env, pad: int = 0,
                 pad_batch=None, forward=None) -> float:
        """The mean validation token loss, as strategy.evaluate computes it (every rank gets it). `pad` extra
        passes (results dropped) keep every pipeline at the same count, which FSDP2's collective forwards need."""
        last = self.pipe.stages[-1]
        hidden, last.return_hidden = last.return_hidden, False
        self.pipe.shard.eval()
        total = torch.zeros(2, dtype=torch.float64, device=device)
        try:
            for i, batch in enumerate(batches + [pad_batch] * pad):
                batch = batch.to(device)
                loss = self._run(batch[:, :-1], batch[:, 1:], autocast, train=False, forward=forward)
                if self.pipe.has_last and i < len(batches):  # once per pipeline: the world sum then counts every replica once
                    total[0] += loss.item()
                    total[1] += batch[:, 1:].numel()
        finally:
            last.return_hidden = hidden
            self.pipe.shard.train()
        env.sum_(total)
        return float(total[0] / total[1].clamp_min(1))

    def _tied(self) -> Optional[nn.Parameter]:
        """This rank's copy of the tied embedding / head weight (first stage: wte, last: lm_head), or None."""
        pipe = self.pipe
        if pipe.tie_group is None:
            return None
        return pipe.shard.wte.weight if pipe.has_first else pipe.shard.lm_head.weight

    @torch.no_grad()
    def clip_and_step(self, apply: bool = True, loss: Optional[torch.Tensor] = None) -> StepOutcome:
        pipe, opt = self.pipe, self.optimizer
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [_local(p.grad) for p in params]  # under FSDP2 each rank's shard of every gradient
        if pipe.dp > 1 and grads:  # data-parallel mean, one all-reduce for the whole shard
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat, group=pipe.dp_group)
            flat /= pipe.dp
            for g, f in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(f.view_as(g))
        tied = self._tied()
        if tied is not None and tied.grad is not None:
            # the embedding's and the head's gradient summed on both ends: the same update keeps them equal
            dist.all_reduce(_local(tied.grad), group=pipe.tie_group)
        counted = [g for p, g in zip(params, grads) if not (p is tied and pipe.has_last)]  # the tied weight once
        local = torch.nn.utils.get_total_norm(counted) if counted else torch.zeros((), device=self.device)
        squared = local.double().square()
        dist.all_reduce(squared, group=pipe.pp_group)  # the stages hold disjoint parameters
        if self.sharded:
            dist.all_reduce(squared, group=self.layout.group("dp_shard"))  # and the shards disjoint pieces
        total = squared.sqrt().float()
        grad_norm, loss_value = read_together(total, loss)  # the step's one host sync
        apply = apply and math.isfinite(loss_value)
        finite = math.isfinite(grad_norm)
        if apply and finite:
            if grads:  # clip_grads_with_norm_'s own arithmetic, on the local shards
                coef = torch.clamp(CLIP_NORM / (total + 1e-6), max=1.0)
                torch._foreach_mul_(grads, coef.to(grads[0].device))
            opt.step()
        opt.zero_grad(set_to_none=True)
        return StepOutcome(grad_norm, applied=apply and finite, train_loss=loss_value if loss is not None else math.nan)

    def describe(self) -> str:
        p = self.pipe
        data = self.layout.data_world
        return (f"pipeline {p.pp} ranks x {p.n_stages // p.pp} stage(s), {self.schedule_name}"
                + (f", data parallel {data}" if data > 1 and not self.sharded else "")
                + (f", FSDP2 over {data}" if self.sharded else "") + (", tied embeddings" if p.tie_group else ""))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor is its own)."""
    return t.to_local() if hasattr(t, "to_local") else t
