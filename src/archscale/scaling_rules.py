"""Base hyperparameters and the rules that turn them into a concrete run plan.

`BaseHyperparameters` holds the seed's era-1 fields and defaults (spec §4.1); `--base_hps.<field>` overrides
them. `resolve_batch_and_lr` and `default_tokens` are the parametrization-independent transfer rules (§4.2):
the batch is b0 rounded down to a multiple of one optimizer micro-round, the LR scales with sqrt(b/b0), and
the token budget defaults to t0 * N(d) / N(d0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from archscale.config import ARCHITECTURES
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


def n_mult(arch: str) -> float:
    """Non-embedding parameters per depth^3 (spec §3): transformer 14.5 * ar^2."""
    ar = ARCHITECTURES[arch].ar
    return {"transformer": 14.5 * ar**2}.get(arch, 14.5 * ar**2)


def default_tokens(hps: BaseHyperparameters, arch: str, depth: int) -> float:
    """Chinchilla-style budget at constant tokens per parameter: T(d) = t0 * N(d) / N(d0).

    As in the seed (era 1), N(d) uses the architecture's own law and N(d0) the Transformer's (n0_mult).
    """
    return hps.t0 * n_mult(arch) * depth**3 / (hps.n0_mult * hps.d0**3)


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
