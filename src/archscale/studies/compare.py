"""`archscale compare`: "is architecture X better than Y at equal compute, and does it hold as it scales?"

One command builds a study - one pretraining run per architecture x size x seed, all under mu-P++ with the same
base hyperparameters (ArchScale's protocol) - writes it to OUT_DIR/compare.yaml (a study file `archscale sweep`
reads too) with OUT_DIR/compare.json (which run is which architecture, size and seed), runs it through the sweep
machinery (`run_study`: resumable, --parallel, timeouts; or --dry_run / --emit), optionally evaluates every
finished model, and writes the analysis of `compare_report` (report.md, report.json, scaling.png).

Two studies, as ArchScale's: FLOPs scaling (`--depths 2,3,4`, the token budget from `--budget`) and data scaling
(`--depth D --tokens 1e8,2e8,4e8`).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from archscale.errors import UserError
from archscale.studies.sweep import Run, Study, format_value, load_study, sanitize

STUDY_FILE = "compare.yaml"
META_FILE = "compare.json"
FIRST_SEED = 3407  # ArchScale's seed; seed i of a study is FIRST_SEED + i
NAME_RE = re.compile(r"[A-Za-z0-9_]+")  # what a registered architecture name looks like


@dataclass
class Arch:
    label: str  # how the report names it: the registry name, or the layout file's stem
    flags: dict[str, str]  # the pretrain flags that select it: {train_model: NAME} or {layout: FILE_OR_STRING}


@dataclass
class CompareSpec:
    archs: list[Arch]
    mode: str  # "flops" (sizes = depths) or "data" (sizes = token budgets at one depth)
    sizes: list[Any]
    seeds: list[int]
    budget: dict[str, Any]  # {"kind": "tokens_per_param" | "t0" | "max_tokens" | "tokens", "value": ...}
    base: dict[str, Any]  # flags every run shares
    out_dir: Path
    depth: Optional[int] = None  # data mode
    timeout: Optional[float] = None
    name: str = "compare"
    extra: dict = field(default_factory=dict)


def arch_flags(entry: str) -> dict[str, str]:
    """The pretrain flags for one --archs entry. A registered name trains `--train_model NAME`; an existing file,
    or a string that is not a plain name (a layout string), trains `--layout ENTRY` (`archscale pretrain --layout
    FILE_OR_STRING`), which pretrain itself validates. The one place that decides between the two."""
    from archscale.config import ARCHITECTURES

    if entry in ARCHITECTURES:
        return {"train_model": entry}
    path = Path(entry)
    if path.is_file():
        return {"layout": str(path.resolve())}
    if NAME_RE.fullmatch(entry) or entry.endswith((".yaml", ".yml", ".json")):
        raise UserError(f"--archs {entry!r}: neither a registered architecture ({', '.join(sorted(ARCHITECTURES))}) "
                        "nor an existing layout file")
    return {"layout": entry}


def parse_archs(text: str) -> list[Arch]:
    entries = [e.strip() for e in (text or "").split(",") if e.strip()]
    if len(entries) < 2:
        raise UserError(f"--archs {text!r}: give at least two architectures to compare, e.g. transformer,sambay")
    archs, seen = [], set()
    for e in entries:
        flags = arch_flags(e)
        label = e if "train_model" in flags else sanitize(Path(e).stem if Path(e).is_file() else e)[:32]
        while label in seen:  # two layout strings that sanitize alike
            label += "_"
        seen.add(label)
        archs.append(Arch(label, flags))
    return archs


def parse_list(text: str, flag: str, kind: Callable = int) -> list:
    try:
        vals = [kind(float(x)) if kind is int else kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated numbers, e.g. {flag} 2,3,4") from None
    if not vals or any(v <= 0 for v in vals) or len(set(vals)) != len(vals):
        raise UserError(f"{flag} {text!r}: expected distinct positive numbers")
    return sorted(vals)


def parse_budget(text: str) -> dict[str, Any]:
    """`tokens_per_param=20` (T = 20 x non-embedding N of each run), `t0` / `t0=1.2e5` (ArchScale's default
    T(d) = t0 x N(d) / N(d0)), or `max_tokens=1e6` (the same tokens for every run)."""
    kind, _, value = text.partition("=")
    kind = kind.strip()
    if kind == "t0" and not value:
        return {"kind": "t0", "value": None}
    try:
        num = float(value)
    except ValueError:
        num = None
    if kind not in ("tokens_per_param", "t0", "max_tokens") or num is None or not num > 0:
        raise UserError(f"--budget {text!r}: expected tokens_per_param=X, t0[=X] or max_tokens=X with X > 0")
    return {"kind": kind, "value": num}


def run_name(arch: Arch, spec: CompareSpec, size: Any, seed: int) -> str:
    if spec.mode == "data":
        return sanitize(f"{arch.label}_d{spec.depth}_T{format_value(float(size))}_s{seed}")
    return sanitize(f"{arch.label}_d{size}_s{seed}")


def run_entries(spec: CompareSpec) -> list[dict[str, Any]]:
    """Every run's own flags (the study file's `runs:`), in the order they run: size by size, so a partial study
    already has every architecture at the small sizes."""
    runs = []
    for size in spec.sizes:
        for seed in spec.seeds:
            for arch in spec.archs:
                flags: dict[str, Any] = {**arch.flags, "seed": seed}
                if spec.mode == "data":
                    flags.update(depth=spec.depth, max_tokens=int(size))
                else:
                    flags["depth"] = int(size)
                runs.append({"name": run_name(arch, spec, size, seed), **flags})
    return runs


def study_body(spec: CompareSpec, runs: list[dict]) -> dict[str, Any]:
    return {"name": spec.name, "out_dir": str(spec.out_dir),
            "description": f"archscale compare: {', '.join(a.label for a in spec.archs)} ({spec.mode} scaling)",
            **({"timeout": spec.timeout} if spec.timeout else {}), "base": spec.base, "runs": runs}


def write_study_file(body: dict, path: Path) -> Study:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# written by `archscale compare`; `archscale sweep` runs it too\n"
                   + yaml.safe_dump(body, sort_keys=False))
    os.replace(tmp, path)
    return load_study(path)


def with_budget(spec: CompareSpec, runs: list[dict]) -> list[dict]:
    """Each run's token budget as an explicit `max_tokens` (tokens_per_param: from the run's own non-embedding
    parameter count, resolved by pretrain's dry run), so the study file says exactly what runs."""
    kind, value = spec.budget["kind"], spec.budget["value"]
    if kind == "max_tokens":
        return [{**r, "max_tokens": int(value)} for r in runs]
    if kind != "tokens_per_param":
        return runs  # t0 (base_hps.t0 in base) and data mode (max_tokens per run) are already explicit
    from archscale.studies.plans import dry_run_plans

    study = Study(path=Path(STUDY_FILE), name=spec.name, out_dir=spec.out_dir, command=[], runs=[
        Run(name=r["name"], overrides={}, flags={**spec.base, **{k: v for k, v in r.items() if k != "name"}})
        for r in runs])
    plans = {p["name"]: p["plan"] for p in dry_run_plans(study)}
    return [{**r, "max_tokens": int(round(value * plans[r["name"]]["n_params_non_embedding"]))} for r in runs]


def build_study(spec: CompareSpec, path: Optional[Path] = None) -> Study:
    """The study as a file (OUT_DIR/compare.yaml unless `path`) loaded back through `load_study`, so that
    `compare` and `sweep` run the same thing and a re-run resumes it."""
    runs = with_budget(spec, run_entries(spec))
    return write_study_file(study_body(spec, runs), path or spec.out_dir / STUDY_FILE)


def meta(spec: CompareSpec, study: Study) -> dict[str, Any]:
    """OUT_DIR/compare.json: what the report needs to group the runs (it does not re-derive it from names)."""
    runs = {}
    for entry, r in zip(run_entries(spec), study.runs):
        arch = next(a for a in spec.archs if all(entry.get(k) == v for k, v in a.flags.items()))
        size = r.flags["max_tokens"] if spec.mode == "data" else r.flags["depth"]
        runs[r.name] = {"arch": arch.label, "size": size, "depth": r.flags["depth"], "seed": r.flags["seed"],
                        "out_dir": r.out_dir}
    return {"mode": spec.mode, "archs": [{"label": a.label, **a.flags} for a in spec.archs],
            "sizes": spec.sizes, "seeds": spec.seeds, "budget": spec.budget, **spec.extra, "runs": runs}


def write_meta(spec: CompareSpec, study: Study) -> Path:
    path = spec.out_dir / META_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta(spec, study), indent=1))
    os.replace(tmp, path)
    return path


def dry_run_study(spec: CompareSpec) -> tuple[Study, list[dict]]:
    """The study and every run's resolved plan, written nowhere (the study file goes to a temporary folder)."""
    from archscale.studies.plans import dry_run_plans

    with tempfile.TemporaryDirectory() as tmp:
        study = build_study(spec, Path(tmp) / STUDY_FILE)
        return study, dry_run_plans(study)


def total_compute(plans: list[dict]) -> tuple[float, float]:
    """(sum of the model's FLOPs per token x tokens, sum of 6 N T) over the runs."""
    model = sum(p["plan"]["flops_per_token"] * p["plan"]["max_tokens"] for p in plans)
    six = sum(6.0 * p["plan"]["n_params_non_embedding"] * p["plan"]["max_tokens"] for p in plans)
    return model, six
