"""`archscale reason --task gsm8k|math|aime24 --data FILE.jsonl (--endpoint URL | --checkpoint RUN)`."""

from __future__ import annotations

from pathlib import Path



def reason_parser():
    from archscale.cli_types import nonnegative_float, positive_int, seed_int
    from archscale.serve.cli import _Parser

    p = _Parser(prog="archscale reason", description="Reasoning evaluation: sample K answers per problem, score "
                                                     "them, report pass@1 and unbiased pass@k.")
    p.add_argument("--task", required=True, choices=["gsm8k", "math", "aime24"])
    p.add_argument("--data", required=True, help="JSONL problems (fields: docs/SERVING.md, 'Reasoning evaluation')")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--endpoint", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (ours or vLLM)")
    src.add_argument("--checkpoint", help="run dir or checkpoints/step-*: decoded in this process")
    p.add_argument("--model", default=None, help="with --endpoint: the model id (default: the server's first)")
    p.add_argument("--tokenizer", default=None, help="with --checkpoint: override the run's tokenizer")
    p.add_argument("--device", default=None)
    p.add_argument("--samples", type=positive_int, default=1, help="K completions per problem")
    p.add_argument("--max_tokens", type=positive_int, default=512)
    p.add_argument("--temperature", type=nonnegative_float, default=None,
                   help="default: 0 for one sample, 0.6 for several")
    p.add_argument("--seed", type=seed_int, default=0, help="sample i of problem j uses seed + j*K + i")
    p.add_argument("--limit", type=positive_int, default=None, help="only the first N problems")
    p.add_argument("--concurrency", type=positive_int, default=8, help="with --endpoint: requests in flight")
    p.add_argument("--output", default=None, help="summary JSON (default: reason-<task>.json); items beside it")
    p.add_argument("--items", default=None, help="per-item JSONL, appended as problems finish; a rerun with the "
                                                 "same settings resumes it (default: <output>.items.jsonl)")
    p.add_argument("--run_name", default=None, help="the series name in `archscale report`")
    from archscale.progress import add_progress_flag
    add_progress_flag(p)
    return p


def reason_main(argv: list[str]) -> int:
    from archscale.reason.runner import (ItemStore, checkpoint_completer, endpoint_completer, items_path_for,
                                         read_items, run_reason, write_outputs)
    from archscale.reason.tasks import get_task

    a = reason_parser().parse_args(argv)
    task = get_task(a.task)
    items = read_items(a.data, task)[: a.limit]
    temperature = a.temperature if a.temperature is not None else (0.0 if a.samples == 1 else 0.6)
    output = a.output or f"reason-{task.name}.json"
    settings = {"task": task.name, "samples": a.samples, "temperature": temperature, "max_tokens": a.max_tokens,
                "seed": a.seed, "model": a.model,  # an endpoint's URL may change between runs (a new port)
                "checkpoint": str(Path(a.checkpoint).resolve()) if a.checkpoint else None}
    store = ItemStore(items_path_for(output, a.items), settings)  # before any sampling: a mismatch is refused now
    if a.endpoint:
        completer = endpoint_completer(a.endpoint, a.model, a.max_tokens, temperature, task.stop, a.seed,
                                       a.concurrency)
        source = a.endpoint
    else:
        completer = checkpoint_completer(a.checkpoint, a.tokenizer, a.device, a.max_tokens, temperature, task.stop,
                                         a.seed)
        source = a.checkpoint
    from archscale.progress import Progress
    rows, summary = run_reason(task, items, completer, a.samples, store, Progress(show=a.progress))
    summary.update(temperature=temperature, max_tokens=a.max_tokens, data=str(a.data), source=source)
    run_name = a.run_name or (completer.info["model"] if a.endpoint else Path(a.checkpoint).resolve().name)
    doc = {"run_name": run_name, "task": task.name, "results": {"reason": {task.name: summary}}}
    out, items_p = write_outputs(rows, doc, output, a.items, store)
    ks = "".join(f", pass@{k} {v:.3f}" for k, v in summary["pass@k"].items() if k != "1")  # pass@1: once
    print(f"{task.name}: {summary['items']} problems x {a.samples} samples: pass@1 {summary['pass@1']:.3f}{ks}")
    print(f"wrote {out} and {items_p}")
    return 0
