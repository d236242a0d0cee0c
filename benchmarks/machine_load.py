"""How busy the rest of the machine was while a benchmark timed something (Linux /proc; None elsewhere).

On a 2-core machine with 2 intra-op threads, one busy neighbour makes every parallel kernel wait for a time
slice: a step slows by up to 10x, and a model with more (or more parallel) kernels is hit harder, so a ratio
measured in such a round says nothing about the models. The throughput benchmarks time inside `CpuMeter` and
report, or leave out, the rounds in which other processes kept more than a fraction of a core busy.

    with CpuMeter() as meter:
        step()
    meter.seconds, meter.other_cores     # wall seconds; cores other processes used meanwhile (or None)

`counted_rounds` runs the rounds and leaves out the busy or slowed ones (`judge_round`); `ratio_intervals` gives
bootstrap intervals of the ratios over the rounds used.
"""

from __future__ import annotations

import os
import random
import statistics
import time


class CpuMeter:
    """Wall time of a block, and how many cores *other* processes kept busy meanwhile: the machine's busy CPU
    ticks minus this process's own (all its threads), over the block's wall time."""

    def __enter__(self) -> "CpuMeter":
        self._t0, self._busy0, self._self0 = time.perf_counter(), machine_busy_ticks(), own_ticks()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0
        busy, own = machine_busy_ticks(), own_ticks()
        if None in (busy, own, self._busy0, self._self0):
            self.other_cores = None
        else:
            others = (busy - self._busy0) - (own - self._self0)
            self.other_cores = max(0.0, others / os.sysconf("SC_CLK_TCK") / self.seconds)


def machine_busy_ticks() -> int | None:
    """Clock ticks every CPU of the machine spent busy since boot (/proc/stat: all but idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    return user + nice + system + irq + softirq + steal


def own_ticks() -> int | None:
    """Clock ticks this process (all its threads) spent on a CPU (/proc/self/stat: utime + stime)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])


def judge_round(other_cores: float | None, peaks: tuple[float, float], best: float, max_noise: float,
                min_peak: float) -> str:
    """Why a timed round should not count ("" if it should): "busy" when other processes kept more than
    `max_noise` cores busy; "slow" when the matmul peak measured just before or after it fell below `min_peak` x
    the best of the run (`best`, these two included): on a VM the host's own load slows every core down without
    showing in /proc (the peak halved on ours while /proc showed 0.01 other cores)."""
    busy = other_cores is not None and other_cores > max_noise
    slow = min(peaks) < min_peak * best
    return " and ".join(why for why, bad in (("busy", busy), ("slow", slow)) if bad)


def counted_rounds(play, rounds: int, peak, max_noise: float = 0.15, min_peak: float = 0.85,
                   max_factor: int = 3) -> tuple[list[tuple[object, float]], dict]:
    """Timed rounds until `rounds` of them count (at most `max_factor` x `rounds` run): `play(r)` runs round r
    and returns (its result, its tok/s text, the cores other processes used); `peak()` measures the matmul peak
    (FLOP/s), taken 3 times first and then just before and after every round. Every round is judged by
    `judge_round` against the best peak of the run so far, and judged again after each new round: a round that
    looked at full speed stops counting once a later peak shows the machine was slowed down then (the host's
    slowdowns last minutes, longer than the 3 first measurements). Each round is printed with its verdict when it
    ran; rounds left out afterwards are listed at the end. Returns [(result, peak before)] over the counted rounds
    (every round, flagged, when fewer counted) and {"quiet": counted, "run": run, "others": cores per round}."""
    best = max(peak() for _ in range(3))
    run: list[tuple[object, float, float, float | None, str]] = []  # result, peaks before / after, others, verdict
    verdicts = lambda: [judge_round(o, (b, a), best, max_noise, min_peak) for _, b, a, o, _ in run]  # noqa: E731
    while sum(not why for why in verdicts()) < rounds and len(run) < max_factor * rounds:
        before = peak()
        result, text, other_cores = play(len(run))
        after = peak()
        best = max(best, before, after)
        why = judge_round(other_cores, (before, after), best, max_noise, min_peak)
        run.append((result, before, after, other_cores, why))
        noise = "n/a" if other_cores is None else f"{other_cores:.2f}"
        print(f"  round {len(run)}: {text}; matmul peak {before / 1e9:.1f} / {after / 1e9:.1f} GFLOP/s (before / "
              f"after); other processes {noise} cores" + (f"  ({why}: not counted)" if why else ""), flush=True)
    final = verdicts()
    later = [str(i + 1) for i, (why, r) in enumerate(zip(final, run)) if why and not r[4]]
    if later:
        print(f"  rounds {', '.join(later)} not counted after all: a later peak put the run's best at "
              f"{best / 1e9:.1f} GFLOP/s, and theirs fell below {min_peak} x that", flush=True)
    counted = [(r[0], r[1]) for why, r in zip(final, run) if not why]
    noise = {"quiet": len(counted), "run": len(run), "others": [r[3] for r in run]}
    if len(counted) < rounds:
        print(f"  only {len(counted)} of {len(run)} rounds were quiet and at full speed: ALL counted, noisy")
        return [(r[0], r[1]) for r in run], noise
    return counted, noise


def ratio_intervals(base: list[float], other: list[float], level: float = 0.95, resamples: int = 2000,
                    seed: int = 0) -> dict[str, tuple[float, float]]:
    """Percentile-bootstrap intervals of the two ratios a benchmark table reports, from paired per-round values
    (`base[i]`, `other[i]`: round i's): "medians", median(base) / median(other), and "per_round", the median of
    base[i] / other[i]. Pass wall times with the reference model as `base` (its time over the other's is the
    other's tok/s over its), or tok/s with the numerator as `base`. Whole rounds are resampled, so the pairing
    stays; the seed is fixed, so a run's printout is reproducible. On a host whose noise moves single steps by
    20%, this says whether a run resolves a target such as 0.85 or not."""
    if len(base) != len(other) or not base:
        raise ValueError("ratio_intervals: base and other need the same, non-zero number of rounds")
    rng = random.Random(seed)
    n = len(base)
    medians, per_round = [], []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        medians.append(statistics.median(base[i] for i in pick) / statistics.median(other[i] for i in pick))
        per_round.append(statistics.median(base[i] / other[i] for i in pick))
    tail = (1.0 - level) / 2.0
    cut = lambda xs: (_quantile(xs, tail), _quantile(xs, 1.0 - tail))  # noqa: E731
    return {"medians": cut(medians), "per_round": cut(per_round)}


def _quantile(xs: list[float], q: float) -> float:
    """The q-quantile of xs by linear interpolation between order statistics."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
