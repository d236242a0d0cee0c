"""Base hyperparameters and the rules that turn them into a concrete run plan.

`BaseHyperparameters` holds ArchScale's `BaseHyperparameters` fields and defaults (its `pretrain.py`);
`--base_hps.<field>` overrides them. `resolve_batch_and_lr` and `default_tokens` are the parametrization-independent
transfer rules:
the batch is b0 rounded down to a multiple of one optimizer micro-round, the LR scales with sqrt(b/b0), and
the token budget defaults to t0 * N(d) / N(d0). `resolve_parametrization` is the one place where SP, mu-P and
mu-P++ differ: a global LR factor, a rule per parameter group (matrix-like / vector-like, as each mixer declares its
parameters' roles in `archscale.models.mixers`), and the model's forward multipliers and init scheme.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from archscale.config import n_mult
from archscale.errors import UserError


@dataclass
class BaseHyperparameters:
    d0: int = 16  # base depth (d16 ~ 1B)
    eta0: float = 4e-4  # base learning rate
    b0: int = 2**21  # base batch, tokens
    t0: float = 1e11  # base tokens at depth d0
    hd0: int = 128  # base head dim (attention scale under mu-P)
    w_init0: float = 1.0  # Linear init multiplier
    n0_mult: float = 237_568.0  # n0 = n0_mult * d0^3 (= 14.5 * 128^2, the Transformer's law)
    weight_decay0: float = 0.1
    eps0: float = 1e-8
    min_lr0: float = 0.0  # absolute minimum LR
    warmup_tokens0: float = 1e9
    beta1_0: float = 0.9
    beta2_0: float = 0.95


def default_tokens(hps: BaseHyperparameters, arch: str, depth: int, ar: int | None = None) -> float:
    """Chinchilla-style budget at constant tokens per parameter: T(d) = t0 * N(d) / N(d0).

    As ArchScale's `pretrain.py` (commit 1fbcceb) does, N(d) uses the architecture's own law (at the run's aspect
    ratio) and N(d0) the Transformer's (n0_mult), whatever the aspect ratio. The laws are large-depth asymptotes of
    the true counts; the dry run prints their deviation (`n_params_law_deviation`).
    """
    return tokens_for_params(hps, n_mult(arch, ar) * depth**3)


def tokens_for_params(hps: BaseHyperparameters, n_params: float) -> float:
    """T = t0 * N / N(d0), N(d0) = n0_mult * d0^3 (the Transformer's law at the base depth)."""
    return hps.t0 * n_params / (hps.n0_mult * hps.d0**3)


def resolve_batch_and_lr(hps: BaseHyperparameters, micro_bsz: int, ctx_len: int, world_size: int):
    """Return (batch_tokens, grad_accum_steps, lr).

    One micro-round = world_size * micro_bsz * ctx_len tokens; the batch is b0 rounded down to a multiple of it
    (constant across depths), and the LR follows eta0 * sqrt(b / b0).
    """
    micro_round = world_size * micro_bsz * ctx_len
    if micro_round <= 0:
        raise UserError("--micro_bsz and --ctx_len must be positive")
    if hps.b0 < micro_round:
        raise UserError(
            f"--base_hps.b0={hps.b0} tokens is smaller than one micro-round "
            f"(world {world_size} x --micro_bsz {micro_bsz} x --ctx_len {ctx_len} = {micro_round}); "
            "raise --base_hps.b0 or lower --micro_bsz/--ctx_len"
        )
    accum = hps.b0 // micro_round
    batch = accum * micro_round
    return batch, accum, hps.eta0 * math.sqrt(batch / hps.b0)


# ------------------------------------------------------------------------------------------ parametrizations
PARAMETRIZATIONS = ("sp", "mup", "mup++")


@dataclass(frozen=True)
class RoleRule:
    """Optimizer rule of one parameter role: the group LR is global_lr * lr_mult, AdamW's decay weight_decay."""

    lr_mult: float
    weight_decay: float


@dataclass(frozen=True)
class Rules:
    """Everything a parametrization decides, for one depth. `model_overrides()` feeds `ModelConfig`."""

    parametrization: str
    global_lr_mult: float  # multiplies eta0 * sqrt(b / b0); mu-P++: sqrt(d0 / d) (Depth-mu-P)
    matrix: RoleRule  # matrix-like weights (hidden Linear weights)
    vector: RoleRule  # vector-like parameters (embeddings, lm_head, norms, biases, SSM vectors)
    residual_scale: float  # multiplies each block branch; mu-P++: 1/sqrt(2L)
    logit_scale: float  # multiplies the final hidden state before lm_head; mu-P/mu-P++: d0/L
    attn_scale_mult: float  # softmax scale = attn_scale_mult / sqrt(head_size); mu-P/mu-P++: sqrt(hd0/hd)
    init_scheme: str  # "sp" | "mup" (see `GPT.reset_parameters`)
    w_init_mult: float  # Linear init multiplier under the mup scheme (w_init0)
    notes: tuple[str, ...] = field(default=())

    def model_overrides(self) -> dict:
        return dict(residual_scale=self.residual_scale, logit_scale=self.logit_scale,
                    attn_scale_mult=self.attn_scale_mult, init_scheme=self.init_scheme, w_init_mult=self.w_init_mult)


def resolve_parametrization(parametrization: str, hps: BaseHyperparameters, depth: int, n_layer: int,
                            head_size: int, tie: bool = False) -> Rules:
    """The three parametrizations of ArchScale's `setup()` (its `pretrain.py`), written once.

    Width is tied to depth (n_embd = ar * depth), so the mu-P width ratio base/width is d0/depth.

    - SP: global LR x1; both roles lr_mult 1, weight decay weight_decay0; no multipliers; N(0, 0.02) init with
      GPT-2's 1/sqrt(2L) on output projections.
    - mu-P (`_ori_mup`, width rules only): matrices lr_mult d0/d; every role decays with weight_decay0; logits x d0/L;
      attention scale x sqrt(hd0/hd); kaiming-uniform init x w_init0 and a zero untied lm_head.
    - mu-P++ (`mup`): mu-P plus Depth-mu-P (global LR x sqrt(d0/d), each block branch x 1/sqrt(2L)) plus no weight
      decay on vector-like parameters. Matrix LR = eta * (d0/d)^1.5, vector LR = eta * (d0/d)^0.5.

    `tie` changes only the init (a tied embedding is N(0, 0.02) under mu-P; see `GPT.reset_parameters`).
    """
    if parametrization not in PARAMETRIZATIONS:
        raise UserError(f"--parametrization {parametrization!r} is unknown; choose one of {', '.join(PARAMETRIZATIONS)}")
    if depth < 1 or n_layer < 1 or head_size < 1:
        raise UserError(f"depth, n_layer and head_size must be positive (got {depth}, {n_layer}, {head_size})")
    wd = hps.weight_decay0
    if parametrization == "sp":  # ArchScale multiplies SP's N(0, 0.02) linears by w_init0 too
        return Rules("sp", 1.0, RoleRule(1.0, wd), RoleRule(1.0, wd), residual_scale=1.0, logit_scale=1.0,
                     attn_scale_mult=1.0, init_scheme="sp", w_init_mult=hps.w_init0)
    width_ratio = hps.d0 / depth  # base width / width
    common = dict(matrix=RoleRule(width_ratio, wd), logit_scale=hps.d0 / n_layer,
                  attn_scale_mult=math.sqrt(hps.hd0 / head_size), init_scheme="mup", w_init_mult=hps.w_init0)
    if parametrization == "mup":
        return Rules("mup", 1.0, vector=RoleRule(1.0, wd), residual_scale=1.0, **common)
    return Rules("mup++", math.sqrt(hps.d0 / depth), vector=RoleRule(1.0, 0.0),
                 residual_scale=1.0 / math.sqrt(2 * n_layer), **common)
