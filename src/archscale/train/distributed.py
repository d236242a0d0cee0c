"""Processes: who am I (rank / world), which strategy, the process group, and the few collectives the trainer uses.

One command line runs everywhere:

    python pretrain.py ...                       one process (strategy auto -> single)
    archscale pretrain ...                       the same
    torchrun --nproc_per_node=M pretrain.py ...  M processes on this node (auto -> fsdp)
    torchrun --nnodes=N --nproc_per_node=M --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT pretrain.py ...

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR/PORT); we read them here. The backend is NCCL when
CUDA is available (one GPU per process: cuda:LOCAL_RANK), gloo otherwise. A distributed strategy in a single
process (e.g. `--strategy fsdp` to get CPU offload with `python pretrain.py`) gets a one-rank group backed by an
in-memory store, so the same code path runs.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from archscale.errors import UserError

STRATEGIES = ("auto", "single", "ddp", "fsdp", "deepspeed")


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "single"
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # we created the process group, so we destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def mean(self, value: torch.Tensor | float) -> float:
        """Average of a scalar over ranks (every rank gets it)."""
        return float(self.mean_tensor(value))

    def mean_tensor(self, value: torch.Tensor | float) -> torch.Tensor:
        """The same average, left on the device: no host sync (the step reads it with the gradient norm)."""
        t = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach().clone()
        if self.distributed and self.world_size > 1:
            dist.all_reduce(t)
            t /= self.world_size
        return t

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on some rank."""
        if not (self.distributed and self.world_size > 1):
            return bool(flag)
        t = torch.tensor(float(flag), device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.distributed and self.world_size > 1:
            dist.all_reduce(t)
        return t

    def broadcast(self, obj):
        """Rank 0's picklable `obj` on every rank."""
        if not (self.distributed and self.world_size > 1):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        """End of a run. On the normal path every rank meets in a barrier first: gloo's barrier waits for all
        earlier work, so no collective that DeepSpeed (ZeRO-3 prefetches) or FSDP launched asynchronously is
        still held by a gloo worker thread when the process exits. (Such a thread that needs the GIL after
        interpreter finalization is killed with pthread_exit, which aborts the process: "terminate called
        without an active exception".) Not on an error path: the other ranks may be gone."""
        if self.distributed and sys.exc_info()[0] is None:
            dist.barrier()
        if self.owns_group and self.distributed:
            dist.destroy_process_group()
            self.owns_group = False


def _destroy_at_exit() -> None:
    """Destroy a process group still alive at exit (e.g. created by the caller's script and never destroyed)
    while the interpreter is fully alive, instead of during its finalization (see DistEnv.close)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; never turn a clean exit into a crash
            pass


_EXIT_HOOK: list[bool] = []


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise UserError(f"--strategy {strategy!r} is unknown; choose one of {', '.join(STRATEGIES)}")


def resolve_strategy(strategy: str, world_size: int) -> str:
    check_strategy(strategy)
    if strategy == "auto":
        return "single" if world_size == 1 else "fsdp"
    if strategy == "single" and world_size > 1:
        raise UserError(f"--strategy single cannot run in {world_size} processes; use ddp, fsdp or deepspeed "
                        "(or launch one process)")
    return strategy


def setup(strategy: str) -> DistEnv:
    """Read the launcher's environment, pick the device and create the process group if one is needed."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    strategy = resolve_strategy(strategy, world)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if strategy == "deepspeed":
        if not cuda:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator talks gloo through torch
        for key, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", local_rank)):
            os.environ.setdefault(key, str(value))  # DeepSpeed insists on them even for `python pretrain.py`
    env = DistEnv(rank=rank, world_size=world, local_rank=local_rank, strategy=strategy, device=device)
    if strategy != "single" and not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if world > 1 or "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=world,
                                    device_id=device if cuda else None)  # env:// from torchrun
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        env.owns_group = True
    if strategy != "single" and not _EXIT_HOOK:
        atexit.register(_destroy_at_exit)
        _EXIT_HOOK.append(True)
    return env
