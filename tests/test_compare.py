"""`archscale compare`: the study it builds, the analysis against known answers, honest refusals, resume."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from archscale.cli import main
from archscale.errors import UserError
from archscale.studies.compare import Arch, CompareSpec, arch_flags, build_study, parse_archs, write_meta
from archscale.studies.compare_report import write_report
from archscale.studies.sweep import read_status, write_status
from archscale.train.metrics import MetricsCSV

SRC = str(Path(__file__).resolve().parents[1] / "src")
PAPER_CSV = Path(__file__).resolve().parents[1] / "examples" / "studies" / "paper_flops_scaling.csv"


def fake_study(out: Path, archs: list[str], sizes: list[int], seeds: int, mode: str = "flops"):
    """The study compare would build (its own builder, study file + compare.json), without running it."""
    budget = {"kind": "max_tokens", "value": 1e6} if mode == "flops" else {"kind": "tokens", "value": None}
    spec = CompareSpec(archs=[Arch(a, {"train_model": a}) for a in archs], mode=mode, sizes=sizes,
                       seeds=[3407 + i for i in range(seeds)], budget=budget, base={"train_data_dir": "unused"},
                       out_dir=out, depth=4 if mode == "data" else None)
    study = build_study(spec)
    write_meta(spec, study)
    return spec, study.runs


def write_run(run_dir: Path, flops: float, losses: list[float], params: int = 10_000):
    """A run dir as the trainer leaves it: config.yaml (pretrain + plan) and metrics.csv (MetricsCSV)."""
    fpt = 6.0 * params  # the plan's training FLOPs per token; tokens = C / fpt
    tokens = int(round(flops / fpt))
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir.joinpath("config.yaml").write_text(yaml.safe_dump({
        "pretrain": {"train_model": "x", "depth": 1, "seed": 1},
        "plan": {"non_embedding_params": params, "total_tokens": tokens, "flops_per_token": fpt, "batch_tokens": 1}}))
    m = MetricsCSV(run_dir / "metrics.csv")
    for i, v in enumerate(losses):
        m.write(step=i + 1, tokens=tokens * (i + 1) // len(losses), train_loss=v + 0.05, val_loss=v)


def record(out: Path, statuses: dict[str, str]):
    write_status(out, {"runs": {n: {"status": s} for n, s in statuses.items()}})


def law(A, b, E, c):
    return A * np.asarray(c, float) ** -b + E


def test_synthetic_law_recovers_b_E_and_the_crossover(tmp_path, capsys):
    """Two families with known laws crossing at C = 1e14 (inside 1e11..1e17; the gap runs from +0.76 to -0.17
    nats), 3 seeds per size, Gaussian noise of 0.004 nats: the 95% CIs cover b, E and the crossover, and are narrow
    enough to say something. Measured coverage over rng seeds 0..11 (300 resamples): b of both 11/12, E of both
    11/12, crossover 10/12 (percentile intervals with few points under-cover a little); seed 1 is fixed here."""
    A1, b1, E1 = 30.0, 0.12, 2.0
    b2, E2, cross = 0.16, 1.85, 1e14
    A2 = (law(A1, b1, E1, cross) - E2) * cross ** b2  # so that the curves cross exactly at `cross`
    truth = {"transformer": (A1, b1, E1), "sambay": (A2, b2, E2)}
    xs = np.geomspace(1e11, 1e17, 7)
    out = tmp_path / "study"
    spec, runs = fake_study(out, list(truth), list(range(2, 9)), seeds=3)
    rng = np.random.default_rng(1)
    meta = json.loads((out / "compare.json").read_text())["runs"]
    for r in runs:
        m = meta[r.name]
        x = xs[m["size"] - 2]
        final = float(law(*truth[m["arch"]], x)) + rng.normal(0, 0.004)
        write_run(Path(r.out_dir), x, [final + 0.5, final])  # the minimum is the last value
    record(out, {r.name: "success" for r in runs})
    assert main(["compare", "--report", str(out), "--bootstrap", "300"]) == 0
    printed = capsys.readouterr().out
    rep = json.loads((out / "report.json").read_text())
    for arch, (A, b, E) in truth.items():
        f = rep["fits"][arch]["fit"]
        assert f["b_ci"][0] <= b <= f["b_ci"][1] and f["C_ci"][0] <= E <= f["C_ci"][1], (arch, f)
        assert f["b_ci"][1] - f["b_ci"][0] < 0.01 and f["C_ci"][1] - f["C_ci"][0] < 0.05, (arch, f)
    (cmp,) = rep["comparisons"]
    cr = cmp["crossover"]
    assert cr["in_range"] and cr["ci"][0] <= cross <= cr["ci"][1], cr
    assert cr["ci"][1] / cr["ci"][0] < 1.3 and abs(np.log10(cr["at"] / cross)) < 0.05
    # the noise floor is the seed spread (sigma 0.004), and the big gaps at the ends are called, with the winner
    assert 0.002 < cmp["noise_floor"] < 0.01
    true_gap = law(*truth["sambay"], xs) - law(*truth["transformer"], xs)
    covered = [g["ci"][0] <= t <= g["ci"][1] for g, t in zip(cmp["gaps"], true_gap)]
    assert sum(covered) >= 6 and all(0 < g["ci"][1] - g["ci"][0] < 0.02 for g in cmp["gaps"]), cmp["gaps"]
    first, last = cmp["gaps"][0], cmp["gaps"][-1]
    assert first["called"] and first["gap"] > 0 and last["called"] and last["gap"] < 0
    assert "transformer is lower" in cmp["verdict"] and "sambay is lower" in cmp["verdict"]
    assert "cross at C = 1" in cmp["verdict"]
    text = (out / "report.md").read_text()
    assert "**Verdict:**" in text and "| sambay" in text and "scaling.png" in text and cmp["verdict"] in printed
    assert "samples" not in rep["fits"]["sambay"]["fit"] and (out / "scaling.png").stat().st_size > 5000


def test_noise_floor_blocks_a_small_gap(tmp_path):
    """Two identical laws shifted by 0.003 nats, seed noise 0.01: the CI may exclude 0 with many points, but a
    gap below the noise floor is never called."""
    out = tmp_path / "study"
    spec, runs = fake_study(out, ["transformer", "sambay"], [2, 3, 4, 5], seeds=2)
    meta = json.loads((out / "compare.json").read_text())["runs"]
    xs = np.geomspace(1e12, 1e15, 4)
    seed_noise = {3407: -0.01, 3408: 0.01}  # every size: the two seeds 0.02 apart (std 0.014)
    for r in runs:
        m = meta[r.name]
        y = float(law(50.0, 0.15, 2.0, xs[m["size"] - 2])) + (0.003 if m["arch"] == "sambay" else 0)
        write_run(Path(r.out_dir), xs[m["size"] - 2], [y + seed_noise[m["seed"]]])
    record(out, {r.name: "success" for r in runs})
    rep = write_report(out, n_bootstrap=200)
    (cmp,) = rep["comparisons"]
    assert cmp["noise_floor"] == pytest.approx(0.02 / np.sqrt(2), rel=1e-6)
    assert not any(g["called"] for g in cmp["gaps"])
    assert cmp["verdict"].startswith("No difference can be called")


def test_data_scaling_report_fits_over_tokens(tmp_path):
    out = tmp_path / "data"
    budgets = [10**5, 10**6, 10**7, 10**8]
    spec, runs = fake_study(out, ["transformer", "sambay"], budgets, seeds=2, mode="data")
    assert [r.name for r in runs][:2] == ["transformer_d4_T100000_s3407", "sambay_d4_T100000_s3407"]
    meta = json.loads((out / "compare.json").read_text())["runs"]
    rng = np.random.default_rng(0)
    for r in runs:
        m = meta[r.name]
        y = float(law(20.0, 0.2 if m["arch"] == "sambay" else 0.15, 2.0, m["size"])) + rng.normal(0, 0.002)
        write_run(Path(r.out_dir), m["size"] * 6.0 * 10_000, [y])  # trains exactly `size` tokens
    record(out, {r.name: "success" for r in runs})
    rep = write_report(out, n_bootstrap=100)
    assert rep["x"] == "tokens" and [r["x"] for r in rep["rows"]][::4] == budgets
    assert rep["fits"]["sambay"]["fit"].b == pytest.approx(0.2, abs=0.03)
    (cmp,) = rep["comparisons"]
    assert all(g["called"] and g["gap"] < 0 for g in cmp["gaps"])  # sambay lower everywhere, by >= 0.04 nats
    assert cmp["verdict"].startswith("sambay reaches a lower loss than transformer at every measured tokens")
    assert "| tokens " in rep["md"].read_text()


def test_a_loss_that_does_not_fall_with_compute_gets_no_verdict(tmp_path):
    """Three sizes whose loss rises with C (undertrained big models): b lands on its bound; no gap is called."""
    out = tmp_path / "study"
    spec, runs = fake_study(out, ["transformer", "sambay"], [4, 8, 12], seeds=2)
    meta = json.loads((out / "compare.json").read_text())["runs"]
    for r in runs:
        m = meta[r.name]
        write_run(Path(r.out_dir), 1e10 * m["size"], [7.8 + 0.02 * m["size"] + 0.001 * (m["seed"] - 3407)])
    record(out, {r.name: "success" for r in runs})
    rep = write_report(out, n_bootstrap=50)
    assert rep["fits"]["sambay"]["degenerate"] and "does not fall with compute" in rep["md"].read_text()
    (cmp,) = rep["comparisons"]
    assert cmp["verdict"].startswith("No verdict: for transformer, its fit is degenerate") and not cmp["gaps"]


def test_papers_sambay_and_transformer_table_reproduces_the_exponents(tmp_path):
    """ArchScale's published FLOPs-scaling losses (T++ mu-P++ and SambaY mu-P++, 6NT from 9.1e18 to 6.65e21) as
    run folders, one seed: the fits give the refit exponents (0.0745, 0.0694) and the verdict refuses to call
    anything, the seed spread being unknown."""
    with open(PAPER_CSV, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["arch"] in ("T++ muP++", "SambaY muP++")]
    label = {"T++ muP++": "transformer", "SambaY muP++": "sambay"}
    sizes = sorted({float(r["flops"]) for r in rows})
    out = tmp_path / "paper"
    spec, runs = fake_study(out, ["transformer", "sambay"], list(range(1, 6)), seeds=1)
    meta = json.loads((out / "compare.json").read_text())["runs"]
    by = {(label[r["arch"]], float(r["flops"])): float(r["loss"]) for r in rows}
    arch_x = {a: sorted(x for (b, x) in by if b == a) for a in label.values()}
    for r in runs:
        m = meta[r.name]
        x = arch_x[m["arch"]][m["size"] - 1]
        write_run(Path(r.out_dir), x, [by[(m["arch"], x)]], params=10**8)
    record(out, {r.name: "success" for r in runs})
    assert len(sizes) == 5  # the table gives both architectures the same FLOPs (6NT) at each depth
    rep = write_report(out, n_bootstrap=200)
    assert rep["fits"]["transformer"]["fit"].b == pytest.approx(0.0745, abs=0.0015)
    assert rep["fits"]["sambay"]["fit"].b == pytest.approx(0.0694, abs=0.0015)
    assert rep["fits"]["sambay"]["fit"].C == pytest.approx(0.585, abs=0.006)
    (cmp,) = rep["comparisons"]
    assert cmp["noise_floor"] is None and cmp["verdict"].startswith("No verdict: one seed per size")
    assert "unknown (1 seed)" in rep["md"].read_text()


def test_one_seed_two_sizes_and_failed_runs_get_honest_refusals(tmp_path):
    out = tmp_path / "study"
    spec, runs = fake_study(out, ["transformer", "sambay"], [2, 4], seeds=1)
    names = [r.name for r in runs]  # transformer_d2, sambay_d2, transformer_d4, sambay_d4 (size by size)
    for r, x, y in zip(runs, (1e12, 1.1e12, 1e13, 1.1e13), (3.0, 3.1, 2.7, 2.6)):
        write_run(Path(r.out_dir), x, [y])
    record(out, {names[0]: "success", names[1]: "success", names[2]: "success", names[3]: "timeout"})
    (Path(runs[0].out_dir) / "eval.json").write_text(json.dumps({"results": {
        "ppl": {"validation": {"1x": {"loss": 3.0, "ppl": 20.09}, "2x": {"loss": 3.2, "ppl": 24.5}}},
        "phonebook": {"lengths": {"10": {"mean": 0.5, "std": 0.1}, "20": {"mean": 0.3, "std": 0.1}}}}}))
    rep = write_report(out, n_bootstrap=50)
    text = rep["md"].read_text()
    assert rep["rows"][0]["eval"] == {"ppl@1x": 20.09, "ppl@2x": 24.5, "phonebook": pytest.approx(0.4)}
    assert "| ppl@1x" in text and "| 20.09" in text
    for arch in ("transformer", "sambay"):
        assert rep["fits"][arch]["fit"] is None and "needs at least 3" in rep["fits"][arch]["refused"]
    assert "refused: 2 size(s)" in text and "refused: 1 size(s)" in text
    assert "the seed-to-seed spread is unknown" in text and "unknown (1 seed)" in text
    (cmp,) = rep["comparisons"]
    assert cmp["verdict"].startswith("No verdict:") and cmp["gaps"] == []
    # the timed-out run is a row of the table, marked, and named among the runs left out of the fits
    row = next(r for r in rep["rows"] if r["run"] == names[3])
    assert row["status"] == "timeout" and not row["in_fit"] and row["loss"] == pytest.approx(2.6)
    assert f"{names[3]} (timeout)" in text and "| timeout" in text


def test_a_layout_file_is_trained_with_layout_and_names_with_train_model(tmp_path):
    spec_file = tmp_path / "my_hybrid.yaml"
    spec_file.write_text("layers: [attn, mamba]\n")
    assert arch_flags("transformer") == {"train_model": "transformer"}
    assert arch_flags(str(spec_file)) == {"layout": str(spec_file.resolve())}
    assert arch_flags("attn:2,mamba:2") == {"layout": "attn:2,mamba:2"}  # a layout string (not a name)
    with pytest.raises(UserError, match="neither a registered architecture"):
        arch_flags("transformr")
    with pytest.raises(UserError, match="neither a registered"):
        arch_flags(str(tmp_path / "missing.yaml"))
    archs = parse_archs(f"transformer,{spec_file}")
    assert [a.label for a in archs] == ["transformer", "my_hybrid"]
    spec = CompareSpec(archs=archs, mode="flops", sizes=[2, 3], seeds=[3407], budget={"kind": "max_tokens",
                       "value": 1e5}, base={"train_data_dir": "d"}, out_dir=tmp_path / "out")
    study = build_study(spec)
    args = {r.name: r.args() for r in study.runs}
    assert f"--layout={spec_file.resolve()}" in args["my_hybrid_d2_s3407"]
    assert not any(a.startswith("--train_model") for a in args["my_hybrid_d2_s3407"])
    assert "--train_model=transformer" in args["transformer_d3_s3407"] and "--max_tokens=100000" in \
        args["transformer_d3_s3407"]


def test_dry_run_prints_plans_and_total_compute_and_writes_nothing(dataset, tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["compare", "--archs", "transformer,transformerls", "--depths", "1,2", "--seeds", "2",
            "--train_data_dir", str(dataset), "--ar", "16", "--set", "ctx_len=64", "--set", "micro_bsz=2",
            "--set", "base_hps.b0=128", "--budget", "tokens_per_param=3", "--out_dir", str(out)]
    assert main([*argv, "--dry_run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    plans = {p["name"]: p["plan"] for p in doc["runs"]}
    assert len(plans) == 8 and not out.exists()
    p = plans["transformer_d2_s3408"]
    assert p["max_tokens"] == round(3 * p["n_params_non_embedding"]) and p["n_layer"] == 2
    assert doc["total_flops_model"] == pytest.approx(sum(q["flops_per_token"] * q["max_tokens"]
                                                         for q in plans.values()))
    assert main([*argv, "--dry_run"]) == 0
    printed = capsys.readouterr().out
    assert "total compute:" in printed and "transformerls_d1_s3407" in printed
    # data scaling: one depth, the token budgets as given
    assert main(["compare", "--archs", "transformer,transformerls", "--depth", "2", "--tokens", "2560,5120",
                 "--seeds", "1", "--train_data_dir", str(dataset), "--ar", "16", "--set", "ctx_len=64",
                 "--set", "micro_bsz=2", "--set", "base_hps.b0=128", "--dry_run", "--json"]) == 0
    plans = {p["name"]: p["plan"] for p in json.loads(capsys.readouterr().out)["runs"]}
    assert plans["transformer_d2_T5120_s3407"]["max_tokens"] == 5120 and len(plans) == 4


@pytest.mark.parametrize("argv, message", [
    (["--depths", "2,3"], "--archs is required"),
    (["--archs", "transformer", "--depths", "2,3"], "at least two architectures"),
    (["--archs", "transformer,sambay", "--depths", "2,3", "--tokens", "1e6"], "give --depths"),
    (["--archs", "transformer,sambay", "--depths", "2,x"], "comma-separated numbers"),
    (["--archs", "transformer,sambay", "--depths", "2,3", "--budget", "tokens=3"], "--budget"),
    (["--archs", "transformer,sambay", "--depth", "2", "--tokens", "1e6", "--budget", "t0"], "drop --budget"),
    (["--archs", "transformer,sambay", "--depths", "2,3", "--set", "depth=4"], "compare sets depth"),
    (["--archs", "transformer,sambay", "--depths", "2,3", "--seeds", "0"], "--seeds"),
    (["--archs", "transformer,sambay", "--depths", "2,3", "--bogus"], "unrecognized arguments"),
])
def test_bad_input_is_one_line(argv, message, capsys, tmp_path):
    base = [] if "--depths" not in argv and "--depth" not in argv else ["--train_data_dir", str(tmp_path)]
    assert main(["compare", *argv, *base]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert main(["compare", "--report", str(tmp_path / "nope")]) == 2
    assert "no such study directory" in capsys.readouterr().err


def _wait_for(pred, proc, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    raise AssertionError("timed out")


@pytest.mark.slow
def test_compare_runs_survives_kill_9_and_resumes(dataset, tmp_path):
    """The real command at tiny size (depths 1..3, two named architectures): kill -9 of the sweep and of the run
    it was training (a machine crash), then the same command finishes: finished runs untouched, the killed run
    continued from its checkpoint; then report.md / report.json / scaling.png."""
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "archscale.cli", "compare", "--archs", "transformer,transformerls",
           "--depths", "1,2,3", "--seeds", "1", "--train_data_dir", str(dataset), "--ar", "16",
           "--budget", "max_tokens=3840", "--out_dir", str(out), "--threads", "1", "--bootstrap", "50",
           "--eval", "ppl"]
    for flag in ("ctx_len=64", "micro_bsz=2", "base_hps.b0=128", "base_hps.warmup_tokens0=256", "eval_interval=10",
                 "eval_iters=2", "log_interval=10", "save_interval=10", "precision=fp32"):
        cmd += ["--set", flag]
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    victim = out / "transformerls_d1_s3407"  # the second run: the first one has finished by then
    _wait_for(lambda: (victim / "checkpoints" / "latest").is_file(), proc)
    pid = read_status(out)["runs"][victim.name]["pid"]
    os.kill(proc.pid, signal.SIGKILL)
    os.killpg(pid, signal.SIGKILL)  # the run is in its own session (the sweep starts it so)
    proc.wait(timeout=30)
    st = read_status(out)["runs"]
    assert st["transformer_d1_s3407"]["status"] == "success" and st[victim.name]["status"] == "running"
    first_mtime = (out / "transformer_d1_s3407" / "metrics.csv").stat().st_mtime_ns
    again = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert again.returncode == 0, again.stdout
    assert "transformer_d1_s3407: finished earlier, skipped" in again.stdout
    st = read_status(out)["runs"]
    assert all(r["status"] == "success" for r in st.values()) and len(st) == 6
    assert (out / "transformer_d1_s3407" / "metrics.csv").stat().st_mtime_ns == first_mtime
    assert "resumed from" in (victim / "sweep.log").read_text() and st[victim.name]["attempts"] == 2
    steps = [int(r["step"]) for r in csv.DictReader(open(victim / "metrics.csv"))]
    assert steps == sorted(set(steps)) and steps[-1] == 30  # 3840 tokens / 128 per step, no duplicated rows
    for name in ("report.md", "report.json", "scaling.png"):
        assert (out / name).is_file()
    rep = json.loads((out / "report.json").read_text())
    assert {a: rep["fits"][a]["n_sizes"] for a in rep["archs"]} == {"transformer": 3, "transformerls": 3}
    assert "No verdict:" in again.stdout and "unknown (1 seed)" in again.stdout  # one seed: nothing is called
    # --eval ppl: every finished model evaluated once, a column per context multiple in the report
    assert all((out / n / "eval.json").is_file() for n in st)
    assert "ppl@1x" in (out / "report.md").read_text() and all(r["eval"]["ppl@1x"] > 1 for r in rep["rows"])
