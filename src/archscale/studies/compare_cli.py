"""Command line of `archscale compare` (registered in archscale.cli); the study is built in `compare`, analysed in
`compare_report`, and run by `sweep.run_study` (the same runner as `archscale sweep`)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Callable

from archscale.errors import UserError
from archscale.studies.compare import (CompareSpec, build_study, dry_run_study, parse_archs, parse_budget, parse_list,
                                       total_compute, write_meta)

DEFAULT_BUDGET = "tokens_per_param=20"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # bad flags: one line, exit 2
        raise UserError(f"{self.prog}: {message}")


def compare_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="archscale compare", description=(
        "Which architecture scales better: one pretraining run per architecture x size x seed under mu-P++ (the "
        "same base hyperparameters for all), run through the sweep machinery (resumable: re-run the command), "
        "then L = A C^-b + E per architecture with bootstrap CIs, the gap and crossover between them, and a "
        "verdict that knows the seed noise: OUT_DIR/report.md, report.json, scaling.png. See docs/STUDIES.md."))
    p.add_argument("--archs", help="comma-separated architectures, the first the reference: registered names "
                                   "(transformer, sambay, ...) or layout files / strings (trained with pretrain "
                                   "--layout)")
    p.add_argument("--depths", help="FLOPs scaling: comma-separated depths, e.g. 2,3,4 (three or more to fit)")
    p.add_argument("--depth", type=int, help="data scaling: the one depth every run trains at (with --tokens)")
    p.add_argument("--tokens", help="data scaling: comma-separated token budgets, e.g. 1e8,2e8,4e8")
    p.add_argument("--seeds", type=int, default=2, help="seeds per size (3407, 3408, ...); their spread is the "
                                                        "noise floor, unknown with 1 (default 2)")
    p.add_argument("--train_data_dir", help="prepared shards (`archscale prepare`) every run trains on")
    p.add_argument("--budget", default=None, help="FLOPs scaling's tokens per run: tokens_per_param=X (X x the "
                                                  "run's non-embedding params; default 20), t0[=X] (ArchScale's "
                                                  "T(d) = t0 N(d)/N(d0)) or max_tokens=X (the same for all)")
    p.add_argument("--ar", type=int, default=None,
                   help="aspect ratio (width = ar x depth) for every architecture (default: each one's own)")
    p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                   help="another pretrain flag for every run (repeatable), e.g. --set ctx_len=128")
    p.add_argument("--out_dir", default=None, help="study dir (default runs/studies/compare_ARCHS_MODE)")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time (default 1)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per run (default cores // parallel)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run; then SIGTERM (the run "
                                                               "checkpoints) and status timeout, shown in the report")
    p.add_argument("--kill_grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--dry_run", action="store_true", help="print every run's plan, FLOPs and the total compute; "
                                                          "run and write nothing")
    p.add_argument("--json", action="store_true", help="with --dry_run: the plans as JSON")
    p.add_argument("--emit", choices=["slurm", "torchrun"], default=None,
                   help="write the study and cluster launch scripts instead of running (then --report)")
    p.add_argument("--nodes", type=int, default=1, help="--emit: nodes per run")
    p.add_argument("--gpus_per_node", type=int, default=8, help="--emit: processes (GPUs) per node")
    p.add_argument("--partition", default=None, help="--emit slurm: #SBATCH --partition")
    p.add_argument("--account", default=None, help="--emit slurm: #SBATCH --account")
    p.add_argument("--eval", default=None, help="after training, `archscale eval` tasks for every finished model "
                                                "(e.g. ppl,phonebook,niah_single_1): extra report columns")
    p.add_argument("--report", default=None, metavar="DIR",
                   help="only (re)write the report of a finished or partial study dir; runs nothing")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for the CIs (default 1000)")
    return p


def spec_from_args(a: argparse.Namespace) -> CompareSpec:
    from archscale.studies.sweep import parse_assignments

    if not a.archs:
        raise UserError("archscale compare: --archs is required, e.g. --archs transformer,sambay "
                        "(or --report DIR for an existing study)")
    if not a.train_data_dir:
        raise UserError("archscale compare: --train_data_dir is required (prepared shards; `archscale prepare`)")
    if a.seeds < 1:
        raise UserError(f"--seeds must be at least 1 (got {a.seeds})")
    archs = parse_archs(a.archs)
    if bool(a.depths) == bool(a.tokens):
        raise UserError("archscale compare: give --depths D1,D2,... (FLOPs scaling) or --depth D --tokens "
                        "T1,T2,... (data scaling)")
    base = {"train_data_dir": a.train_data_dir, "parametrization": "mup++", **({"ar": a.ar} if a.ar else {}),
            **parse_assignments(a.set, "--set")}
    if a.tokens:
        if a.depth is None or a.budget:
            raise UserError("data scaling: --tokens needs --depth D, and sets the budgets itself (drop --budget)")
        mode, sizes, budget = "data", parse_list(a.tokens, "--tokens"), {"kind": "tokens", "value": None}
    else:
        if a.depth is not None:
            raise UserError("--depth D is data scaling's (with --tokens); FLOPs scaling takes --depths D1,D2,...")
        mode, sizes, budget = "flops", parse_list(a.depths, "--depths"), parse_budget(a.budget or DEFAULT_BUDGET)
        if budget["kind"] == "t0" and budget["value"]:
            base["base_hps.t0"] = budget["value"]
    for k in ("train_model", "layout", "depth", "seed", "max_tokens", "out_dir"):
        if k in base:
            raise UserError(f"--set {k}=...: compare sets {k} per run (use --archs / --depths / --seeds / --budget)")
    labels = "_".join(x.label for x in archs)
    out = Path(a.out_dir or Path("runs") / "studies" / f"compare_{labels}_{mode}")
    return CompareSpec(archs=archs, mode=mode, sizes=sizes, seeds=[3407 + i for i in range(a.seeds)],
                       budget=budget, base=base, out_dir=out, depth=a.depth, timeout=a.timeout,
                       name=re.sub(r"[^A-Za-z0-9_.-]", "-", out.name))


def print_dry_run(spec: CompareSpec, as_json: bool) -> int:
    from archscale.studies.plans import plan_table

    study, plans = dry_run_study(spec)
    model, six = total_compute(plans)
    if as_json:
        print(json.dumps({"runs": plans, "total_flops_model": model, "total_flops_6nt": six}, indent=2))
        return 0
    print(f"compare {', '.join(a.label for a in spec.archs)}: {len(plans)} runs -> {spec.out_dir}")
    print(plan_table(plans))
    print(f"total compute: {model:.3g} FLOPs (the models' own count: FLOPs per token x tokens), {six:.3g} (6NT)")
    for pl in plans:
        for w in pl["warnings"]:
            print(f"  {pl['name']}: {w}")
    return 0


def evaluate_runs(study, status: dict, tasks: str, echo: Callable[[str], None] = print) -> None:
    """`archscale eval --tasks TASKS` on every finished run, into RUN/eval.json (kept when it has these tasks)."""
    from archscale.eval_cli import run_eval

    for r in study.runs:
        if status["runs"].get(r.name, {}).get("status") != "success":
            continue
        out = Path(r.out_dir) / "eval.json"
        if out.is_file() and json.loads(out.read_text()).get("settings", {}).get("tasks") == tasks:
            echo(f"[compare] {r.name}: evaluated earlier ({out})")
            continue
        echo(f"[compare] {r.name}: eval {tasks}")
        run_eval(["--checkpoint", r.out_dir, "--tasks", tasks, "--output", str(out)])


def print_report(out_dir: Path, n_bootstrap: int) -> dict:
    from archscale.studies.compare_report import write_report

    res = write_report(out_dir, n_bootstrap=n_bootstrap)
    print(res["text"].rsplit("\n![", 1)[0])
    print(f"wrote {res['md']}, {res['json']}, {res['png']}")
    return res


def compare_main(argv: list[str]) -> int:
    from archscale.studies.plans import emit_scripts
    from archscale.studies.sweep import read_status, run_study, summary_lines

    a = compare_parser().parse_args(argv)
    if a.report:
        print_report(Path(a.report), a.bootstrap)
        return 0
    spec = spec_from_args(a)
    if a.dry_run:
        return print_dry_run(spec, a.json)
    dry_run_study(spec)  # every run's flags resolve (one line on the first bad one) before anything is written
    study = build_study(spec)
    write_meta(spec, study)
    if a.emit:
        files = emit_scripts(study, a.emit, nodes=a.nodes, gpus_per_node=a.gpus_per_node, partition=a.partition,
                             account=a.account, parallel=a.parallel)
        print(f"wrote {study.path} and {len(files)} launch files to {files[0].parent}; afterwards: "
              f"archscale compare --report {spec.out_dir}")
        return 0
    try:
        status = run_study(study, parallel=a.parallel, threads=a.threads, timeout=a.timeout, kill_grace=a.kill_grace)
    except KeyboardInterrupt:
        print("\n".join(summary_lines(study, read_status(study.out_dir))))
        print(f"re-run the same command to resume; archscale compare --report {spec.out_dir} for the partial study")
        raise
    print("\n".join(summary_lines(study, status)))
    if a.eval:
        evaluate_runs(study, status, a.eval)
    print_report(spec.out_dir, a.bootstrap)
    return 0 if all(r.get("status") == "success" for r in status["runs"].values()) else 1
