"""`archscale serve`: continuous batching is exact (every architecture), the OpenAI API over HTTP (plain and SSE),
sampling controls, logprobs/echo, 400/404/503 errors, a disconnecting client frees its slot, and the CLI on a run."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from archscale.config import ARCHITECTURES
from archscale.serve.batching import BatchState, decode_step, prefill, prefill_batch
from serving_fixtures import make_run, running_server, tiny_model, tiny_tokenizer

PROMPTS = ["Lords and Commons of England", "books are not absolutely dead things", "Truth", "a licensing order"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def reference_greedy(model, ids, steps):
    """Greedy decoding alone through GPT.forward with a cache: (tokens, logits of each step)."""
    logits, cache = prefill(model, ids, len(ids) + steps)
    row, toks, rows = logits[-1], [], []
    with torch.no_grad():
        for _ in range(steps):
            rows.append(row)
            toks.append(int(row.argmax()))
            row = model(torch.tensor([[toks[-1]]]), cache=cache)[0, -1]
    return toks, rows


def poison(cache) -> None:
    """Every tensor of a prefilled cache's per-layer state (K/V buffers, recurrent states) set to NaN."""
    for state in cache.layers.values():
        for t in vars(state).values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.fill_(float("nan"))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_decode_step_equals_the_model_alone(arch):
    """Rows that join at steps 0/2/3 with prompts of 3/9/6 tokens (longer than the window of 5) and leave after 9
    tokens: the batched step gives each the logits of decoding it alone (1e-5) and the same greedy tokens. A
    poisoned neighbour (a 4th row, joining at step 1, whose whole decode state is NaN) decodes beside them: its
    logits are non-finite at every step and nothing of it leaks into the other rows (a request fails only itself)."""
    model = tiny_model(arch, 97)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (3, 9, 6, 5)]
    refs = [reference_greedy(model, p, 9) for p in prompts[:3]]
    batch = BatchState(model, 4)
    got = {i: ([], []) for i in range(4)}
    rows: list[int] = []  # request in each batch row
    for step in range(12):
        if step in (0, 1, 2, 3):
            i = (0, 2, 3, 1).index(step)
            logits, cache = prefill(model, prompts[i], 40)
            if i == 3:
                poison(cache)
            batch.insert(cache)
            rows.append(i)
            got[i][0].append(int(logits[-1].argmax()))
            got[i][1].append(logits[-1])
        if step == 4:
            assert batch.rows == 4  # all four decode together here
        logits = decode_step(batch, torch.tensor([got[i][0][-1] for i in rows]))
        for r, i in enumerate(rows):
            got[i][0].append(int(logits[r].argmax()) if i != 3 else 0)
            got[i][1].append(logits[r])
            assert torch.isfinite(logits[r]).all() == (i != 3), (step, i)
        for i in [i for i in rows if len(got[i][0]) >= 9]:
            r = rows.index(i)
            moved = batch.remove(r)
            rows[r] = rows[moved] if moved is not None else rows[r]
            rows.pop(moved if moved is not None else r)
        if not rows:
            break
    for i in range(3):
        assert got[i][0][:9] == refs[i][0]
        for a, b in zip(got[i][1], refs[i][1]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_batched_prefill_equals_each_prompt_alone(arch):
    """Three prompts of 7 tokens (longer than the window of 5) prefilled as one batch, each row inserted into its
    own slot (in another order) and decoded together for 6 steps: every row gives the logits of decoding its
    prompt alone (1e-5) and the same greedy tokens. The negative control inserts one row's cache for all three."""
    model = tiny_model(arch, 97)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 97, (7,), generator=g).tolist() for _ in range(3)]
    refs = [reference_greedy(model, p, 6) for p in prompts]
    logits, cache = prefill_batch(model, prompts, 20)

    def decode(order):
        batch = BatchState(model, 3)
        toks = []
        for i in order:
            batch.insert(cache, i)
            toks.append([int(logits[i].argmax())])
        rows = [[logits[i]] for i in order]
        for _ in range(5):
            out = decode_step(batch, torch.tensor([t[-1] for t in toks]))
            for r in range(3):
                toks[r].append(int(out[r].argmax()))
                rows[r].append(out[r])
        return toks, rows

    toks, rows = decode([2, 0, 1])
    for r, i in enumerate([2, 0, 1]):
        assert toks[r] == refs[i][0]
        for a, b in zip(rows[r], refs[i][1]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    same, _ = decode([0, 0, 0])  # every slot from row 0: rows 1 and 2 would decode prompt 0
    assert same[1] == refs[0][0] and (refs[1][0] != refs[0][0] or refs[2][0] != refs[0][0])


def test_burst_of_equal_prompts_is_prefilled_together_and_matches_alone(tok, monkeypatch):
    """Eight requests submitted at once (two prompts, four each) are admitted in one batched prefill per prompt
    length and complete exactly as when sent alone; when a batched prefill fails, its prompts are prefilled alone
    and still complete (a failure there harms no request)."""
    from archscale.serve import engine as engine_mod

    model = tiny_model("sambay", tok.vocab_size)
    prompts = [PROMPTS[0], PROMPTS[1]] * 4
    body = dict(max_tokens=6, temperature=0, ignore_eos=True)
    with running_server(model, tok, max_model_len=256, max_batch=8) as (url, engine):
        with httpx.Client(base_url=url, timeout=60) as c:
            alone = {p: complete(c, prompt=p, **body)["choices"][0]["text"] for p in PROMPTS[:2]}
        for failing in (False, True):
            if failing:
                monkeypatch.setattr(engine_mod, "prefill_batch", lambda *a, **k: 1 / 0)
            before = engine.stats()["batched_prefills"]
            texts = burst(engine, tok, prompts, body)
            assert texts == [alone[p] for p in prompts], failing
            assert engine.stats()["batched_prefills"] - before == (0 if failing else 2)


def burst(engine, tok, prompts, body) -> list[str]:
    """Submit every prompt to the engine in one call (so they are admitted together); their completed texts."""
    from archscale.serve.engine import SamplingParams, Sequence

    done = [threading.Event() for _ in prompts]
    texts = [""] * len(prompts)

    def emit(i):
        def on_event(ev):
            texts[i] += ev.text
            if ev.finish_reason is not None:
                done[i].set()
        return on_event

    engine.submit([Sequence(tok.encode(p, eos=False), SamplingParams(**body), emit(i))
                   for i, p in enumerate(prompts)])
    assert all(d.wait(60) for d in done)
    return texts


def complete(client, **body):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(client, **body):
    chunks = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


@pytest.mark.parametrize("arch", ["transformer", "sambay"])
def test_concurrent_requests_decode_together_and_match_alone(arch, tok):
    """Greedy completions requested one at a time and then all at once (staggered, so they join mid-decode) are
    identical, equal to GPT.generate's, and the engine really did decode several rows per step."""
    model = tiny_model(arch, tok.vocab_size)
    body = dict(max_tokens=12, temperature=0, ignore_eos=True)
    with running_server(model, tok, max_model_len=256) as (url, engine), httpx.Client(base_url=url, timeout=60) as c:
        alone = [complete(c, prompt=p, **body)["choices"][0]["text"] for p in PROMPTS]
        assert engine.stats()["peak_batch"] == 1
        together = [None] * len(PROMPTS)

        def worker(i):
            time.sleep(0.01 * i)
            with httpx.Client(base_url=url, timeout=60) as ci:
                together[i] = complete(ci, prompt=PROMPTS[i], **body)["choices"][0]["text"]

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert together == alone
        assert engine.stats()["peak_batch"] > 1
    for p, text in zip(PROMPTS, alone):
        ids = tok.encode(p, eos=False)
        out = model.generate(torch.tensor([ids]), 12, temperature=0.0)[0, len(ids):].tolist()
        assert tok.decode(out) == text


@pytest.fixture(scope="module")
def server(tok):
    model = tiny_model("transformer", tok.vocab_size)
    with running_server(model, tok, max_model_len=4096, max_batch=4) as (url, engine):
        with httpx.Client(base_url=url, timeout=60) as client:
            yield SimpleNamespace(c=client, engine=engine, model=model, tok=tok)


def test_health_and_models(server):
    c = server.c
    h = c.get("/health").json()
    assert h["status"] == "ok" and h["model"] == "tiny" and h["slots"] == 4
    m = c.get("/v1/models").json()
    assert m["object"] == "list" and [d["id"] for d in m["data"]] == ["tiny"]
    assert m["data"][0]["max_model_len"] == 4096


def test_stream_equals_plain_and_reports_usage(server):
    c = server.c
    body = dict(prompt=PROMPTS[0], max_tokens=9, temperature=0, ignore_eos=True)
    plain = complete(c, **body)
    events = stream_events(c, **body, stream_options={"include_usage": True})
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == plain["choices"][0]["text"]
    assert plain["choices"][0]["finish_reason"] == "length"
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 9
    n_prompt = len(server.tok.encode(PROMPTS[0], eos=False))
    assert plain["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 9, "total_tokens": n_prompt + 9}


def test_seeded_sampling_is_reproducible_and_seed_matters(server):
    c = server.c
    body = dict(prompt=PROMPTS[1], max_tokens=20, temperature=1.0, top_k=50, top_p=0.9, ignore_eos=True)
    a = complete(c, **body, seed=7)["choices"][0]["text"]
    assert complete(c, **body, seed=7)["choices"][0]["text"] == a
    assert complete(c, **body, seed=8)["choices"][0]["text"] != a
    greedy = complete(c, prompt=PROMPTS[1], max_tokens=20, temperature=0, ignore_eos=True)["choices"][0]["text"]
    assert a != greedy
    two = complete(c, **body, seed=7, n=2)["choices"]
    assert [ch["index"] for ch in two] == [0, 1] and two[0]["text"] == a and two[1]["text"] != a


def test_repetition_penalty_changes_greedy_output(server):
    c = server.c
    body = dict(prompt="the the the the", max_tokens=16, temperature=0, ignore_eos=True)
    plain = complete(c, **body)
    penalised = complete(c, **body, repetition_penalty=5.0)
    assert plain["choices"][0]["text"] != penalised["choices"][0]["text"]


def test_stop_string_cuts_plain_and_streamed_text(server):
    c = server.c
    body = dict(prompt=PROMPTS[2], max_tokens=24, temperature=0, ignore_eos=True)
    full = complete(c, **body)["choices"][0]["text"]
    stop = full[9:12]
    want = full[:full.find(stop)]
    got = complete(c, **body, stop=[stop, "\x00never"])["choices"][0]
    assert got["text"] == want and got["finish_reason"] == "stop"
    events = stream_events(c, **body, stop=stop)
    assert "".join(e["choices"][0]["text"] for e in events) == want
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_and_echo_match_a_forward_pass(server):
    c, model, tok = server.c, server.model, server.tok
    ids = tok.encode(PROMPTS[3], eos=False)
    r = complete(c, prompt=ids, max_tokens=3, temperature=0, logprobs=2, echo=True, ignore_eos=True)
    ch = r["choices"][0]
    lp = ch["logprobs"]
    assert ch["text"].startswith(PROMPTS[3])
    assert len(lp["tokens"]) == len(ids) + 3 and lp["token_logprobs"][0] is None
    with torch.no_grad():
        full = torch.tensor([ids + [0] * 3])
        logits = model(full[:, :-1])[0]
    gen = [t for t in lp["tokens"][len(ids):]]
    assert "".join(lp["tokens"][:len(ids)]) == tok.decode(ids)
    want = torch.log_softmax(logits[:len(ids) - 1].float(), -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:len(ids)]), want, atol=1e-4, rtol=0)
    # generated tokens: greedy, so each is the top alternative, and its logprob is the best of the 2 listed
    for t, v, top in zip(gen, lp["token_logprobs"][len(ids):], lp["top_logprobs"][len(ids):]):
        assert len(top) <= 2 and t in top
        if len(top) == 2:  # (two byte-level tokens may decode to the same text, e.g. a lone "\ufffd": one key)
            assert max(top.values()) == pytest.approx(v, abs=1e-6)
    assert lp["text_offset"][len(ids)] == len(tok.decode(ids))


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": 5}, 400, None),
    ({"prompt": [1, 10 ** 6]}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"prompt": "x", "stop": [""]}, 400, None),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
])
def test_bad_requests_get_json_errors(server, body, status, param):
    c = server.c
    r = c.post("/v1/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["code"] == status
    if param:
        assert err["param"] == param


def test_non_json_body_is_400(server):
    c = server.c
    r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]


def wait_for(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_client_disconnect_frees_its_slot(server):
    c, engine = server.c, server.engine
    assert wait_for(lambda: engine.stats()["active"] == 0)
    steps0 = engine.stats()["steps"]
    with httpx.Client(base_url=str(c.base_url), timeout=60) as other:
        with other.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 4000, "stream": True,
                                                           "ignore_eos": True}) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            assert engine.stats()["active"] == 1
    assert wait_for(lambda: engine.stats()["active"] == 0), engine.stats()
    assert engine.stats()["steps"] - steps0 < 3900  # the sequence was dropped, not decoded to the end


def test_plain_request_whose_client_leaves_is_cancelled(server):
    c, engine = server.c, server.engine
    assert wait_for(lambda: engine.stats()["active"] == 0)
    steps0 = engine.stats()["steps"]
    with httpx.Client(base_url=str(c.base_url), timeout=httpx.Timeout(60, read=0.5)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/completions", json={"prompt": "x", "max_tokens": 4000, "ignore_eos": True})
    assert wait_for(lambda: engine.stats()["active"] == 0), engine.stats()
    assert engine.stats()["steps"] - steps0 < 3900


def test_full_queue_answers_503(tok):
    """One slot, one queue place: a third request is refused. The engine's decode step is held on an event while
    the requests arrive, so the first sequence keeps its slot however fast or slow the machine is (an ungated
    stream could finish, or fill its socket and be dropped as departed, before the third request came)."""
    model = tiny_model("transformer", tok.vocab_size)
    with running_server(model, tok, max_model_len=512, max_batch=1, max_queue=1) as (url, engine):
        release = threading.Event()
        step = engine._step

        def held_step():
            release.wait(timeout=60)
            step()

        engine._step = held_step  # the loop calls self._step: the instance attribute wins
        req = {"prompt": "x", "max_tokens": 20, "stream": True, "ignore_eos": True}
        try:
            with httpx.Client(base_url=url, timeout=60) as a, httpx.Client(base_url=url, timeout=60) as b, \
                    httpx.Client(base_url=url, timeout=60) as c:
                with a.stream("POST", "/v1/completions", json=req) as r1:
                    # admitted and prefilled: the only slot is taken (not "its first line came": a token that ends
                    # inside a UTF-8 character sends no text, and the next one waits for the held step)
                    assert wait_for(lambda: engine.stats()["active"] == 1)
                    with b.stream("POST", "/v1/completions", json=req) as r2:
                        assert r2.status_code == 200
                        assert wait_for(lambda: engine.stats()["waiting"] == 1)
                        r3 = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                        assert r3.status_code == 503 and r3.json()["error"]["type"] == "server_overloaded"
                        release.set()
                        assert [line for line in r2.iter_lines() if line][-1] == "data: [DONE]"  # then it ran
        finally:
            release.set()
        assert wait_for(lambda: engine.stats()["active"] == 0 and engine.stats()["waiting"] == 0)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("serverun"))


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_cli_on_a_run_dir(run_dir):
    """`archscale serve --checkpoint RUN` in its own process answers with the run's model and tokenizer."""
    from archscale.eval.loading import load_eval_model

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "archscale.cli", "serve", "--checkpoint", str(run_dir),
                             "--port", str(port), "--max_batch", "2"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            def up():
                try:
                    return c.get("/health").status_code == 200
                except httpx.TransportError:
                    return proc.poll() is None and False
            assert wait_for(up, timeout=60), proc.stderr.read() if proc.poll() is not None else "no answer"
            assert c.get("/v1/models").json()["data"][0]["id"] == "run"
            text = complete(c, prompt="Lords", max_tokens=6, temperature=0, ignore_eos=True)["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    em = load_eval_model(run_dir, device="cpu")
    ids = em.tokenizer.encode("Lords", eos=False)
    out = em.model.generate(torch.tensor([ids]), 6, temperature=0.0)[0, len(ids):].tolist()
    assert text == em.tokenizer.decode(out)


def test_serve_cli_bad_checkpoint_is_one_line(tmp_path, capsys):
    from archscale.cli import main

    assert main(["serve", "--checkpoint", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "nope" in err[0]
