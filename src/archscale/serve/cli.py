"""`archscale serve` and `archscale bench-serve` (registered in archscale.cli)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from archscale.errors import UserError
from archscale.serve.bench import _Parser


@dataclass
class ServedModel:
    model: object
    tokenizer: object
    name: str
    max_model_len: int
    autocast: object  # () -> context manager


def load_served_model(checkpoint: str, tokenizer: str | None = None, device: str | None = None,
                      precision: str = "fp32", name: str | None = None) -> ServedModel:
    """A run dir / checkpoints dir / step dir, through the evaluation loader.

    This is the one place `serve` (and `reason --checkpoint`) turns a path into a model: an exported HF folder
    (config.json + model.safetensors + tokenizer.json) plugs in here as a second branch once `archscale export
    --format hf` writes it, returning the same ServedModel."""
    from archscale.eval.loading import load_eval_model

    em = load_eval_model(checkpoint, device=device, tokenizer=tokenizer, precision=precision)
    run = em.run_dir if em.run_dir is not None else Path(checkpoint)
    return ServedModel(em.model, em.tokenizer, name or Path(run).resolve().name, em.train_len, em.autocast)


def serve_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="archscale serve", description="OpenAI-compatible completions server with continuous batching.")
    p.add_argument("--checkpoint", required=True, help="run dir (its latest checkpoint) or checkpoints/step-*")
    p.add_argument("--tokenizer", default=None, help="override the tokenizer recorded by the run's data manifest")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model_name", default=None, help="the id clients use (default: the run dir's name)")
    p.add_argument("--max_batch", type=int, default=16, help="sequences decoded together (batch slots)")
    p.add_argument("--max_queue", type=int, default=256, help="sequences waiting for a slot before 503s")
    p.add_argument("--max_model_len", type=int, default=None,
                   help="prompt + max_tokens limit (default: the training context length)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    return p


def serve_main(argv: list[str]) -> int:
    import uvicorn

    from archscale.serve.app import create_app
    from archscale.serve.engine import Engine

    a = serve_parser().parse_args(argv)
    for flag in ("max_batch", "max_queue", "max_model_len"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            raise UserError(f"--{flag} must be at least 1, got {getattr(a, flag)}")
    sm = load_served_model(a.checkpoint, a.tokenizer, a.device, a.precision, a.model_name)
    engine = Engine(sm.model, sm.tokenizer, max_batch=a.max_batch, max_queue=a.max_queue,
                    max_model_len=a.max_model_len or sm.max_model_len, autocast=sm.autocast).start()
    print(f"serving {sm.name} on http://{a.host}:{a.port}/v1 ({a.max_batch} batch slots, "
          f"max_model_len {engine.max_model_len})", file=sys.stderr, flush=True)
    try:
        uvicorn.run(create_app(engine, sm.name), host=a.host, port=a.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0


def bench_main(argv: list[str]) -> int:
    from archscale.serve.bench import bench_cli
    return bench_cli(argv)
