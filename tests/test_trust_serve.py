"""The server as a hostile client meets it: every field at its extremes (0, negative, huge, NaN, inf, 1e-300, wrong
type, lone surrogates, deep or huge JSON) is a 4xx JSON body naming the field, never a 500 or a plain-text answer;
the server survives all of it; and a request can only fail itself: a numerical failure in the shared decode step
(a sampler blow-up, a non-finite row) ends that row alone while its neighbours get exactly their tokens."""

import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

from serving_fixtures import running_server, tiny_model, tiny_tokenizer

PROMPTS = ["Lords and Commons of England", "books are not absolutely dead things", "Truth", "a licensing order"]
MAX_QUEUE = 8


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def server(tok):
    model = tiny_model("transformer", tok.vocab_size, depth=2)
    with running_server(model, tok, max_model_len=256, max_batch=8, max_queue=MAX_QUEUE) as (url, engine):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield SimpleNamespace(c=client, engine=engine, model=model, tok=tok, url=url)


def greedy_alone(model, tok, prompt: str, steps: int) -> list[int]:
    ids = tok.encode(prompt, eos=False)
    return model.generate(torch.tensor([ids]), steps, temperature=0.0)[0, len(ids):].tolist()


def assert_json_error(r, status: int, param: str | None = None, says: str | None = None):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and "\n" not in err["message"]
    if param:
        assert err["param"] == param, err
    if says:
        assert says in err["message"], err


HOSTILE_FIELDS = [  # (body, param): values that pass a plain `float` / `int` but break float32 or torch
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # 0 in float32: logits / 0 = inf
    ({"repetition_penalty": 1e300}, "repetition_penalty"),  # inf in float32
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"temperature": 1e-40}, "temperature"),  # a float32 denormal: logits / t overflows
    ({"temperature": 1e300}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1e-300}, "top_p"),  # 0 in float32: every token dropped
    ({"top_p": 1.5}, "top_p"),
    ({"seed": 10 ** 23}, "seed"),  # torch.Generator: "Overflow when unpacking long long"
    ({"seed": 2 ** 64}, "seed"),
    ({"seed": -(2 ** 63) - 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"max_tokens": 10 ** 30}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": 10 ** 9}, "n"),
    ({"logprobs": 10 ** 9}, "logprobs"),
    ({"stop": ["x"] * 9}, "stop"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"stream": "yes please"}, "stream"),
]


@pytest.mark.parametrize("body, param", HOSTILE_FIELDS, ids=[json.dumps(b)[:40] for b, _ in HOSTILE_FIELDS])
def test_hostile_field_is_a_400_naming_it(server, body, param):
    r = server.c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
    assert_json_error(r, 400, param)


RAW_BODIES = [  # bodies a JSON library may not take: never a plain-text 500
    (b'{"prompt": "x", "temperature": NaN}', 400, None),
    (b'{"prompt": "x", "top_p": Infinity}', 400, None),
    (b'{"prompt": "x", "presence_penalty": -Infinity}', 400, None),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None),  # Python's int digit limit
    (b"[" * 100_000 + b"]" * 100_000, 400, None),  # the C parser's recursion limit
    (b'{"prompt": ' + b"[" * 60 + b"1" + b"]" * 60 + b"}", 400, None),  # deep but parseable
    (b'{"prompt": "\\ud800 a lone surrogate"}', 400, "prompt"),
    (b'{"prompt": ["ok", "\\udfff"]}', 400, "prompt"),
    (b'{"prompt": "x", "stop": "\\ud800"}', 400, "stop"),
    (b'\xff\xfe{"prompt": "x"}', 400, None),  # not UTF-8
    (b'"just a string"', 400, None),
    (b"", 400, None),
    (b'{"prompt": "' + b"a" * (9 << 20) + b'"}', 413, None),  # larger than the body limit
]


@pytest.mark.parametrize("raw, status, param", RAW_BODIES, ids=[r[:30].decode("latin-1") for r, _, _ in RAW_BODIES])
def test_hostile_json_is_a_json_error(server, raw, status, param):
    r = server.c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_json_error(r, status, param)
    assert server.c.get("/health").json()["status"] == "ok"


def test_request_larger_than_the_queue_is_a_400_with_the_limit(server):
    """n x prompts above --max_queue can never be admitted: 400 naming the limit, not a 503 forever."""
    r = server.c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": MAX_QUEUE + 1})
    assert_json_error(r, 400, "n", says=str(MAX_QUEUE))
    r = server.c.post("/v1/completions", json={"prompt": ["x"] * (MAX_QUEUE + 1), "max_tokens": 2})
    assert_json_error(r, 400, "prompt", says=str(MAX_QUEUE))
    assert server.c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": MAX_QUEUE}).status_code == 200


def test_extremes_inside_the_bounds_are_served(server):
    """The smallest and largest accepted values decode without error (the bounds are where float32 still holds)."""
    from archscale.serve.app import LIMITS

    for body in ({"temperature": LIMITS.temperature_min}, {"temperature": 100.0},
                 {"repetition_penalty": LIMITS.penalty_min}, {"repetition_penalty": LIMITS.penalty_max},
                 {"top_p": LIMITS.top_p_min}, {"seed": 2 ** 63 - 1, "n": 3}, {"seed": -(2 ** 63)},
                 {"top_k": 10 ** 12}, {"logprobs": 20, "echo": True}):
        r = server.c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 3, "ignore_eos": True,
                                                   **body})
        assert r.status_code == 200, (body, r.text)
        assert all(ch["finish_reason"] == "length" for ch in r.json()["choices"]), (body, r.json())


# --------------------------------------------------------------------------------- a request fails only itself
def collect(engine, seqs, timeout=60.0):
    """Submit engine Sequences directly (no HTTP schema in the way) and wait for all of them to finish."""
    done = threading.Event()
    left = [len(seqs)]
    lock = threading.Lock()

    def on_finish():
        with lock:
            left[0] -= 1
            if not left[0]:
                done.set()
    def emit_for(s):
        def emit(ev):
            if ev.finish_reason:
                s.error_text = ev.error or ""
                on_finish()
        return emit
    for s in seqs:
        s.emit = emit_for(s)
    engine.submit(seqs)
    assert done.wait(timeout), "the engine did not finish the sequences"


def decode_with_a_poisoned_neighbour(tok, poison):
    """Greedy rows A and B are admitted and decode together; while the decode step is held, `poison(engine, b)`
    breaks B alone. Returns (model, A, B) once both finished."""
    from archscale.serve.engine import SamplingParams, Sequence

    model = tiny_model("transformer", tok.vocab_size, depth=2)
    params = dict(max_tokens=8, temperature=0, ignore_eos=True)
    with running_server(model, tok, max_model_len=128, max_batch=2) as (_, engine):
        release, step = threading.Event(), engine._step

        def held_step():
            release.wait(timeout=60)
            step()
        engine._step = held_step  # the loop calls self._step: the instance attribute wins
        a = Sequence(tok.encode(PROMPTS[0], eos=False), SamplingParams(**params), None, 0)
        b = Sequence(tok.encode(PROMPTS[1], eos=False), SamplingParams(**params), None, 1)
        t = threading.Thread(target=collect, args=(engine, [a, b]))
        t.start()
        deadline = time.monotonic() + 30
        while engine.stats()["active"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats()["active"] == 2
        poison(engine, b)
        release.set()
        t.join(timeout=60)
    return model, a, b


def test_a_non_finite_row_in_the_decode_step_fails_only_itself(tok):
    """B's K/V turn NaN inside the batch: B ends with an error (not a NaN argmax passed off as a token), A is
    exactly what it is alone."""
    def nan_kv(engine, b):
        row = engine.rows.index(b)
        with torch.inference_mode():  # the engine's buffers are inference tensors
            for kv in engine.batch.kv.values():
                kv.k[row].fill_(float("nan"))

    model, a, b = decode_with_a_poisoned_neighbour(tok, nan_kv)
    assert b.finish_reason == "error" and "finite" in b.error_text
    assert a.finish_reason == "length" and a.out_ids == greedy_alone(model, tok, PROMPTS[0], 8)


def test_a_sampler_blow_up_fails_only_its_own_row(tok):
    """B's sampling turns into a value the schema refuses (a penalty that is 0 in float32, then inf logits and NaN
    probabilities) in the middle of decoding: B ends with an error, A is exact."""
    def hot_penalty(engine, b):
        b.params.temperature, b.params.repetition_penalty = 1.0, 1e-300

    model, a, b = decode_with_a_poisoned_neighbour(tok, hot_penalty)
    assert b.finish_reason == "error"
    assert a.finish_reason == "length" and a.out_ids == greedy_alone(model, tok, PROMPTS[0], 8)


def test_64_concurrent_clients_valid_and_hostile(server):
    """64 clients at once: greedy ones (each must get exactly its tokens alone), hostile ones (400s, deep JSON,
    lone surrogates, too many sequences), extreme-but-valid sampling, and streams that hang up after one event.
    Every valid answer is exact, every hostile one a 4xx JSON body, and the server is healthy afterwards."""
    from archscale.serve.app import LIMITS

    tok, model, url = server.tok, server.model, server.url
    steps = 4
    want = {p: tok.decode(greedy_alone(model, tok, p, steps)) for p in PROMPTS}
    hostile_raw = [b'{"prompt": "x", "temperature": NaN}', b"[" * 50_000, b'{"prompt": "\\ud800"}',
                   b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"]
    hostile_json = [{"prompt": "x", "repetition_penalty": 1e-300}, {"prompt": "x", "temperature": 1e-40},
                    {"prompt": "x", "seed": 10 ** 23}, {"prompt": "x", "top_p": 1e-300},
                    {"prompt": "x", "n": MAX_QUEUE + 1}]
    extreme = [{"temperature": LIMITS.temperature_min, "repetition_penalty": LIMITS.penalty_min},
               {"repetition_penalty": LIMITS.penalty_max, "top_p": LIMITS.top_p_min, "temperature": 1.0},
               {"seed": 2 ** 63 - 1, "temperature": 2.0, "top_k": 10 ** 9}]
    results: dict[int, object] = {}

    def client(i: int) -> None:
        kind = i % 4
        with httpx.Client(base_url=url, timeout=120) as c:
            if kind in (0, 1):  # valid greedy: half of the clients
                p = PROMPTS[i % len(PROMPTS)]
                deadline = time.monotonic() + 240
                while True:  # a full queue (503) is the one refusal a valid request may meet: retry
                    r = c.post("/v1/completions", json={"prompt": p, "max_tokens": steps, "temperature": 0,
                                                        "ignore_eos": True})
                    if r.status_code != 503 or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                results[i] = ("valid", p, r.status_code, r.json())
            elif kind == 2:
                j = i // 4
                if j % 2:
                    r = c.post("/v1/completions", content=hostile_raw[j % len(hostile_raw)],
                               headers={"content-type": "application/json"})
                else:
                    r = c.post("/v1/completions", json=hostile_json[j % len(hostile_json)])
                results[i] = ("hostile", None, r.status_code, r.json())
            else:
                j = i // 4
                if j % 2:  # a stream that hangs up after its first line
                    with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True,
                                                                   "ignore_eos": True}) as r:
                        next(r.iter_lines())
                    results[i] = ("gone", None, r.status_code, None)
                else:
                    r = c.post("/v1/completions", json={"prompt": PROMPTS[j % 4], "max_tokens": steps,
                                                        "ignore_eos": True, **extreme[j % len(extreme)]})
                    results[i] = ("extreme", None, r.status_code, r.json())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 64
    for i, (kind, p, status, body) in sorted(results.items()):
        if kind == "valid":
            assert status == 200, (i, body)
            assert body["choices"][0]["text"] == want[p], (i, p)
        elif kind == "hostile":
            assert 400 <= status < 500 and body["error"]["message"], (i, body)
        elif kind == "extreme":
            assert status in (200, 503), (i, body)
            if status == 200:
                assert body["choices"][0]["finish_reason"] == "length", (i, body)
        else:  # the stream that hung up (or met a full queue first)
            assert status in (200, 503), i
    assert server.engine.stats()["peak_batch"] > 1
    assert server.c.get("/health").json()["status"] == "ok"
