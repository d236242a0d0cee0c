"""The parallel layout of a run, decided once from the world size and the flags: how many ranks replicate the
data-parallel state (DDP), shard it (FSDP2, ZeRO), cut the blocks into pipeline stages (`--pp`) and split the
experts (`--ep`), as one named `DeviceMesh` over (dp_replicate, dp_shard, pp, ep).

    rank = ((r * dp_shard + s) * pp + p) * ep + e          (row-major over the mesh: pp and ep innermost)
    data rank = (r * dp_shard + s) * ep + e,  data world = dp_replicate x dp_shard x ep

The ranks of one pipeline (same r, s, e; p = 0..pp-1) share their batches; the ranks of one expert group each read
their own (expert parallelism splits the experts, not the data: every rank is a data-parallel rank for the dense
weights). Which strategy class runs the step is `layout.kind` (train/strategy.STRATEGIES).

Every rule about which flags combine is `check_layout` below, with the reason each refusal exists; the dry run
calls it too, so a refused combination fails before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from archscale.errors import UserError

DIMS = ("dp_replicate", "dp_shard", "pp", "ep")
PP_SCHEDULES_TWO_STAGES = ("interleaved1f1b",)  # schedules that hold two stages per pipeline rank


def run_strategy(cfg) -> str:
    """The data-parallel strategy the flags ask for, before the world size is known (`auto` is resolved by
    distributed.resolve_strategy): --fsdp_save_mem means FSDP2; a pipeline's replicas default to DDP."""
    if cfg.strategy != "auto":
        return cfg.strategy
    if cfg.fsdp_save_mem:
        return "fsdp"
    return "ddp" if cfg.pp > 1 else "auto"


@dataclass
class ParallelLayout:
    """The mesh's shape, this rank's place in it, and (once `build_mesh` ran) the mesh itself."""

    strategy: str  # the data-parallel strategy: single | ddp | fsdp | deepspeed (distributed.resolve_strategy)
    world_size: int = 1
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: str = "1f1b"
    mesh: Optional[object] = None  # torch.distributed.device_mesh.DeviceMesh with mesh_dim_names == DIMS

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in DIMS)

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinate along every mesh dimension."""
        out, rest = {}, self.rank
        for name, size in reversed(list(zip(DIMS, self.shape))):
            out[name], rest = rest % size, rest // size
        return {d: out[d] for d in DIMS}

    @property
    def data_world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.ep

    @property
    def data_rank(self) -> int:
        c = self.coords
        return (c["dp_replicate"] * self.dp_shard + c["dp_shard"]) * self.ep + c["ep"]

    @property
    def kind(self) -> str:
        """The strategy class that runs this layout's step (train/strategy.STRATEGIES)."""
        return "pipeline" if self.pp > 1 else self.strategy

    @property
    def data_dim(self) -> str:
        """The mesh dimension the data-parallel strategy reduces over (the other data dimension has size 1)."""
        return "dp_shard" if self.strategy in ("fsdp", "deepspeed") else "dp_replicate"

    def build_mesh(self) -> Optional[object]:
        """The named DeviceMesh over every rank (None in a single process without a process group)."""
        if self.mesh is None and dist.is_available() and dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(self.device.type, self.shape, mesh_dim_names=DIMS)
        return self.mesh

    def group(self, dim: str):
        """The process group of this rank along `dim` (ranks differing only in that coordinate)."""
        return self.build_mesh().get_group(dim)

    def submesh(self, *dims: str):
        return self.build_mesh()[dims if len(dims) > 1 else dims[0]]

    def describe(self) -> str:
        return " x ".join(f"{d} {n}" for d, n in zip(DIMS, self.shape) if n > 1) or "one process"


def make_layout(cfg, strategy: str, world_size: int, rank: int = 0,
                device: torch.device = torch.device("cpu")) -> ParallelLayout:
    """The layout of `world_size` ranks running the resolved `strategy` with cfg's --pp / --ep. The data ranks
    (world / pp) replicate under DDP and single, shard under FSDP2 and DeepSpeed; --ep splits them further."""
    pp, ep = cfg.pp, cfg.ep
    data = max(1, world_size // (pp * ep))
    shard = strategy in ("fsdp", "deepspeed")
    return ParallelLayout(strategy=strategy, world_size=world_size, rank=rank, device=device,
                          dp_replicate=1 if shard else data, dp_shard=data if shard else 1, pp=pp, ep=ep,
                          pp_schedule=cfg.pp_schedule)


def data_world_of(cfg, world_size: int) -> int:
    """The data-parallel world of `world_size` ranks before the layout is checked (the ranks of one pipeline
    share their batches; a --pp that does not divide the world is refused by check_layout)."""
    return world_size // cfg.pp if world_size % cfg.pp == 0 else world_size


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule in PP_SCHEDULES_TWO_STAGES else 1


def _pipeline_refusals(cfg, strategy: str) -> list[tuple[str, bool, str]]:
    """(what, refused, why) for --pp: each a real limit of the pipeline as built here (docs/PIPELINE.md)."""
    return [
        ("--strategy deepspeed", strategy == "deepspeed",
         "DeepSpeed's engine owns backward and the optimizer step; a pipeline schedule runs backward itself"),
        ("--ep", cfg.ep > 1, "expert all-to-alls inside a stage would need the expert group and the pipeline group "
                             "to interleave their collectives alike on every rank, which the schedules do not"),
        ("--precision fp16-mixed", cfg.precision == "fp16-mixed",
         "the schedule's backward does not go through a GradScaler (use bf16-mixed)"),
        ("--fsdp_save_mem", cfg.fsdp_save_mem, "FSDP2's CPU offload under a pipeline schedule is untested here"),
        ("--grad_compression", (cfg.grad_compression or "none") != "none",
         "the replicas' gradients are averaged by one all-reduce of the shard, not by DDP's hooks"),
    ]


def check_layout(cfg, world_size: int, n_layer: int, microbatches: int) -> None:
    """Every rule on how --strategy, --pp and --ep combine with each other and with the rest, as one-line
    errors (the dry run calls this too)."""
    strategy = run_strategy(cfg)
    pp, ep = cfg.pp, cfg.ep
    if ep > 1:
        if world_size % ep:
            raise UserError(f"--ep {ep} must divide the number of processes ({world_size}); launch with torchrun "
                            f"--nproc_per_node a multiple of {ep}")
        if strategy not in ("ddp", "fsdp", "auto"):
            raise UserError(f"--ep {ep} composes with --strategy ddp or fsdp (got {strategy})")
    if pp == 1:
        if cfg.pp_layers:
            raise UserError("--pp_layers cuts a pipeline: add --pp N")
        return
    _check_pipeline(cfg, strategy, world_size, n_layer, microbatches)


def _check_pipeline(cfg, strategy: str, world_size: int, n_layer: int, microbatches: int) -> None:
    pp, sched = cfg.pp, cfg.pp_schedule
    stages = pp * stages_per_rank(sched)
    if world_size % pp:
        raise UserError(f"--pp {pp} must divide the number of processes ({world_size}); launch with torchrun "
                        f"--nproc_per_node a multiple of {pp}")
    if stages > n_layer:
        raise UserError(f"--pp {pp} ({sched}: {stages} stages) needs at least {stages} blocks; the model has "
                        f"{n_layer} (raise --depth or lower --pp)")
    for what, refused, why in _pipeline_refusals(cfg, strategy):
        if refused:
            raise UserError(f"--pp {pp} does not combine with {what}: {why}")
    if sched == "1f1b" and microbatches < pp:
        raise UserError(f"--pp_schedule 1f1b needs at least --pp {pp} micro-batches per step (this run has "
                        f"{microbatches}: lower --micro_bsz or raise --base_hps.b0)")
    if sched == "interleaved1f1b" and microbatches % max(1, microbatches // pp):
        raise UserError(f"--pp_schedule interleaved1f1b: {microbatches} micro-batches per step must be a multiple "
                        f"of {max(1, microbatches // pp)} (micro-batches // pp); change --micro_bsz or --base_hps.b0")
