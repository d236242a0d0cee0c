"""Command lines of `archscale sweep`, `archscale analyze` and `archscale fit`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from archscale.errors import UserError


def sweep_main(argv: list[str]) -> int:
    from archscale.studies.plans import dry_run_plans, emit_scripts, plan_table
    from archscale.studies.sweep import load_study, parse_assignments, read_status, run_study, summary_lines

    p = argparse.ArgumentParser(prog="archscale sweep", description=(
        "Run every pretraining run of a study file (base flags + grid/list of overrides), one after another or "
        "N at a time; status per run in STUDY_DIR/study.json; re-running skips finished runs and resumes the "
        "others from their last checkpoint."))
    p.add_argument("study", help="study YAML (see docs/STUDIES.md and examples/studies/)")
    p.add_argument("--out_dir", default=None, help="study dir (default: the file's out_dir, else runs/studies/NAME)")
    p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                   help="replace or add a base flag (repeatable), e.g. --set train_data_dir=data/")
    p.add_argument("--grid", action="append", default=None, metavar="KEY=V1,V2",
                   help="replace or add a grid axis (repeatable), e.g. --grid depth=2,4,6")
    p.add_argument("--parallel", type=int, default=None, help="runs at a time (default: the file's, else 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per run (OMP_NUM_THREADS; default: cores // parallel)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per run, for runs without their own (then SIGTERM: the run saves a checkpoint)")
    p.add_argument("--kill_grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--resume", default="auto", choices=["auto", "none"],
                   help="auto: skip finished runs, continue the others; none: refuse if runs exist")
    p.add_argument("--only", nargs="+", default=None, help="run only these run names")
    p.add_argument("--dry_run", action="store_true", help="list the runs with their resolved plans; run nothing")
    p.add_argument("--json", action="store_true", help="with --dry_run: print the plans as JSON")
    p.add_argument("--emit", choices=["slurm", "torchrun"], default=None,
                   help="write launch scripts (torchrun per run; plus a SLURM array script) instead of running")
    p.add_argument("--nodes", type=int, default=1, help="--emit: nodes per run")
    p.add_argument("--gpus_per_node", type=int, default=8, help="--emit: processes (GPUs) per node")
    p.add_argument("--partition", default=None, help="--emit slurm: #SBATCH --partition")
    p.add_argument("--account", default=None, help="--emit slurm: #SBATCH --account")
    from archscale.progress import Progress, add_progress_flag
    add_progress_flag(p)
    a = p.parse_args(argv)
    study = load_study(a.study, a.out_dir, set_flags=parse_assignments(a.set, "--set"),
                       grid_flags=parse_assignments(a.grid, "--grid", as_list=True))
    if a.dry_run:
        plans = dry_run_plans(study)
        if a.json:
            print(json.dumps(plans, indent=2))
        else:
            print(f"study {study.name}: {len(plans)} runs -> {study.out_dir}")
            print(plan_table(plans))
            for pl in plans:
                for w in pl["warnings"]:
                    print(f"  {pl['name']}: {w}")
        return 0
    if a.emit:
        files = emit_scripts(study, a.emit, nodes=a.nodes, gpus_per_node=a.gpus_per_node, partition=a.partition,
                             account=a.account, parallel=a.parallel, resume=a.resume)
        print(f"wrote {len(files)} files to {files[0].parent}:")
        for f in files:
            print(f"  {f}")
        if a.emit == "slurm":
            print(f"submit with: sbatch {files[-1]}")
        return 0
    try:
        status = run_study(study, parallel=a.parallel, threads=a.threads, resume=a.resume, timeout=a.timeout,
                           kill_grace=a.kill_grace, only=a.only, progress=Progress(show=a.progress))
    except KeyboardInterrupt:
        print("\n".join(summary_lines(study, read_status(study.out_dir))))
        raise
    print("\n".join(summary_lines(study, status)))
    print(f"status: {study.out_dir / 'study.json'}; next: archscale analyze {study.out_dir}")
    bad = [n for n, r in status["runs"].items() if r.get("status") != "success" and (not a.only or n in a.only)]
    return 1 if bad else 0


def analyze_main(argv: list[str]) -> int:
    from archscale.studies.analyze import analyze

    p = argparse.ArgumentParser(prog="archscale analyze", description=(
        "Tabulate every run of a study dir (overrides, params, tokens, FLOPs 6NT and the model's FLOPs, final and "
        "best val_loss); for LR/batch sweeps also the best configuration and a quadratic fit in log2(LR). "
        "Writes CSV, Markdown and a PNG under STUDY_DIR/analysis/."))
    p.add_argument("study_dir")
    p.add_argument("--out_dir", default=None, help="default STUDY_DIR/analysis")
    p.add_argument("--no_plot", action="store_true")
    a = p.parse_args(argv)
    res = analyze(a.study_dir, a.out_dir, plot=not a.no_plot)
    print(res["report"])
    print(f"\nwrote {res['csv']}, {res['md']}" + (f", {res['png']}" if res["png"] else ""))
    return 0


def fit_main(argv: list[str]) -> int:
    from archscale.studies.fit import (fit_power_law, plot_fits, report, series_from_csv, series_from_studies,
                                       to_json)

    p = argparse.ArgumentParser(prog="archscale fit", description=(
        "Fit L = A * X^-b + C (X = FLOPs, tokens or params) per series, with bootstrap 95%% CIs, and plot it "
        "log-log with the extrapolation to --target."))
    p.add_argument("study_dirs", nargs="*", help="study dirs (one series each, or per --group)")
    p.add_argument("--csv", default=None, help="fit columns of a CSV instead of study dirs")
    p.add_argument("--x", default=None,
                   help="X column (study dirs: flops (6NT, default), flops_model, tokens or params)")
    p.add_argument("--y", default=None, help="loss column (study dirs: best_val_loss (default) or final_val_loss)")
    p.add_argument("--group", default=None, help="column naming the series (study dirs: default `study`)")
    p.add_argument("--target", type=float, default=None, help="extrapolate each fit to this X")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for the CIs (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write {series: {A, b, C, A_ci, b_ci, C_ci, n_points}} JSON")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the input; `none` for no plot)")
    a = p.parse_args(argv)
    if bool(a.csv) == bool(a.study_dirs):
        raise UserError("archscale fit: give study dirs, or --csv FILE --x COL --y COL (not both)")
    if a.csv:
        if not (a.x and a.y):
            raise UserError("--csv needs --x COL and --y COL")
        xcol, ycol = a.x, a.y
        series = series_from_csv(a.csv, xcol, ycol, a.group)
        default_png = Path(a.csv).with_name(Path(a.csv).stem + "_fit.png")
    else:
        xcol, ycol = a.x or "flops", a.y or "best_val_loss"
        series = series_from_studies(a.study_dirs, xcol, ycol, a.group)
        default_png = Path(a.study_dirs[0]) / "analysis" / f"fit_{xcol}.png"
    results = {name: fit_power_law(xs, ys, n_bootstrap=a.bootstrap, seed=a.seed, target=a.target, name=name)
               for name, (xs, ys) in series.items()}
    print(report(results, xcol))
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(json.dumps(to_json(results), indent=2))
        print(f"wrote {a.output}")
    if (a.plot or "").lower() != "none":
        png = Path(a.plot) if a.plot else default_png
        png.parent.mkdir(parents=True, exist_ok=True)
        plot_fits(series, results, png, xcol, ycol, a.target)
        print(f"wrote {png}")
    return 0
