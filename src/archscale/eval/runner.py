"""`archscale eval`: run the requested tasks on one checkpoint and write one JSON file.

The tasks are the registry's (archscale/eval/tasks/, one file each: docs/EVALUATION.md, "Adding an eval task");
this module names none of them. `run` resolves the protocol's settings, plans every task (so a bad setting fails
before any work), prints the plan, then runs the tasks in their order, writing the results file after each task
and after each length a task reports (an interrupt keeps them).

Context limits: `limit` (the longest sequence a task may feed the model) is `--max_length` when given, else
4x the training length (ArchScale's extrapolation range), and never more than a hard limit the model declares
(`model.max_context_length` or `config.max_seq_length`, if present). A task that needs more stops with a
one-line error before any work.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from archscale.errors import UserError
from archscale.progress import Progress

DEFAULT_EXTRAPOLATION_LIMIT = 4


def requested_tasks(spec: str) -> dict[str, list[str]]:
    """--tasks "ppl,lm_eval:a,b,phonebook" -> {"ppl": [], "lm_eval": ["a", "b"], "phonebook": []}: after
    "NAME:" of a task that takes items, items that are not task names are its items too."""
    from archscale.eval.tasks import by_name

    tasks = by_name()
    out: dict[str, list[str]] = {}
    in_items = None
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        name, colon, first = item.partition(":")
        if colon and name in tasks and tasks[name].items:
            if not first.strip():
                raise UserError(f"--tasks: '{name}:' needs a {tasks[name].items.lower()} name, e.g. "
                                f"{tasks[name].items_example}")
            in_items = name
            out.setdefault(name, []).append(first.strip())
        elif item in tasks and not tasks[item].items:
            out.setdefault(item, [])
        elif in_items:
            out[in_items].append(item)
        else:
            choices = ", ".join(n for n, t in tasks.items() if not t.items)
            choices = " or ".join([choices, *(f"{n}:{t.items}" for n, t in tasks.items() if t.items)])
            raise UserError(f"--tasks: unknown task {item!r}; choose from {choices}")
    if not out:
        raise UserError("--tasks is empty")
    return {name: list(dict.fromkeys(items)) for name, items in out.items()}


def parse_tasks(spec: str) -> tuple[list[str], list[str]]:
    """(the tasks that take no items, every item): --tasks split as before the registry."""
    from archscale.eval.tasks import by_name

    req, tasks = requested_tasks(spec), by_name()
    return [n for n in req if not tasks[n].items], [i for items in req.values() for i in items]


def hard_context_limit(model) -> int | None:
    for v in (getattr(model, "max_context_length", None), getattr(getattr(model, "config", None), "max_seq_length", None)):
        if isinstance(v, int) and v > 0:
            return v
    return None


class ModelTextGenerator:
    """Text in, greedy continuation text out, with a context-length check."""

    def __init__(self, em, batch_size: int, limit: int, limit_why: str):
        self.em, self.batch_size, self.limit, self.limit_why = em, batch_size, limit, limit_why
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = self.em.tokenizer.encode(text, eos=False)
            self._cache[text] = ids
        return ids

    def check(self, prompts: list[str], max_new_tokens: int, what: str) -> None:
        longest = max(len(self.encode(p)) for p in prompts)
        if longest + max_new_tokens > self.limit:
            raise UserError(f"{what}: a prompt of {longest} tokens + {max_new_tokens} generated is longer than the "
                            f"{self.limit} tokens allowed ({self.limit_why}); use shorter lengths or raise "
                            f"--max_length")

    def __call__(self, prompts: list[str], max_new_tokens: int, mark_eos: bool = False,
                 on_batch=None) -> list[str]:
        """Continuations cut before EOS; with `mark_eos` a generated EOS is kept as phonebook.EOS_MARK (a
        continuation shorter than `max_new_tokens` ended at EOS), as a decoder that keeps special tokens shows it."""
        from archscale.eval.decode import greedy_batch
        from archscale.eval.phonebook import EOS_MARK

        ids = [self.encode(p) for p in prompts]
        with self.em.autocast():
            outs = greedy_batch(self.em.model, ids, max_new_tokens, self.em.tokenizer.eos_id, self.batch_size,
                                on_batch=on_batch)
        for p in prompts:
            self._cache.pop(p, None)
        return [self.em.tokenizer.decode(o) + (EOS_MARK if mark_eos and len(o) < max_new_tokens else "")
                for o in outs]


def check_output_path(path: str) -> Path:
    from archscale.outputs import writable_file

    out_path = Path(path)
    if out_path.exists() and out_path.is_dir():
        raise UserError(f"--output {path} is a folder; give a .json file path")
    writable_file(out_path, "--output")  # before the evaluation, not after it
    return out_path


def context_limit(em, max_length: int | None) -> tuple[int, str]:
    """The longest sequence a built-in task may feed the model, and why (for error messages)."""
    T = em.train_len
    hard = hard_context_limit(em.model)
    if max_length is not None:
        if max_length < 2:
            raise UserError(f"--max_length must be at least 2, got {max_length}")
        limit, why = max_length, "--max_length"
    else:
        limit, why = DEFAULT_EXTRAPOLATION_LIMIT * T, f"default {DEFAULT_EXTRAPOLATION_LIMIT}x the training length {T}"
    if hard is not None and limit > hard:
        if max_length is not None:
            raise UserError(f"--max_length {max_length} is longer than the model supports ({hard} tokens)")
        limit, why = hard, "the model's maximum context"
    return limit, why


def result_document(args, em, st: dict, notes: list[str], limit: int, results: dict, timings: dict,
                    complete: bool = True) -> dict:
    plan = em.run_cfg.get("plan") or {}
    return {
        "complete": complete,  # False while tasks run: the file then holds the lengths finished so far
        "checkpoint": str(em.step_dir.resolve()) if em.step_dir else None,
        "run_dir": str(em.run_dir.resolve()) if em.run_dir else None,
        "run_name": plan.get("run_name") or (em.run_dir.name if em.run_dir else None),
        "step": em.step,
        "tokens_trained": plan.get("total_tokens"),
        "model": em.run_cfg.get("model"),
        "train_length": em.train_len,
        "tokenizer": getattr(em.tokenizer, "path", None),
        "context_limit": limit,
        "protocol": st["protocol"],
        "settings": {**vars(args), **st},
        "notes": notes,
        "results": results,
        "time_s": timings,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"python": platform.python_version(), "device": str(em.device), "precision": em.precision},
    }


def run(args) -> dict:
    """Evaluate; `args` is the parsed `archscale eval` namespace. Returns the JSON document (also written)."""
    from archscale.eval.loading import load_eval_model
    from archscale.eval.protocol import resolve
    from archscale.eval.tasks import by_name
    from archscale.eval.tasks.base import RunContext

    tasks = by_name()
    requested = requested_tasks(args.tasks)
    out_path = check_output_path(args.output)
    em = load_eval_model(args.checkpoint, device=args.device, tokenizer=args.tokenizer, precision=args.precision,
                         need_tokenizer=any(tasks[n].needs_tokenizer(args) for n in requested))
    varlen = bool((em.run_cfg.get("pretrain") or {}).get("varlen"))
    st, notes = resolve(args, em.train_len, varlen, set(requested))
    for note in notes:
        print(f"eval: note: {note}", file=sys.stderr, flush=True)
    limit, why = context_limit(em, args.max_length)
    results: dict = {}
    timings: dict = {}

    def write(complete: bool = False) -> dict:
        doc = result_document(args, em, st, notes, limit, results, timings, complete=complete)
        write_results(out_path, doc)
        return doc

    def on_length(task):
        """on_length of `task`: its finished lengths go to the output file at once (an interrupt keeps them)."""
        done: dict = {}

        def record(n: str, result: dict) -> None:
            done[n] = result
            results[task] = {"partial": True, "lengths": dict(done)}
            write()
        return record

    ctx = RunContext(args, st, em, ModelTextGenerator(em, args.batch_size, limit, why),
                     Progress(show=getattr(args, "progress", True)), notes, on_length)
    order = sorted(requested, key=lambda n: tasks[n].order)  # stable: the user's order within one task file
    plans = {n: tasks[n].plan(ctx, n, requested[n]) if tasks[n].plan else None for n in order}
    from archscale.eval.estimate import plan_lines

    for line in plan_lines(ctx, [(n, tasks[n], plans[n]) for n in order], measure=ctx.progress.show):
        ctx.progress.line(line)
    for name in order:
        t0 = time.perf_counter()
        results[name] = tasks[name].run(ctx, name, plans[name])
        timings[name] = round(time.perf_counter() - t0, 2)
        write()
    return write(complete=True)


def write_results(out_path: Path, doc: dict) -> None:
    """Atomically (a reader never sees half a file; an interrupt leaves the previous version)."""
    if out_path.parent and not out_path.parent.exists():
        out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, out_path)


def summary_lines(doc: dict) -> list[str]:
    from archscale.eval.tasks import all_tasks

    return [line for task in all_tasks() if task.summary for line in task.summary(doc["results"])]
