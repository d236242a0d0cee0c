"""`archscale sweep STUDY.yaml`: many pretraining runs from one file.

A study file holds flags shared by every run (`base`), a cartesian `grid` of overrides and/or an explicit list of
runs (`runs`, or ArchScale's `experiments:` mapping of name -> flags with `base_command`). Each run becomes
`python -m archscale.pretrain --flag=value ... --out_dir STUDY_DIR/NAME`, launched as a subprocess with its own
thread count and timeout; its status goes to `STUDY_DIR/study.json`. Re-running the same file skips runs that
finished and continues the others from their last checkpoint (`--resume auto`).

    name: depth_sweep
    out_dir: runs/studies/depth_sweep
    timeout: 3600                 # seconds per run (a run can override it)
    base: {train_data_dir: data/, train_model: transformer, ctx_len: 256, base_hps.b0: 4096}
    grid: {depth: [2, 4, 6]}      # or runs: [{depth: 2, max_tokens: 1e6}, ...]
    name_format: "d{depth}"       # optional; default: from the overrides (`depth2`, `lr4e-4_bs4096`)
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from archscale.errors import UserError
from archscale.progress import Progress

# keys of a run entry (or of the study file) that are not pretrain flags
RUN_KEYS = {"name", "timeout", "description", "threads"}
STUDY_KEYS = {"name", "out_dir", "base", "grid", "runs", "experiments", "command", "base_command", "timeout",
              "parallel", "threads", "name_format", "description", "emit"}
# short names for run naming: key -> prefix ("" = the value alone)
SHORT = {"depth": "d", "base_hps.eta0": "lr", "base_hps.b0": "bs", "max_tokens": "T", "ctx_len": "ctx",
         "train_model": "", "parametrization": "", "micro_bsz": "mbs", "ar": "ar", "train_name": "",
         "base_hps.warmup_tokens0": "wu", "seed": "seed", "schedule": ""}
FINISHED = "success"
STATUS_FILE = "study.json"
LOG_FILE = "sweep.log"


@dataclass
class Run:
    name: str
    overrides: dict[str, Any]  # what this run changes relative to `base`
    flags: dict[str, Any]  # base + overrides: every pretrain flag (without out_dir)
    timeout: Optional[float] = None
    threads: Optional[int] = None
    description: str = ""
    out_dir: str = ""

    def args(self) -> list[str]:
        """The pretrain arguments, `--key=value` (so negative numbers and paths are unambiguous)."""
        flags = dict(self.flags)
        flags["out_dir"] = self.out_dir
        flags.setdefault("progress", False)
        return [f"--{k}={format_flag(v)}" for k, v in flags.items()]

    def fingerprint(self) -> str:
        flags = {k: format_flag(v) for k, v in sorted(self.flags.items()) if k != "resume"}
        return hashlib.sha1(json.dumps(flags, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class Study:
    path: Path
    name: str
    out_dir: Path
    command: list[str]
    runs: list[Run]
    parallel: int = 1
    threads: Optional[int] = None
    timeout: Optional[float] = None
    description: str = ""
    raw: dict = field(default_factory=dict)


def format_flag(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)


def format_value(v: Any) -> str:
    """A value as it appears in a run name: strings as written (`4e-4`), ints in full, floats compactly."""
    if isinstance(v, bool):
        return "T" if v else "F"
    if isinstance(v, float):
        if v == int(v) and abs(v) < 1e6:
            return str(int(v))
        if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e6):
            m, e = f"{v:.3e}".split("e")
            return f"{m.rstrip('0').rstrip('.')}e{int(e)}"
        return f"{v:.4g}"
    return str(v)


def sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+=-]+", "-", name).strip("-") or "run"


def run_name(overrides: dict[str, Any], all_flags: dict[str, Any], template: Optional[str]) -> str:
    if template:
        def sub(m):
            key = m.group(1)
            if key not in all_flags:
                raise UserError(f"name_format {template!r}: {{{key}}} is not a flag of this run "
                                f"(known: {', '.join(sorted(all_flags))})")
            return format_value(all_flags[key])
        return sanitize(re.sub(r"\{([^{}]+)\}", sub, template))
    if not overrides:
        return "base"
    parts = []
    for k, v in overrides.items():
        prefix = SHORT.get(k, k.split(".")[-1])
        parts.append(f"{prefix}{format_value(v)}")
    return sanitize("_".join(parts))


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{'base_hps': {'eta0': 1}} -> {'base_hps.eta0': 1}; keeps already-dotted keys."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k not in ("data_mixture",):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def parse_assignments(items: Optional[list[str]], flag: str, as_list: bool = False) -> dict[str, Any]:
    """`--set key=value` / `--grid key=v1,v2` -> {key: value} (values read as YAML scalars)."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise UserError(f"{flag} {item!r}: expected KEY=VALUE" + (",VALUE..." if as_list else ""))
        k, v = item.split("=", 1)
        k = k.strip().lstrip("-")
        vals = [yaml.safe_load(x) for x in v.split(",")] if as_list else yaml.safe_load(v)
        out[k] = vals
    return out


def load_study(path: str | Path, out_dir: Optional[str] = None, set_flags: Optional[dict[str, Any]] = None,
               grid_flags: Optional[dict[str, list]] = None) -> Study:
    """Parse a study file; `set_flags` replace/add base flags and `grid_flags` grid axes (CLI --set / --grid)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such study file")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a study file is a mapping with `base`, `grid` and/or `runs` (see docs/STUDIES.md)")
    unknown = set(raw) - STUDY_KEYS
    if unknown:
        raise UserError(f"{path}: unknown key(s) {sorted(unknown)}; a study file has {sorted(STUDY_KEYS)} "
                        "(pretrain flags go under `base`, `grid` or `runs`)")
    name = str(raw.get("name") or path.stem)
    base = _flatten(raw.get("base") or {})
    base.update(set_flags or {})
    base.pop("out_dir", None)
    grid = {**_flatten(raw.get("grid") or {}), **(grid_flags or {})}
    for k in grid:
        base.pop(k, None)
    for k, v in grid.items():
        if not isinstance(v, list) or not v:
            raise UserError(f"{path}: grid.{k} must be a non-empty list of values, got {v!r}")
    entries: list[tuple[Optional[str], dict]] = []
    exps = raw.get("runs", raw.get("experiments"))
    if isinstance(exps, dict):  # ArchScale's experiments.yaml: {name: {flags..., timeout, description}}
        entries = [(str(k), dict(v or {})) for k, v in exps.items()]
    elif isinstance(exps, list):
        for i, e in enumerate(exps):
            if not isinstance(e, dict):
                raise UserError(f"{path}: runs[{i}] must be a mapping of flags, got {e!r}")
            entries.append((e.get("name"), dict(e)))
    elif exps is not None:
        raise UserError(f"{path}: `runs` must be a list (or a name -> flags mapping), got {type(exps).__name__}")
    if not entries:
        entries = [(None, {})]
    if not grid and entries == [(None, {})] and not base:
        raise UserError(f"{path}: no runs: give `base` flags plus a `grid` and/or a `runs` list")
    cmd = raw.get("command", raw.get("base_command"))
    command = shlex.split(cmd) if isinstance(cmd, str) else list(cmd) if cmd else \
        [sys.executable, "-m", "archscale.pretrain"]
    study_out = Path(out_dir or raw.get("out_dir") or Path("runs") / "studies" / name)
    template = raw.get("name_format")
    keys = list(grid)
    runs: list[Run] = []
    for entry_name, entry in entries:
        meta = {k: entry.pop(k) for k in list(entry) if k in RUN_KEYS}
        entry = _flatten(entry)
        entry.pop("out_dir", None)
        for combo in itertools.product(*(grid[k] for k in keys)) if keys else [()]:
            overrides = {**entry, **dict(zip(keys, combo))}
            flags = {**base, **overrides}
            if entry_name and keys:
                name_ = sanitize(f"{entry_name}_{run_name(dict(zip(keys, combo)), flags, None)}")
            elif entry_name:
                name_ = sanitize(entry_name)
            else:
                name_ = run_name(overrides, flags, template)
            runs.append(Run(name=name_, overrides=overrides, flags=flags,
                            timeout=_num(meta.get("timeout"), path, "timeout"), threads=meta.get("threads"),
                            description=str(meta.get("description", "")), out_dir=str(study_out / name_)))
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.name] = seen.get(r.name, 0) + 1
    dup = [n for n, c in seen.items() if c > 1]
    if dup:
        raise UserError(f"{path}: several runs get the same name {dup}; add a `name_format` that uses every "
                        "swept flag, or name the runs")
    return Study(path=path, name=name, out_dir=study_out, command=command, runs=runs,
                 parallel=int(raw.get("parallel") or 1), threads=raw.get("threads"),
                 timeout=_num(raw.get("timeout"), path, "timeout"), description=str(raw.get("description", "")),
                 raw=raw)


def _num(v, path, key) -> Optional[float]:
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        raise UserError(f"{path}: {key} must be a number of seconds, got {v!r}") from None


# ---------------------------------------------------------------- status file

def now() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")


def read_status(study_dir: Path) -> dict:
    p = Path(study_dir) / STATUS_FILE
    if not p.is_file():
        return {"runs": {}}
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError:
        raise UserError(f"{p} is not valid JSON; fix or delete it (the run dirs are kept)") from None


def write_status(study_dir: Path, status: dict) -> None:
    p = Path(study_dir) / STATUS_FILE
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(status, indent=2))
    os.replace(tmp, p)  # atomic: a kill never leaves half a file


def val_losses(run_dir: Path) -> dict[str, Optional[float]]:
    """final/best validation loss and the last train loss from metrics.csv (None when absent)."""
    import csv
    p = Path(run_dir) / "metrics.csv"
    out: dict[str, Optional[float]] = {"final_val_loss": None, "best_val_loss": None, "final_train_loss": None,
                                       "tokens": None}
    if not p.is_file():
        return out
    with open(p, newline="") as f:
        rows = list(csv.DictReader(f))
    vals = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    trains = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    if vals:
        out["final_val_loss"], out["best_val_loss"] = vals[-1], min(vals)
    if trains:
        out["final_train_loss"] = trains[-1]
    if rows and rows[-1].get("tokens"):
        out["tokens"] = int(float(rows[-1]["tokens"]))
    return out


# ---------------------------------------------------------------- execution

def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        env[k] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class _Active:
    run: Run
    proc: subprocess.Popen
    start: float
    log: Any
    deadline: Optional[float]
    term_sent: Optional[float] = None
    timed_out: bool = False


class _Runner:
    """The processes of one `run_study` call: launch, watch (timeouts: SIGTERM, then SIGKILL), record."""

    def __init__(self, study: Study, status: dict, resume: str, parallel: int, threads: Optional[int],
                 timeout: Optional[float], kill_grace: float, echo: Callable[[str], None]):
        self.study, self.status, self.recorded = study, status, status["runs"]
        self.resume, self.parallel, self.threads, self.timeout = resume, parallel, threads, timeout
        self.kill_grace, self.echo = kill_grace, echo
        self.ncpu = os.cpu_count() or 1
        self.active: list[_Active] = []

    def save_status(self) -> None:
        write_status(self.study.out_dir, self.status)

    def launch(self, r: Run) -> None:
        study, rec = self.study, self.recorded[r.name]
        n_threads = int(r.threads or self.threads or study.threads or max(1, self.ncpu // self.parallel))
        Path(r.out_dir).mkdir(parents=True, exist_ok=True)
        attempts = int(rec.get("attempts", 0)) + 1
        resumed = attempts > 1 and (Path(r.out_dir) / "checkpoints").is_dir()
        cmd = [*study.command, *r.args(), f"--resume={self.resume}"]
        log = open(Path(r.out_dir) / LOG_FILE, "a")
        log.write(f"\n===== {now()} attempt {attempts}: {shlex.join(cmd)}\n")
        log.flush()
        t = r.timeout if r.timeout is not None else self.timeout if self.timeout is not None else study.timeout
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(n_threads),
                                start_new_session=True)
        rec.update(status="running", attempts=attempts, started=now(), pid=proc.pid, threads=n_threads,
                   timeout=t, command=shlex.join(cmd), log=str(Path(r.out_dir) / LOG_FILE))
        rec.pop("returncode", None)
        self.save_status()
        self.echo(f"[sweep] {r.name}: started{' (resuming)' if resumed else ''}, pid {proc.pid}, {n_threads} "
                  f"thread{'s' if n_threads > 1 else ''}" + (f", timeout {t:g}s" if t else ""))
        self.active.append(_Active(r, proc, time.monotonic(), log, time.monotonic() + t if t else None))

    def finish(self, a: _Active, rc: int) -> None:
        a.log.close()
        rec = self.recorded[a.run.name]
        duration = time.monotonic() - a.start
        state = "timeout" if a.timed_out else FINISHED if rc == 0 else "failed"
        rec.update(status=state, returncode=rc, finished=now(), duration_s=round(duration, 2),
                   total_duration_s=round(rec.get("total_duration_s", 0) + duration, 2))
        rec.pop("pid", None)
        rec.update(val_losses(Path(a.run.out_dir)))
        if state != FINISHED:
            rec["error"] = _tail(Path(a.run.out_dir) / LOG_FILE)
        else:
            rec.pop("error", None)
        self.save_status()
        best = rec.get("best_val_loss")
        self.echo(f"[sweep] {a.run.name}: {state} (exit {rc}) in {duration:.1f}s"
                  + (f", best val_loss {best:.4f}" if best is not None else "")
                  + ("" if state == FINISHED else f"; log {rec['log']}"))

    @staticmethod
    def signal_group(a: _Active, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(a.proc.pid, sig)

    def watch(self) -> None:
        """One look at every running process: record the finished ones, enforce timeouts."""
        t = time.monotonic()
        for a in list(self.active):
            rc = a.proc.poll()
            if rc is not None:
                self.active.remove(a)
                self.finish(a, rc)
            elif a.deadline is not None and t > a.deadline and a.term_sent is None:
                # SIGTERM first: the trainer saves a checkpoint and exits, so a re-run continues from there
                a.timed_out, a.term_sent = True, t
                self.signal_group(a, signal.SIGTERM)
            elif a.term_sent is not None and t > a.term_sent + self.kill_grace:
                self.signal_group(a, signal.SIGKILL)

    def current(self) -> str:
        """The running runs and the last step each logged (its metrics.csv), for the progress bar."""
        return ", ".join(f"{a.run.name} step {_last_step(Path(a.run.out_dir))}" for a in self.active)

    def stop_all(self, queue: list[Run]) -> None:
        """Interrupted: SIGTERM every child (each saves a checkpoint), SIGKILL what outlives the grace period."""
        self.echo(f"[sweep] interrupted: stopping {len(self.active)} run(s) (they save a checkpoint; re-run to "
                  "resume)")
        for a in self.active:
            self.signal_group(a, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace
        for a in self.active:
            try:
                rc = a.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.signal_group(a, signal.SIGKILL)
                rc = a.proc.wait()
            a.log.close()
            self.recorded[a.run.name].update(status="interrupted", returncode=rc, finished=now(),
                                             duration_s=round(time.monotonic() - a.start, 2))
            self.recorded[a.run.name].pop("pid", None)
        for r in queue:
            self.recorded[r.name]["status"] = "pending"
        self.status["updated"] = now()
        self.save_status()


def _runs_to_do(study: Study, status: dict, resume: str, only: Optional[list[str]],
                echo: Callable[[str], None]) -> list[Run]:
    """The study's runs that still need running (marked pending in `status`); refuses changed or running ones."""
    out, recorded = study.out_dir, status["runs"]
    todo: list[Run] = []
    for r in study.runs:
        if only and r.name not in only:
            continue
        rec = recorded.get(r.name)
        if rec and rec.get("fingerprint") not in (None, r.fingerprint()):
            raise UserError(f"{out}/{r.name} was run with other flags than {study.path} now gives it "
                            f"(was: {rec.get('args')}); rename the run, use another --out_dir, or delete "
                            f"{out}/{r.name} and its entry in {out}/{STATUS_FILE}")
        if rec and rec.get("status") == "running" and _alive(rec.get("pid")):
            raise UserError(f"{out}/{r.name} is running right now (pid {rec['pid']}, from another sweep of this "
                            "study); wait for it or stop that sweep first")
        if rec and rec.get("status") == FINISHED and resume == "auto":
            echo(f"[sweep] {r.name}: finished earlier, skipped")
            continue
        todo.append(r)
        recorded[r.name] = {**(rec or {}), "status": "pending", "overrides": r.overrides, "out_dir": r.out_dir,
                            "fingerprint": r.fingerprint(), "args": r.args()}
    return todo


def run_study(study: Study, parallel: Optional[int] = None, threads: Optional[int] = None,
              resume: str = "auto", timeout: Optional[float] = None, kill_grace: float = 30.0,
              only: Optional[list[str]] = None, echo: Callable[[str], None] = print,
              poll: float = 0.2, progress: Optional[Progress] = None) -> dict:
    """Run every unfinished run; returns the status dict (also in STUDY_DIR/study.json). `progress`: a bar of
    runs done / to do, naming the running ones with their last logged step."""
    if resume not in ("auto", "none"):
        raise UserError(f"--resume {resume!r}: a sweep resumes with `auto` (skip finished runs, continue the "
                        "others) or starts fresh with `none`")
    out = study.out_dir
    status = read_status(out)
    if resume == "none" and any(Path(r.out_dir).exists() for r in study.runs):
        raise UserError(f"--resume none: {out} already holds runs of this study; use --resume auto to continue "
                        "it, or another --out_dir")
    parallel = max(1, int(parallel or study.parallel or 1))
    status.update(name=study.name, study_file=str(study.path.resolve()), out_dir=str(out),
                  command=study.command, updated=now())
    status.setdefault("created", now())
    status["runs"] = status.get("runs", {})
    queue = _runs_to_do(study, status, resume, only, echo)
    write_status(out, status)
    runner = _Runner(study, status, resume, parallel, threads, timeout, kill_grace, echo)
    # SIGTERM (kill, a scheduler) and SIGINT (Ctrl-C; also when started in the background, where SIGINT is
    # inherited as ignored) both stop the sweep cleanly: every child gets SIGTERM, saves a checkpoint and exits
    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old_handlers[sig] = signal.signal(sig, _raise_interrupt)
    try:
        with (progress or Progress(show=False)).stage(f"sweep {study.name}", len(queue), "runs") as bar:
            total = len(queue)
            while queue or runner.active:
                while queue and len(runner.active) < parallel:
                    r = queue.pop(0)
                    try:
                        runner.launch(r)
                    except OSError as e:  # the command itself cannot start
                        status["runs"][r.name].update(status="error", error=str(e), finished=now())
                        write_status(out, status)
                        echo(f"[sweep] {r.name}: error: {e}")
                time.sleep(poll)
                runner.watch()
                bar.update(completed=total - len(queue) - len(runner.active), note=runner.current())
    except KeyboardInterrupt:
        runner.stop_all(queue)
        raise
    finally:
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
    status["updated"] = now()
    write_status(out, status)
    return status


def _last_step(run_dir: Path) -> str:
    """The step of metrics.csv's last row ("-" before the first), reading only the file's end."""
    try:
        with open(run_dir / "metrics.csv", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            last = f.read().decode("utf-8", "replace").strip().splitlines()[-1]
    except (OSError, IndexError):
        return "-"
    step = last.split(",", 1)[0]
    return step if step.isdigit() else "-"


def _alive(pid) -> bool:
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    try:  # a zombie or a reused pid running something else does not count
        cmdline = Path(f"/proc/{int(pid)}/cmdline").read_bytes()
        return b"archscale" in cmdline or b"pretrain" in cmdline
    except OSError:
        return True


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _tail(path: Path, n: int = 5) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def summary_lines(study: Study, status: dict) -> list[str]:
    recs = status.get("runs", {})
    counts: dict[str, int] = {}
    lines = []
    for r in study.runs:
        rec = recs.get(r.name, {})
        s = rec.get("status", "pending")
        counts[s] = counts.get(s, 0) + 1
        best = rec.get("best_val_loss")
        lines.append(f"  {r.name:<28} {s:<11} exit {str(rec.get('returncode', '-')):<4} "
                     f"{rec.get('total_duration_s', rec.get('duration_s', 0)) or 0:>8.1f}s  "
                     f"best val_loss {best:.4f}" if best is not None else
                     f"  {r.name:<28} {s:<11} exit {str(rec.get('returncode', '-')):<4} "
                     f"{rec.get('total_duration_s', rec.get('duration_s', 0)) or 0:>8.1f}s")
    head = f"study {study.name} ({study.out_dir}): " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    return [head, *lines]


def _ovr(o: dict) -> str:
    return " ".join(f"{k}={format_value(v)}" for k, v in o.items()) or "-"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])
