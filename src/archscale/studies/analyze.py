"""`archscale analyze STUDY_DIR`: one table of every run, and the best configuration of an LR x batch sweep.

Reads every run dir under STUDY_DIR (a folder with `metrics.csv`; `config.yaml` and `study.json` add sizes,
overrides and status), and writes `STUDY_DIR/analysis/runs.csv`, `runs.md` and a PNG:
- params N (non-embedding), tokens T actually trained, FLOPs = 6NT, and `flops_model` = the model's analytic
  FLOPs per token (attention included) x T;
- the final and the best (minimum) `val_loss` of each run (ArchScale's sweep analysis takes the minimum);
- when the runs differ in LR (`base_hps.eta0`), the best configuration and, per batch size with at least three
  LRs, a quadratic fit of best val_loss against log2(LR) and the LR at its minimum.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

from archscale.errors import UserError
from archscale.studies.sweep import STATUS_FILE, format_value, markdown_table, read_status, val_losses

COLUMNS = ["run", "status", "overrides", "train_model", "depth", "lr", "batch", "params", "tokens", "flops",
           "flops_model", "final_val_loss", "best_val_loss", "final_train_loss", "duration_s"]
# seed-style run names: hp_sweep_lr4e-4_bs4194304
NAME_LR = re.compile(r"lr([0-9.]+(?:e-?[0-9]+)?)", re.I)
NAME_BS = re.compile(r"bs([0-9]+)", re.I)


def find_runs(study_dir: Path) -> list[Path]:
    study_dir = Path(study_dir)
    if not study_dir.is_dir():
        raise UserError(f"{study_dir}: no such study directory")
    runs = sorted({p.parent for p in study_dir.glob("*/metrics.csv")}
                  | {p.parent for p in study_dir.glob("*/*/metrics.csv") if p.parent.parent.name != "analysis"})
    if (study_dir / "metrics.csv").is_file():
        runs.insert(0, study_dir)
    return runs


def run_row(run_dir: Path, rec: Optional[dict] = None) -> dict[str, Any]:
    rec = rec or {}
    cfg_path = run_dir / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text()) if cfg_path.is_file() else {}
    pre, plan = (cfg or {}).get("pretrain", {}) or {}, (cfg or {}).get("plan", {}) or {}
    hps = pre.get("base_hps") or {}
    losses = val_losses(run_dir)
    n = plan.get("non_embedding_params")
    tokens = losses["tokens"] if losses["tokens"] else plan.get("total_tokens")
    lr, bs = hps.get("eta0"), hps.get("b0")
    m = NAME_LR.search(run_dir.name)
    if lr is None and m:
        lr = float(m.group(1))
    m = NAME_BS.search(run_dir.name)
    if bs is None and m:
        bs = int(m.group(1))
    fpt = plan.get("flops_per_token")
    return {
        "run": run_dir.name, "status": rec.get("status", "-"),
        "overrides": " ".join(f"{k}={format_value(v)}" for k, v in (rec.get("overrides") or {}).items()) or "-",
        "train_model": pre.get("train_model"), "depth": pre.get("depth"), "lr": lr,
        "batch": plan.get("batch_tokens") or bs, "params": n, "tokens": tokens,
        "flops": 6.0 * n * tokens if n and tokens else None,
        "flops_model": float(fpt) * tokens if fpt and tokens else None,
        "final_val_loss": losses["final_val_loss"], "best_val_loss": losses["best_val_loss"],
        "final_train_loss": losses["final_train_loss"],
        "duration_s": rec.get("total_duration_s", rec.get("duration_s")),
    }


def collect(study_dir: str | Path) -> list[dict[str, Any]]:
    study_dir = Path(study_dir)
    recs = read_status(study_dir).get("runs", {}) if (study_dir / STATUS_FILE).is_file() else {}
    rows = [run_row(d, recs.get(d.name)) for d in find_runs(study_dir)]
    num = lambda v: (v is None, float(v) if isinstance(v, (int, float)) else 0.0)  # noqa: E731
    rows.sort(key=lambda r: (str(r["train_model"]), num(r["depth"]), num(r["params"]), num(r["lr"]),
                             num(r["batch"]), num(r["tokens"]), r["run"]))
    if not rows:
        raise UserError(f"{study_dir}: no run dirs with a metrics.csv below it (run `archscale sweep` first)")
    return rows


def _cell(v: Any, col: str = "") -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if v != 0 and abs(v) >= 1e5:
            return f"{v:.3e}"
        if "loss" in col:
            return f"{v:.4f}"
        return f"{v:.4g}"
    return str(v)


def lr_analysis(rows: list[dict]) -> Optional[dict]:
    """Best configuration, and per batch a quadratic fit of best val_loss vs log2(lr); None if lr is constant."""
    ok = [r for r in rows if r["lr"] is not None and r["best_val_loss"] is not None]
    if len({r["lr"] for r in ok}) < 2:
        return None
    best = min(ok, key=lambda r: r["best_val_loss"])
    fits = {}
    for bs in sorted({r["batch"] for r in ok}, key=lambda b: (b is None, b)):
        pts = [r for r in ok if r["batch"] == bs]
        x = np.log2([float(r["lr"]) for r in pts])
        y = np.array([r["best_val_loss"] for r in pts])
        fit = {"n_points": len(pts), "best_lr_measured": float(pts[int(np.argmin(y))]["lr"]),
               "best_loss_measured": float(y.min())}
        if len(set(x.tolist())) >= 3:
            a, b, c = np.polyfit(x, y, 2)
            fit.update(coeffs=[float(a), float(b), float(c)])
            if a > 0:
                xm = -b / (2 * a)
                fit.update(lr_opt=float(2 ** xm), loss_opt=float(c - b * b / (4 * a)),
                           inside_range=bool(x.min() <= xm <= x.max()))
        fits[str(bs)] = fit
    return {"best": {"run": best["run"], "lr": best["lr"], "batch": best["batch"],
                     "best_val_loss": best["best_val_loss"]}, "per_batch": fits}


def analyze(study_dir: str | Path, out_dir: Optional[str | Path] = None, plot: bool = True) -> dict:
    study_dir = Path(study_dir)
    rows = collect(study_dir)
    out = Path(out_dir) if out_dir else study_dir / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "runs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows([{k: ("" if r[k] is None else r[k]) for k in COLUMNS} for r in rows])
    show = [c for c in COLUMNS if any(r[c] not in (None, "-", "") for r in rows)]
    table = markdown_table(show, [[_cell(r[c], c) for c in show] for r in rows])
    lr = lr_analysis(rows)
    text = [table]
    if lr:
        b = lr["best"]
        text.append(f"\nbest configuration: {b['run']} (lr {b['lr']}, batch {b['batch']}): best val_loss "
                    f"{b['best_val_loss']:.4f}")
        for bs, f in lr["per_batch"].items():
            if "lr_opt" in f:
                text.append(f"batch {bs}: quadratic fit in log2(lr) has its minimum at lr {f['lr_opt']:.3g} "
                            f"(loss {f['loss_opt']:.4f}{'' if f['inside_range'] else ', outside the swept range'})")
            elif "coeffs" in f:
                text.append(f"batch {bs}: the quadratic fit in log2(lr) opens downwards (no minimum); "
                            f"best measured lr {f['best_lr_measured']:g}")
    report = "\n".join(text)
    (out / "runs.md").write_text(f"# {study_dir.name}\n\n{report}\n")
    (out / "summary.json").write_text(json.dumps({"runs": rows, "lr_sweep": lr}, indent=2, default=str))
    png = None
    if plot:
        png = out / ("lr_sweep.png" if lr else "loss_vs_flops.png")
        (plot_lr(rows, lr, png) if lr else plot_flops(rows, png))
    return {"rows": rows, "lr_sweep": lr, "report": report, "csv": out / "runs.csv", "md": out / "runs.md",
            "png": png}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_lr(rows: list[dict], lr: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for bs, f in lr["per_batch"].items():
        pts = sorted([r for r in rows if str(r["batch"]) == bs and r["best_val_loss"] is not None and r["lr"]],
                     key=lambda r: r["lr"])
        x = np.log2([float(r["lr"]) for r in pts])
        line = ax.plot(x, [r["best_val_loss"] for r in pts], "o", label=f"batch {bs}")[0]
        if "coeffs" in f:
            xs = np.linspace(x.min() - 0.3, x.max() + 0.3, 100)
            ax.plot(xs, np.polyval(f["coeffs"], xs), "-", color=line.get_color(), alpha=0.6)
    b = lr["best"]
    ax.plot([math.log2(float(b["lr"]))], [b["best_val_loss"]], "k*", ms=12, label=f"best: {b['run']}")
    ax.set_xlabel("log2(base LR eta0)")
    ax.set_ylabel("best val_loss")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_flops(rows: list[dict], path: Path) -> None:
    plt = _plt()
    pts = [r for r in rows if r["flops"] and r["best_val_loss"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    if pts:
        ax.loglog([r["flops"] for r in pts], [r["best_val_loss"] for r in pts], "o")
        for r in pts:
            ax.annotate(r["run"], (r["flops"], r["best_val_loss"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xlabel("FLOPs = 6NT")
    ax.set_ylabel("best val_loss")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
