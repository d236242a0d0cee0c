"""`archscale eval`: run the requested tasks on one checkpoint and write one JSON file.

Context limits: `limit` (the longest sequence any task may feed the model) is `--max_length` when given, else
4x the training length (ArchScale's extrapolation range), and never more than a hard limit the model declares
(`model.max_context_length` or `config.max_seq_length`, if present). A task that needs more stops with a
one-line error before any work. lm-eval tasks read at most `--max_length` tokens (default: the training length;
4096 under --protocol archscale), keeping the last ones, as lm-eval's own models do.

`--protocol` (eval/protocol.py) fills every flag left unset with archscale's or ArchScale's settings; `run` resolves
them, plans every task (so a bad setting fails before any work), runs the built-in tasks, then lm-eval's.
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

BUILTIN = ("ppl", "phonebook", "niah_single_1", "niah_single_2", "niah_single_3")
DEFAULT_EXTRAPOLATION_LIMIT = 4


def parse_tasks(spec: str) -> tuple[list[str], list[str]]:
    """"ppl,lm_eval:a,b,phonebook" -> (["ppl", "phonebook"], ["a", "b"]): after "lm_eval:", items that are not
    built-in task names are lm-eval tasks too."""
    builtin, lm_tasks = [], []
    in_lm = False
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        if item.startswith("lm_eval:"):
            in_lm = True
            item = item[len("lm_eval:"):].strip()
            if not item:
                raise UserError("--tasks: 'lm_eval:' needs a task name, e.g. lm_eval:archscale_mc")
            lm_tasks.append(item)
        elif item in BUILTIN:
            builtin.append(item)
        elif in_lm:
            lm_tasks.append(item)
        else:
            raise UserError(f"--tasks: unknown task {item!r}; choose from {', '.join(BUILTIN)} or lm_eval:TASK")
    if not builtin and not lm_tasks:
        raise UserError("--tasks is empty")
    return list(dict.fromkeys(builtin)), list(dict.fromkeys(lm_tasks))


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


def default_lm_eval_include() -> list[str]:
    """The repo's examples/lm_eval_tasks (present in a source checkout)."""
    p = Path(__file__).resolve().parents[3] / "examples" / "lm_eval_tasks"
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


def plan_builtin(args, st: dict, em, gen: ModelTextGenerator, builtin: list[str]) -> dict:
    """Check every built-in task's settings and build its samples before running any (a bad flag should not
    cost the first tasks' time). `st`: the protocol's resolved settings."""
    from archscale.eval.loading import validation_dir

    T, limit, why = em.train_len, gen.limit, gen.limit_why
    plans: dict = {}
    if "ppl" in builtin:
        factors = sorted({int(x) for x in str(st["extrapolation"]).split(",") if x.strip()})
        if not factors or factors[0] < 1:
            raise UserError(f"--extrapolation needs positive integers, got {st['extrapolation']!r}")
        if factors[-1] * T > limit:
            raise UserError(f"--extrapolation {factors[-1]}x = {factors[-1] * T} tokens is longer than the {limit} "
                            f"tokens allowed ({why}); raise --max_length")
        window = args.window or T
        if args.ppl_file and window > limit:
            raise UserError(f"--window {window} is longer than the {limit} tokens allowed ({why})")
        from archscale.eval.ppl import count_validation_samples

        val_dir = validation_dir(em, args.val_data_dir)
        samples = count_validation_samples(val_dir, factors[-1] * T + 1, args.batch_size, st["ppl_max_batches"],
                                           st["ppl_selection"])
        plans["ppl"] = {"factors": factors, "window": window, "val_dir": val_dir, "samples": samples}
    if "phonebook" in builtin:
        from archscale.eval.phonebook import MAX_NEW_TOKENS, lengths_from, plan_phonebook, prompts_of

        plans["phonebook"] = plan_phonebook(lengths_from(st["min_eval_len"], st["max_eval_len"], st["eval_len_step"]),
                                            args.seed, st["eval_num_batches"], st["phonebook_batch_size"],
                                            st["phonebook_style"], st["phonebook_names"])
        gen.check(prompts_of(plans["phonebook"]), MAX_NEW_TOKENS, "phonebook")
    lengths = [int(x) for x in str(st["max_seq_lengths"]).split(",") if x.strip()]
    for task in [t for t in builtin if t.startswith("niah_")]:
        from archscale.eval.niah import TOKENS_TO_GENERATE, plan_niah

        plans[task] = plan_niah(task, lengths, st["niah_samples"], lambda s: len(gen.encode(s)), args.seed,
                                args.haystack_file, keys=st["niah_keys"])
        gen.check([s["prompt"] for v in plans[task].values() for s in v], TOKENS_TO_GENERATE, task)
    return plans


def run_builtin(args, st: dict, em, gen: ModelTextGenerator, plans: dict, timed, progress, partial) -> None:
    """Run the planned built-in tasks; `partial(task)` is the `on_length` that records a task's finished lengths."""
    if "ppl" in plans:
        from archscale.eval.ppl import sliding_window_ppl, validation_extrapolation

        p = plans["ppl"]

        def ppl():
            with progress.stage(f"ppl {','.join(f'{k}x' for k in p['factors'])}", p["samples"], "samples") as bar:
                r = {"validation": validation_extrapolation(em, p["val_dir"], p["factors"], args.batch_size,
                                                            st["ppl_max_batches"], st["ppl_selection"],
                                                            on_batch=bar.advance),
                     "val_data_dir": str(p["val_dir"])}
            if args.ppl_file:
                stride = args.stride or max(1, p["window"] // 2)
                with progress.stage(f"ppl {args.ppl_file}"):
                    r["file"] = sliding_window_ppl(em, args.ppl_file, p["window"], stride, args.batch_size)
            return r
        timed("ppl", ppl)
    if "phonebook" in plans:
        from archscale.eval.phonebook import evaluate_phonebook

        timed("phonebook", lambda: evaluate_phonebook(gen, [], plan=plans["phonebook"], stage=progress.stage,
                                                      on_length=partial("phonebook")))
    for task in [t for t in plans if t.startswith("niah_")]:
        from archscale.eval.niah import evaluate_niah

        timed(task, lambda task=task: evaluate_niah(task, gen, [], 0, None, args.seed, args.haystack_file,
                                                    plan=plans[task], stage=progress.stage,
                                                    on_length=partial(task)))


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

    builtin, lm_tasks = parse_tasks(args.tasks)
    out_path = check_output_path(args.output)
    # perplexity on validation shards reads token ids: it needs no tokenizer (foreign shards have none)
    needs_tokenizer = bool(lm_tasks) or any(t != "ppl" for t in builtin) or bool(args.ppl_file)
    em = load_eval_model(args.checkpoint, device=args.device, tokenizer=args.tokenizer, precision=args.precision,
                         need_tokenizer=needs_tokenizer)
    varlen = bool((em.run_cfg.get("pretrain") or {}).get("varlen"))
    st, notes = resolve(args, em.train_len, varlen, set(builtin))
    for note in notes:
        print(f"eval: note: {note}", file=sys.stderr, flush=True)
    limit, why = context_limit(em, args.max_length)
    gen = ModelTextGenerator(em, args.batch_size, limit, why)
    results: dict = {}
    timings: dict = {}
    progress = Progress(show=getattr(args, "progress", True))

    def timed(name, fn):
        t0 = time.perf_counter()
        results[name] = fn()
        timings[name] = round(time.perf_counter() - t0, 2)
        write_results(out_path, result_document(args, em, st, notes, limit, results, timings, complete=False))

    def partial(task):
        """on_length of `task`: its finished lengths go to the output file at once (an interrupt keeps them)."""
        done: dict = {}

        def on_length(n: str, result: dict) -> None:
            done[n] = result
            results[task] = {"partial": True, "lengths": dict(done)}
            write_results(out_path, result_document(args, em, st, notes, limit, results, timings, complete=False))
        return on_length

    plans = plan_builtin(args, st, em, gen, builtin)
    meta = lm_eval_metadata(args, st) if lm_tasks else {}
    from archscale.eval.estimate import plan_lines

    for line in plan_lines(em, args, plans, lm_tasks, lambda text: len(gen.encode(text)), measure=progress.show):
        progress.line(line)
    run_builtin(args, st, em, gen, plans, timed, progress, partial)
    if lm_tasks:
        include = list(args.lm_eval_include or []) + default_lm_eval_include()
        max_length = args.max_length or st["lm_eval_max_length"] or em.train_len

        def lm():
            with progress.stage(f"lm_eval {','.join(lm_tasks)}"):
                return run_lm_eval(em, lm_tasks, include, args.batch_size, max_length, args.lm_eval_limit,
                                   args.num_fewshot, args.seed, meta)
        timed("lm_eval", lm)
        notes.extend(results["lm_eval"].get("notes", []))
    doc = result_document(args, em, st, notes, limit, results, timings)
    write_results(out_path, doc)
    return doc


def write_results(out_path: Path, doc: dict) -> None:
    """Atomically (a reader never sees half a file; an interrupt leaves the previous version)."""
    if out_path.parent and not out_path.parent.exists():
        out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, out_path)


def summary_lines(doc: dict) -> list[str]:
    lines = []
    r = doc["results"]
    if "ppl" in r:
        v = r["ppl"]["validation"]
        lines.append("ppl: " + ", ".join(f"val_loss@{k} {v[k]['loss']:.3f} (ppl {v[k]['ppl']:.1f})"
                                         for k in v if k.endswith("x")))
        if "file" in r["ppl"]:
            f = r["ppl"]["file"]
            lines.append(f"ppl file: loss {f['loss']:.3f}, ppl {f['ppl']:.1f}, {f['bits_per_byte']:.3f} bits/byte")
    if "phonebook" in r:
        lines.append("phonebook: " + ", ".join(f"{n} entries {v['mean']:.2f}±{v['std']:.2f}"
                                               for n, v in r["phonebook"]["lengths"].items()))
    for t in ("niah_single_1", "niah_single_2", "niah_single_3"):
        if t in r:
            lines.append(f"{t}: " + ", ".join(f"{n} tokens {v['score']:.2f}" for n, v in r[t]["lengths"].items()))
    if "lm_eval" in r:
        for t, m in r["lm_eval"]["tasks"].items():
            lines.append(f"lm_eval {t}: " + ", ".join(f"{k} {v:.4g}" for k, v in m.items()))
    return lines
