"""`archscale bench-serve`: the statistics on known numbers, SSE parsing with and without `usage`, and a short run
against our server (table + JSON) through the CLI."""

import asyncio
import json

import httpx
import numpy as np
import pytest

from archscale.cli import main
from archscale.serve.bench import RequestResult, one_request, read_prompts, summarize
from serving_fixtures import running_server, tiny_model, tiny_tokenizer


def test_summary_statistics_on_known_numbers():
    rs = [RequestResult(ok=True, latency=lat, ttft=0.1, itl=[0.01 * (i + 1)] * 3, output_tokens=4)
          for i, lat in enumerate([0.2, 0.4, 0.6, 0.8, 1.0])]
    rs.append(RequestResult(ok=False, error="HTTP 503: busy"))
    doc = summarize(rs, wall=2.0, concurrency=2)
    assert doc["requests"] == 5 and doc["failed"] == 1 and doc["errors"] == ["HTTP 503: busy"]
    assert doc["requests_per_s"] == pytest.approx(2.5) and doc["output_tokens_per_s"] == pytest.approx(10.0)
    lat = doc["latency_ms"]
    assert lat["mean"] == pytest.approx(600.0) and lat["median"] == pytest.approx(600.0)
    assert lat["p95"] == pytest.approx(960.0) and lat["p99"] == pytest.approx(992.0)  # linear interpolation
    assert doc["ttft_ms"]["mean"] == pytest.approx(100.0)
    assert doc["itl_ms"]["median"] == pytest.approx(30.0)
    # time per output token: (latency - ttft) / (tokens - 1)
    assert doc["tpot_ms"]["mean"] == pytest.approx(np.mean([(x - 0.1) / 3 * 1000 for x in [.2, .4, .6, .8, 1.]]))


def sse(*chunks):
    return "".join(f"data: {c}\n\n" for c in [*map(json.dumps, chunks), "[DONE]"])


@pytest.mark.parametrize("with_usage", [True, False])
def test_one_request_reads_a_vllm_style_stream(with_usage):
    """Token count from the final `usage` chunk when present (here 5, more than the 3 text chunks: a held-back
    token), else one per chunk with text; an empty-text chunk is not a token."""
    chunks = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ["a", "", "b", "c"]]
    if with_usage:
        chunks.append({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}})

    def handler(request):
        assert json.loads(request.content)["stream"] is True
        return httpx.Response(200, text=sse(*chunks), headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            return await one_request(c, "http://x/v1/completions", {"stream": True})

    r = asyncio.run(go())
    assert r.ok and len(r.itl) == 2 and r.ttft is not None and r.latency >= r.ttft
    assert r.output_tokens == (5 if with_usage else 3)


def test_one_request_counts_http_errors():
    async def go():
        transport = httpx.MockTransport(lambda req: httpx.Response(503, json={"error": {"message": "busy"}}))
        async with httpx.AsyncClient(transport=transport) as c:
            return await one_request(c, "http://x/v1/completions", {})

    r = asyncio.run(go())
    assert not r.ok and r.error.startswith("HTTP 503")


def test_prompts_file_forms(tmp_path):
    (tmp_path / "p.txt").write_text("one\n\ntwo\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n{"text": "y"}\n')
    (tmp_path / "bad.jsonl").write_text('{"q": 1}\n')
    assert read_prompts(str(tmp_path / "p.txt")) == ["one", "two"]
    assert read_prompts(str(tmp_path / "p.jsonl")) == ["x", "y"]
    with pytest.raises(Exception, match="bad.jsonl:1"):
        read_prompts(str(tmp_path / "bad.jsonl"))


def test_bench_serve_cli_against_our_server(tmp_path, capsys):
    tok = tiny_tokenizer(tmp_path)
    model = tiny_model("transformer", tok.vocab_size)
    with running_server(model, tok, max_model_len=256, max_batch=4) as (url, engine):
        out = tmp_path / "bench.json"
        assert main(["bench-serve", "--url", url, "--concurrency", "3", "--duration", "1.0", "--max_tokens", "8",
                     "--output", str(out)]) == 0
        stats = engine.stats()
    printed = capsys.readouterr().out
    assert "time to first token" in printed and "output tokens/s" in printed
    doc = json.loads(out.read_text())
    assert doc["model"] == "tiny" and doc["concurrency"] == 3 and doc["failed"] == 0 and doc["requests"] >= 3
    assert doc["output_tokens"] == 8 * doc["requests"]  # ignore_eos: every request decodes max_tokens
    assert doc["output_tokens_per_s"] == pytest.approx(doc["output_tokens"] / doc["duration_s"])
    lat, ttft = doc["latency_ms"], doc["ttft_ms"]
    assert 0 < ttft["mean"] <= lat["mean"] and lat["median"] <= lat["p95"] <= lat["p99"]
    assert doc["itl_ms"]["mean"] > 0
    assert stats["peak_batch"] > 1  # three clients were decoded together


def test_bench_serve_unreachable_url_is_one_line(capsys):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["bench-serve", "--url", f"http://127.0.0.1:{port}", "--duration", "0.2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --url") and "--model" in err[0]
