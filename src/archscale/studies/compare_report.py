"""The analysis of `archscale compare` (also `archscale compare --report DIR` on a finished or partial study).

Per architecture: L(C) = A C^-b + E fitted on its runs (`fit.fit_power_law`, every seed a point, 95% CIs from its
residual bootstrap over all runs and seeds), with C = the model's own training FLOPs per token (3 x forward,
attention / scan terms included: the plan's `flops_per_token`) x the tokens the run trained (in data-scaling mode
C = tokens). The seed-to-seed spread at each size is the noise floor. Between the first architecture and each
other one: the gap of the fitted curves at every measured C with a CI (pairs of bootstrap fits), the C at which
they cross (with CI, or "no crossover in the measured range" and where the fits extrapolate one), and a verdict
that does not call a gap smaller than the noise floor. Writes report.md, report.json and scaling.png.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

from archscale.errors import UserError
from archscale.studies.analyze import run_row
from archscale.studies.fit import N_PARAMS, FitResult, fit_power_law
from archscale.studies.sweep import FINISHED, STATUS_FILE, markdown_table, read_status

LOSS = "best_val_loss"  # the minimum validation loss of a run, as ArchScale's analysis
META_FILE = "compare.json"
DEGENERATE_B = 1e-3  # a fitted exponent below this is fit.py's lower bound: no power law in the points
WINDOW = 1e6  # crossovers are searched from C_min / WINDOW to C_max * WINDOW
X_NAMES = {"flops": "C (FLOPs)", "data": "tokens"}


# ---------------------------------------------------------------- the runs

def _infer_meta(study_dir: Path) -> dict:
    """Without compare.json (runs written by hand or by another tool): group by each run's config.yaml."""
    runs, archs = {}, []
    for cfg_path in sorted(study_dir.glob("*/config.yaml")):
        pre = (yaml.safe_load(cfg_path.read_text()) or {}).get("pretrain", {}) or {}
        layout = pre.get("layout")
        label = Path(str(layout)).stem if layout else pre.get("train_model")
        if label not in archs:
            archs.append(label)
        runs[cfg_path.parent.name] = {"arch": label, "size": pre.get("depth"), "depth": pre.get("depth"),
                                      "seed": pre.get("seed"), "out_dir": str(cfg_path.parent)}
    return {"mode": "flops", "archs": [{"label": a} for a in archs], "runs": runs}


def load_runs(study_dir: Path) -> tuple[dict, list[dict]]:
    """(meta, one row per run): status from study.json, numbers from the run dir; runs that never started are
    rows too (status pending), so nothing is silently missing from the report."""
    if not study_dir.is_dir():
        raise UserError(f"--report {study_dir}: no such study directory")
    meta_path = study_dir / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else _infer_meta(study_dir)
    if not meta.get("runs"):
        raise UserError(f"--report {study_dir}: no runs found (neither {META_FILE} nor run dirs with a config.yaml)")
    recs = read_status(study_dir).get("runs", {}) if (study_dir / STATUS_FILE).is_file() else {}
    rows = []
    for name, m in meta["runs"].items():
        run_dir = Path(m.get("out_dir") or study_dir / name)
        if not run_dir.is_dir():
            run_dir = study_dir / name  # the study dir was moved
        rec = recs.get(name, {})
        base = run_row(run_dir, rec) if run_dir.is_dir() else {"status": "-", LOSS: None, "params": None,
                                                                 "tokens": None, "flops_model": None}
        status = rec.get("status") or ("unrecorded" if base[LOSS] is not None else "pending")
        x = base["flops_model"] if meta.get("mode", "flops") == "flops" else base["tokens"]
        in_fit = status in (FINISHED, "unrecorded") and base[LOSS] is not None and bool(x)
        rows.append({"run": name, "arch": m["arch"], "size": m["size"], "depth": m.get("depth"), "seed": m.get("seed"),
                     "status": status, "params": base["params"], "tokens": base["tokens"], "x": x,
                     "loss": base[LOSS], "in_fit": in_fit, "error": (rec.get("error") or "").splitlines()[-1:],
                     "eval": read_eval(run_dir)})
    return meta, rows


def read_eval(run_dir: Path) -> dict[str, float]:
    """One number per task from RUN/eval.json (`archscale eval`): ppl at each context multiple, the mean
    Phonebook / NIAH score over the lengths, lm-eval's metrics."""
    path = run_dir / "eval.json"
    if not path.is_file():
        return {}
    res = json.loads(path.read_text()).get("results", {})
    out: dict[str, float] = {}
    for k, v in (res.get("ppl", {}).get("validation") or {}).items():
        if k.endswith("x") and isinstance(v, dict) and "ppl" in v:
            out[f"ppl@{k}"] = float(v["ppl"])
    for task, key in (("phonebook", "mean"), ("niah_single_1", "score"), ("niah_single_2", "score"),
                      ("niah_single_3", "score")):
        lengths = (res.get(task) or {}).get("lengths") or {}
        if lengths:
            out[task] = float(np.mean([v[key] for v in lengths.values()]))
    for task, metrics in ((res.get("lm_eval") or {}).get("tasks") or {}).items():
        for k, v in metrics.items():
            out[f"{task}:{k}"] = float(v)
    return out


# ---------------------------------------------------------------- per architecture

def cells(rows: list[dict], arch: str) -> list[dict]:
    """Per size of `arch`: the fit points' seeds, mean loss, seed spread (std with ddof 1; None with one seed)."""
    out = []
    for size in sorted({r["size"] for r in rows if r["arch"] == arch and r["in_fit"]}):
        pts = [r for r in rows if r["arch"] == arch and r["size"] == size and r["in_fit"]]
        losses = np.array([r["loss"] for r in pts])
        out.append({"size": size, "x": float(np.mean([r["x"] for r in pts])), "n_seeds": len(pts),
                    "mean": float(losses.mean()), "std": float(losses.std(ddof=1)) if len(pts) > 1 else None,
                    "min": float(losses.min()), "max": float(losses.max())})
    return out


def fit_arch(rows: list[dict], arch: str, n_bootstrap: int, seed: int) -> dict[str, Any]:
    """The law for one architecture, or why not (fewer than three sizes: three parameters need three)."""
    pts = [r for r in rows if r["arch"] == arch and r["in_fit"]]
    n_sizes = len({r["size"] for r in pts})
    if n_sizes < N_PARAMS:
        return {"fit": None, "n_points": len(pts), "n_sizes": n_sizes,
                "refused": f"{n_sizes} size(s) with finished runs: a 3-parameter law L = A C^-b + E needs at least "
                           f"{N_PARAMS}, so only the points are reported"}
    notes: list[str] = []
    fit = fit_power_law([r["x"] for r in pts], [r["loss"] for r in pts], n_bootstrap=n_bootstrap, seed=seed,
                        name=arch, warn=notes.append)
    degenerate = None
    if fit.b < DEGENERATE_B:  # b on its lower bound: the points do not fall with compute, the law says nothing
        degenerate = (f"its fit is degenerate (b = {fit.b:.2g}: the loss does not fall with compute over these "
                      "sizes, so L = A C^-b + E does not describe them)")
        notes.append(f"{arch}: {degenerate}")
    return {"fit": fit, "n_points": len(pts), "n_sizes": n_sizes, "refused": None, "degenerate": degenerate,
            "notes": notes}


def predict_samples(fit: FitResult, x: np.ndarray) -> Optional[np.ndarray]:
    """(bootstrap samples, len(x)) predictions, or None without a bootstrap."""
    if fit.samples is None or not len(fit.samples):
        return None
    s = fit.samples
    return s[:, :1] * np.exp(-s[:, 1:2] * np.log(x)[None, :]) + s[:, 2:3]


def noise_floor(cell_lists: list[list[dict]]) -> Optional[float]:
    """The largest seed-to-seed standard deviation over the sizes measured with two or more seeds (None: unknown)."""
    stds = [c["std"] for cl in cell_lists for c in cl if c["std"] is not None]
    return max(stds) if stds else None


# ---------------------------------------------------------------- between two architectures

def crossings(fa: FitResult, fb: FitResult, lo: float, hi: float, n: int = 4000) -> list[float]:
    """Every C in [lo, hi] where the two fitted curves cross (sign changes on a log grid, refined linearly)."""
    grid = np.geomspace(lo, hi, n)
    d = fa.predict(grid) - fb.predict(grid)
    return _roots(grid, d)


def _roots(grid: np.ndarray, d: np.ndarray) -> list[float]:
    idx = np.nonzero(np.sign(d[:-1]) * np.sign(d[1:]) < 0)[0]
    lg = np.log(grid)
    return [float(np.exp(lg[i] - d[i] * (lg[i + 1] - lg[i]) / (d[i + 1] - d[i]))) for i in idx]


def crossover(fa: FitResult, fb: FitResult, x_lo: float, x_hi: float) -> dict[str, Any]:
    """The crossover of the fits (inside [x_lo, x_hi], or the nearest extrapolated one within WINDOW) with a
    95% interval over paired bootstrap fits (the sample's crossing nearest the estimate)."""
    lo, hi = x_lo / WINDOW, x_hi * WINDOW
    roots = crossings(fa, fb, lo, hi)
    inside = [r for r in roots if x_lo <= r <= x_hi]
    out: dict[str, Any] = {"measured_range": [x_lo, x_hi], "search_range": [lo, hi], "all": roots,
                           "in_range": bool(inside), "at": None, "ci": None, "frac_resamples": None}
    if not roots:
        return out
    est = inside[0] if inside else min(roots, key=lambda r: min(abs(math.log(r / x_lo)), abs(math.log(r / x_hi))))
    out["at"] = est
    grid = np.geomspace(lo, hi, 1500)
    pa, pb = predict_samples(fa, grid), predict_samples(fb, grid)
    if pa is None or pb is None:
        return out
    k = min(len(pa), len(pb))
    near = []
    for i in range(k):
        rs = _roots(grid, pa[i] - pb[i])
        if rs:
            near.append(min(rs, key=lambda r: abs(math.log(r / est))))
    out["frac_resamples"] = len(near) / k
    if near:
        out["ci"] = np.percentile(near, [2.5, 97.5]).tolist()
    return out


def gaps(fa: FitResult, fb: FitResult, xs: list[float], floor: Optional[float]) -> list[dict]:
    """At each measured C: L_b - L_a from the fits, its 95% CI (paired bootstrap fits), and whether it is called:
    the CI excludes 0 and the gap exceeds the noise floor."""
    x = np.asarray(xs, float)
    la, lb = fa.predict(x), fb.predict(x)
    pa, pb = predict_samples(fa, x), predict_samples(fb, x)
    out = []
    for i, xi in enumerate(xs):
        g = float(lb[i] - la[i])
        ci = None
        if pa is not None and pb is not None:
            k = min(len(pa), len(pb))
            ci = np.percentile(pb[:k, i] - pa[:k, i], [2.5, 97.5]).tolist()
        excludes_zero = ci is not None and (ci[0] > 0 or ci[1] < 0)
        called = bool(excludes_zero and floor is not None and abs(g) > floor)
        out.append({"x": float(xi), "loss_a": float(la[i]), "loss_b": float(lb[i]), "gap": g, "ci": ci,
                    "called": called})
    return out


def _ci_text(ci: Optional[list[float]], fmt: str = ".3f") -> str:
    return f" [{ci[0]:{fmt}}, {ci[1]:{fmt}}]" if ci else " [no CI]"


def crossover_sentence(cr: Optional[dict], xname: str) -> str:
    if not cr or cr["at"] is None:
        return f" The fits do not cross in the measured range, nor within a factor {WINDOW:.0e} beyond it."
    ci = (f", 95% CI [{cr['ci'][0]:.3g}, {cr['ci'][1]:.3g}] ({cr['frac_resamples']:.0%} of the bootstrap "
          "resamples cross)" if cr["ci"] else ", no CI")
    if cr["in_range"]:
        return f" The fitted curves cross at {xname} = {cr['at']:.3g}{ci}."
    side = "above" if cr["at"] > cr["measured_range"][1] else "below"
    return (f" No crossover in the measured range; the fits extrapolate one at {xname} = {cr['at']:.3g} ({side} "
            f"the measured range{ci}).")


def verdict(a: str, b: str, cmp: dict, xname: str) -> str:
    """One sentence (or two) that calls a gap only where its CI excludes 0 and it exceeds the noise floor."""
    g, floor = cmp["gaps"], cmp["noise_floor"]
    if cmp.get("refused"):
        return f"No verdict: {cmp['refused']}."
    cross = crossover_sentence(cmp["crossover"], xname)
    last = g[-1]
    if floor is None:
        return (f"No verdict: one seed per size, so the seed-to-seed spread (the noise floor) is unknown; the fitted "
                f"gap {b} - {a} at the largest measured {xname} ({last['x']:.3g}) is {last['gap']:+.3f} nats"
                f"{_ci_text(last['ci'])}, but it cannot be told apart from seed noise (run with --seeds 2 or more)."
                + cross)
    called = [x for x in g if x["called"]]
    if not called:
        biggest = max(abs(x["gap"]) for x in g)
        return (f"No difference can be called between {a} and {b}: at every measured {xname} the gap (at most "
                f"{biggest:.3f} nats) is within the seed noise floor ({floor:.3f} nats) or its 95% CI includes 0."
                + cross)
    winner = lambda x: a if x["gap"] > 0 else b  # noqa: E731  (gap = L_b - L_a: positive means a is lower)
    winners = {winner(x) for x in called}
    if len(called) == len(g) and len(winners) == 1:
        w = winners.pop()
        mags = [abs(x["gap"]) for x in g]
        return (f"{w} reaches a lower loss than {b if w == a else a} at every measured {xname} ({g[0]['x']:.3g} to "
                f"{g[-1]['x']:.3g}), by {min(mags):.3f} to {max(mags):.3f} nats, each above the seed noise floor "
                f"({floor:.3f} nats) with a 95% CI that excludes 0." + cross)
    parts = []
    for w in sorted(winners, key=lambda w: min(x["x"] for x in called if winner(x) == w)):  # by compute
        xs = [x for x in called if winner(x) == w]
        parts.append(f"{w} is lower at {xname} = {', '.join(format(x['x'], '.3g') for x in xs)} (by up to "
                     f"{max(abs(x['gap']) for x in xs):.3f} nats)")
    rest = (f"; at the other measured {xname} the gap is within the seed noise floor ({floor:.3f} nats) or its "
            "95% CI includes 0" if len(called) < len(g) else f", each above the seed noise floor ({floor:.3f} nats)")
    return "; ".join(parts) + rest + "." + cross


def compare_pair(a: str, b: str, fits: dict, cells_by: dict, xname: str) -> dict[str, Any]:
    floor = noise_floor([cells_by[a], cells_by[b]])
    out: dict[str, Any] = {"a": a, "b": b, "noise_floor": floor, "gaps": [], "crossover": None, "refused": None}
    missing = [arch for arch in (a, b) if fits[arch]["fit"] is None or fits[arch].get("degenerate")]
    if missing:
        out["refused"] = "; ".join(f"{arch} has {fits[arch]['refused']}" if fits[arch]["fit"] is None else
                                   f"for {arch}, {fits[arch]['degenerate']}" for arch in missing)
    else:
        fa, fb = fits[a]["fit"], fits[b]["fit"]
        xs = sorted({c["x"] for c in cells_by[a] + cells_by[b]})
        out["gaps"] = gaps(fa, fb, xs, floor)
        out["crossover"] = crossover(fa, fb, xs[0], xs[-1])
    out["verdict"] = verdict(a, b, out, xname)
    return out


def analyze_compare(study_dir: str | Path, n_bootstrap: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Everything the report shows, as a dict (FitResult objects under "fits"; report.json gets plain JSON)."""
    study_dir = Path(study_dir)
    meta, rows = load_runs(study_dir)
    archs = [a["label"] for a in meta["archs"]]
    mode = meta.get("mode", "flops")
    xname = "C" if mode == "flops" else "tokens"
    cells_by = {a: cells(rows, a) for a in archs}
    fits = {a: fit_arch(rows, a, n_bootstrap, seed) for a in archs}
    pairs = [compare_pair(archs[0], b, fits, cells_by, xname) for b in archs[1:]]
    return {"study_dir": str(study_dir), "mode": mode, "x": xname, "loss": LOSS, "archs": archs, "rows": rows,
            "cells": cells_by, "fits": fits, "comparisons": pairs, "budget": meta.get("budget"),
            "seeds": sorted({r["seed"] for r in rows if r["seed"] is not None})}


# ---------------------------------------------------------------- report.md / report.json

def _num(v: Any, fmt: str = ".3g") -> str:
    return "" if v is None else format(v, fmt)


def runs_table(rep: dict) -> str:
    eval_cols = sorted({k for r in rep["rows"] for k in r["eval"]})
    size = "depth" if rep["mode"] == "flops" else "tokens (planned)"
    head = ["run", "arch", size, "seed", "status", "params", "tokens", X_NAMES[rep["mode"]], LOSS, "in fit",
            *eval_cols]
    body = [[r["run"], r["arch"], str(r["size"]), str(r["seed"]), r["status"], _num(r["params"]), _num(r["tokens"]),
             _num(r["x"]), _num(r["loss"], ".4f"), "yes" if r["in_fit"] else "no",
             *[_num(r["eval"].get(c), ".4g") for c in eval_cols]] for r in rep["rows"]]
    return markdown_table(head, body)


def spread_table(rep: dict) -> str:
    body = []
    for a in rep["archs"]:
        for c in rep["cells"][a]:
            std = _num(c["std"], ".4f") if c["std"] is not None else "unknown (1 seed)"
            body.append([a, str(c["size"]), _num(c["x"]), str(c["n_seeds"]), _num(c["mean"], ".4f"), std,
                         f"{c['max'] - c['min']:.4f}" if c["n_seeds"] > 1 else "-"])
    return markdown_table(["arch", "size", X_NAMES[rep["mode"]], "seeds", "mean loss", "seed std", "seed range"],
                          body or [["-"] * 7])


def fits_table(rep: dict) -> str:
    body = []
    for a in rep["archs"]:
        f = rep["fits"][a]
        r = f["fit"]
        if r is None:
            body.append([a, str(f["n_points"]), str(f["n_sizes"]), "-", "-", "-", "-", "refused: " + f["refused"]])
            continue
        note = "; ".join(n.removeprefix("warning: ").removeprefix(f"{a}: ") for n in f["notes"]) or "-"
        body.append([a, str(f["n_points"]), str(f["n_sizes"]), f"{r.A:.4g}{_ci_text(r.A_ci, '.4g')}",
                     f"{r.b:.4f}{_ci_text(r.b_ci, '.4f')}", f"{r.C:.4f}{_ci_text(r.C_ci, '.4f')}", f"{r.rmse:.3g}",
                     note])
    return markdown_table(["arch", "points", "sizes", "A", "b", "E", "rmse", "note"], body)


def gaps_table(cmp: dict, xname: str) -> str:
    floor = _num(cmp["noise_floor"], ".4f") if cmp["noise_floor"] is not None else "unknown"
    body = [[_num(g["x"]), f"{g['loss_a']:.4f}", f"{g['loss_b']:.4f}", f"{g['gap']:+.4f}", _ci_text(g["ci"], "+.4f"),
             floor, "yes" if g["called"] else "no"] for g in cmp["gaps"]]
    return markdown_table([xname, f"L({cmp['a']}) fit", f"L({cmp['b']}) fit",
                           f"gap {cmp['b']} - {cmp['a']}", "95% CI", "noise floor", "called"], body)


def render_md(rep: dict, png_name: Optional[str]) -> str:
    xdef = ("C = the model's own training FLOPs per token (3 x forward, attention and scan terms included; "
            "the plan's `flops_per_token`) x the tokens each run trained" if rep["mode"] == "flops" else
            "x = the tokens each run trained (data scaling at one depth)")
    lines = [f"# compare: {' vs '.join(rep['archs'])} ({rep['mode']} scaling)", "",
             f"Study `{rep['study_dir']}`; loss = each run's minimum validation loss; {xdef}. Fits: L = A x^-b + E, "
             "95% CIs from a residual bootstrap over every run and seed. Noise floor = the largest seed-to-seed "
             "standard deviation at any size of the two architectures; a gap is called only where its 95% CI "
             "excludes 0 and it exceeds the noise floor.", "", "## Runs", "", runs_table(rep)]
    dropped = [r for r in rep["rows"] if not r["in_fit"]]
    if dropped:
        lines += ["", "Not in the fits: " + "; ".join(
            f"{r['run']} ({r['status']}{': ' + r['error'][0] if r['error'] else ''})" for r in dropped) + "."]
    lines += ["", "## Seed spread per size (the noise floor)", "", spread_table(rep)]
    if len(rep["seeds"]) <= 1:
        lines += ["", "One seed per size: the seed-to-seed spread is unknown, so no gap can be told apart from "
                  "seed noise (run with --seeds 2 or more)."]
    lines += ["", f"## Fits: L({rep['x']}) = A {rep['x']}^-b + E", "", fits_table(rep)]
    for cmp in rep["comparisons"]:
        lines += ["", f"## {cmp['b']} vs {cmp['a']}", ""]
        if cmp["gaps"]:
            lines += [gaps_table(cmp, rep["x"]), ""]
        lines += [f"**Verdict:** {cmp['verdict']}"]
    if png_name:
        lines += ["", f"![scaling]({png_name})"]
    return "\n".join(lines) + "\n"


def to_json(rep: dict) -> dict:
    from dataclasses import asdict

    fits = {}
    for a, f in rep["fits"].items():
        r = f["fit"]
        fits[a] = {**{k: v for k, v in f.items() if k != "fit"},
                   "fit": None if r is None else {k: v for k, v in asdict(r).items() if k != "samples"}}
    return {**{k: v for k, v in rep.items() if k != "fits"}, "fits": fits}


# ---------------------------------------------------------------- scaling.png

def _plot_arch(ax, rep: dict, arch: str, color, span: tuple[float, float]) -> None:
    cl = rep["cells"][arch]
    if cl:
        x = np.array([c["x"] for c in cl])
        mean = np.array([c["mean"] for c in cl])
        err = np.array([[c["mean"] - c["min"] for c in cl], [c["max"] - c["mean"] for c in cl]])
        ax.errorbar(x, mean, yerr=err, fmt="o", ms=5, capsize=4, color=color,
                    label=f"{arch}: mean of seeds (bars: seed range)")
    pts = [r for r in rep["rows"] if r["arch"] == arch and r["in_fit"]]
    ax.plot([r["x"] for r in pts], [r["loss"] for r in pts], ".", color=color, alpha=0.5)
    out = [r for r in rep["rows"] if r["arch"] == arch and not r["in_fit"] and r["x"] and r["loss"] is not None]
    if out:
        ax.plot([r["x"] for r in out], [r["loss"] for r in out], "x", color=color, ms=8,
                label=f"{arch}: not in the fit ({', '.join(sorted({r['status'] for r in out}))})")
    fit = rep["fits"][arch]["fit"]
    if fit is None:
        return
    grid = np.geomspace(*span, 300)
    ax.plot(grid, fit.predict(grid), "-", color=color, lw=1.5,
            label=f"{arch} fit: {fit.A:.3g} x^-{fit.b:.3f} + {fit.C:.3f}")
    band = predict_samples(fit, grid)
    if band is not None:
        lo, hi = np.percentile(band, [2.5, 97.5], axis=0)
        ax.fill_between(grid, lo, hi, color=color, alpha=0.15, lw=0)


def _span(rep: dict) -> tuple[float, float]:
    """The x range drawn: the measured points, widened a little, and out to a nearby extrapolated crossover."""
    xs = [r["x"] for r in rep["rows"] if r["x"]]
    lo, hi = min(xs) / 1.5, max(xs) * 1.5
    for cmp in rep["comparisons"]:
        at = (cmp["crossover"] or {}).get("at")
        if at and hi / 1e3 < at < lo * 1e3:
            lo, hi = min(lo, at / 1.5), max(hi, at * 1.5)
    return lo, hi


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.6), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if any(r["x"] for r in rep["rows"]):
        span = _span(rep)
        for i, arch in enumerate(rep["archs"]):
            _plot_arch(ax, rep, arch, colors[i % len(colors)], span)
        for cmp in rep["comparisons"]:
            cr = cmp["crossover"] or {}
            if cr.get("at") and span[0] <= cr["at"] <= span[1]:
                ax.axvline(cr["at"], color="k", ls=":", lw=1,
                           label=f"crossover {cmp['b']} / {cmp['a']}: {cr['at']:.3g}"
                                 + ("" if cr["in_range"] else " (extrapolated)"))
                if cr.get("ci"):
                    ax.axvspan(max(cr["ci"][0], span[0]), min(cr["ci"][1], span[1]), color="k", alpha=0.07, lw=0)
        ax.set_xscale("log")
    ax.set_xlabel(X_NAMES[rep["mode"]] + (" = model FLOPs/token x tokens" if rep["mode"] == "flops" else ""))
    ax.set_ylabel("validation loss (min over the run)")
    ax.set_title(f"{' vs '.join(rep['archs'])}: fits with 95% bootstrap bands")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(study_dir: str | Path, n_bootstrap: int = 1000, seed: int = 0, png: bool = True) -> dict:
    """Analyse STUDY_DIR and write report.md, report.json and scaling.png into it; returns the analysis with
    the paths (md, json, png) and the Markdown text."""
    study_dir = Path(study_dir)
    rep = analyze_compare(study_dir, n_bootstrap=n_bootstrap, seed=seed)
    png_path = study_dir / "scaling.png" if png else None
    if png_path:
        plot(rep, png_path)
    text = render_md(rep, png_path.name if png_path else None)
    (study_dir / "report.md").write_text(text)
    (study_dir / "report.json").write_text(json.dumps(to_json(rep), indent=1, default=str))
    return {**rep, "text": text, "md": study_dir / "report.md", "json": study_dir / "report.json", "png": png_path}
