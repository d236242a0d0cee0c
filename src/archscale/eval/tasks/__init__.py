"""The registry of `archscale eval` tasks: every module of this package that defines `TASK` (found by package
discovery: a new built-in task is one file here), then the task files named by the environment variable
ARCHSCALE_EVAL_TASKS (Python files or folders of them, separated by the path separator, ':' on Linux; read on
every call, so a file named there is a task for as long as the variable names it). See base.py for the fields
and docs/EVALUATION.md, "Adding an eval task"."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
from functools import lru_cache
from pathlib import Path

from archscale.errors import UserError
from archscale.eval.tasks.base import EvalTask

ENV = "ARCHSCALE_EVAL_TASKS"


def _task_of(module, where: str) -> EvalTask:
    task = getattr(module, "TASK", None)
    if not isinstance(task, EvalTask):
        raise UserError(f"{where}: an eval task file must define TASK = EvalTask(...) (archscale.eval.tasks.base)")
    return task


@lru_cache(maxsize=1)
def builtin_tasks() -> tuple[EvalTask, ...]:
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name != "base":
            module = importlib.import_module(f"{__name__}.{info.name}")
            found.append(_task_of(module, module.__name__))
    return tuple(found)


@lru_cache(maxsize=None)
def _load_file(path: Path) -> EvalTask:
    """Run one task file (user code the user named, as a plugin) as its own module."""
    name = f"archscale_eval_task_{abs(hash(str(path)))}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a @dataclass in the file looks its module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a broken plugin is the user's input: one line, not a traceback
        del sys.modules[name]
        raise UserError(f"{ENV}: {path}: {type(e).__name__}: {e}") from None
    return _task_of(module, f"{ENV}: {path}")


def plugin_files() -> list[Path]:
    files = []
    for entry in filter(None, os.environ.get(ENV, "").split(os.pathsep)):
        p = Path(entry).expanduser().resolve()
        if p.is_dir():
            files += sorted(f for f in p.glob("*.py") if not f.name.startswith("_"))
        elif p.is_file():
            files.append(p)
        else:
            raise UserError(f"{ENV}: {entry}: no such file or folder")
    return files


def all_tasks() -> list[EvalTask]:
    """Every task, in run order (built-ins first, then plugins in the order named); a name taken twice is an
    error."""
    tasks = list({id(t): t for t in [*builtin_tasks(), *(_load_file(p) for p in plugin_files())]}.values())
    seen: dict[str, EvalTask] = {}
    for task in tasks:
        for name in task.names:
            if name in seen and seen[name] is not task:
                raise UserError(f"eval task {name!r} is defined twice ({ENV} names a file that redefines it)")
            seen[name] = task
    return sorted(tasks, key=lambda t: t.order)  # stable: ties keep discovery order


def by_name() -> dict[str, EvalTask]:
    return {name: task for task in all_tasks() for name in task.names}
