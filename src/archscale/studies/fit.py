"""`archscale fit`: fit `L = A * X^-b + C` (X = FLOPs, tokens or parameters) with bootstrap 95% CIs.

Sources: study dirs (the `archscale analyze` table; one series per dir, or per `--group COL`) or a CSV
(`--csv FILE --x COL --y COL [--group COL]`). The fit runs on X / X0 (X0 = the geometric mean of X, so the
numbers stay well conditioned at 1e21 FLOPs) with bounds b > 0, 0 <= C <= min(L), from the best start of a
scan over C; the reported A is for X itself. CIs come from a residual bootstrap (the data's own x values are
kept, so a handful of depths still gives meaningful intervals). It refuses fewer points (distinct X) than
parameters and warns when C sits on a bound (then the irreducible loss is not identified by the data).
"""

from __future__ import annotations

import csv
import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from archscale.errors import UserError

N_PARAMS = 3


@dataclass
class FitResult:
    A: float
    b: float
    C: float
    A_ci: Optional[list[float]]
    b_ci: Optional[list[float]]
    C_ci: Optional[list[float]]
    n_points: int
    x0: float
    rmse: float
    C_at_bound: Optional[str] = None
    n_bootstrap: int = 0
    warnings: list[str] = field(default_factory=list)
    target: Optional[float] = None
    prediction: Optional[float] = None
    prediction_ci: Optional[list[float]] = None
    # the bootstrap's (A, b, C) rows, for intervals of derived quantities (`archscale compare`'s gaps and
    # crossovers); left out of to_json
    samples: Optional[np.ndarray] = field(default=None, repr=False)

    def predict(self, x) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        return self.A * np.exp(-self.b * np.log(x)) + self.C


def _model(u, loga, b, c):
    return np.exp(loga - b * np.log(u)) + c


def _fit_once(u: np.ndarray, y: np.ndarray, c_max: float, start=None) -> tuple[float, float, float]:
    from scipy.optimize import curve_fit

    if start is None:  # scan C, solving log(y - C) = log a - b log u by least squares; keep the best in y-space
        best = None
        for c in np.linspace(0.0, c_max, 41)[:-1]:
            r = y - c
            if np.any(r <= 0):
                continue
            slope, inter = np.polyfit(np.log(u), np.log(r), 1)
            b = max(-slope, 1e-4)
            sse = float(np.sum((_model(u, inter, b, c) - y) ** 2))
            if best is None or sse < best[0]:
                best = (sse, inter, b, c)
        start = best[1:] if best else (math.log(max(float(np.mean(y)), 1e-9)), 0.1, 0.0)
    lo, hi = [-np.inf, 1e-9, 0.0], [np.inf, 20.0, c_max]
    p0 = [start[0], min(max(start[1], 2e-9), 19.9), min(max(start[2], 0.0), c_max * (1 - 1e-9))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        popt, _ = curve_fit(_model, u, y, p0=p0, bounds=(lo, hi), method="trf", maxfev=20000,
                            x_scale=[1.0, 0.1, max(c_max, 1e-9)])
    return float(popt[0]), float(popt[1]), float(popt[2])


def fit_power_law(x, y, n_bootstrap: int = 1000, seed: int = 0, target: Optional[float] = None,
                  name: str = "series", warn: Callable[[str], None] = print) -> FitResult:
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = np.isfinite(x) & np.isfinite(y)
    if (~keep).any():
        warn(f"warning: {name}: dropped {int((~keep).sum())} point(s) with a missing or non-finite value")
        x, y = x[keep], y[keep]
    if np.any(x <= 0):
        raise UserError(f"{name}: X must be > 0 for a power law (got {x[x <= 0][:3].tolist()})")
    if np.any(y <= 0):
        raise UserError(f"{name}: the loss must be > 0 (got {y[y <= 0][:3].tolist()})")
    n, distinct = len(x), len(np.unique(x))
    if n < N_PARAMS or distinct < N_PARAMS:
        raise UserError(f"{name}: {n} point(s) at {distinct} distinct X; fitting L = A*X^-b + C needs at least "
                        f"{N_PARAMS} distinct X (add runs, or fit fewer series)")
    notes = []
    if n == N_PARAMS:
        notes.append(f"{name}: {n} points for {N_PARAMS} parameters: no residual degrees of freedom, so no bootstrap "
                     "CIs (reported as null / 'no CI')")
    x0 = float(np.exp(np.mean(np.log(x))))
    u = x / x0
    c_max = float(y.min())
    loga, b, c = _fit_once(u, y, c_max)
    fitted = _model(u, loga, b, c)
    resid = y - fitted
    rmse = float(np.sqrt(np.mean(resid ** 2)))
    A = float(math.exp(loga + b * math.log(x0)))
    tol = 1e-3 * max(float(y.max() - y.min()), 1e-6)
    at_bound = "lower (C = 0)" if c <= tol else "upper (C = min L)" if c >= c_max - tol else None
    if at_bound:
        notes.append(f"{name}: C ran into its {at_bound} bound; the irreducible loss is not identified by these "
                     "points (more scale range, or fix C)")
    # residual bootstrap (residuals rescaled for the 3 fitted degrees of freedom)
    boots = []
    if n_bootstrap > 0 and n > N_PARAMS:
        rng = np.random.default_rng(seed)
        scaled = resid * math.sqrt(n / (n - N_PARAMS))
        failures = 0
        for _ in range(n_bootstrap):
            yb = fitted + rng.choice(scaled, size=n, replace=True)
            try:
                la, bb, cb = _fit_once(u, yb, max(float(yb.min()), 1e-12), start=(loga, b, min(c, yb.min())))
            except (RuntimeError, ValueError):
                failures += 1
                continue
            boots.append((math.exp(la + bb * math.log(x0)), bb, cb))
        if failures > n_bootstrap // 10:
            notes.append(f"{name}: {failures} of {n_bootstrap} bootstrap fits failed")
    if boots:
        arr = np.array(boots)
        ci = [np.percentile(arr[:, i], [2.5, 97.5]).tolist() for i in range(3)]
        # A's spread is log-normal-like: percentiles are still the honest interval
    else:
        ci = [None, None, None]  # no bootstrap (n == 3 or --bootstrap 0): JSON null, printed as "no CI"
    res = FitResult(A=A, b=b, C=c, A_ci=ci[0], b_ci=ci[1], C_ci=ci[2], n_points=n, x0=x0, rmse=rmse,
                    C_at_bound=at_bound, n_bootstrap=len(boots), warnings=notes,
                    samples=np.array(boots) if boots else None)
    if target is not None:
        res.target = float(target)
        res.prediction = float(res.predict(target))
        if boots:
            preds = arr[:, 0] * np.exp(-arr[:, 1] * math.log(target)) + arr[:, 2]
            res.prediction_ci = np.percentile(preds, [2.5, 97.5]).tolist()
    for m in notes:
        warn(f"warning: {m}")
    return res


# ---------------------------------------------------------------- data sources

def series_from_csv(path: str | Path, xcol: str, ycol: str, group: Optional[str]) -> dict[str, tuple[list, list]]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--csv {path}: no such file")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise UserError(f"--csv {path}: no rows")
    for col, flag in ((xcol, "--x"), (ycol, "--y"), (group, "--group")):
        if col and col not in rows[0]:
            raise UserError(f"{flag} {col}: {path} has no such column (columns: {', '.join(rows[0])})")
    return _group(rows, xcol, ycol, group, default=path.stem)


def _num(v) -> float:
    try:
        return float(v) if v not in (None, "") else float("nan")
    except (TypeError, ValueError):
        return float("nan")


def _group(rows: list[dict], xcol: str, ycol: str, group: Optional[str], default: str):
    out: dict[str, tuple[list, list]] = {}
    for r in rows:
        key = str(r.get(group)) if group else default
        xs, ys = out.setdefault(key, ([], []))
        xs.append(_num(r.get(xcol)))
        ys.append(_num(r.get(ycol)))
    return out


def series_from_studies(dirs: list[str], xcol: str, ycol: str, group: Optional[str]):
    from archscale.studies.analyze import COLUMNS, collect

    rows = []
    for d in dirs:
        for r in collect(d):
            rows.append({**r, "study": Path(d).name})
    cols = COLUMNS + ["study"]
    for col, flag in ((xcol, "--x"), (ycol, "--y"), (group, "--group")):
        if col and col not in cols:
            raise UserError(f"{flag} {col}: a study table has the columns {', '.join(cols)}")
    return _group(rows, xcol, ycol, group or "study", default="")


# ---------------------------------------------------------------- report

def _fmt(v: float) -> str:
    return f"{v:.4g}"


def report(results: dict[str, FitResult], xname: str) -> str:
    lines = [f"fit L = A * {xname}^-b + C (95% bootstrap CIs)"]
    for name, r in results.items():
        ci = lambda v, fmt: f" [{v[0]:{fmt}}, {v[1]:{fmt}}]" if v else " [no CI]"  # noqa: E731
        lines.append(f"  {name}: n={r.n_points}  A = {_fmt(r.A)}{ci(r.A_ci, '.4g')}  "
                     f"b = {r.b:.4f}{ci(r.b_ci, '.4f')}  C = {r.C:.4f}{ci(r.C_ci, '.4f')}  rmse {r.rmse:.3g}"
                     + (f"  (C at its {r.C_at_bound} bound)" if r.C_at_bound else ""))
        if r.target is not None:
            pci = f" [{r.prediction_ci[0]:.4f}, {r.prediction_ci[1]:.4f}]" if r.prediction_ci else ""
            lines.append(f"    extrapolated to {xname} = {r.target:.3g}: L = {r.prediction:.4f}{pci}")
    return "\n".join(lines)


def to_json(results: dict[str, FitResult]) -> dict:
    return {k: {kk: vv for kk, vv in asdict(v).items() if kk != "samples"} for k, v in results.items()}


def plot_fits(series: dict[str, tuple[list, list]], results: dict[str, FitResult], path: str | Path, xname: str,
              yname: str, target: Optional[float] = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for name, (xs, ys) in series.items():
        xs, ys = np.asarray(xs, float), np.asarray(ys, float)
        ok = np.isfinite(xs) & np.isfinite(ys)
        r = results.get(name)
        pts = ax.loglog(xs[ok], ys[ok], "o", label=None if r is not None else name)[0]
        if r is None:
            continue
        lo, hi = xs[ok].min(), xs[ok].max()
        grid = np.geomspace(lo / 1.5, hi * 1.5, 200)
        ax.plot(grid, r.predict(grid), "-", color=pts.get_color(), alpha=0.8,
                label=f"{name}: {r.A:.3g} x^-{r.b:.3f} + {r.C:.3f}")
        if target is not None and target > hi:
            ext = np.geomspace(hi, target, 100)
            ax.plot(ext, r.predict(ext), "--", color=pts.get_color(), alpha=0.6)
            ax.plot([target], [r.predict(target)], "*", ms=11, color=pts.get_color())
            if len(results) <= 2:
                ax.annotate(f"{float(r.predict(target)):.3f}", (target, float(r.predict(target))), fontsize=7,
                            xytext=(4, 4), textcoords="offset points")
    from matplotlib.ticker import FormatStrFormatter, NullFormatter
    lo, hi = ax.get_ylim()
    ax.set_yticks(np.geomspace(lo, hi, 6)[1:-1])
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(lo, hi)
    ax.set_xlabel(xname + (f" (star: extrapolation to {target:.3g})" if target is not None else ""))
    ax.set_ylabel(yname)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
