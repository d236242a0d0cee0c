"""What an `archscale eval` task declares (docs/EVALUATION.md, "Adding an eval task").

A task is one module that defines `TASK = EvalTask(...)`: the names `--tasks` accepts, its flags and their
defaults per protocol, how it plans (checks its settings and builds its samples before any task runs), how it
runs, its line in the printed plan, its summary lines and its report panel. The runner, the command line, the
plan and the report loop over the registry (`archscale.eval.tasks.all_tasks`) and name no task.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

NO_QUICK = object()  # an option --quick leaves alone


@dataclass(frozen=True)
class Option:
    """One setting of a task: the flag `--NAME` (unless `flag` is False) and, for a protocol setting, its default
    under each protocol (`protocol={"native": ..., "archscale": ...}`; archscale-strict takes archscale's) and
    under --quick. An explicit flag wins; the resolved value is `ctx.settings[NAME]`, else `ctx.args.NAME`."""
    name: str
    help: str = ""
    type: Callable[[str], Any] | None = None
    default: Any = None  # the argparse default of a flag outside the protocols
    choices: tuple | None = None
    action: str | None = None  # e.g. "append" (repeatable)
    protocol: dict[str, Any] | None = None
    quick: Any = NO_QUICK
    flag: bool = True

    def add_to(self, group) -> None:
        kw: dict[str, Any] = {"default": self.default, "help": self.help}
        if self.action:
            kw["action"] = self.action
        if self.type is not None:
            kw["type"] = self.type
        if self.choices is not None:
            kw["choices"] = list(self.choices)
        group.add_argument(f"--{self.name}", **kw)


@dataclass(frozen=True)
class Panel:
    """One panel of `archscale report`: `draw(ax, docs, labels, colors)` plots every results file (`docs`, one
    series each, `labels[i]` / `colors[i % len(colors)]`) on the matplotlib axes; panels appear by `order`."""
    draw: Callable[[Any, list[dict], list[str], list[str]], None]
    order: int = 100


@dataclass
class RunContext:
    """What a task's plan / run / plan_row get: the parsed flags, the resolved settings, the loaded model, a text
    generator with the context check (`gen.check`, `gen.encode`, `gen(prompts, max_new_tokens)`), the progress
    display, the results' notes, and `on_length(name)`: the callback that writes a task's finished lengths to the
    output file at once (an interrupt keeps them)."""
    args: Any
    settings: dict
    em: Any
    gen: Any
    progress: Any
    notes: list[str]
    on_length: Callable[[str], Callable[[str, dict], None]]


@dataclass(frozen=True)
class EvalTask:
    names: tuple[str, ...]  # what --tasks accepts, and the results' keys
    run: Callable[[RunContext, str, Any], dict]  # (ctx, name, plan) -> results[name]
    about: str = ""  # its words in `archscale eval --help`
    example: str | None = None  # its item in the --tasks example
    options: tuple[Option, ...] = ()
    group: str | None = None  # the --help group of its flags (default: its first name)
    plan: Callable[[RunContext, str, list[str]], Any] | None = None  # (ctx, name, items) -> plan; UserError on bad input
    plan_row: Callable[[RunContext, str, Any, Any], tuple[str, float | None]] | None = None  # (what, seconds or None)
    uses_speed: bool = False  # plan_row wants the measured (FLOP/s, s per decoding step); else it gets None
    summary: Callable[[dict], list[str]] | None = None  # doc["results"] -> printed lines
    panel: Panel | None = None
    settle: Callable[[dict, Any], list[tuple[str, str]]] | None = None  # fills computed settings; missing packages
    needs_tokenizer: Callable[[Any], bool] = field(default=lambda args: True)
    items: str | None = None  # "TASK": --tasks takes NAME:ITEM[,ITEM...] (lm_eval:hellaswag)
    items_example: str = ""
    quick_help: str = ""  # what --quick does to it, for --help
    order: int = 100  # run order (and the plan's); built-ins 10..50
