"""`archscale bench-serve`: a load-test client for any OpenAI-compatible completions server (ours, vLLM, ...).

N concurrent clients each send streaming `/v1/completions` requests back to back for S seconds (a request started
before the deadline runs to its end). Per request we time the first token (TTFT), every gap between tokens (ITL),
the whole request (latency) and count output tokens (the server's `usage` when it sends one, else one per
streamed chunk with text). Reported: mean / median / p95 / p99 of each, requests/s and output tokens/s over the
wall time, as a table and as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from archscale.errors import UserError
from archscale.progress import Progress, add_progress_flag


class _Parser(argparse.ArgumentParser):
    """Flag errors as one-line UserErrors like every other bad input (`serve` and `bench-serve`)."""

    def error(self, message):
        raise UserError(f"{self.prog}: {message}")

DEFAULT_PROMPTS = [
    "Lords and Commons of England, consider what nation it is whereof ye are",
    "For books are not absolutely dead things, but do contain a potency of life in them",
    "Give me the liberty to know, to utter, and to argue freely according to conscience",
    "And though all the winds of doctrine were let loose to play upon the earth",
]


@dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


def read_prompts(path: str | None) -> list[str]:
    """One prompt per line of a .txt file, or the "prompt" (or "text") field of each line of a .jsonl file."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--prompts {path}: no such file")
    prompts = []
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--prompts {path}: not UTF-8 text (byte {e.start})") from None
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                row = json.loads(line)
                prompts.append(str(row["prompt"] if "prompt" in row else row["text"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"--prompts {path}:{i}: want a JSON object with a 'prompt' field") from None
        else:
            prompts.append(line)
    if not prompts:
        raise UserError(f"--prompts {path}: no prompts in it")
    return prompts


async def one_request(client, url: str, body: dict) -> RequestResult:
    start = time.perf_counter()
    last = None
    res = RequestResult(ok=False)
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:200]
                return RequestResult(ok=False, error=f"HTTP {r.status_code}: {text}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    res.output_tokens = int(msg["usage"].get("completion_tokens") or 0)
                if not msg.get("choices") or not msg["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                chunks += 1
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the benchmark goes on
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}")
    res.ok, res.latency = True, time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks
    return res


def _stats(values: list[float], scale: float = 1000.0) -> dict | None:
    if not values:
        return None
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], wall: float, concurrency: int) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency, "duration_s": wall, "requests": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0, "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall if wall > 0 else 0.0,
        "latency_ms": _stats([r.latency for r in ok]), "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _stats([g for r in ok for g in r.itl]),
        "tpot_ms": _stats([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok
                           if r.ttft is not None and r.output_tokens > 1]),
    }


async def run_load(base_url: str, model: str | None, concurrency: int, duration: float, max_tokens: int,
                   prompts: list[str], temperature: float = 0.0, ignore_eos: bool = True, timeout: float = 600.0,
                   progress: Progress | None = None) -> dict:
    import httpx

    base = api_base(base_url, "--url")
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if model is None:
            model = await discover_model(client, base)
        body = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if ignore_eos:
            body["ignore_eos"] = True
        results: list[RequestResult] = []
        counter = iter(range(10 ** 12))
        start = time.perf_counter()
        deadline = start + duration

        async def client_loop():
            while time.perf_counter() < deadline:
                i = next(counter)
                results.append(await one_request(client, f"{base}/completions",
                                                 {**body, "prompt": prompts[i % len(prompts)]}))

        with (progress or Progress(show=False)).stage(f"bench-serve {model}", duration, "s") as bar:
            async def show_time_left():  # the bar's "left" is the load's time left
                while time.perf_counter() < deadline:
                    bar.update(completed=min(duration, time.perf_counter() - start), note=f"{len(results)} requests")
                    await asyncio.sleep(0.25)
                bar.update(completed=duration, note=f"{len(results)} requests")

            await asyncio.gather(show_time_left(), *(client_loop() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    doc = summarize(results, wall, concurrency)
    doc.update(url=base_url, model=model, max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos)
    return doc


def api_base(url: str, flag: str) -> str:
    """`url` as the API's base (".../v1"), checked first: an http(s) URL with a host (a one-line error otherwise,
    not httpx's InvalidURL / UnsupportedProtocol traceback mid-run)."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as e:
        raise UserError(f"{flag} {url!r}: not a URL ({e})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise UserError(f"{flag} {url!r}: want an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000")
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


async def discover_model(client, base: str) -> str:
    import httpx

    try:
        r = await client.get(f"{base}/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise UserError(f"--url {base}: cannot list its models ({type(e).__name__}: {e}); pass --model NAME") from None


def print_table(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{doc['model']} @ {doc['url']}: concurrency {doc['concurrency']}, {doc['requests']} requests "
                    f"({doc['failed']} failed) in {doc['duration_s']:.1f} s")
    for col in ("metric", "mean", "median", "p95", "p99"):
        t.add_column(col, justify="right" if col != "metric" else "left")
    for key, label in (("latency_ms", "request latency (ms)"), ("ttft_ms", "time to first token (ms)"),
                       ("itl_ms", "inter-token latency (ms)"), ("tpot_ms", "time per output token (ms)")):
        s = doc[key]
        t.add_row(label, *(["-"] * 4 if s is None else [f"{s[k]:.2f}" for k in ("mean", "median", "p95", "p99")]))
    console = Console(width=110)
    console.print(t)
    console.print(f"throughput: {doc['requests_per_s']:.2f} requests/s, {doc['output_tokens_per_s']:.1f} output "
                  f"tokens/s ({doc['output_tokens']} tokens)")
    for e in doc["errors"]:
        console.print(f"error: {e}", markup=False)


def bench_parser():
    from archscale.cli_types import nonnegative_float, positive_float, positive_int

    p = _Parser(prog="archscale bench-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 (or .../v1)")
    p.add_argument("--model", default=None, help="model id (default: the first of GET /v1/models)")
    p.add_argument("--concurrency", type=positive_int, default=1, help="clients sending requests back to back")
    p.add_argument("--duration", type=positive_float, default=30.0, help="seconds during which new requests start")
    p.add_argument("--max_tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=nonnegative_float, default=0.0)
    p.add_argument("--prompts", default=None, help=".txt (one per line) or .jsonl with a 'prompt' field")
    p.add_argument("--no_ignore_eos", action="store_true",
                   help="do not send vLLM's `ignore_eos` (needed for servers that reject unknown fields)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    add_progress_flag(p)
    return p


def bench_cli(argv: list[str]) -> int:
    a = bench_parser().parse_args(argv)
    api_base(a.url, "--url")  # before anything runs
    doc = asyncio.run(run_load(a.url, a.model, a.concurrency, a.duration, a.max_tokens, read_prompts(a.prompts),
                               temperature=a.temperature, ignore_eos=not a.no_ignore_eos,
                               progress=Progress(show=a.progress)))
    if doc["requests"] == 0:
        raise UserError(f"--url {a.url}: no request succeeded ({'; '.join(doc['errors']) or 'none finished'})")
    print_table(doc)
    text = json.dumps(doc, indent=2)
    print(text)
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(text + "\n")
        print(f"wrote {a.output}")
    return 0
