"""`lm_eval:TASK[,TASK...]`: lm-evaluation-harness tasks on our model (archscale/eval/lm_eval_model.py) through
`lm_eval.simple_evaluate`; the report's "Standard (lm-eval)" panel.

lm-eval tasks read at most `--max_length` tokens (default: the training length; 4096 under --protocol archscale),
keeping the last ones, as lm-eval's own models do."""

from __future__ import annotations

import json
import os
from pathlib import Path

from archscale.cli_types import nonnegative_int, positive_float
from archscale.errors import UserError
from archscale.eval.tasks.base import EvalTask, Option, Panel, RunContext

# the headline metric of an lm-eval task, in order of preference (accuracy-like, higher is better, in [0, 1])
MAIN_METRICS = ("acc_norm", "acc", "exact_match", "f1", "mcc")
OPTIONS = (
    Option("lm_eval_include", action="append", help="folder of local task YAMLs (repeatable)"),
    Option("lm_eval_limit", type=positive_float, help="examples per task (or a fraction if < 1)"),
    Option("num_fewshot", type=nonnegative_int),
    Option("lm_eval_metadata",
           help="JSON handed to lm-eval tasks, as lm-eval's --metadata, e.g. '{\"max_seq_lengths\":[4096]}' "
                "for its RULER tasks (default lengths: --max_seq_lengths, else lm-eval's)"),
    Option("lm_eval_max_length", flag=False, protocol={"native": None, "archscale": 4096}),  # ArchScale's eval.py
)


def default_lm_eval_include() -> list[str]:
    """The repo's examples/lm_eval_tasks (present in a source checkout)."""
    p = Path(__file__).resolve().parents[4] / "examples" / "lm_eval_tasks"
    return [str(p)] if p.is_dir() else []


def run_lm_eval(em, tasks: list[str], include: list[str], batch_size: int, max_length: int, limit: float | None,
                num_fewshot: int | None, seed: int, metadata: dict | None = None) -> dict:
    """lm-eval's `simple_evaluate` on our model; `metadata` reaches the tasks as lm-eval's --metadata does (RULER:
    max_seq_lengths); RULER's tasks size prompts with our tokenizer and run offline (eval/ruler_offline.py)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("lm_eval tasks need lm-eval: pip install 'archscale[eval]'") from None
    import logging

    from archscale.eval.lm_eval_model import ArchScaleLM

    for d in include:
        if not Path(d).is_dir():
            raise UserError(f"--lm_eval_include {d}: no such folder")
    from archscale.eval import ruler_offline

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    metadata = dict(metadata or {})
    if ruler_offline.wants_ruler(tasks):  # index lm-eval's RULER folder alone, not its ~12,000-file catalogue
        include = [*include, str(ruler_offline.ruler_folder())]
    tm = TaskManager(include_path=include or None, include_defaults=False, metadata=metadata)
    missing = [t for t in tasks if t not in tm.all_tasks]
    if missing:  # the built-in catalogue takes seconds to index; only when a task is not local
        tm = TaskManager(include_path=include or None, metadata=metadata)
        missing = [t for t in tasks if t not in tm.all_tasks]
    if missing:
        raise UserError(f"--tasks: unknown lm-eval task(s) {', '.join(missing)} (looked in lm-eval's catalogue and "
                        f"{', '.join(include) or 'no --lm_eval_include folder'})")
    lm = ArchScaleLM(em, batch_size=batch_size, max_length=max_length)
    if ruler_offline.wants_ruler(tasks):
        ruler_offline.install()
    notes_before = len(ruler_offline.NOTES)
    try:
        res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=tm, limit=limit, num_fewshot=num_fewshot,
                                      log_samples=False, bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed,
                                      torch_random_seed=seed, fewshot_random_seed=seed)
    except (ConnectionError, OSError) as e:
        raise UserError(f"lm-eval could not load a task's data offline ({str(e).splitlines()[0][:200]}); "
                        "use local tasks (--lm_eval_include DIR)") from None
    except ValueError as e:  # e.g. RULER: "Could not generate any sample ... Raise `max_seq_lengths`"
        raise UserError(f"lm-eval: {(str(e).splitlines() or [type(e).__name__])[0][:300]}") from None
    out = {}
    for name, metrics in (res or {}).get("results", {}).items():
        clean = {}
        for k, v in metrics.items():
            if k in ("alias", "sample_len") or "_stderr" in k or not isinstance(v, (int, float)):
                continue
            clean[k.split(",")[0] if k.endswith(",none") else k] = v
        out[name] = clean
    return {"tasks": out, "versions": {k: v for k, v in (res or {}).get("versions", {}).items()},
            "n_samples": (res or {}).get("n-samples", {}), "max_length": max_length, "limit": limit,
            "num_fewshot": num_fewshot, "metadata": metadata, "notes": ruler_offline.NOTES[notes_before:],
            "lm_eval_version": getattr(lm_eval, "__version__", None)}


def lm_eval_metadata(args, st: dict) -> dict:
    """--lm_eval_metadata (JSON object), with RULER's `max_seq_lengths` from --max_seq_lengths when given."""
    meta: dict = {}
    if args.lm_eval_metadata:
        try:
            meta = json.loads(args.lm_eval_metadata)
        except json.JSONDecodeError as e:
            raise UserError(f"--lm_eval_metadata: not JSON ({e})") from None
        if not isinstance(meta, dict):
            raise UserError("--lm_eval_metadata must be a JSON object, e.g. '{\"max_seq_lengths\":[4096]}'")
    if "max_seq_lengths" not in meta and (args.max_seq_lengths or args.protocol != "native"):
        meta["max_seq_lengths"] = [int(x) for x in str(st["max_seq_lengths"]).split(",") if x.strip()]
    return meta



def plan(ctx: RunContext, name: str, items: list[str]) -> dict:
    return {"tasks": items, "metadata": lm_eval_metadata(ctx.args, ctx.settings)}


def run(ctx: RunContext, name: str, p: dict) -> dict:
    args = ctx.args
    include = list(args.lm_eval_include or []) + default_lm_eval_include()
    max_length = args.max_length or ctx.settings["lm_eval_max_length"] or ctx.em.train_len
    with ctx.progress.stage(f"lm_eval {','.join(p['tasks'])}"):
        r = run_lm_eval(ctx.em, p["tasks"], include, args.batch_size, max_length, args.lm_eval_limit,
                        args.num_fewshot, args.seed, p["metadata"])
    ctx.notes.extend(r.get("notes", []))
    return r


def plan_row(ctx: RunContext, name: str, p: dict, speed) -> tuple[str, float | None]:
    return ", ".join(p["tasks"]), None


def summary(results: dict) -> list[str]:
    return [f"lm_eval {t}: " + ", ".join(f"{k} {v:.4g}" for k, v in m.items())
            for t, m in (results.get("lm_eval") or {}).get("tasks", {}).items()]


def standard_scores(doc: dict) -> dict[str, float]:
    out = {}
    for task, metrics in (doc["results"].get("lm_eval") or {}).get("tasks", {}).items():
        for m in MAIN_METRICS:
            if isinstance(metrics.get(m), (int, float)):
                out[f"{task}\n{m}"] = float(metrics[m])
                break
    return out


def draw(ax, docs: list[dict], labels: list[str], colors: list[str]) -> None:
    from archscale.eval.panels import bars, no_data

    if bars(ax, [standard_scores(d) for d in docs], labels, colors):
        ax.set_ylabel("score")
    else:
        no_data(ax, "lm-eval")
    ax.set_title("Standard (lm-eval)")


TASK = EvalTask(
    names=("lm_eval",), items="TASK", items_example="lm_eval:archscale_mc", example="lm_eval:archscale_mc",
    about="lm_eval:TASK[,TASK...] (lm-evaluation-harness)", order=40, options=OPTIONS, plan=plan, run=run,
    plan_row=plan_row, summary=summary, panel=Panel(draw, order=10),
)
