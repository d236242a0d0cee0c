"""Shared by the serving tests: a tiny BPE tokenizer, tiny models, and our server on 127.0.0.1 in a thread."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import torch

from archscale import GPT, ModelConfig
from archscale.config import ARCHITECTURES

ESSAY = Path(__file__).resolve().parents[1] / "src" / "archscale" / "eval" / "data" / "areopagitica.txt"


def tiny_tokenizer(tmp_dir: Path, vocab_size: int = 300):
    from archscale.data.tokenizer import Tokenizer, train_bpe

    train_bpe([str(ESSAY)], vocab_size, str(tmp_dir / "tok.json"))
    return Tokenizer(tmp_dir / "tok.json")


def tiny_model(arch: str, vocab_size: int, depth: int = 8, seed: int = 0, **kw) -> GPT:
    """Every layer kind of the architecture at depth 8 (a window of 5: shorter than the prompts)."""
    base = dict(vocab_size=vocab_size, block_size=64)
    if ARCHITECTURES[arch].sliding_window:
        base["sliding_window"] = 5
    if arch == "phi4miniflash":
        base.update(n_head=8, n_query_groups=4, head_size=8)
    base.update(kw)
    torch.manual_seed(seed)
    return GPT(ModelConfig.from_arch(arch, depth, ar=8, **base)).eval()


def essay_data(d: Path, vocab_size: int = 320) -> Path:
    """Areopagitica's paragraphs as documents, a BPE tokenizer trained on them (d/tok.json) and their shards
    (d/data, 20% validation)."""
    import json

    from archscale.data.prepare import prepare
    from archscale.data.tokenizer import train_bpe

    paras = [p for p in ESSAY.read_text().split("\n\n") if p.strip()]
    (d / "c.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paras))
    train_bpe([str(d / "c.jsonl")], vocab_size, str(d / "tok.json"))
    prepare([str(d / "c.jsonl")], str(d / "data"), str(d / "tok.json"), val_fraction=0.2, chunk_size=8192,
            progress=False, num_workers=1)
    return d / "data"


def make_run(d: Path) -> Path:
    """A 2-step transformer_d1 run (ctx 32) on Areopagitica whose data manifest records its own BPE tokenizer."""
    import json

    from archscale.cli import main
    from archscale.data.prepare import prepare

    paras = [p for p in ESSAY.read_text().split("\n\n") if p.strip()]
    (d / "c.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paras))
    tiny_tokenizer(d)
    prepare([str(d / "c.jsonl")], str(d / "data"), str(d / "tok.json"), val_fraction=0.2, chunk_size=8192,
            progress=False, num_workers=1)
    assert main(["pretrain", "--train_data_dir", str(d / "data"), "--train_model", "transformer", "--depth", "1",
                 "--ctx_len", "32", "--micro_bsz", "2", "--base_hps.b0", "128", "--max_tokens", "256",
                 "--base_hps.warmup_tokens0", "128", "--eval_iters", "1", "--eval_interval", "100",
                 "--out_dir", str(d / "run"), "--progress", "false", "--precision", "fp32", "--resume", "none"]) == 0
    return d / "run"


@contextlib.contextmanager
def running_server(model, tokenizer, name: str = "tiny", **engine_kw):
    """Yields (base_url, engine) for our app served by uvicorn on a free port of 127.0.0.1."""
    import uvicorn

    from archscale.serve.app import create_app
    from archscale.serve.engine import Engine

    engine = Engine(model, tokenizer, **engine_kw).start()
    config = uvicorn.Config(create_app(engine, name), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()
