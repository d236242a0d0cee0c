"""`archscale reason` as a hostile user and a broken endpoint meet it: every item is checked against the task's fields
before any sampling; each problem's row is appended to the items JSONL as soon as it is scored, so a failed run
loses no sampled work and a rerun samples only what is missing; an endpoint that answers fewer choices than asked,
or not JSON, is a one-line error; pass@k has one figure per k, from the samples actually scored; bad flags and
non-UTF-8 data are one-line errors (exit 2)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from archscale.cli import main

DATA = Path(__file__).parent / "data" / "reason"
GSM = DATA / "gsm8k.jsonl"  # golds 7, 60, 7, 18


def one_error_line(capsys, *words: str) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.endswith(" ...")]  # progress off a terminal: one line as each stage starts, not an error
    assert len(err) == 1 and err[0].startswith("error:"), err
    for w in words:
        assert w in err[0], err[0]
    return err[0]


class FakeEndpoint:
    """An OpenAI-style endpoint on 127.0.0.1 answering "#### 7" for every choice, or whatever `answer(body, i)`
    (the i-th completion request) returns as (status, bytes). Records the prompts it was asked."""

    def __init__(self, answer=None):
        self.prompts: list[str] = []
        self.answer = answer or self.sevens
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, data: bytes):
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, json.dumps({"data": [{"id": "fake"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.prompts.append(body["prompt"])
                self._send(*outer.answer(body, len(outer.prompts) - 1))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @staticmethod
    def sevens(body, i):
        return 200, json.dumps({"choices": [{"index": j, "text": "#### 7"} for j in range(body["n"])]}).encode()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def reason(url, out, *extra):
    return main(["reason", "--task", "gsm8k", "--data", str(GSM), "--endpoint", url, "--samples", "2",
                 "--temperature", "0.7", "--output", str(out), *extra])


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.with_suffix(".items.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------- items before sampling
BAD_ITEMS = [
    ("gsm8k", {"question": "q"}),  # no answer
    ("gsm8k", {"question": "q", "answer": None}),
    ("gsm8k", {"question": 5, "answer": "1"}),
    ("gsm8k", {"prompt": 3, "answer": "1"}),  # a prompt that is not text, and no question
    ("gsm8k", {"question": "q", "answer": "#### "}),  # an empty reference
    ("math", {"problem": "p", "solution": "no boxed answer in it"}),  # KeyError 'answer' after sampling, before
    ("math", {"problem": "p", "answer": None}),
    ("math", {"problem": ["p"], "answer": "1"}),
    ("aime24", {"problem": "p", "answer": [1]}),
    ("aime24", {"problem": "p", "answer": {"x": 1}}),
]


@pytest.mark.parametrize("task, item", BAD_ITEMS, ids=[f"{t}-{json.dumps(i)[:40]}" for t, i in BAD_ITEMS])
def test_a_bad_item_is_refused_before_any_sampling(tmp_path, capsys, task, item):
    data = tmp_path / "d.jsonl"
    good = {"gsm8k": {"question": "q", "answer": "#### 1"}, "math": {"problem": "p", "answer": "1"},
            "aime24": {"problem": "p", "answer": "1"}}[task]
    data.write_text(json.dumps(good) + "\n" + json.dumps(item) + "\n")
    with FakeEndpoint() as ep:
        assert main(["reason", "--task", task, "--data", str(data), "--endpoint", ep.url,
                     "--output", str(tmp_path / "o.json")]) == 2
    one_error_line(capsys, "d.jsonl:2")
    assert ep.prompts == []  # nothing was sampled


def test_non_utf8_data_is_one_line(tmp_path, capsys):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes('{"question": "caf\xe9?", "answer": "1"}\n'.encode("latin-1"))
    assert main(["reason", "--task", "gsm8k", "--data", str(data), "--endpoint", "http://127.0.0.1:9"]) == 2
    one_error_line(capsys, "latin1.jsonl", "UTF-8")


@pytest.mark.parametrize("flag, value", [("--limit", "0"), ("--limit", "-1"), ("--limit", "abc"),
                                         ("--samples", "0"), ("--max_tokens", "-5"), ("--concurrency", "0"),
                                         ("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-1"),
                                         ("--seed", str(2 ** 70)), ("--samples", "1e3")])
def test_bad_flag_values_are_one_line(tmp_path, capsys, flag, value):
    with FakeEndpoint() as ep:
        assert reason(ep.url, tmp_path / "o.json", flag, value) == 2
    one_error_line(capsys, flag)
    assert ep.prompts == []


def test_limit_takes_the_first_n(tmp_path):
    with FakeEndpoint() as ep:
        assert reason(ep.url, tmp_path / "o.json", "--limit", "3") == 0
    assert [r["id"] for r in rows(tmp_path / "o.json")] == ["apples", "pens", "change"]


# -------------------------------------------------------------------------------------- broken endpoints
@pytest.mark.parametrize("answer, words", [
    (lambda body, i: (200, b"<html>not json</html>"), ("not JSON",)),
    (lambda body, i: (200, b'{"id": "x"}'), ("choices",)),
    (lambda body, i: (200, b'{"choices": [{"index": 0}]}'), ("choices",)),
    (lambda body, i: (200, json.dumps({"choices": [{"index": 0, "text": "#### 7"}]}).encode()), ("1", "n=2")),
    (lambda body, i: (200, json.dumps({"choices": [{"index": 0, "text": "#### 7"}] * 2}).encode()), ("index",)),
])
def test_a_broken_answer_is_one_line(tmp_path, capsys, answer, words):
    with FakeEndpoint(answer) as ep:
        assert reason(ep.url, tmp_path / "o.json") == 2
    one_error_line(capsys, "--endpoint", *words)


def test_a_failed_run_keeps_its_rows_and_a_rerun_samples_only_the_rest(tmp_path, capsys):
    """The endpoint fails on the third problem (fewer choices than asked): the others, answered before and after
    it, are in the items file; the rerun asks only for the missing one and ends with exactly a fresh run's rows
    and figures."""
    def third_is_short(body, i):
        n = body["n"] - (1 if i == 2 else 0)
        return 200, json.dumps({"choices": [{"index": j, "text": "#### 7"} for j in range(n)]}).encode()

    out = tmp_path / "r.json"
    with FakeEndpoint(third_is_short) as ep:
        assert reason(ep.url, out, "--concurrency", "1") == 2
    one_error_line(capsys, "n=2")
    assert [r["id"] for r in rows(out)] == ["apples", "pens", "laps"]
    with FakeEndpoint() as ep:
        assert reason(ep.url, out, "--concurrency", "1") == 0
        asked = list(ep.prompts)
    assert len(asked) == 1 and asked[0].startswith("Question: Tom pays")
    fresh = tmp_path / "fresh.json"
    with FakeEndpoint() as ep:
        assert reason(ep.url, fresh) == 0
    assert rows(out) == rows(fresh)
    s, f = (json.loads(p.read_text())["results"]["reason"]["gsm8k"] for p in (out, fresh))
    assert s == {**f, "source": s["source"]} and s["pass@1"] == s["pass@k"]["1"] == 0.5


def test_rerun_with_other_settings_is_refused(tmp_path, capsys):
    out = tmp_path / "r.json"
    with FakeEndpoint() as ep:
        assert reason(ep.url, out, "--limit", "1") == 0
        assert reason(ep.url, out, "--seed", "5") == 2
    one_error_line(capsys, "--items", "seed")


def test_pass_at_k_has_one_figure_per_k(tmp_path):
    """pass@1 is reported once: the summary's pass@1 is the pass@k table's "1", from the samples scored."""
    with FakeEndpoint(lambda body, i: (200, json.dumps({"choices": [
            {"index": j, "text": "#### 7" if (i + j) % 3 else "#### 60"} for j in range(body["n"])]}).encode())) as ep:
        assert main(["reason", "--task", "gsm8k", "--data", str(GSM), "--endpoint", ep.url, "--samples", "3",
                     "--temperature", "0.7", "--concurrency", "1", "--output", str(tmp_path / "o.json")]) == 0
    s = json.loads((tmp_path / "o.json").read_text())["results"]["reason"]["gsm8k"]
    assert s["pass@1"] == s["pass@k"]["1"]
    got = rows(tmp_path / "o.json")
    assert all(len(r["correct"]) == 3 for r in got)
    assert s["pass@1"] == pytest.approx(sum(r["n_correct"] / 3 for r in got) / len(got), abs=1e-12)
