"""The OpenAI-compatible HTTP API (FastAPI on uvicorn): `/v1/completions` (plain and server-sent events),
`/v1/models`, `/health`.

Errors answer in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: a malformed request is 400
(JSON that is not UTF-8, nests deeper than `LIMITS.json_depth`, holds NaN/Infinity or a number Python cannot read,
text with lone surrogates, a sampling value float32 cannot carry, more sequences than the queue holds), a body over
`LIMITS.body_bytes` 413, an unknown model 404 (as vLLM does), a full queue 503. A streaming client that disconnects
cancels its sequences, so their batch slots free at the next token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from archscale.serve.engine import Engine, Event, QueueFull, SamplingParams, Sequence


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds of the request schema. The float ones are where float32 sampling still holds: logits / temperature,
    logits / or * repetition_penalty stay finite for any logit below 1e4 in size (a 1e-300 penalty or a 1e-40
    temperature is 0 in float32 and makes every probability NaN), and top_p stays a positive float32."""

    temperature_min: float = 1e-4  # above 0; 0 itself means greedy
    temperature_max: float = 100.0
    penalty_min: float = 1e-4
    penalty_max: float = 1e4
    top_p_min: float = 1e-6
    seed_min: int = -(2 ** 63)  # torch.Generator.manual_seed takes int64 (and uint64: seed + choice index fits)
    seed_max: int = 2 ** 63 - 1
    body_bytes: int = 8 << 20  # 413 above this
    json_depth: int = 16  # the deepest valid body is 3 (a list of token-id lists)


LIMITS = Limits()


class CompletionRequest(BaseModel):
    """The `/v1/completions` fields we honour; an unknown field is a 400, not silently ignored. Floats must be
    finite, strings valid text (no lone surrogates)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]] = ""
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=LIMITS.temperature_max)
    top_p: float = Field(1.0, ge=LIMITS.top_p_min, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extension; 0 or -1: off
    repetition_penalty: float = Field(1.0, ge=LIMITS.penalty_min, le=LIMITS.penalty_max)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=LIMITS.seed_min, le=LIMITS.seed_max)
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    ignore_eos: bool = False  # vLLM's extension: decode exactly max_tokens (load tests)
    user: str | None = None
    # OpenAI fields we accept only at their neutral value
    best_of: int | None = None
    suffix: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("model", "prompt", "stop", "user", "suffix")
    @classmethod
    def _valid_text(cls, v):
        for s in [v] if isinstance(v, str) else v or []:
            if isinstance(s, str):
                try:
                    s.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(f"not valid text (a lone surrogate at character {e.start})") from None
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops) or len(stops) > 8:
            raise ValueError("stop must be up to 8 non-empty strings")
        return stops

    @model_validator(mode="after")
    def _temperature(self):
        if 0 < self.temperature < LIMITS.temperature_min:
            raise _FieldError("temperature", f"must be 0 (greedy) or at least {LIMITS.temperature_min:g}, got "
                                             f"{self.temperature:g} (smaller overflows float32 sampling)")
        return self

    def unsupported(self) -> str | None:
        if self.best_of not in (None, 1):
            return "best_of"
        if self.suffix:
            return "suffix"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty" if self.presence_penalty else "frequency_penalty"
        if self.logit_bias:
            return "logit_bias"
        if self.stream_options and set(self.stream_options) - {"include_usage"}:
            return "stream_options"
        return None


class _FieldError(ValueError):
    """A check across the model's fields that names the field it is about."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"{text[:20]} is outside the float range")
    return x


def _depth(value: Any) -> int:
    """How deeply lists / objects nest in a parsed JSON value (iteratively: no recursion on hostile input)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            if d <= LIMITS.json_depth:  # deeper than the limit is refused anyway: stop walking there
                todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse_json(raw: bytes) -> Any:
    """The request body as JSON, or a BadRequest: not UTF-8, not JSON, NaN / Infinity, numbers Python refuses
    (over 4300 digits), nesting that overflows the parser or exceeds `LIMITS.json_depth`."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float)
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not UTF-8 (byte {e.start})") from None
    except RecursionError:
        raise BadRequest(f"the request body is not JSON this server takes (nested deeper than "
                         f"{LIMITS.json_depth})") from None
    except ValueError as e:  # json.JSONDecodeError is one; also int digit limits and _reject_constant
        raise BadRequest(f"the request body is not JSON ({str(e).splitlines()[0][:200]})") from None
    if _depth(body) > LIMITS.json_depth:
        raise BadRequest(f"the request body is not JSON this server takes (nested deeper than {LIMITS.json_depth})")
    return body


async def read_body(request: Request) -> bytes:
    """The body, refused with a 413 as soon as it is over `LIMITS.body_bytes` (not read whole first)."""
    too_big = BadRequest(f"the request body is larger than {LIMITS.body_bytes} bytes", status=413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > LIMITS.body_bytes:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > LIMITS.body_bytes:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _validated(body: dict) -> CompletionRequest:
    try:
        return CompletionRequest(**body)
    except ValidationError as e:
        err = e.errors()[0]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, _FieldError):
            raise BadRequest(str(cause), cause.field) from None
        loc = ".".join(str(x) for x in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        raise BadRequest(f"{loc}: {msg}" if loc else msg, str(err["loc"][0]) if err["loc"] else None) from None


def parse_request(body: Any, tokenizer, max_model_len: int, served_name: str,
                  max_sequences: int | None = None) -> tuple[CompletionRequest, list[list[int]]]:
    """Validate a request body; return it with the tokenized prompts. Raises BadRequest. `max_sequences`: the
    queue's size; a request asking for more (prompts x n) could never be admitted."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    req = _validated(body)
    bad = req.unsupported()
    if bad:
        raise BadRequest(f"{bad}: not supported by this server (leave it at its default)", bad)
    if req.model is not None and req.model != served_name:
        raise BadRequest(f"The model `{req.model}` does not exist (this server has `{served_name}`)", "model",
                         status=404, kind="NotFoundError")
    p = req.prompt
    if isinstance(p, str):
        prompts = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts:
        raise BadRequest("prompt: give a string, a list of strings, or token ids", "prompt")
    if max_sequences is not None and len(prompts) * req.n > max_sequences:
        raise BadRequest(f"{'n' if req.n > max_sequences else 'prompt'}: this request asks for {len(prompts) * req.n} "
                         f"sequences (prompts x n); this server queues at most {max_sequences} (--max_queue)",
                         "n" if req.n > max_sequences else "prompt")
    vocab = tokenizer.vocab_size
    ids_list = []
    for q in prompts:
        if isinstance(q, str):
            ids = tokenizer.encode(q, bos=False, eos=False) if q else [tokenizer.eos_id]
        else:
            ids = list(q) or [tokenizer.eos_id]
            if any(t < 0 or t >= vocab for t in ids):
                raise BadRequest(f"prompt: token ids must be in [0, {vocab})", "prompt")
        if len(ids) + req.max_tokens > max_model_len:
            raise BadRequest(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                             f"{len(ids)} and max_tokens asks for {req.max_tokens}", "max_tokens")
        ids_list.append(ids)
    return req, ids_list


def sampling_params(req: CompletionRequest, choice: int) -> SamplingParams:
    seed = None if req.seed is None else req.seed + choice  # n > 1: distinct, reproducible samples
    return SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                          top_k=max(req.top_k, 0), repetition_penalty=req.repetition_penalty, stop=tuple(req.stop or ()),
                          seed=seed, logprobs=req.logprobs, ignore_eos=req.ignore_eos, echo=req.echo)


class _Choice:
    """Accumulates one choice's events into the non-streaming answer."""

    def __init__(self, index: int, want_logprobs: bool):
        self.index, self.want = index, want_logprobs
        self.text, self.finish = "", None
        self.lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, ev: Event) -> None:
        _add_logprobs(self.lp, ev, len(self.text))
        self.text += ev.text
        if ev.finish_reason:
            self.finish = ev.finish_reason

    def json(self) -> dict:
        return {"index": self.index, "text": self.text, "logprobs": self.lp if self.want else None,
                "finish_reason": self.finish}


def _add_logprobs(lp: dict, ev: Event, offset: int) -> None:
    for t in ev.tokens:
        lp["tokens"].append(t.text)
        lp["token_logprobs"].append(t.logprob)
        lp["top_logprobs"].append(t.top)
        lp["text_offset"].append(offset)
        offset += len(t.text)


def create_app(engine: Engine, served_name: str):
    app = FastAPI(title="archscale", docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": served_name, **engine.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": created,
                                            "owned_by": "archscale", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = parse_json(await read_body(request))
            req, prompts = parse_request(body, engine.tok, engine.max_model_len, served_name, engine.max_queue)
        except BadRequest as e:
            return _error(e.status, str(e), e.param, e.kind)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(ev: Event) -> None:  # called on the engine thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        seqs = [Sequence(ids, sampling_params(req, j), emit, index=i * req.n + j)
                for i, ids in enumerate(prompts) for j in range(req.n)]
        try:
            engine.submit(seqs)
        except QueueFull as e:
            return _error(503, f"server busy: {e}; retry later", kind="server_overloaded")
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": served_name}
        n_prompt = sum(len(ids) for ids in prompts) * req.n

        def usage() -> dict:
            n_out = sum(len(s.out_ids) for s in seqs)
            return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return StreamingResponse(_stream(engine, seqs, events, head, req.logprobs is not None, include_usage,
                                             usage), media_type="text/event-stream")
        return await _collect(engine, request, seqs, events, head, req.logprobs is not None, usage)

    return app


async def _collect(engine, request, seqs, events, head, want_lp, usage):
    choices = {s.index: _Choice(s.index, want_lp) for s in seqs}
    pending = len(seqs)
    loop = asyncio.get_running_loop()
    checked = loop.time()
    try:
        while pending:
            try:
                ev = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                ev = None
            if ev is None or loop.time() - checked > 0.25:  # a busy engine never times out: check on a clock
                checked = loop.time()
                if await request.is_disconnected():
                    return None
            if ev is None:
                continue
            choices[ev.index].add(ev)
            if ev.finish_reason:
                pending -= 1
                if ev.finish_reason == "error":
                    return _error(500, f"generation failed: {ev.error}", kind="server_error")
    finally:
        for s in seqs:
            engine.cancel(s)
    return {**head, "choices": [choices[i].json() for i in sorted(choices)], "usage": usage()}


async def _stream(engine, seqs, events, head, want_lp, include_usage, usage):
    """Server-sent events, one per token (per choice); `data: [DONE]` at the end."""
    pending = len(seqs)
    offsets = {s.index: 0 for s in seqs}
    try:
        while pending:
            ev = await events.get()
            lp = None
            if want_lp:
                lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                _add_logprobs(lp, ev, offsets[ev.index])
            offsets[ev.index] += len(ev.text)
            choice = {"index": ev.index, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}
            chunk = {**head, "choices": [choice]}
            if ev.finish_reason == "error":
                chunk["error"] = {"message": f"generation failed: {ev.error}", "type": "server_error"}
            if include_usage:
                chunk["usage"] = None
            yield f"data: {json.dumps(chunk)}\n\n"
            if ev.finish_reason:
                pending -= 1
        if include_usage:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage()})}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # normal end, or the client went away mid-stream (the generator is closed / cancelled)
        for s in seqs:
            engine.cancel(s)
