"""Sample K completions per problem (from an OpenAI-compatible endpoint or a checkpoint in this process), score
them, write per-item JSONL and a summary JSON that `archscale report` plots."""

from __future__ import annotations

import asyncio
import json
import threading
from math import comb
from pathlib import Path
from typing import Callable

from archscale.errors import UserError
from archscale.progress import Progress
from archscale.reason.tasks import Task, check_item, extract, gold_for, is_correct, prompt_for

# prompts, n samples each -> n completions per prompt
Completer = Callable[[list[str], int], list[list[str]]]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def ks_for(samples: int) -> list[int]:
    """1, 2, 4, ... up to the number of samples, and the number of samples itself."""
    ks, k = [], 1
    while k < samples:
        ks.append(k)
        k *= 2
    return ks + [samples]


def read_items(path: str, task: Task) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--data {path}: no such file")
    items = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"--data {path}:{i}: not JSON ({e.msg})") from None
        if not isinstance(item, dict):
            raise UserError(f"--data {path}:{i}: want a JSON object per line")
        check_item(task, item, i, path)
        item.setdefault("id", i)
        items.append(item)
    if not items:
        raise UserError(f"--data {path}: no items in it")
    return items


def score(task: Task, items: list[dict], completions: list[list[str]], samples: int) -> tuple[list[dict], dict]:
    rows = []
    for item, outs in zip(items, completions):
        gold = gold_for(task, item)
        preds = [extract(task, o) for o in outs]
        correct = [is_correct(task, p, gold) for p in preds]
        rows.append({"id": item["id"], "task": task.name, "prompt": prompt_for(task, item), "gold": gold,
                     "completions": outs, "predictions": preds, "correct": correct, "n_correct": sum(correct),
                     "pass@1": sum(correct) / len(correct)})
    ks = ks_for(samples)
    summary = {"items": len(rows), "samples": samples,
               "pass@1": sum(r["pass@1"] for r in rows) / len(rows),
               "pass@k": {str(k): sum(pass_at_k(samples, r["n_correct"], k) for r in rows) / len(rows) for k in ks}}
    return rows, summary


# ------------------------------------------------------------------------------------------------ completers
def endpoint_completer(url: str, model: str | None, max_tokens: int, temperature: float, stop: tuple[str, ...],
                       seed: int | None, concurrency: int = 8) -> Completer:
    """One `/v1/completions` request per problem with n = samples (ours or vLLM's)."""
    import httpx

    from archscale.serve.bench import discover_model

    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    info = {"model": model}

    async def run(prompts: list[str], n: int, on_done=None) -> list[list[str]]:
        async with httpx.AsyncClient(timeout=3600) as client:
            name = info["model"] = model or await discover_model(client, base)
            gate = asyncio.Semaphore(concurrency)

            async def one(i: int, prompt: str) -> list[str]:
                body = {"model": name, "prompt": prompt, "n": n, "max_tokens": max_tokens,
                        "temperature": temperature, "stop": list(stop)}
                if seed is not None:
                    body["seed"] = seed + i * n
                async with gate:
                    try:
                        r = await client.post(f"{base}/completions", json=body)
                    except httpx.HTTPError as e:
                        raise UserError(f"--endpoint {url}: {type(e).__name__}: {e}") from None
                if r.status_code != 200:
                    raise UserError(f"--endpoint {url}: HTTP {r.status_code}: {r.text[:300]}")
                choices = sorted(r.json()["choices"], key=lambda c: c["index"])
                if on_done is not None:  # progress: samples done
                    on_done(len(choices))
                return [c["text"] for c in choices]

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    def complete(prompts: list[str], n: int, on_done=None) -> list[list[str]]:
        return asyncio.run(run(prompts, n, on_done))

    complete.info = info  # the model id the server answered with, once run
    return complete


def checkpoint_completer(checkpoint: str, tokenizer: str | None, device: str | None, max_tokens: int,
                         temperature: float, stop: tuple[str, ...], seed: int | None, max_batch: int = 16) -> Completer:
    """Our engine in this process: every sample of every problem is queued at once and decoded in batches."""
    from archscale.serve.cli import load_served_model
    from archscale.serve.engine import Engine, SamplingParams, Sequence

    sm = load_served_model(checkpoint, tokenizer, device)

    def run(prompts: list[str], n: int, on_done=None) -> list[list[str]]:
        ids = [sm.tokenizer.encode(p, bos=False, eos=False) or [sm.tokenizer.eos_id] for p in prompts]
        max_len = max(len(x) for x in ids) + max_tokens
        engine = Engine(sm.model, sm.tokenizer, max_batch=max_batch, max_queue=len(prompts) * n,
                        max_model_len=max_len, autocast=sm.autocast).start()
        texts = [[""] * n for _ in prompts]
        errors: list[str] = []
        left = [len(prompts) * n]
        done = threading.Event()
        lock = threading.Lock()

        def emit_for(i: int):
            def emit(ev):
                texts[i][ev.index] += ev.text
                if ev.finish_reason:
                    with lock:
                        if ev.error:
                            errors.append(ev.error)
                        left[0] -= 1
                        if on_done is not None:  # progress: samples done
                            on_done(1)
                        if left[0] == 0:
                            done.set()
            return emit

        seqs = [Sequence(x, SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stop,
                                           seed=None if seed is None else seed + i * n + j), emit_for(i), index=j)
                for i, x in enumerate(ids) for j in range(n)]
        try:
            engine.submit(seqs)
            done.wait()
        finally:
            engine.shutdown()
        if errors:
            raise UserError(f"--checkpoint {checkpoint}: generation failed ({errors[0]})")
        return texts

    return run


def run_reason(task: Task, items: list[dict], completer: Completer, samples: int,
               progress: Progress | None = None) -> tuple[list[dict], dict]:
    """Sample and score; with `progress`, a bar of samples done (the completer then gets `on_done`)."""
    prompts = [prompt_for(task, it) for it in items]
    if progress is None:
        completions = completer(prompts, samples)
    else:
        with progress.stage(f"reason {task.name}", len(items) * samples, "samples") as bar:
            completions = completer(prompts, samples, on_done=bar.advance)
    return score(task, items, completions, samples)


def write_outputs(rows: list[dict], summary: dict, output: str, items_path: str | None) -> tuple[Path, Path]:
    out = Path(output)
    items_p = Path(items_path) if items_path else out.with_suffix(".items.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    items_p.parent.mkdir(parents=True, exist_ok=True)
    items_p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out.write_text(json.dumps(summary, indent=2) + "\n")
    return out, items_p
