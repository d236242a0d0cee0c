"""Mixture-of-experts SwiGLU feed-forward (layer kind "moe"), usable in any architecture (`ModelConfig.ffn_kind`).

Follows ArchScale's MoE (github.com/microsoft/ArchScale, `lit_gpt/moe.py` at its HEAD):
- token-choice top-k routing with the softmax taken *after* the top-k (over the k chosen logits only, as
  ArchScale, Shazeer et al. 2017 and gpt-oss do): each token's gates sum to 1 whatever the number of experts;
- fine-grained experts: each expert is a SwiGLU of hidden `intermediate_size // (top_k + n_shared)`, so a token's
  active hidden width equals the dense SwiGLU's (4d) and an MoE model has the active parameters of its dense twin;
- `routing="softmax_then_topk"` (Jamba, Mixtral-style without renormalisation, Qwen-MoE's norm_topk_prob=False):
  the softmax over all E logits, then the k largest probabilities as gates, not renormalised (they sum to < 1);
- `fine_grained=False` (Jamba, Mixtral): each expert is as wide as the dense SwiGLU (`intermediate_size`);
- optional shared experts that every token uses (ArchScale's `share_expert` takes one of the k slots: its top_k=K
  with a shared expert is n_shared=1, top_k=K-1 here), added to the routed output with weight 1;
- router logits computed in fp32 and multiplied by `ModelConfig.logit_scale` (d0/L under mu-P, 1 under SP: the
  scale ArchScale applies to router logits under mu-P);
- the Switch/GShard load-balancing loss `aux_coef * E * sum_i f_i P_i` (f_i: fraction of the token->expert
  assignments that go to expert i, P_i: mean router probability of expert i over the tokens; ArchScale's
  "switch" style, gamma 1e-3) and the ST-MoE router z-loss `z_coef * mean_t logsumexp(logits_t)^2` (ArchScale only
  logs it: default 0). Both are statistics of this process's tokens and are appended to `ctx.aux_losses`.
- dropless: every token reaches its k experts (no capacity factor, so no token is ever dropped).

Expert parallelism (`train/expert_parallel.py`) calls `shard_experts`: this rank then holds experts
[rank * E/N, (rank + 1) * E/N) and exchanges tokens with all-to-all; the result is the single-process one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from archscale.config import ModelConfig
from archscale.errors import UserError
from archscale.models.mixers.base import (BIAS, MATRIX, OUTPUT, ForwardContext, MixerSpec, Role, SaveEnv, options_of,
                                         register)
from archscale.models.mixers.swiglu import SwiGLU

ROUTER_STD = 0.02  # ArchScale's Router.reset_parameters: N(0, 0.02) whatever the parametrization


@dataclass
class MoEOptions:
    n_experts: int = 8  # routed experts E
    top_k: int = 2  # routed experts per token k
    n_shared: int = 0  # shared experts every token uses
    expert_hidden: int = 0  # SwiGLU hidden of one expert; 0: intermediate_size // (top_k + n_shared)
    aux_coef: float = 1e-3  # load-balancing loss coefficient (ArchScale's aux_gamma)
    z_coef: float = 0.0  # router z-loss coefficient (ST-MoE uses 1e-3)
    routing: str = "topk_then_softmax"  # ArchScale's gates; "softmax_then_topk": Jamba's (see the module doc)
    fine_grained: bool = True  # expert hidden intermediate_size // (top_k + n_shared); False: intermediate_size


ROUTINGS = ("topk_then_softmax", "softmax_then_topk")


def moe_options(config: ModelConfig) -> MoEOptions:
    o = options_of(config, SPEC)
    if o.n_experts < 1 or not 1 <= o.top_k <= o.n_experts or o.n_shared < 0 or o.aux_coef < 0 or o.z_coef < 0:
        raise UserError(f"moe: need 1 <= top_k <= n_experts, n_shared >= 0 and coefficients >= 0 (got {o})")
    if o.routing not in ROUTINGS:
        raise UserError(f"moe: routing must be one of {', '.join(ROUTINGS)} (got {o.routing!r})")
    return o


def expert_hidden(config: ModelConfig, o: MoEOptions) -> int:
    dense = config.intermediate_size
    hidden = o.expert_hidden or (dense // (o.top_k + o.n_shared) if o.fine_grained else dense)
    if hidden < 1:
        raise UserError(f"moe: expert hidden width is {hidden}; lower top_k + n_shared or set expert_hidden")
    return hidden


class GroupedLinear(nn.Module):
    """E Linear layers without bias stacked in one weight (E, out, in); each expert keeps PyTorch's Linear init."""

    def __init__(self, n: int, in_features: int, out_features: int):
        super().__init__()
        self.in_features = in_features
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features))
        self.reset_parameters()  # on meta too (a no-op there): meta-device init replays its draws (train/meta_init.py)

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)) of nn.Linear, per expert
        nn.init.uniform_(self.weight, -bound, bound)


def swiglu_expert(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    gate, inp = (x @ w1.t()).chunk(2, dim=-1)
    return (F.silu(gate) * inp) @ w3.t()


def run_experts(x: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor,
                expert_of_segment: list[int]) -> torch.Tensor:
    """x holds consecutive segments of `counts[s]` rows, segment s for local expert `expert_of_segment[s]`. Empty
    segments run too (0-row matmuls): the autograd graph then has the same shape on every rank, which expert
    parallelism needs (each rank's backward must reach its all-to-alls even when it received no token)."""
    outs, start = [], 0
    for n, e in zip(counts, expert_of_segment):
        outs.append(swiglu_expert(x[start:start + n], w1[e], w3[e]))
        start += n
    return torch.cat(outs)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, kind: str):
        super().__init__()
        o = moe_options(config)
        self.n_experts, self.top_k = o.n_experts, o.top_k
        self.aux_coef, self.z_coef = o.aux_coef, o.z_coef
        self.routing = o.routing
        self.logit_scale = config.logit_scale
        hidden = expert_hidden(config, o)
        self.router = nn.Linear(config.n_embd, o.n_experts, bias=False)
        self.w1 = GroupedLinear(o.n_experts, config.n_embd, 2 * hidden)
        self.w3 = GroupedLinear(o.n_experts, hidden, config.n_embd)
        self.shared = SwiGLU(config.n_embd, o.n_shared * hidden, bias=config.bias) if o.n_shared else None
        self.ep_dispatch = None  # expert parallelism (train/expert_parallel.py): sends tokens to their experts' ranks
        self.n_local = o.n_experts  # experts held here

    def expert_parameters(self) -> list[nn.Parameter]:
        """The per-expert weights (what expert parallelism splits)."""
        return [self.w1.weight, self.w3.weight]

    def shard_experts(self, rank: int, size: int, dispatch, distribute) -> None:
        """Expert parallelism over `size` ranks: `distribute` turns each (E, ...) weight into a DTensor whose local
        shard holds experts [rank E/size, (rank+1) E/size); `dispatch(run, xs, counts, n_local)` exchanges tokens."""
        if self.n_experts % size:
            raise UserError(f"--ep {size} must divide the {self.n_experts} experts")
        self.w1.weight, self.w3.weight = distribute(self.w1.weight), distribute(self.w3.weight)
        self.ep_dispatch, self.n_local = dispatch, self.n_experts // size

    def reset_parameters(self) -> None:
        nn.init.normal_(self.router.weight, 0.0, ROUTER_STD)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits (N, E) fp32, chosen experts (N, k), gates (N, k) fp32: summing to 1 per token, or with
        "softmax_then_topk" the chosen experts' probabilities under the softmax over all E)."""
        with torch.autocast(flat.device.type, enabled=False):
            logits = (flat.float() @ self.router.weight.float().t()) * self.logit_scale
        if self.routing == "softmax_then_topk":
            gates, top_idx = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
            return logits, top_idx, gates
        top_logits, top_idx = logits.topk(self.top_k, dim=-1)
        return logits, top_idx, torch.softmax(top_logits, dim=-1)

    def aux_loss(self, logits: torch.Tensor, top_idx: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(top_idx.flatten(), minlength=self.n_experts).to(logits.dtype)
        f = counts / top_idx.numel()
        p = torch.softmax(logits, dim=-1).mean(dim=0)
        loss = self.aux_coef * self.n_experts * (f * p).sum()
        if self.z_coef:
            loss = loss + self.z_coef * torch.logsumexp(logits, dim=-1).square().mean()
        return loss

    def forward(self, x: torch.Tensor, ctx: Optional[ForwardContext] = None) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        logits, top_idx, gates = self.route(flat)
        if ctx is not None and (self.aux_coef or self.z_coef):
            ctx.aux_losses.append(self.aux_loss(logits, top_idx))
        order = top_idx.flatten().argsort(stable=True)  # assignments grouped by expert
        token_of = order // self.top_k
        counts = torch.bincount(top_idx.flatten(), minlength=self.n_experts)
        xs = flat[token_of]
        w1, w3 = self.w1.weight, self.w3.weight
        if self.ep_dispatch is None:
            ys = run_experts(xs, counts.tolist(), w1, w3, list(range(self.n_experts)))
        else:  # this rank's experts: the local shards of DTensors
            w1, w3 = w1.to_local(), w3.to_local()
            ys = self.ep_dispatch(lambda x, seg_counts, seg_experts: run_experts(x, seg_counts, w1, w3, seg_experts),
                                  xs, counts, self.n_local)
        ys = (ys.float() * gates.flatten()[order, None]).to(ys.dtype)
        out = ys.new_zeros(flat.shape[0], C).index_add_(0, token_of, ys)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.reshape(B, T, C)


def moe_init_std(config: ModelConfig, rel: str) -> Optional[float]:
    """mu-P: an expert weight keeps the Linear init U(+-1/sqrt(fan_in)) of its (E, out, in) slice."""
    if rel in ("w1.weight", "w3.weight"):
        fan_in = config.n_embd if rel == "w1.weight" else expert_hidden(config, moe_options(config))
        return 1.0 / math.sqrt(3 * fan_in)
    return None


def moe_active(config: ModelConfig, rel: str) -> float:
    """Fraction of a parameter each token uses: k of the E routed experts; router and shared experts all."""
    o = moe_options(config)
    return o.top_k / o.n_experts if rel in ("w1.weight", "w3.weight") else 1.0


def moe_flops(config: ModelConfig, kind: str, seq_len: int) -> dict[str, float]:
    # the router's matmul (its weight has its own init, so the generic matmul term does not count it)
    return {"moe_router": 2.0 * config.n_embd * moe_options(config).n_experts}


def moe_saved(config: ModelConfig, kind: str, env: SaveEnv) -> dict[str, float]:
    """Per token: the router's fp32 input and logits (d + E), the k gates; per routed assignment (k per token) the
    gathered input (fp32, and its cast for w1), each expert's SwiGLU like the dense one (d + 4 h in the activation
    dtype), its fp32 output for the gate product; the shared experts as a dense SwiGLU of n_shared h."""
    if env.act_ckpt:
        return {}
    o, a, d = moe_options(config), env.act_bytes, config.n_embd
    h = expert_hidden(config, o)
    routed = o.top_k * (4 * d + a * (d + 4 * h) + 4 * d + 4)
    shared = a * (d + 4 * o.n_shared * h) if o.n_shared else 0
    return {"router": 4 * (d + o.n_experts + o.top_k), "experts": routed, "shared_experts": shared}


SPEC = register(MixerSpec(
    name="moe",
    slot="ffn",
    kinds=("moe",),
    build=MoE,
    options=MoEOptions,
    # router: a hidden matrix for the optimizer (mu-P LR and weight decay of matrices), its own init N(0, 0.02);
    # experts: each slice a SwiGLU's w1 (MATRIX) and w3 (OUTPUT: writes into the residual stream)
    roles=(("router.weight", Role("matrix", "own")), ("w1.weight", MATRIX), ("w3.weight", OUTPUT),
           ("shared.w1.weight", MATRIX), ("shared.w3.weight", OUTPUT), ("*.bias", BIAS)),
    flops=moe_flops,
    description="top-k routed SwiGLU experts (+ optional shared experts), Switch load-balancing and z losses",
    tests=("tests/test_moe.py::test_routing_equals_a_per_token_loop",
           "tests/test_moe.py::test_aux_loss_equals_its_formula",
           "tests/test_external_hybrids.py::test_jamba_matches_transformers"),
    varlen="exact: per token",
    mup_init_std=moe_init_std,
    saved=moe_saved,
    active=moe_active,
))
