"""`archscale lm_eval ARGS...`: lm-evaluation-harness's own command line, with archscale's model registered.

lm-eval has no plugin hook for outside models on its command line, so this registers ours ("archscale" /
"ArchScale", `eval/lm_eval_model.py`) in-process and then calls lm-eval's console entry point with ARGS
unchanged: every lm-eval flag (--tasks, --num_fewshot, --limit, --output_path, --log_samples, --include_path,
--metadata, ...) and every other lm-eval model (`--model hf` on an `archscale export --format hf` folder) work
as in `lm_eval` itself.
"""

from __future__ import annotations

import dataclasses
import sys

from archscale.errors import UserError


def _gave_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _lm_eval_default_device() -> str | None:
    """The device lm-eval's command line passes when --device is absent (its config's default, 'cuda:0')."""
    try:
        from lm_eval.config.evaluate_config import EvaluatorConfig
    except ImportError:  # pragma: no cover - other lm-eval layouts
        return "cuda:0"
    return next((f.default for f in dataclasses.fields(EvaluatorConfig) if f.name == "device"), None)


def _task_names(argv: list[str]) -> list[str]:
    for i, a in enumerate(argv):
        if a == "--tasks" and i + 1 < len(argv):
            return argv[i + 1].split(",")
        if a.startswith("--tasks="):
            return a[len("--tasks="):].split(",")
    return []


def run_lm_eval(argv: list[str]) -> int:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        raise UserError("archscale lm_eval needs lm-evaluation-harness: pip install 'archscale[eval]'") from None
    from archscale.eval import ruler_offline
    from archscale.eval.lm_eval_model import ArchScaleLM  # registers the model names

    if ruler_offline.wants_ruler(_task_names(argv)):  # tokenizer from our model, offline haystack
        ruler_offline.install()
    ArchScaleLM.cli_default_device = None if _gave_flag(argv, "--device") else _lm_eval_default_device()
    saved = sys.argv
    sys.argv = ["lm_eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as e:  # argparse --help / usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except ValueError as e:  # lm-eval checks --tasks against its index and --include_path: bad input, one line
        if not str(e).startswith("Tasks not found"):
            raise
        raise UserError(f"--tasks: {str(e).splitlines()[0]} (lm-eval's index and --include_path; `lm_eval ls "
                        "tasks` lists them)") from None
    finally:
        sys.argv = saved
        ArchScaleLM.cli_default_device = None
    return 0
