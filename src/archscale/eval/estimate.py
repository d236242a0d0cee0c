"""`archscale eval`'s plan, printed before any work: tasks, lengths, samples, batch, and a time estimate.

The estimate: the model's analytic FLOPs (`GPT.flops_per_token`) over every token a task feeds it, divided by a
forward speed measured on this model now (one pass of up to 128 tokens after a warm-up), plus the decoding steps
(a batch of equal-length prompts decodes one token per step) times a measured step time. It is a guide, not a
promise: long contexts cost more per token than the short measurement, and early EOS makes decoding shorter.
"""

from __future__ import annotations

import math
import time
from collections import Counter

import torch

MEASURE_TOKENS = 128
MEASURE_NEW_TOKENS = 8


def _sync(device) -> None:
    if getattr(device, "type", None) == "cuda":
        torch.cuda.synchronize(device)


def measure_speed(em) -> tuple[float, float] | None:
    """(forward FLOP/s, seconds per decoding step) of `em.model` on its device, or None if it has no FLOP count."""
    from archscale.eval.decode import greedy_batch

    model = em.model
    if not callable(getattr(model, "flops_per_token", None)):
        return None
    n = max(2, min(em.train_len, MEASURE_TOKENS))
    x = torch.randint(0, model.config.vocab_size, (1, n), device=em.device, generator=None)
    with torch.no_grad(), em.autocast():
        model(x)  # warm-up (allocations, kernel choice)
        _sync(em.device)
        t0 = time.perf_counter()
        model(x)
        _sync(em.device)
        forward_s = time.perf_counter() - t0
        prompt = [x[0, :16].tolist()]
        greedy_batch(model, prompt, 2, None, 1)  # warm-up: the first decode pays one-time costs
        t0 = time.perf_counter()
        greedy_batch(model, prompt, MEASURE_NEW_TOKENS, None, 1)
        _sync(em.device)
        step_s = (time.perf_counter() - t0) / MEASURE_NEW_TOKENS
    return model.flops_per_token(n, training=False) * n / max(forward_s, 1e-9), step_s


def generation_seconds(em, token_counts: list[int], new_tokens: int, batch_size: int, speed) -> float:
    """Prefill of every prompt + one step per new token for each batch (greedy_batch groups equal lengths)."""
    rate, step_s = speed
    context = max(token_counts) + new_tokens
    prefill = sum(token_counts) * em.model.flops_per_token(context, training=False) / rate
    batches = sum(math.ceil(c / max(1, batch_size)) for c in Counter(token_counts).values())
    return prefill + batches * new_tokens * step_s


def task_rows(ctx, planned: list, speed) -> list[tuple[str, str, float | None]]:
    """(task, what runs, estimated seconds or None) per planned task: each task's `plan_row`."""
    rows = []
    for name, task, plan in planned:
        if task.plan_row is not None:
            what, secs = task.plan_row(ctx, name, plan, speed if task.uses_speed else None)
            rows.append((name, what, secs))
    return rows


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def plan_lines(ctx, planned: list, measure: bool = True) -> list[str]:
    """The plan as lines; `planned`: (name, EvalTask, plan) in run order. The model's speed is measured first when
    a task's estimate uses it, unless `measure` is False (e.g. when quiet)."""
    em, args = ctx.em, ctx.args
    speed = measure_speed(em) if measure and any(task.uses_speed for _, task, _ in planned) else None
    rows = task_rows(ctx, planned, speed)
    name = getattr(getattr(em.model, "config", None), "name", None) or "model"
    head = f"eval plan: {name}" + (f" (step {em.step})" if em.step is not None else "") + \
        f" on {em.device}, batch {args.batch_size}" + (", --quick" if getattr(args, "quick", False) else "")
    width = max((len(r[0]) for r in rows), default=0)
    lines = [head] + [f"  {task.ljust(width)}  {what}" + (f"  ~{_duration(s)}" if s is not None else "")
                      for task, what, s in rows]
    known = [s for _, _, s in rows if s is not None]
    if speed and known:
        lines.append(f"  estimated ~{_duration(sum(known))}" + (" for the tasks above with an estimate"
                                                                if len(known) < len(rows) else "")
                     + f" (the model's FLOPs at a measured {speed[0] / 1e9:.2f} GFLOP/s forward, "
                       f"{speed[1] * 1e3:.0f} ms per decoding step)")
    return lines
