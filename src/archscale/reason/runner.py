"""Sample K completions per problem (from an OpenAI-compatible endpoint or a checkpoint in this process), score
them, write per-item JSONL and a summary JSON that `archscale report` plots.

Nothing sampled is lost: each problem's row is appended to the items JSONL (and flushed) as soon as its K samples
are scored, and a rerun with the same settings reads those rows back and samples only the problems still missing
(`ItemStore`). A source that answers fewer completions than asked is an error, so every row holds exactly K
samples and pass@k is computed from the samples actually scored, one figure per k."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from math import comb
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from archscale.errors import UserError
from archscale.progress import Progress
from archscale.reason.tasks import Task, check_item, extract, gold_for, is_correct, prompt_for

# (problem index, prompt) jobs, n samples each, and on_done(index, n completions), called as each problem finishes
Completer = Callable[[list[tuple[int, str]], int, Callable[[int, list[str]], None]], None]


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
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--data {path}: not UTF-8 text (byte {e.start}); save it as UTF-8 JSONL") from None
    items = []
    for i, line in enumerate(text.splitlines(), 1):
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


def score_item(task: Task, item: dict, outs: list[str]) -> dict:
    gold = gold_for(task, item)
    preds = [extract(task, o) for o in outs]
    correct = [is_correct(task, p, gold) for p in preds]
    return {"id": item["id"], "task": task.name, "prompt": prompt_for(task, item), "gold": gold,
            "completions": outs, "predictions": preds, "correct": correct, "n_correct": sum(correct),
            "pass@1": sum(correct) / len(correct)}


def summarize(rows: list[dict], samples: int) -> dict:
    """pass@k for k = 1, 2, 4, ..., samples over the rows (each with exactly `samples` scored samples); the
    summary's "pass@1" is the table's "1", the same number."""
    ks = ks_for(samples)
    table = {str(k): sum(pass_at_k(len(r["correct"]), r["n_correct"], k) for r in rows) / len(rows) for k in ks}
    return {"items": len(rows), "samples": samples, "pass@1": table["1"], "pass@k": table}


def score(task: Task, items: list[dict], completions: list[list[str]], samples: int) -> tuple[list[dict], dict]:
    rows = [score_item(task, item, outs) for item, outs in zip(items, completions)]
    return rows, summarize(rows, samples)


class ItemStore:
    """The items JSONL: rows appended as problems finish; rows of an earlier run with the same settings resume."""

    def __init__(self, path: str | Path, settings: dict):
        self.path, self.settings = Path(path), settings
        self.rows: dict[str, dict] = {}
        self.lock = threading.Lock()
        if self.path.is_file():
            self._read()

    @staticmethod
    def key(item: dict, prompt: str) -> str:
        return json.dumps([item["id"], prompt])

    def _read(self) -> None:
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a crash: that problem is sampled again
                continue
            if not isinstance(row, dict) or "prompt" not in row or "id" not in row:
                continue
            if row.get("settings") != self.settings:
                diff = sorted(k for k in {**self.settings, **(row.get("settings") or {})}
                              if (row.get("settings") or {}).get(k) != self.settings.get(k))
                raise UserError(f"--items {self.path}: written by a run with other settings ({', '.join(diff)}); "
                                "pass another --items / --output, or delete it to start over")
            self.rows[self.key(row, row["prompt"])] = row

    def add(self, row: dict) -> None:
        row = {**row, "settings": self.settings}
        with self.lock:
            self.rows[self.key(row, row["prompt"])] = row
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def rewrite(self, order: list[str]) -> None:
        """The finished file, in problem order (rows of problems outside this run kept at the end), atomically."""
        rest = [k for k in self.rows if k not in set(order)]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(self.rows[k]) + "\n" for k in [*order, *rest]), encoding="utf-8")
        os.replace(tmp, self.path)


# ------------------------------------------------------------------------------------------------ completers
def _choices(r, url: str, n: int) -> list[str]:
    """The n completion texts of one answer, in choice order; a one-line UserError for anything else."""
    try:
        data = r.json()
    except ValueError:
        raise UserError(f"--endpoint {url}: the answer is not JSON ({r.text[:80]!r})") from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not all(isinstance(c, dict) and isinstance(c.get("text"), str)
                                                for c in choices):
        raise UserError(f"--endpoint {url}: the answer has no list of choices with text ({r.text[:80]!r})")
    if len(choices) != n:
        raise UserError(f"--endpoint {url}: asked for n={n} completions, the answer has {len(choices)} choices "
                        "(does the server support n?); that problem was not scored")
    indices = [c.get("index", i) for i, c in enumerate(choices)]
    if sorted(indices) != list(range(n)):
        raise UserError(f"--endpoint {url}: the answer's choice index values are {indices}, not 0..{n - 1}")
    return [c["text"] for c in sorted(choices, key=lambda c: c.get("index", 0))]


def endpoint_completer(url: str, model: str | None, max_tokens: int, temperature: float, stop: tuple[str, ...],
                       seed: int | None, concurrency: int = 8) -> Completer:
    """One `/v1/completions` request per problem with n = samples (ours or vLLM's). When one fails, the others
    in flight still finish (and are written) before the error is raised."""
    import httpx

    from archscale.serve.bench import api_base, discover_model

    base = api_base(url, "--endpoint")
    info = {"model": model}

    async def run(jobs: list[tuple[int, str]], n: int, on_done) -> None:
        async with httpx.AsyncClient(timeout=3600) as client:
            name = info["model"] = model or await discover_model(client, base)
            gate = asyncio.Semaphore(concurrency)

            async def one(i: int, prompt: str) -> None:
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
                on_done(i, _choices(r, url, n))

            results = await asyncio.gather(*(one(i, p) for i, p in jobs), return_exceptions=True)
            errors = [e for e in results if isinstance(e, BaseException)]
            if errors:
                raise errors[0]

    def complete(jobs: list[tuple[int, str]], n: int, on_done) -> None:
        asyncio.run(run(jobs, n, on_done))

    complete.info = info  # the model id the server answered with, once run
    return complete


def checkpoint_completer(checkpoint: str, tokenizer: str | None, device: str | None, max_tokens: int,
                         temperature: float, stop: tuple[str, ...], seed: int | None, max_batch: int = 16) -> Completer:
    """Our engine in this process: every sample of every problem is queued at once and decoded in batches."""
    from archscale.serve.cli import load_served_model

    sm = load_served_model(checkpoint, tokenizer, device)
    return model_completer(sm.model, sm.tokenizer, sm.autocast, max_tokens, temperature, stop, seed, max_batch,
                           source=f"--checkpoint {checkpoint}")


def model_completer(model, tokenizer, autocast, max_tokens: int, temperature: float, stop: tuple[str, ...],
                    seed: int | None, max_batch: int = 16, source: str = "the model") -> Completer:
    """`checkpoint_completer` on a model already loaded (`archscale eval --tasks reason` reuses its own)."""
    from archscale.serve.engine import Engine, SamplingParams, Sequence

    sm = SimpleNamespace(model=model, tokenizer=tokenizer, autocast=autocast)

    def run(jobs: list[tuple[int, str]], n: int, on_done) -> None:
        ids = [sm.tokenizer.encode(p, bos=False, eos=False) or [sm.tokenizer.eos_id] for _, p in jobs]
        max_len = max(len(x) for x in ids) + max_tokens
        engine = Engine(sm.model, sm.tokenizer, max_batch=max_batch, max_queue=len(jobs) * n,
                        max_model_len=max_len, autocast=sm.autocast).start()
        texts = [[""] * n for _ in jobs]
        errors: list[str] = []
        left, per_job = [len(jobs) * n], [n] * len(jobs)
        done = threading.Event()
        lock = threading.Lock()

        def emit_for(k: int):
            def emit(ev):
                texts[k][ev.index] += ev.text
                if ev.finish_reason:
                    with lock:
                        if ev.error:
                            errors.append(ev.error)
                        per_job[k] -= 1
                        if per_job[k] == 0 and not ev.error:  # this problem's n samples are in: score it now
                            on_done(jobs[k][0], texts[k])
                        left[0] -= 1
                        if left[0] == 0:
                            done.set()
            return emit

        seqs = [Sequence(x, SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stop,
                                           seed=None if seed is None else seed + i * n + j), emit_for(k), index=j)
                for k, ((i, _), x) in enumerate(zip(jobs, ids)) for j in range(n)]
        try:
            engine.submit(seqs)
            done.wait()
        finally:
            engine.shutdown()
        if errors:
            raise UserError(f"{source}: generation failed ({errors[0]})")

    return run


def run_reason(task: Task, items: list[dict], completer: Completer, samples: int,
               store: ItemStore | None = None, progress: Progress | None = None) -> tuple[list[dict], dict]:
    """Score every item, sampling only those `store` does not hold yet; each finished row goes to `store` at
    once (with `progress`, a bar of samples done). Returns the rows in item order and the summary."""
    store = store or _MemoryStore()
    prompts = [prompt_for(task, it) for it in items]
    keys = [ItemStore.key(it, p) for it, p in zip(items, prompts)]
    todo = [(i, p) for i, (k, p) in enumerate(zip(keys, prompts)) if k not in store.rows]
    if todo:
        with (progress or Progress(show=False)).stage(f"reason {task.name}", len(todo) * samples, "samples") as bar:
            def done(i: int, outs: list[str]) -> None:
                store.add(score_item(task, items[i], outs))
                bar.advance(len(outs))
            completer(todo, samples, done)
    rows = [store.rows[k] for k in keys]
    return rows, summarize(rows, samples)


class _MemoryStore(ItemStore):
    def __init__(self):  # noqa: D107 - no file: rows kept in memory only
        self.rows, self.lock = {}, threading.Lock()

    def add(self, row: dict) -> None:
        with self.lock:
            self.rows[self.key(row, row["prompt"])] = row


def items_path_for(output: str, items_path: str | None) -> Path:
    return Path(items_path) if items_path else Path(output).with_suffix(".items.jsonl")


def write_outputs(rows: list[dict], summary: dict, output: str, items_path: str | None,
                  store: ItemStore | None = None) -> tuple[Path, Path]:
    out = Path(output)
    items_p = items_path_for(output, items_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    items_p.parent.mkdir(parents=True, exist_ok=True)
    if store is not None:
        store.rewrite([ItemStore.key(r, r["prompt"]) for r in rows])
    else:
        items_p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out.write_text(json.dumps(summary, indent=2) + "\n")
    return out, items_p
