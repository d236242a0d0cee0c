"""Run under torchrun (gloo, 2+ ranks): a tiny MoE GPT with --ep N against the single-process model. Rank r feeds
its own batch; the reference model (same init, all experts, every rank) feeds every rank's batch and sums the
losses. Checks, fp32, atol 1e-5: logits; dense gradients summed over ranks; each rank's expert-gradient shard.
Writes {"ok": true, "max_diff": ...} to argv[1] on rank 0."""

import copy
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from archscale import GPT, ModelConfig
from archscale.train.expert_parallel import ExpertParallel

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
ep = int(sys.argv[2])
torch.manual_seed(0)
cfg = ModelConfig.from_arch(sys.argv[3], 4, ar=16, vocab_size=97, block_size=32, sliding_window=16, ffn_kind="moe",
                            mixer_options={"moe": dict(n_experts=4, top_k=2, n_shared=1, z_coef=1e-3)})
model = GPT(cfg)
ref = copy.deepcopy(model)
plan = ExpertParallel(ep, torch.device("cpu"))
names = plan.shard(model)
batches = [torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]


def loss_of(m, batch):
    logits = m(batch[:, :-1])
    return logits, F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()) + m.aux_loss


logits, loss = loss_of(model, batches[rank])
loss.backward()
total = 0
for r, batch in enumerate(batches):
    ref_logits, ref_loss = loss_of(ref, batch)
    total = total + ref_loss
    if r == rank:
        want_logits = ref_logits.detach()
total.backward()
diffs = {"logits": (logits - want_logits).abs().max().item()}
ids = {id(p) for p in plan.params}
lo = plan.rank * (4 // ep)
for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
    if id(p) in ids:  # this rank's experts: sum over the replicas (the EP group already summed its ranks)
        g = p.grad.to_local().clone()
        if world // ep > 1:
            dist.all_reduce(g, group=plan.replica_group)
        want = q.grad[lo:lo + g.shape[0]]
    else:
        g = p.grad.clone()
        dist.all_reduce(g)
        want = q.grad
    diffs[name] = (g - want).abs().max().item()
    assert want.abs().max() > 0, name  # every compared gradient is alive
worst = max(diffs.values())
assert worst < 1e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
assert len(names) == 2 * cfg.n_layer and all(model.get_parameter(n).to_local().shape[0] == 4 // ep for n in names)
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"ok": True, "max_diff": worst}, f)
dist.destroy_process_group()
