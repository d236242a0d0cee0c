"""benchmarks/arch_throughput.py's rounds: a round in which other processes kept the machine busy, or in which the
matmul peak dropped (the host slowing the VM down), is not counted; rounds go on until enough counted ones are in,
and with too few every round counts (and says so); benchmarks/machine_load.py's meter reads /proc."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    sys.path.insert(0, str(BENCH))  # the scripts import their neighbours (step_breakdown, machine_load)
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def arch():
    return load("arch_throughput")


def scripted(monkeypatch, arch, noise: list[float | None], peaks: list[tuple[float, float]] | None = None):
    """Rounds whose meter reports `noise[i]` other cores and whose matmul peaks before / after are `peaks[i]`
    (default: 100 + i before, 100 after; the three measured before the rounds are 100), so the peaks returned
    (each counted round's first) say which rounds were counted; the steps do nothing."""
    peaks = peaks or [(100.0 + i, 100.0) for i in range(len(noise))]
    measured = iter([100.0] * 3 + [p for pair in peaks for p in pair])
    rounds = iter(range(len(noise)))
    state = {}

    class Meter:
        def __enter__(self):
            state["round"] = next(rounds)
            return self

        def __exit__(self, *exc):
            self.seconds, self.other_cores = 1.0, noise[state["round"]]

    monkeypatch.setattr(arch, "CpuMeter", Meter)
    monkeypatch.setattr(arch, "measure_matmul_flops", lambda *a: next(measured))
    monkeypatch.setattr(arch, "step", lambda *a: None)


def run(arch, rounds: int, max_noise: float = 0.15):
    models = {"a": (None, None, 0, {}), "b": (None, None, 0, {})}
    return arch.timed_rounds(models, ["a", "b"], torch.zeros(1, 3, dtype=torch.long), rounds, max_noise, 0.85)


def test_busy_rounds_are_left_out_and_replaced(monkeypatch, arch):
    scripted(monkeypatch, arch, [0.01, 0.9, 0.02, 0.16, 0.0])
    wall, cpu, peaks, noise = run(arch, rounds=3)
    assert peaks == [100.0, 102.0, 104.0]                # rounds 1 and 3 (0.9, 0.16 cores) not counted
    assert noise == {"quiet": 3, "run": 5, "others": [0.01, 0.9, 0.02, 0.16, 0.0]}
    assert all(len(v) == 3 for v in (*wall.values(), *cpu.values()))


def test_slow_rounds_are_left_out(monkeypatch, arch):
    # the peak before or after a round below 0.85 x the best so far (100, then 120 from round 2 on) = a slowdown
    scripted(monkeypatch, arch, [0.0] * 5, [(100.0, 84.0), (120.0, 110.0), (101.0, 110.0), (103.0, 104.0),
                                            (105.0, 120.0)])
    _, _, peaks, noise = run(arch, rounds=3)
    assert peaks == [120.0, 103.0, 105.0]                # 84 < 85; 101 < 0.85 x 120 = 102
    assert noise["quiet"] == 3 and noise["run"] == 5


def test_rounds_slowed_by_the_runs_later_best_are_left_out_afterwards(monkeypatch, arch, capsys):
    # rounds 1-2 look at full speed against the first peaks (100); round 3's 130-131 shows they were slowed
    # (101 < 0.85 x 131), so they stop counting and two more rounds run
    scripted(monkeypatch, arch, [0.0] * 5, [(100.0, 100.0), (101.0, 100.0), (130.0, 131.0), (132.0, 130.0),
                                            (133.0, 130.0)])
    _, _, peaks, noise = run(arch, rounds=3)
    assert peaks == [130.0, 132.0, 133.0]
    assert noise["quiet"] == 3 and noise["run"] == 5
    assert "rounds 1, 2 not counted after all" in capsys.readouterr().out


def test_too_few_quiet_rounds_count_every_round(monkeypatch, arch):
    scripted(monkeypatch, arch, [0.5, 0.0, 0.5, 0.5, 0.5, 0.5])
    wall, _, peaks, noise = run(arch, rounds=2)          # at most 3 x 2 rounds run; only one was quiet
    assert peaks == [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]
    assert noise["quiet"] == 1 and noise["run"] == 6
    assert len(wall["a"]) == 6


def test_unknown_load_counts_as_quiet(monkeypatch, arch):
    scripted(monkeypatch, arch, [None, None])           # off Linux: nothing to judge by but the peaks
    _, _, peaks, noise = run(arch, rounds=2)
    assert peaks == [100.0, 101.0] and noise["quiet"] == 2


def test_meter_reads_the_machine():
    meter_module = load("machine_load")
    with meter_module.CpuMeter() as meter:
        sum(i * i for i in range(200_000))
    assert meter.seconds > 0
    if Path("/proc/stat").exists():
        assert meter.other_cores is not None and meter.other_cores >= 0
        assert meter_module.own_ticks() > 0 and meter_module.machine_busy_ticks() >= meter_module.own_ticks()


@pytest.fixture(scope="module")
def load_module():
    return load("machine_load")


def test_ratio_intervals_pin_a_constant_ratio(load_module):
    """Every round with the same ratio: both intervals are that ratio exactly."""
    base = [2.0, 2.2, 1.9, 2.5, 2.1]
    iv = load_module.ratio_intervals(base, [b / 0.85 for b in base])
    for lo, hi in iv.values():
        assert lo == pytest.approx(0.85, abs=1e-12) and hi == pytest.approx(0.85, abs=1e-12)


def test_ratio_intervals_cover_the_estimate_and_narrow_with_rounds(load_module):
    """Noisy rounds: the interval holds the run's own ratios, is reproducible (fixed seed), and narrows when
    sixteen times as many rounds are drawn from the same noise (interval widths ~0.05-0.09 at 20 rounds, ~0.02 at
    320, over seeds 1-3)."""
    import random
    import statistics

    def rounds(n: int, seed: int):
        rng = random.Random(seed)
        base = [2.0 * rng.uniform(1.0, 1.3) for _ in range(n)]
        return base, [b / 0.86 * rng.uniform(0.9, 1.1) for b in base]

    base, other = rounds(20, 1)
    iv = load_module.ratio_intervals(base, other)
    point = statistics.median(base) / statistics.median(other)
    per_round = statistics.median(b / o for b, o in zip(base, other))
    assert iv["medians"][0] <= point <= iv["medians"][1]
    assert iv["per_round"][0] <= per_round <= iv["per_round"][1]
    assert iv == load_module.ratio_intervals(base, other)
    many = load_module.ratio_intervals(*rounds(320, 2))
    for key in ("medians", "per_round"):
        (lo, hi), (few_lo, few_hi) = many[key], iv[key]
        assert hi - lo < 0.5 * (few_hi - few_lo)
        assert lo < 0.86 < hi
    with pytest.raises(ValueError):
        load_module.ratio_intervals(base, other[:-1])


SAVED_RUN = """torch 2.13.0+cpu, 2 threads, B4 x T512
  round 1: transformer 2,000.0  gdny 1,700.0 tok/s; matmul peak 330.0 / 331.0 GFLOP/s (before / after)
  round 2: gdny 1,000.0  transformer 2,000.0 tok/s; matmul peak 200.0 / 331.0 GFLOP/s  (slow: not counted)
  round 3: transformer 2,100.0  gdny 1,800.0 tok/s; matmul peak 330.0 / 250.0 GFLOP/s (before / after)
  round 4: gdny 1,750.0  transformer 2,050.0 tok/s; matmul peak 330.0 / 331.0 GFLOP/s (before / after)
  rounds 3 not counted after all: a later peak put the run's best at 360.0 GFLOP/s, and theirs fell below
rounds counted: 2 (2 of 4 run were quiet and at full speed)
"""


def test_pool_rounds_keeps_only_the_rounds_the_run_counted(tmp_path, capsys):
    """A round marked "not counted" and one listed "not counted after all" stay out, whatever the order the
    models ran in; the pooled ratios are those of the rounds kept (two runs: 1,700/2,000 and 1,750/2,050 each)."""
    pool = load("pool_rounds")
    run, again = tmp_path / "run.txt", tmp_path / "again.txt"
    run.write_text(SAVED_RUN)
    again.write_text(SAVED_RUN)
    assert pool.counted_rounds(str(run), ["transformer", "gdny"]) == [
        {"transformer": 2000.0, "gdny": 1700.0}, {"transformer": 2050.0, "gdny": 1750.0}]
    pool.main([str(run), str(again), "--archs", "transformer,gdny"])
    out = capsys.readouterr().out
    assert "4 counted rounds from 2 runs" in out
    assert f"ratio of medians {1725 / 2025:.3f}" in out and f"per-round median {(0.85 + 1750 / 2050) / 2:.3f}" in out


def test_pool_rounds_says_what_is_wrong_in_one_line(tmp_path):
    pool = load("pool_rounds")
    (tmp_path / "empty.txt").write_text("no rounds here\n")
    for argv, message in (([str(tmp_path / "missing.txt")], "cannot read"),
                          ([str(tmp_path / "empty.txt")], "no counted round"),
                          ([str(tmp_path / "empty.txt"), "--archs", "gdny"], "needs the reference"),
                          ([str(tmp_path / "empty.txt")] * 2, "given twice")):
        with pytest.raises(SystemExit, match=message):
            pool.main(argv)
