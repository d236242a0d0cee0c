"""Learning-rate schedules, indexed by optimizer step (0-based), returning a multiplier of the peak LR."""

from __future__ import annotations

import math

SCHEDULES = ("linear", "cosine", "wsd")
WSD_STABLE_FRACTION = 5 / 7  # of the post-warmup steps, as in ArchScale


def lr_at(step: int, peak: float, min_lr: float, warmup_steps: int, max_steps: int, schedule: str = "linear") -> float:
    """Linear warmup 0 -> peak over `warmup_steps`, then decay to `min_lr` at `max_steps`.

    linear: straight line; cosine: half cosine; wsd: hold the peak for 5/7 of the post-warmup steps, then a
    linear decay.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}")
    if warmup_steps > 0 and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "wsd":
        if progress < WSD_STABLE_FRACTION:
            return peak
        progress = (progress - WSD_STABLE_FRACTION) / (1 - WSD_STABLE_FRACTION)
        return min_lr + (peak - min_lr) * (1 - progress)
    if schedule == "cosine":
        return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (peak - min_lr)
    return min_lr + (peak - min_lr) * (1 - progress)
