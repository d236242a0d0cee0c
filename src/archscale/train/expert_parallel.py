"""Expert parallelism (`--ep N`): each group of N consecutive ranks splits every mixture of experts' E experts
(rank i of a group holds experts [i E/N, (i+1) E/N)) and exchanges tokens with two all-to-alls per layer.

    world = R replicas x N expert ranks; rank = replica * N + i
    dense parameters: replicated on every rank, averaged by DDP or sharded by FSDP2 over all ranks (as without EP)
    expert parameters: DTensors on the (replica, ep) mesh, placements (Replicate, Shard(0)): one logical (E, ...)
        tensor per name, so torch.distributed.checkpoint saves and reshards them like any parameter (a
        checkpoint saved at --ep 2 loads at --ep 1 and back); DDP and FSDP2 ignore them

Forward (per MoE layer, `dispatch`): the tokens, already sorted by expert, go to the rank that holds their expert
(all_to_all_single of the per-expert counts, then of the tokens, autograd-aware), each rank runs its experts on
what it received, and a second all-to-all brings the outputs back. The result is the single-process MoE's: a
token's output depends only on that token (dropless routing). Backward runs the same exchanges in reverse, so an
expert's gradient on its rank sums the contributions of the N ranks' tokens; `ExpertParallel.clip` then sums it
over the R replicas and divides by the world size, which is the data-parallel mean the dense gradients get, and
clips every gradient by the global norm (dense and experts together), as without EP.

A module takes part by having `expert_parameters()` and `shard_experts(rank, size, dispatch, distribute)` methods
(the MoE feed-forward does).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from archscale.errors import UserError


class ExpertParallel:
    """The process groups of `--ep N` and the expert parameters they own."""

    def __init__(self, ep: int, device: torch.device, layout=None):
        """`layout`: the run's ParallelLayout, whose (data dimension, ep) sub-mesh holds the experts; without it
        (a test harness) a (replica, ep) mesh of its own."""
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        self.size, self.world = ep, world
        if layout is not None:
            self.mesh = layout.submesh(layout.data_dim, "ep")
        else:
            self.mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("replica", "ep"))
        # Groups of our own for the token exchange and the expert-gradient sums: the mesh may hand out the world
        # group, on which DDP / FSDP2 run their gradient collectives during the same backward, in an order that
        # need not interleave alike on every rank (gloo needs one order per group)
        me = dist.get_rank()
        for g in range(world // ep):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(g * ep, (g + 1) * ep)))
            if me // ep == g:
                self.group = group
        for i in range(ep):
            group = dist.new_group(list(range(i, world, ep)))
            if me % ep == i:
                self.replica_group = group
        self.rank = me % ep
        self.params: list[nn.Parameter] = []

    def shard(self, model: nn.Module) -> list[str]:
        """Turn every expert-holding module's experts into (Replicate, Shard(0)) DTensors; returns their names."""
        for module in model.modules():
            if hasattr(module, "shard_experts"):
                module.shard_experts(self.rank, self.size, self.dispatch, self.distribute)
        self.params = expert_params(model)
        if not self.params:
            raise UserError(f"--ep {self.size}: the model has no experts (add --moe E:k)")
        ids = {id(p) for p in self.params}
        return [n for n, p in model.named_parameters() if id(p) in ids]

    def distribute(self, full: torch.Tensor) -> nn.Parameter:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        return nn.Parameter(distribute_tensor(full.detach(), self.mesh, [Replicate(), Shard(0)]))

    def dispatch(self, run: Callable, xs: torch.Tensor, counts: torch.Tensor, n_local: int) -> torch.Tensor:
        """xs (tokens sorted by expert, counts[e] each) -> their experts' outputs in the same order. `run(x,
        segment_counts, local_expert_of_segment)` applies this rank's experts."""
        N = self.size
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # chunk j: counts for rank j's experts
        send = counts.view(N, n_local).sum(1).tolist()
        recv = recv_counts.view(N, n_local).sum(1).tolist()
        got = all_to_all_single(xs.new_empty(sum(recv), xs.shape[1]), xs, recv, send, group=self.group)
        ys = run(got, recv_counts.tolist(), [e for _ in range(N) for e in range(n_local)])
        return all_to_all_single(ys.new_empty(sum(send), ys.shape[1]), ys.contiguous(), send, recv,
                                 group=self.group)

    def local_grads(self) -> list[torch.Tensor]:
        """Each expert parameter's local gradient (zeros where this rank's experts got no token)."""
        out = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad.to_local())
        return out

    @torch.no_grad()
    def clip(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Finish the expert gradients (sum over replicas, / world size), then clip every gradient to the global
        norm `max_norm`; returns that norm (before clipping)."""
        grads = self.local_grads()
        flat = torch.cat([g.flatten() for g in grads])
        if self.world // self.size > 1:
            dist.all_reduce(flat, group=self.replica_group)
        flat /= self.world
        for g, f in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(f.view_as(g))
        experts_sq = flat.double().square().sum()
        dist.all_reduce(experts_sq, group=self.group)  # the N ranks hold disjoint experts
        ids = {id(p) for p in self.params}
        dense = [p.grad for p in model.parameters() if id(p) not in ids and p.grad is not None]
        dense_norm = torch.nn.utils.get_total_norm(dense) if dense else torch.zeros(())
        if hasattr(dense_norm, "full_tensor"):
            dense_norm = dense_norm.full_tensor()
        total = torch.sqrt(dense_norm.double().square() + experts_sq)
        coef = min(1.0, max_norm / (float(total) + 1e-6))
        if coef < 1.0 and math.isfinite(float(total)):
            for g in dense + grads:
                g.mul_(coef)
        return total.float()


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """Every expert weight of the model (empty for a dense model)."""
    return [p for m in model.modules() if hasattr(m, "expert_parameters") for p in m.expert_parameters()]


def expert_param_groups(groups: list[dict], experts: list[nn.Parameter]) -> list[dict]:
    """The optimizer groups with the expert weights moved to groups of their own (same rules): a fused AdamW
    step cannot mix DTensors of two meshes, or DTensors and plain tensors, in one group. Done with and without
    --ep, so that optimizer checkpoints have the same groups whatever the expert parallelism."""
    ids = {id(p) for p in experts}
    out = []
    for g in groups:
        mine = [p for p in g["params"] if id(p) in ids]
        rest = [p for p in g["params"] if id(p) not in ids]
        if rest:
            out.append({**g, "params": rest})
        if mine:
            out.append({**g, "name": g["name"] + "_experts", "params": mine})
    return out
