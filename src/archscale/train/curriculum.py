"""Sequence-length curriculum (DeepSpeed's `seqlen` curriculum learning, in its "reshape" form):
`--curriculum seqlen:start=64,steps=N,schedule=linear|root`.

For the first N optimizer steps the model trains on shorter sequences: step s uses length

    raw(s) = start + (ctx_len - start) * (s / N) ** p       p = 1 (linear) or 1/2 (root, DeepSpeed's fixed_root
                                                                               with root_degree 2)
    L(s)   = the largest divisor of ctx_len that is <= raw(s)   (start itself divides ctx_len)

and from step N on the full `--ctx_len`. DeepSpeed rounds the length to a multiple of `difficulty_step`; here it
is rounded down to a divisor of ctx_len so that every packed `(micro_bsz, ctx_len)` micro-batch is cut exactly
into `micro_bsz * ctx_len / L` sequences of length L: the same tokens, each predicting the same next token, only
the attention (and recurrent state) is cut at L. The tokens per optimizer step therefore stay constant (more
sequences at short lengths), so the LR schedule and the token budget, which count steps of a fixed number of
tokens, count tokens. With a power-of-two ctx_len the lengths are powers of two (the length doubles in steps).

The length is a pure function of the step, so resuming mid-curriculum needs no extra state: the resumed run
continues with the same lengths (the data loader is untouched, still drawing full blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from archscale.errors import UserError

SCHEDULES = ("linear", "root")
_USAGE = "use --curriculum none or seqlen:start=S,steps=N[,schedule=linear|root] (S divides --ctx_len)"


@dataclass(frozen=True)
class SeqlenCurriculum:
    start: int
    steps: int
    schedule: str
    ctx_len: int

    def raw_length(self, step: int) -> float:
        """The schedule's (unrounded) length at optimizer step `step` (0-based)."""
        if step >= self.steps:
            return float(self.ctx_len)
        frac = step / self.steps
        return self.start + (self.ctx_len - self.start) * (frac if self.schedule == "linear" else frac ** 0.5)

    def length_at(self, step: int) -> int:
        raw = self.raw_length(step)
        return max(d for d in divisors(self.ctx_len) if d <= raw + 1e-9 and d >= self.start)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_curriculum(spec: Optional[str], ctx_len: int) -> Optional[SeqlenCurriculum]:
    """`--curriculum` -> the schedule (None for `none`); a one-line UserError for anything else."""
    if spec in (None, "", "none"):
        return None
    kind, _, rest = str(spec).partition(":")
    if kind != "seqlen" or not rest:
        raise UserError(f"--curriculum {spec!r}: {_USAGE}")
    fields: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq or key not in ("start", "steps", "schedule") or key in fields:
            raise UserError(f"--curriculum {spec!r}: bad item {item!r}; {_USAGE}")
        fields[key] = value
    try:
        start, steps = int(fields["start"]), int(fields["steps"])
    except (KeyError, ValueError):
        raise UserError(f"--curriculum {spec!r}: start and steps must be integers; {_USAGE}") from None
    schedule = fields.get("schedule", "linear")
    if schedule not in SCHEDULES:
        raise UserError(f"--curriculum {spec!r}: schedule must be linear or root (got {schedule!r})")
    if steps < 1 or not 1 <= start <= ctx_len or ctx_len % start:
        raise UserError(f"--curriculum {spec!r}: need steps >= 1 and a start that divides --ctx_len {ctx_len} "
                        f"(got start={start}, steps={steps})")
    return SeqlenCurriculum(start, steps, schedule, ctx_len)


def cut_batch(batch: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A `(B, T + 1)` block batch -> (inputs, targets) of shape `(B * T / length, length)`: the same B*T
    (input, next token) pairs as `batch[:, :-1], batch[:, 1:]`, cut into sequences of `length`."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    if length == inputs.shape[1]:
        return inputs, targets
    return inputs.reshape(-1, length), targets.reshape(-1, length)
