"""LR transfer across depth, mu-P++ vs SP (issue #3).

A 2x-spaced grid of base learning rates eta0 x depths x {mup++, sp} on the demo corpus. Every run has the same
token budget, batch, schedule, seed and therefore the same data order; only depth (and width = ar x depth),
eta0 and the parametrization change. For each (parametrization, depth) the best grid LR is refined with a
quadratic fit of the final validation loss against log2(eta0) over the best point and its two neighbours
(a 5-point fit is reported next to it as a robustness check); the drift is max - min of the fitted optimum
over depths, in octaves (= grid steps, since the grid is 2x-spaced).

The x-axis is the BASE LR eta0 (`--base_hps.eta0`). Under mu-P++ the trainer scales it by depth on purpose
(global x sqrt(d0/d); matrices x d0/d on top), with d0 = the smallest depth of the study, so at that depth both
parametrizations apply eta0 unchanged. "Transfer" means the best eta0 stays put while the model grows.

Runs go through the public API (`archscale.cli.parse_pretrain` + `archscale.train.trainer.pretrain`), one
process per worker (`--jobs`, each with `--threads` torch threads, all under whatever `nice` you launch with).
Each finished run leaves `<out_dir>/runs/<case>.json`; a rerun skips those whose settings match, and resumes
an interrupted run from its checkpoint, so a crash or Ctrl-C loses little.

    nice -n 19 .venv/bin/python benchmarks/lr_transfer.py            # the study (45 min measured on 2 busy CPU cores)
    nice -n 19 .venv/bin/python benchmarks/lr_transfer.py --quick    # smoke test (~1 min; 46 s measured)
    .venv/bin/python benchmarks/lr_transfer.py --analyze_only         # table + PNG from the cached runs
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO / "runs" / "demo" / "data"


# ------------------------------------------------------------------------------------------------ arguments
def int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def int_range(s: str) -> list[int]:
    """"-9:-5" -> [-9, ..., -5]; "-9,-7,-5" -> as listed."""
    if ":" in s:
        lo, hi = (int(x) for x in s.split(":"))
        return list(range(lo, hi + 1))
    return int_list(s)


def grid_spec(s: str) -> dict[str, list[int]]:
    """"sp=-9:-5;mup++=-7:-3" (one grid per parametrization) or "-9:-5" (the same for all: key "*")."""
    if "=" not in s:
        return {"*": int_range(s)}
    return {k.strip(): int_range(v) for k, v in (part.split("=", 1) for part in s.split(";") if part.strip())}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data_dir", default=str(DEFAULT_DATA), help="LITPKDS shards (train_*, validation_*)")
    p.add_argument("--out_dir", default=None, help="cache of runs (default runs/lr_transfer, --quick: "
                   "runs/lr_transfer_quick)")
    p.add_argument("--depths", type=int_list, default=[2, 4, 8])
    p.add_argument("--parametrizations", default="mup++,sp")
    p.add_argument("--log2_lrs", type=grid_spec, default=grid_spec("sp=-9:-5;mup++=-7:-3"),
                   help="grid of log2(eta0), eta0 = 2**k: 'LO:HI' or 'a,b,c' for every parametrization, or "
                        "'sp=LO:HI;mup++=LO:HI' per parametrization")
    p.add_argument("--extend", type=int, default=2,
                   help="extra grid points allowed per (parametrization, depth) past a grid edge that holds "
                        "the minimum")
    p.add_argument("--ar", type=int, default=8, help="aspect ratio: width = ar x depth, head_size = ar")
    p.add_argument("--ctx_len", type=int, default=128)
    p.add_argument("--micro_bsz", type=int, default=16)
    p.add_argument("--batch_tokens", type=int, default=2048, help="--base_hps.b0 (held fixed)")
    p.add_argument("--tokens", type=int, default=393216, help="token budget per run (--max_tokens)")
    p.add_argument("--eval_batches", type=int, default=20,
                   help="validation batches (micro_bsz x ctx_len+1 tokens each; the same ones for every run)")
    p.add_argument("--warmup_frac", type=float, default=0.1, help="warmup as a fraction of the budget")
    p.add_argument("--d0", type=int, default=None, help="mu-P++ base depth (default: the smallest depth)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    p.add_argument("--seed", type=int, default=3407)
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--png", default=None, help="figure path (default docs/lr_transfer.png; --quick: out_dir)")
    p.add_argument("--analyze_only", action="store_true", help="no training: table + PNG from cached runs")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: depths 2,4, three LRs, 16K tokens, into runs/lr_transfer_quick")
    a = p.parse_args(argv)
    a.parametrizations = [x.strip() for x in a.parametrizations.split(",") if x.strip()]
    if a.quick:
        a.depths, a.log2_lrs, a.tokens, a.extend, a.eval_batches = [2, 4], {"*": [-7, -6, -5]}, 16384, 1, 4
    a.out_dir = Path(a.out_dir or REPO / "runs" / ("lr_transfer_quick" if a.quick else "lr_transfer"))
    a.png = Path(a.png) if a.png else (a.out_dir / "lr_transfer.png" if a.quick else REPO / "docs" / "lr_transfer.png")
    a.d0 = a.d0 or min(a.depths)
    a.grids = {p: a.log2_lrs.get(p, a.log2_lrs.get("*")) for p in a.parametrizations}
    missing = [p for p, g in a.grids.items() if not g]
    if missing:
        p.error(f"--log2_lrs gives no grid for {missing}")
    return a


def check_data(data_dir: str) -> None:
    d = Path(data_dir)
    ok = (d / "manifest.json").is_file() and any(d.glob("train*.bin")) and any(d.glob("validation*.bin"))
    if not ok:
        sys.exit(f"error: no prepared corpus in {d} (manifest.json, train*.bin, validation*.bin); "
                 "run `make demo` first, or pass --data_dir")


# ------------------------------------------------------------------------------------------------ one run
def settings_of(a: argparse.Namespace) -> dict:
    """What every run shares; a cached result is reused only if these match."""
    return dict(data_dir=str(Path(a.data_dir).resolve()), ar=a.ar, ctx_len=a.ctx_len, micro_bsz=a.micro_bsz,
                batch_tokens=a.batch_tokens, tokens=a.tokens, warmup_tokens=int(a.warmup_frac * a.tokens),
                d0=a.d0, hd0=a.ar, precision=a.precision, seed=a.seed, schedule="linear",
                eval_batches=a.eval_batches)


def case_name(param: str, depth: int, k: int) -> str:
    return f"{param.replace('+', 'p')}_d{depth}_lr2^{k}"


def pretrain_argv(s: dict, param: str, depth: int, k: int, run_dir: Path) -> list[str]:
    return [
        "pretrain", "--train_data_dir", s["data_dir"], "--train_model", "transformer",
        "--depth", str(depth), "--ar", str(s["ar"]), "--parametrization", param,
        "--ctx_len", str(s["ctx_len"]), "--micro_bsz", str(s["micro_bsz"]),
        "--base_hps.b0", str(s["batch_tokens"]), "--base_hps.eta0", repr(2.0 ** k),
        "--base_hps.d0", str(s["d0"]), "--base_hps.hd0", str(s["hd0"]),
        "--base_hps.warmup_tokens0", str(s["warmup_tokens"]), "--max_tokens", str(s["tokens"]),
        "--schedule", s["schedule"], "--precision", s["precision"], "--seed", str(s["seed"]),
        "--eval_interval", str(10**9), "--eval_iters", str(s["eval_batches"]),  # at start and end
        "--log_interval", "8", "--save_interval", str(10**9), "--keep_last", "1",
        "--out_dir", str(run_dir), "--resume", "auto", "--progress", "false",
    ]


def run_one(job: dict) -> dict:
    """Train one grid point (in this process) and return its result; also written to job['json']."""
    import torch

    from archscale.cli import parse_pretrain
    from archscale.train.metrics import read_metrics
    from archscale.train.trainer import pretrain

    torch.set_num_threads(job["threads"])
    s, run_dir = job["settings"], Path(job["run_dir"])
    argv = pretrain_argv(s, job["param"], job["depth"], job["k"], run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    logf = open(run_dir / "train.log", "a")
    print("$ archscale " + " ".join(argv), file=logf, flush=True)
    cfg, explicit = parse_pretrain(argv[1:])
    t0 = time.perf_counter()
    diverged = None
    try:
        pretrain(cfg, explicit, log=lambda m: print(m, file=logf, flush=True))
    except RuntimeError as e:  # the trainer stops on a non-finite loss
        if "loss is" not in str(e):
            raise
        diverged = str(e)
        print(f"diverged: {e}", file=logf, flush=True)
    wall = time.perf_counter() - t0
    logf.close()
    rows = read_metrics(run_dir / "metrics.csv")
    vals = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
    trains = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    import yaml
    plan = yaml.safe_load((run_dir / "config.yaml").read_text())["plan"]
    final = vals[-1][1] if vals and not diverged and vals[-1][0] == plan["max_steps"] else None
    res = dict(settings=s, param=job["param"], depth=job["depth"], width=s["ar"] * job["depth"], log2_lr=job["k"],
               eta0=2.0 ** job["k"], val_loss=final, init_val_loss=vals[0][1] if vals else None,
               last_train_loss=trains[-1] if trains else None, diverged=diverged, wall_s=round(wall, 1),
               steps=plan["max_steps"], lr_matrix=plan["lr"] * plan["lr_mult_matrix"],
               lr_vector=plan["lr"] * plan["lr_mult_vector"], non_embedding_params=plan["non_embedding_params"])
    if final is None and not diverged:
        raise RuntimeError(f"{run_dir}: no final validation loss in metrics.csv")
    Path(job["json"]).write_text(json.dumps(res, indent=1))
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # ~12 bytes/param each; the JSON is the result
    return res


def load_cached(path: Path, settings: dict):
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return res if res.get("settings") == settings else None


def run_jobs(jobs: list[dict], a: argparse.Namespace, done_before: int, total: int, t_start: float) -> list[dict]:
    """Run the jobs (longest first), printing one line per finished run."""
    jobs = sorted(jobs, key=lambda j: (-j["depth"], j["param"], j["k"]))
    out, n = [], done_before

    def report(res):
        nonlocal n
        n += 1
        loss = f"val {res['val_loss']:.4f}" if res["val_loss"] is not None else "DIVERGED"
        el = (time.perf_counter() - t_start) / 60
        print(f"[{n:3d}/{total}] {res['param']:5s} d{res['depth']} eta0=2^{res['log2_lr']} "
              f"({res['eta0']:.2e}): {loss}  ({res['wall_s']:.0f} s; {el:.1f} min elapsed)", flush=True)

    if a.jobs <= 1:
        for j in jobs:
            res = run_one(j)
            out.append(res)
            report(res)
        return out
    with cf.ProcessPoolExecutor(a.jobs, mp_context=mp.get_context("spawn")) as pool:
        futs = [pool.submit(run_one, j) for j in jobs]
        for f in cf.as_completed(futs):
            res = f.result()
            out.append(res)
            report(res)
    return out


# ------------------------------------------------------------------------------------------------ analysis
def fit_case(points: dict[int, float | None]) -> dict:
    """points: log2 eta0 -> final val loss (None = diverged). Best grid point, 3- and 5-point quadratic fits."""
    ks = sorted(points)
    ok = [k for k in ks if points[k] is not None and math.isfinite(points[k])]
    out = dict(best_k=None, fit3=None, fit3_loss=None, fit5=None, edge=None)
    if not ok:
        return out
    best = min(ok, key=lambda k: points[k])
    out["best_k"], out["best_loss"] = best, points[best]
    i = ks.index(best)
    lo_nb = ks[i - 1] if i > 0 else None
    hi_nb = ks[i + 1] if i + 1 < len(ks) else None
    if lo_nb is None:
        out["edge"] = "low"
    elif hi_nb is None:
        out["edge"] = "high"
    elif points[hi_nb] is None:  # diverged above the best point: the optimum is inside, but no 3-point fit
        out["edge"] = "high (next LR diverged)"
    elif points[lo_nb] is None:
        out["edge"] = "low (next LR diverged)"
    if out["edge"] is None:
        x = np.array([lo_nb, best, hi_nb], float)
        y = np.array([points[k] for k in (lo_nb, best, hi_nb)])
        c = np.polyfit(x, y, 2)
        out["fit3"] = float(-c[1] / (2 * c[0]))
        out["fit3_loss"] = float(np.polyval(c, out["fit3"]))
        out["fit3_coef"] = c.tolist()
    win = [k for k in ks[max(0, i - 2):i + 3] if points[k] is not None]
    if len(win) >= 4:
        c = np.polyfit(np.array(win, float), np.array([points[k] for k in win]), 2)
        if c[0] > 0:
            v = float(-c[1] / (2 * c[0]))
            out["fit5"] = v if min(win) <= v <= max(win) else None
    return out


def collect(a: argparse.Namespace, settings: dict) -> dict:
    """(param, depth) -> {k: val_loss or None} from every cached run with these settings."""
    data: dict = {}
    for f in sorted((a.out_dir / "runs").glob("*.json")):
        res = load_cached(f, settings)
        if res is None or res["param"] not in a.parametrizations or res["depth"] not in a.depths:
            continue
        data.setdefault((res["param"], res["depth"]), {})[res["log2_lr"]] = res["val_loss"]
    return data


def edge_extensions(a, data: dict, used: dict) -> list[tuple[str, int, int]]:
    """Grid points to add where the minimum sits on a grid edge (at most a.extend per case)."""
    new = []
    for key, pts in data.items():
        fit = fit_case(pts)
        if fit["edge"] in ("low", "high") and used.get(key, 0) < a.extend:
            k = min(pts) - 1 if fit["edge"] == "low" else max(pts) + 1
            new.append((key[0], key[1], k))
            used[key] = used.get(key, 0) + 1
    return new


def lr_fmt(k: float | None) -> str:
    return "-" if k is None else f"2^{k:.2f} = {2.0 ** k:.2e}" if k != int(k) else f"2^{int(k)} = {2.0 ** k:.2e}"


def analyze(a: argparse.Namespace, settings: dict, data: dict) -> tuple[str, dict]:
    lines, summary = [], {"settings": settings, "cases": {}, "drift": {}}
    lines += ["| parametrization | depth | width | best grid eta0 | val loss there | fitted optimum eta0 (3-pt) "
              "| fitted loss | 5-pt fit | matrix LR at optimum |",
              "|---|---|---|---|---|---|---|---|---|"]
    for p in a.parametrizations:
        for d in a.depths:
            pts = data.get((p, d), {})
            fit = fit_case(pts)
            summary["cases"][f"{p}_d{d}"] = dict(points={str(k): v for k, v in sorted(pts.items())}, **fit)
            if fit["best_k"] is None:
                lines.append(f"| {p} | {d} | {a.ar * d} | (no finished runs) | | | | | |")
                continue
            opt = fit["fit3"] if fit["fit3"] is not None else fit["best_k"]
            mat_mult = 1.0 if p == "sp" else math.sqrt(a.d0 / d) * (a.d0 / d)
            if fit["fit3"] is not None:
                fitted, floss = lr_fmt(fit["fit3"]), f"{fit['fit3_loss']:.4f}"
            else:
                fitted, floss = f"none: minimum at {fit['edge']} edge", "-"
            f5 = "-" if fit["fit5"] is None else f"2^{fit['fit5']:.2f}"
            lines.append(f"| {p} | {d} | {a.ar * d} | {lr_fmt(fit['best_k'])} | {fit['best_loss']:.4f} | {fitted} "
                         f"| {floss} | {f5} | {2.0 ** opt * mat_mult:.2e} |")
    lines.append("")
    lines.append("| parametrization | fitted log2 eta0 per depth | drift (max - min) | slope per depth doubling |")
    lines.append("|---|---|---|---|")
    for p in a.parametrizations:
        fits = [(d, fit_case(data.get((p, d), {}))) for d in a.depths]
        opts = [(d, f["fit3"]) for d, f in fits if f["fit3"] is not None]
        edges = [f"d{d} {f['edge']}" for d, f in fits if f["fit3"] is None]
        per = ", ".join(f"d{d}: {x:+.2f}" for d, x in opts) + (f" (no fit: {', '.join(edges)})" if edges else "")
        if len(opts) >= 2:
            xs = [x for _, x in opts]
            drift = max(xs) - min(xs)
            slope = float(np.polyfit(np.log2([d for d, _ in opts]), xs, 1)[0])
            dtxt = f"{drift:.2f} octaves ({drift:.2f} grid steps)" + (" (fitted depths only)" if edges else "")
            stxt = f"{slope:+.2f} octaves"
        else:
            drift, slope, dtxt, stxt = None, None, "-", "-"
        summary["drift"][p] = dict(fitted=dict(opts), drift_octaves=drift, slope_per_doubling=slope, no_fit=edges)
        lines.append(f"| {p} | {per} | {dtxt} | {stxt} |")
    lines.append("")
    # the raw grid: final val loss per (parametrization, depth) x eta0
    ks = sorted({k for pts in data.values() for k in pts})
    lines.append("| final val loss | " + " | ".join(f"2^{k}" for k in ks) + " |")
    lines.append("|---|" + "---|" * len(ks))
    for p in a.parametrizations:
        for d in a.depths:
            pts = data.get((p, d), {})
            cells = []
            for k in ks:
                v = pts.get(k, "n/a")
                cells.append("" if v == "n/a" else "div." if v is None else f"{v:.4f}")
            lines.append(f"| {p} d{d} | " + " | ".join(cells) + " |")
    return "\n".join(lines), summary


def plot(a: argparse.Namespace, data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(a.parametrizations), figsize=(5.2 * len(a.parametrizations), 4.0), sharey=True,
                             squeeze=False)
    colors = plt.cm.viridis(np.linspace(0.05, 0.8, len(a.depths)))
    finite = [v for pts in data.values() for v in pts.values() if v is not None]
    for ax, p in zip(axes[0], a.parametrizations):
        for c, d in zip(colors, a.depths):
            pts = data.get((p, d), {})
            if not pts:
                continue
            ks = sorted(k for k in pts if pts[k] is not None)
            ax.plot(ks, [pts[k] for k in ks], "o-", color=c, ms=4, lw=1.2, label=f"d{d} (width {a.ar * d})")
            div = [k for k in pts if pts[k] is None]
            if div and finite:
                ax.plot(div, [max(finite)] * len(div), "x", color=c, ms=7)
            fit = fit_case(pts)
            if fit["fit3"] is not None:
                ks_all = sorted(pts)
                i = ks_all.index(fit["best_k"])
                xs = np.linspace(ks_all[i - 1], ks_all[i + 1], 40)
                ax.plot(xs, np.polyval(fit["fit3_coef"], xs), "--", color=c, lw=1)
                ax.plot([fit["fit3"]], [fit["fit3_loss"]], "*", color=c, ms=13, mec="k", mew=0.6)
                ax.axvline(fit["fit3"], color=c, lw=0.6, ls=":")
        ax.set_title(f"{p}: final val loss vs base LR (stars: fitted optima)", fontsize=9)
        ax.set_xlabel("log2(eta0)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("final validation loss (nats/token)")
    if finite:
        lo = min(finite)
        axes[0][0].set_ylim(lo - 0.05, min(max(finite), lo + 1.5) + 0.05)
    fig.suptitle(f"LR transfer, demo corpus: ar {a.ar} (width = {a.ar} x depth), ctx {a.ctx_len}, "
                 f"{a.tokens:,} tokens/run, "
                 f"batch {a.batch_tokens} tokens, d0={a.d0}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    a = parse_args(argv)
    check_data(a.data_dir)
    settings = settings_of(a)
    (a.out_dir / "runs").mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    print(f"LR transfer: depths {a.depths}, log2(eta0) grids {a.grids}, "
          f"{a.tokens:,} tokens/run, out {a.out_dir}", flush=True)
    print("settings: " + json.dumps(settings), flush=True)

    def jobs_for(points):
        jobs, cached = [], 0
        for p, d, k in points:
            js = a.out_dir / "runs" / f"{case_name(p, d, k)}.json"
            if load_cached(js, settings) is not None:
                cached += 1
                continue
            jobs.append(dict(settings=settings, param=p, depth=d, k=k, threads=a.threads, json=str(js),
                             run_dir=str(a.out_dir / "runs" / case_name(p, d, k))))
        return jobs, cached

    if not a.analyze_only:
        grid = [(p, d, k) for p in a.parametrizations for d in a.depths for k in a.grids[p]]
        jobs, cached = jobs_for(grid)
        print(f"{len(grid)} grid runs: {cached} cached, {len(jobs)} to train ({a.jobs} at a time, "
              f"{a.threads} thread(s) each)", flush=True)
        run_jobs(jobs, a, cached, len(grid), t_start)
        used: dict = {}
        while True:  # extend the grid where a minimum sits on its edge
            ext = edge_extensions(a, collect(a, settings), used)
            if not ext:
                break
            print("minimum on a grid edge; extending: " + ", ".join(f"{p} d{d} 2^{k}" for p, d, k in ext), flush=True)
            jobs, cached = jobs_for(ext)
            run_jobs(jobs, a, cached, len(ext), t_start)
    data = collect(a, settings)
    table, summary = analyze(a, settings, data)
    summary["wall_s_this_invocation"] = round(time.perf_counter() - t_start, 1)
    summary["train_wall_s_sum"] = round(sum(json.loads(f.read_text()).get("wall_s", 0)
                                            for f in (a.out_dir / "runs").glob("*.json")), 1)
    (a.out_dir / "table.md").write_text(table + "\n")
    (a.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(a, data, a.png)
    print()
    print(table)
    print(f"\nfigure: {a.png}; table: {a.out_dir / 'table.md'}; wall {summary['wall_s_this_invocation'] / 60:.1f} min "
          f"(this invocation), sum of run times {summary['train_wall_s_sum'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
