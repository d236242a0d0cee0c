"""Where a CPU training step's time goes: its matrix products against everything else, timed op by op.

`breakdown(step)` runs `step()` under a dispatch mode that times every aten op with the wall clock (CPU ops run
synchronously, so an op's time is its own) and counts the FLOPs of the matrix products among them (mm, bmm,
addmm, baddbmm: 2 m k n per product). torch.profiler was not used because on these machines it inflated the
memory-bound ops several times over (a log-softmax read 8 ms by the wall clock and 65-115 ms under the
profiler), which hid where the time really went. The mode adds a few microseconds per op, so the instrumented
step is slower than an untimed one; its parts are compared with each other and with the same parts of another
model's instrumented step, not with untimed steps.

Ops with products inside that are not aten's (a custom kernel that registered its FLOPs for `FlopCounterMode`,
e.g. the SSD scan's C++ kernel) are booked as other ops, their elementwise work being inseparable from their
products there; their time and FLOPs are also reported apart ("kernels").

The numbers a ratio target needs follow from it: if model A's products alone take longer than a fraction of
model B's whole step, no work on A's other ops can bring A within that fraction of B (`bound`).

    from step_breakdown import breakdown
    parts = breakdown(lambda: train_step(model, opt, x), steps=2)   # {"matmul_s": ..., "other_s": ..., ...}
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

# aten products whose FLOPs are counted, by the position of their two factors among the op's arguments
PRODUCTS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}


def product_flops(name: str, args: tuple) -> float:
    """2 m k n per (batched) product: the factors' shapes (.., m, k) and (.., k, n)."""
    a, b = (args[i] for i in PRODUCTS[name])
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


class OpTimer(TorchDispatchMode):
    """Wall-clock seconds per op (by name) and the counted product FLOPs, over everything run under it; apart, the
    FLOPs of other ops with a registered formula (custom kernels), by name."""

    def __init__(self):
        super().__init__()
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self.flops = 0.0
        self.kernel_flops: dict[str, float] = collections.defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.seconds[name] += time.perf_counter() - t0
        self.calls[name] += 1
        if name in PRODUCTS:
            self.flops += product_flops(name, args)
        elif func.overloadpacket in flop_registry and func.namespace != "aten":
            self.kernel_flops[name] += flop_registry[func.overloadpacket](*args, **(kwargs or {}), out_val=out)
        return out


def breakdown(step: Callable[[], object], steps: int = 2) -> dict:
    """Per step (means over `steps` instrumented steps): wall seconds; seconds in the products and in every
    other op; the rest of the wall time (Python, autograd's engine, the mode itself); the products' FLOPs; and
    the five slowest other ops {name: seconds}; and the custom kernels with products inside, among the other ops
    (seconds and FLOPs)."""
    timer = OpTimer()
    t0 = time.perf_counter()
    with timer:
        for _ in range(steps):
            step()
    wall = (time.perf_counter() - t0) / steps
    matmul = sum(s for n, s in timer.seconds.items() if n in PRODUCTS) / steps
    other = sum(s for n, s in timer.seconds.items() if n not in PRODUCTS) / steps
    slowest = sorted(((s / steps, n) for n, s in timer.seconds.items() if n not in PRODUCTS), reverse=True)[:5]
    kernel_s = sum(timer.seconds[n] for n in timer.kernel_flops) / steps
    return {"wall_s": wall, "matmul_s": matmul, "other_s": other, "untimed_s": wall - matmul - other,
            "matmul_flop": timer.flops / steps, "kernel_s": kernel_s,
            "kernel_flop": sum(timer.kernel_flops.values()) / steps, "slowest_other": {n: s for s, n in slowest}}


def interleaved(steps: dict[str, Callable[[], object]], rounds: int = 3) -> dict[str, dict]:
    """`breakdown` of one step per model per round, models in turn (order reversed every round, as the timed
    rounds), and per model the median over rounds of every number: on a noisy machine a single instrumented
    step's product rate moved by 20% between neighbouring models."""
    runs: dict[str, list[dict]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            runs[name].append(breakdown(steps[name], steps=1))
    out = {}
    for name, parts in runs.items():
        out[name] = {k: statistics.median(p[k] for p in parts) for k in parts[0] if k != "slowest_other"}
        out[name]["slowest_other"] = parts[len(parts) // 2]["slowest_other"]
    return out


def bound(model: dict, base: dict, target: float) -> dict:
    """What `target` (model's tok/s over base's) asks of model, from two breakdowns at equal tokens per step:
    the best ratio its products allow (base's whole timed step over model's products alone), and the time left
    for all of model's other work at the target (base's timed step / target - model's products)."""
    base_step = base["matmul_s"] + base["other_s"]
    return {"products_only_ratio": base_step / model["matmul_s"],
            "other_budget_s": base_step / target - model["matmul_s"]}


def describe_bound(name: str, parts: dict, base_name: str, base: dict, target: float) -> str:
    """One line: what `target` (name's tok/s over base_name's) leaves for name's ops other than the products."""
    b = bound(parts, base, target)
    return (f"  {name} at {target:.2f}x {base_name}: its products alone allow {b['products_only_ratio']:.3f}x; they "
            f"leave {b['other_budget_s'] * 1e3:,.0f} ms for its other ops, which took {parts['other_s'] * 1e3:,.0f} ms "
            f"({base_name}'s: {base['other_s'] * 1e3:,.0f} ms)")


def describe(name: str, parts: dict) -> str:
    slow = ", ".join(f"{n} {s * 1e3:.0f}" for n, s in parts["slowest_other"].items())
    kernels = (f"; of the other ops, kernels with products inside {parts['kernel_s'] * 1e3:,.0f} ms "
               f"({parts['kernel_flop'] / 1e9:.1f} GFLOP)" if parts.get("kernel_flop") else "")
    return (f"  {name}: instrumented step {parts['wall_s'] * 1e3:,.0f} ms = products {parts['matmul_s'] * 1e3:,.0f} ms "
            f"({parts['matmul_flop'] / 1e9:.1f} GFLOP, {parts['matmul_flop'] / max(parts['matmul_s'], 1e-9) / 1e9:.0f} GFLOP/s) "
            f"+ other ops {parts['other_s'] * 1e3:,.0f} ms (slowest: {slow}) + untimed {parts['untimed_s'] * 1e3:,.0f} ms"
            f"{kernels}")
