"""`archscale serve` and `archscale bench-serve` (registered in archscale.cli)."""

from __future__ import annotations

import argparse
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from archscale.cli_types import nonnegative_int, positive_int
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
                      precision: str = "fp32", name: str | None = None, pack_weights: str = "auto") -> ServedModel:
    """A run dir / checkpoints dir / step dir, through the evaluation loader. With `pack_weights` "auto" an fp32
    model on the CPU gets its linear weights pre-packed for oneDNN (`kernels/packed_linear.py`: decode steps
    1.3x faster, one more copy of those weights in memory); "off" keeps PyTorch's plain linears.

    This is the one place `serve` (and `reason --checkpoint`) turns a path into a model: an exported HF folder
    (config.json + model.safetensors + tokenizer.json) plugs in here as a second branch once `archscale export
    --format hf` writes it, returning the same ServedModel."""
    from archscale.eval.loading import load_eval_model

    em = load_eval_model(checkpoint, device=device, tokenizer=tokenizer, precision=precision)
    if pack_weights == "auto" and precision == "fp32" and em.device.type == "cpu":
        from archscale.kernels.packed_linear import pack_linears

        pack_linears(em.model)
    run = em.run_dir if em.run_dir is not None else Path(checkpoint)
    return ServedModel(em.model, em.tokenizer, name or Path(run).resolve().name, em.train_len, em.autocast)


def port_number(text: str) -> int:
    n = nonnegative_int(text)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0..65535, got {n}")
    return n


def serve_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="archscale serve", description="OpenAI-compatible completions server with continuous batching.")
    p.add_argument("--checkpoint", required=True, help="run dir (its latest checkpoint) or checkpoints/step-*")
    p.add_argument("--tokenizer", default=None, help="override the tokenizer recorded by the run's data manifest")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--model_name", default=None, help="the id clients use (default: the run dir's name)")
    p.add_argument("--max_batch", type=positive_int, default=16, help="sequences decoded together (batch slots)")
    p.add_argument("--max_queue", type=positive_int, default=256,
                   help="sequences waiting for a slot before 503s (a request asking for more is a 400)")
    p.add_argument("--max_model_len", type=positive_int, default=None,
                   help="prompt + max_tokens limit (default: the training context length)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="bf16: run under bf16 autocast (the weights stay fp32; --pack_weights applies at fp32 only)")
    p.add_argument("--pack_weights", default="auto", choices=["auto", "off"],
                   help="auto: on the CPU at fp32, pre-pack the linear weights for oneDNN (faster decode steps, "
                        "a second copy of those weights in memory); off: PyTorch's plain linears")
    return p


def serve_main(argv: list[str]) -> int:
    import uvicorn

    from archscale.serve.app import create_app
    from archscale.serve.engine import Engine

    a = serve_parser().parse_args(argv)
    sock = listening_socket(a.host, a.port)  # before the model loads and "serving on": a busy port is bad input
    try:
        sm = load_served_model(a.checkpoint, a.tokenizer, a.device, a.precision, a.model_name, a.pack_weights)
        engine = Engine(sm.model, sm.tokenizer, max_batch=a.max_batch, max_queue=a.max_queue,
                        max_model_len=a.max_model_len or sm.max_model_len, autocast=sm.autocast).start()
        print(f"serving {sm.name} on http://{a.host}:{sock.getsockname()[1]}/v1 ({a.max_batch} batch slots, "
              f"max_model_len {engine.max_model_len})", file=sys.stderr, flush=True)
        try:
            config = uvicorn.Config(create_app(engine, sm.name), host=a.host, port=a.port, log_level="warning")
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            engine.shutdown()
    finally:
        sock.close()
    return 0


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (SO_REUSEADDR, as uvicorn binds it): a port in use or a host that is not
    this machine's is a one-line error (exit 2), not uvicorn's startup failure (exit 3, the code that means
    "training diverged") after the model loaded and "serving on" was printed."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:
        sock.close()
        raise UserError(f"--host {host} --port {port}: cannot listen there ({getattr(e, 'strerror', None) or e})") \
            from None
    sock.set_inheritable(True)
    return sock


def bench_main(argv: list[str]) -> int:
    from archscale.serve.bench import bench_cli
    return bench_cli(argv)
