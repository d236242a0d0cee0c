"""The OpenAI-compatible HTTP API (FastAPI on uvicorn): `/v1/completions` (plain and server-sent events),
`/v1/models`, `/health`.

Errors answer in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: a malformed request is 400, an
unknown model 404 (as vLLM does), a full queue 503. A streaming client that disconnects cancels its sequences, so
their batch slots free at the next token.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from archscale.serve.engine import Engine, Event, QueueFull, SamplingParams, Sequence


class CompletionRequest(BaseModel):
    """The `/v1/completions` fields we honour; an unknown field is a 400, not silently ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]] = ""
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extension; 0 or -1: off
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop: str | list[str] | None = None
    seed: int | None = None
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

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops) or len(stops) > 8:
            raise ValueError("stop must be up to 8 non-empty strings")
        return stops

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


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def parse_request(body: Any, tokenizer, max_model_len: int, served_name: str) -> tuple[CompletionRequest, list[list[int]]]:
    """Validate a request body; return it with the tokenized prompts. Raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        req = CompletionRequest(**body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or None
        raise BadRequest(f"{loc}: {err['msg']}" if loc else err["msg"], loc) from None
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
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"the request body is not JSON ({e})")
        try:
            req, prompts = parse_request(body, engine.tok, engine.max_model_len, served_name)
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
