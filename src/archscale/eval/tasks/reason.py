"""`reason`: `archscale reason`'s evaluation (archscale/reason/: sample K answers per problem, pass@1 and
pass@k) on the checkpoint being evaluated, through reason's own runner and resumable item store; the report's
"Reasoning" panel, which also draws `archscale reason` summaries (the same `results.reason.TASK` shape)."""

from __future__ import annotations

from pathlib import Path

from archscale.cli_types import nonnegative_float, positive_int
from archscale.errors import UserError
from archscale.eval.tasks.base import EvalTask, Option, Panel, RunContext

OPTIONS = (
    Option("reason_task", default="gsm8k", choices=("gsm8k", "math", "aime24"), help="the problem set's scoring"),
    Option("reason_data", help="JSONL problems (fields: docs/SERVING.md, 'Reasoning evaluation')"),
    Option("reason_samples", type=positive_int, default=1, help="K completions per problem"),
    Option("reason_max_tokens", type=positive_int, default=512, help="tokens generated per completion"),
    Option("reason_temperature", type=nonnegative_float, help="default: 0 for one sample, 0.6 for several"),
    Option("reason_limit", type=positive_int, help="only the first N problems"),
)


def items_path(output: str, task: str) -> Path:
    """Beside the results file; a rerun with the same settings resumes it (reason's ItemStore)."""
    out = Path(output)
    return out.with_name(f"{out.stem}.reason-{task}.items.jsonl")


def plan(ctx: RunContext, name: str, items: list[str]) -> dict:
    from archscale.reason.runner import ItemStore, read_items
    from archscale.reason.tasks import get_task

    a = ctx.args
    if not a.reason_data:
        raise UserError("--tasks reason needs --reason_data FILE.jsonl (docs/SERVING.md, 'Reasoning evaluation')")
    task = get_task(a.reason_task)
    problems = read_items(a.reason_data, task)[: a.reason_limit]
    temperature = a.reason_temperature if a.reason_temperature is not None else (0.0 if a.reason_samples == 1 else 0.6)
    settings = {"task": task.name, "samples": a.reason_samples, "temperature": temperature,
                "max_tokens": a.reason_max_tokens, "seed": a.seed, "model": None,
                "checkpoint": str(Path(a.checkpoint).resolve())}
    store = ItemStore(items_path(a.output, task.name), settings)  # a mismatch is refused before any work
    return {"task": task, "items": problems, "temperature": temperature, "store": store}


def run(ctx: RunContext, name: str, p: dict) -> dict:
    from archscale.reason.runner import model_completer, run_reason

    a, em, task = ctx.args, ctx.em, p["task"]
    completer = model_completer(em.model, em.tokenizer, em.autocast, a.reason_max_tokens, p["temperature"],
                                task.stop, a.seed, source=f"--checkpoint {a.checkpoint}")
    rows, summary = run_reason(task, p["items"], completer, a.reason_samples, p["store"], ctx.progress)
    p["store"].rewrite([p["store"].key(r, r["prompt"]) for r in rows])
    summary.update(temperature=p["temperature"], max_tokens=a.reason_max_tokens, data=str(a.reason_data),
                   source=a.checkpoint, items_file=str(p["store"].path))
    return {task.name: summary}


def plan_row(ctx: RunContext, name: str, p: dict, speed) -> tuple[str, float | None]:
    return (f"{p['task'].name}: {len(p['items'])} problems x {ctx.args.reason_samples} samples, up to "
            f"{ctx.args.reason_max_tokens} new tokens each", None)


def summary(results: dict) -> list[str]:
    return [f"reason {t}: {r['items']} problems x {r['samples']} samples: pass@1 {r['pass@1']:.3f}"
            + "".join(f", pass@{k} {v:.3f}" for k, v in r["pass@k"].items() if k != "1")
            for t, r in (results.get("reason") or {}).items()]


def reasoning_scores(doc: dict) -> dict[str, float]:
    """`archscale reason` summaries: pass@1 and pass@K (K = the samples drawn) per task."""
    out = {}
    for task, r in (doc["results"].get("reason") or {}).items():
        out[f"{task}\npass@1"] = float(r["pass@1"])
        k = max(r.get("pass@k", {}), key=int, default=None)
        if k is not None and k != "1":
            out[f"{task}\npass@{k}"] = float(r["pass@k"][k])
    return out


def draw(ax, docs: list[dict], labels: list[str], colors: list[str]) -> None:
    from archscale.eval.panels import bars, no_data

    if bars(ax, [reasoning_scores(d) for d in docs], labels, colors):
        ax.set_ylabel("accuracy")
    else:
        no_data(ax, "reasoning")
    ax.set_title("Reasoning (archscale reason)")


TASK = EvalTask(
    names=("reason",), about="reason (gsm8k, math, aime24 problems from --reason_data: pass@1, pass@k)", order=50,
    options=OPTIONS, plan=plan, run=run, plan_row=plan_row, summary=summary, panel=Panel(draw, order=50),
)
