"""Pool the counted rounds of several saved `arch_throughput.py` runs into one ratio with one interval.

A single run's 95% interval says how well its own 20-40 rounds pin a ratio. Runs of the same code on the same
machine pin it better together, and show whether a ratio that moved between runs (0.85 in one, 0.87 in the
next) is noise. This reads the runs' printed round lines (rounds marked "not counted" stay out), and prints the
ratio of medians and the median of per-round ratios of one architecture to another, with the same percentile
bootstrap the single runs print (machine_load.ratio_intervals: 2,000 resamples of whole rounds, seed 0).

    python benchmarks/arch_throughput.py --archs transformer,gdny --rounds 40 > run1.txt   # and run2.txt, ...
    python benchmarks/pool_rounds.py run1.txt run2.txt --archs transformer,gdny
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys

from machine_load import ratio_intervals

ROUND = re.compile(r"^  round (\d+): (.*?) tok/s;")
PAIR = re.compile(r"([\w\[\]]+) ([\d,]+(?:\.\d+)?)")
LATER = re.compile(r"^  rounds ([\d, ]+) not counted after all")


def counted_rounds(path: str, archs: list[str]) -> list[dict[str, float]]:
    """{arch: tok/s} per round that one saved run counted (machine_load.counted_rounds' verdicts as printed: a
    round marked "not counted", or listed as "not counted after all", stays out; when the run says it counted
    them ALL, noisy, all are in), for the rounds that timed every one of `archs`."""
    rounds, left_out, take_all = {}, set(), False
    with open(path) as f:
        for line in f:
            if (m := ROUND.match(line)) is not None:
                speeds = {name: float(value.replace(",", "")) for name, value in PAIR.findall(m.group(2))}
                if all(a in speeds for a in archs):
                    rounds[int(m.group(1))] = {a: speeds[a] for a in archs}
                if "not counted" in line:
                    left_out.add(int(m.group(1)))
            elif (m := LATER.match(line)) is not None:
                left_out.update(int(x) for x in m.group(1).split(","))
            elif "ALL counted, noisy" in line:
                take_all = True
    return [r for i, r in sorted(rounds.items()) if take_all or i not in left_out]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="saved stdout of arch_throughput.py runs")
    p.add_argument("--archs", default="transformer,gdny",
                   help="comma list: the reference first, then the architectures to pool against it")
    a = p.parse_args(argv)
    archs = [x.strip() for x in a.archs.split(",") if x.strip()]
    if len(archs) < 2:
        sys.exit("pool_rounds: --archs needs the reference and at least one other architecture")
    if len(set(a.runs)) < len(a.runs):
        sys.exit("pool_rounds: a run is given twice (its rounds would count twice)")
    per_run = {}
    for path in a.runs:
        try:
            per_run[path] = counted_rounds(path, archs)
        except OSError as e:
            sys.exit(f"pool_rounds: cannot read {path}: {e.strerror}")
        if not per_run[path]:
            sys.exit(f"pool_rounds: {path} has no counted round that timed all of {', '.join(archs)}")
    rounds = [r for rs in per_run.values() for r in rs]
    print(f"{len(rounds)} counted rounds from {len(a.runs)} runs ("
          + ", ".join(f"{path}: {len(rs)}" for path, rs in per_run.items()) + ")")
    base = [r[archs[0]] for r in rounds]
    for name in archs[1:]:
        speeds = [r[name] for r in rounds]  # tok/s, so the numerator (the model) goes first
        iv = ratio_intervals(speeds, base)
        medians = statistics.median(speeds) / statistics.median(base)
        per_round = statistics.median(s / b for s, b in zip(speeds, base))
        print(f"{name} to {archs[0]}: ratio of medians {medians:.3f} ({iv['medians'][0]:.3f}-"
              f"{iv['medians'][1]:.3f}), per-round median {per_round:.3f} ({iv['per_round'][0]:.3f}-"
              f"{iv['per_round'][1]:.3f}); 95% bootstrap intervals, 2,000 resamples of whole rounds, seed 0")


if __name__ == "__main__":
    main()
