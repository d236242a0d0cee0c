"""Flags of `archscale eval` and `archscale report` (registered in archscale.cli)."""

from __future__ import annotations

import argparse

from archscale.cli_types import positive_int, seed_int
from archscale.errors import UserError
from archscale.progress import add_progress_flag


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2, like every other UserError
        raise UserError(f"{self.prog}: {message}")


def eval_parser() -> argparse.ArgumentParser:
    """The flags common to every task, then each task's own (`EvalTask.options`), a --help group per task file."""
    from archscale.eval.tasks import all_tasks

    tasks = all_tasks()
    p = _Parser(prog="archscale eval", description=(
        f"Evaluate a checkpoint. Tasks: {', '.join(t.about for t in tasks if t.about)}. See docs/EVALUATION.md."))
    p.add_argument("--checkpoint", required=True, help="run dir (latest complete checkpoint) or checkpoints/step-*")
    p.add_argument("--tasks", required=True,
                   help="comma-separated, e.g. " + ",".join(t.example for t in tasks if t.example))
    p.add_argument("--output", required=True, help="results JSON file")
    p.add_argument("--batch_size", type=positive_int, default=8, help="sequences per forward pass / decoding batch")
    p.add_argument("--max_length", type=positive_int, default=None,
                   help="longest context fed to the model (default: 4x the training length for ppl/phonebook/niah; "
                        "the training length for lm-eval contexts)")
    p.add_argument("--tokenizer", default=None, help="override the tokenizer recorded in the run's data manifest")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16 = autocast")
    p.add_argument("--seed", type=seed_int, default=42)
    p.add_argument("--quick", action="store_true",
                   help=f"a few samples at short lengths ({'; '.join(t.quick_help for t in tasks if t.quick_help)}): "
                        "to see every task work on a CPU; explicit flags win")
    add_progress_flag(p)
    p.add_argument("--protocol", default="native", choices=["native", "archscale", "archscale-strict"],
                   help="defaults of the flags left unset: archscale's own (native), ArchScale's (archscale; "
                        "falls back to offline name/key lists without the names/wonderwords packages), or "
                        "ArchScale's with no fallback (archscale-strict). See docs/EVALUATION.md")
    for task in tasks:
        flags = [o for o in task.options if o.flag]
        if flags:
            group = p.add_argument_group(task.group or task.names[0])
            for option in flags:
                option.add_to(group)
    return p


def run_eval(argv: list[str]) -> int:
    from archscale.eval.runner import run, summary_lines

    args = eval_parser().parse_args(argv)  # every number through a parser type (archscale.cli_types)
    doc = run(args)
    for line in summary_lines(doc):
        print(line)
    print(f"wrote {args.output}")
    return 0


def run_report(argv: list[str]) -> int:
    from archscale.eval.report import draw_report

    p = _Parser(prog="archscale report", description="Grouped summary plot of `archscale eval` results "
                                                     "(standard / long-context / extrapolation).")
    p.add_argument("results", nargs="+", help="results JSON files (one series each)")
    p.add_argument("--out", required=True, help="output PNG")
    a = p.parse_args(argv)
    draw_report(a.results, a.out)
    print(f"wrote {a.out}")
    return 0
